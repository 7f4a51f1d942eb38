"""Fidelity of a source (synthetic, passkey, natural text, a saved cache) as result rows."""

from __future__ import annotations

import time
from dataclasses import dataclass

from questprof.core.config import ConfigError
from questprof.fidelity import prompts, rows
from questprof.fidelity.capture import Capture, load_capture
from questprof.fidelity.evaluate import FidelityGrid, evaluate, one_thread
from questprof.fidelity.selectors import evaluate_selectors, has_quest

SOURCES = ("synthetic", "passkey", "natural", "cache", "multikey", "aggregate")


@dataclass(frozen=True)
class Request:
    """One fidelity run: where the caches come from and what to measure."""

    source: str
    grid: FidelityGrid
    lengths: tuple[int, ...] = ()
    steps: int = 8
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    dense_layers: int = 2
    task: bool = True
    seed: int = 0
    scenario: str = "smoke"
    model: str = "smollm2"
    cache_path: str = ""


def _meta(cap: Capture, request: Request, backend, scenario: str, source: str) -> dict:
    """Key fields of every row of one capture."""
    return {"scenario": scenario, "model": cap.model, "layers": cap.layers,
            "q_heads": cap.q_heads, "kv_heads": cap.kv_heads, "head_dim": cap.head_dim,
            "dtype": request.grid.dtype, "source": source, "backend": backend.name}


def _evaluate(caps, request: Request, backend, scenario: str, length: int, log) -> list[dict]:
    """Rows of one length from its captures (prompts of one length pooled)."""
    started = time.perf_counter()
    quest = has_quest(request.grid)
    results = [{**(evaluate(cap, backend, request.grid) if quest else {}),
                **evaluate_selectors(cap, request.grid)} for cap in caps]
    log(f"{caps[0].source} {length} tokens: metrics of {len(caps)} capture(s) in "
        f"{time.perf_counter() - started:.1f} s")
    meta = _meta(caps[0], request, backend, scenario, caps[0].source)
    return rows.fidelity_rows(meta, length, results, request.dense_layers)


def synthetic_rows(request: Request, backend, log):
    """Random and drift caches shaped like the scenario's model, at each length."""
    from questprof.core.scenarios import load_scenario
    from questprof.fidelity.synthetic import KINDS, synthetic_capture
    shape = load_scenario(request.scenario).model
    for length in request.lengths:
        for kind in KINDS:
            cap = synthetic_capture(kind, request.seed, shape.layers, shape.q_heads,
                                    shape.kv_heads, shape.head_dim, length, request.steps)
            yield from _evaluate([cap], request, backend, shape.name, length, log)


def cache_rows(request: Request, backend, log):
    """A user's saved capture (safetensors, docs/FIDELITY.md)."""
    cap = load_capture(request.cache_path)
    yield from _evaluate([cap], request, backend, cap.model, cap.step_length(0), log)


def _prompts(loaded, request: Request, length: int):
    if loaded.tokenizer is None:  # random weights: random tokens, no answer to check
        return [prompts.random_tokens(loaded.model.config.vocab_size, length, request.seed)]
    if request.source == "natural":
        return [prompts.natural(loaded.tokenizer, length)]
    if request.source in ("multikey", "aggregate"):
        from questprof.fidelity import tasks
        make = tasks.multikeys if request.source == "multikey" else tasks.aggregates
        return make(loaded.tokenizer, length, request.seed)
    return prompts.passkeys(loaded.tokenizer, length, request.depths, request.seed)


def _prompt_tokens(loaded, length: int, steps: int) -> int:
    """Prompt tokens for a length: `length`, less room for the decode steps at the context's
    edge (an 8k prompt of an 8k model); ConfigError beyond the context."""
    if not loaded.context:
        return length
    if length > loaded.context:
        raise ConfigError(f"prompt of {length} tokens exceeds {loaded.name}'s context of "
                          f"{loaded.context} tokens")
    return min(length, loaded.context - steps + 1)


def model_rows(request: Request, backend, log):
    """Captures of a real model's decode steps on passkey or natural prompts, then the task."""
    from questprof.fidelity.model_run import capture, check_fits
    from questprof.fidelity.models import load_model
    loaded = load_model(request.model, request.seed)
    for length in request.lengths:
        batch = _prompts(loaded, request, _prompt_tokens(loaded, length, request.steps))
        for prompt in batch:  # fail before the first capture when any prompt is too long
            check_fits(loaded, prompt, request.steps)
        source = request.source if loaded.tokenizer is not None else "random-tokens"
        started, captured = time.perf_counter(), []
        for prompt in batch:
            captured.append(capture(loaded, prompt, request.steps, source))
        log(f"{loaded.name} {length} tokens: captured {len(batch)} prompt(s) "
            f"in {time.perf_counter() - started:.1f} s")
        caps = [c.capture for c in captured]
        yield from _evaluate(caps, request, backend, source, length, log)
        if request.task and batch[0].answer:
            yield from task_rows(loaded, batch, captured, request, backend, length, log)


def task_rows(loaded, batch, captured, request: Request, backend, length: int, log):
    """Passkey answered with dense attention and with Quest at every page size and budget."""
    from questprof.fidelity.model_run import quest_answer
    meta = _meta(captured[0].capture, request, backend, request.source, request.source)
    dense = [bool(c.capture.info["dense_correct"]) for c in captured]
    mode, started = request.grid.modes[0], time.perf_counter()
    for page_size, budget, _ in [s for s in request.grid.settings() if s[2] == mode]:
        with one_thread():  # one-token decode steps are small ops, like the metrics
            answers = [quest_answer(loaded, p, c, backend, page_size, budget, mode,
                                    request.dense_layers, request.grid.dtype)
                       for p, c in zip(batch, captured)]
        row = rows.task_row(meta, length, page_size, budget, mode, dense, [a[1] for a in answers])
        row["passkey_keys"] = "|".join(p.answer for p in batch)
        row["passkey_quest_answers"] = "|".join(loaded.tokenizer.decode(a[0]).strip()
                                                for a in answers)
        yield row
    log(f"{loaded.name} {length} tokens: passkey with Quest in "
        f"{time.perf_counter() - started:.1f} s")


def fidelity_rows(request: Request, backend, log=lambda msg: None):
    """Every result row of `request`, as they are ready (a generator)."""
    make = {"synthetic": synthetic_rows, "cache": cache_rows}.get(request.source, model_rows)
    yield from make(request, backend, log)
