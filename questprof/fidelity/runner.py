"""Fidelity of a source (synthetic, passkey, natural text, a saved cache) as result rows."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

import numpy as np

from questprof.core.config import ConfigError
from questprof.core.scenarios import load_scenario
from questprof.core.selectors import QUEST
from questprof.fidelity import prompts, prompts_spread, rows
from questprof.fidelity.capture import Capture, load_capture
from questprof.fidelity.evaluate import FidelityGrid, evaluate_batch, one_thread
from questprof.fidelity.evaluate_selectors import evaluate_selectors, has_quest, others
from questprof.fidelity.models import known_shape, load_model, model_name
from questprof.fidelity.pace import Pace, heartbeat, model_dims, shape_dims
from questprof.fidelity.synthetic import KINDS, synthetic_capture

SOURCES = ("synthetic", "passkey", "natural", "cache", "multikey", "aggregate")
PROMPTS = 20  # per length: a Wilson interval of +-0.2 at 50% (5 prompts: +-0.35)
# Share of the host's memory one chunk of prompts may hold (captured keys and values, the
# model's cache, fp32): 20 SmolLM2 prompts of 2K tokens take 3.8 GB, of 8K 15 GB (one chunk
# on a 128 GiB GPU host; chunks of 7 on the 23 GiB CPU machine)
CHUNK_SHARE = 0.25


@dataclass(frozen=True)
class Request:
    """One fidelity run: where the caches come from and what to measure."""

    source: str
    grid: FidelityGrid
    lengths: tuple[int, ...] = ()
    steps: int = 8
    depths: tuple[float, ...] = ()  # passkey depths; empty: `prompts` depths spread over 0..1
    dense_layers: int = 2
    task: bool = True
    seed: int = 0
    scenario: str = "smoke"
    model: str = "smollm2"
    cache_path: str = ""
    prompts: int = PROMPTS
    forced: bool = False  # the task teacher-forced too (dense tokens fed), beside free-running

    def prompt_depths(self) -> tuple[float, ...]:
        return self.depths or prompts.spread_depths(self.prompts)


def _meta(cap, request: Request, backend, scenario: str, source: str) -> dict:
    """Key fields of every row of one capture (a Capture or a model_run.Captured)."""
    return {"scenario": scenario, "model": cap.model, "layers": cap.layers,
            "q_heads": cap.q_heads, "kv_heads": cap.kv_heads, "head_dim": cap.head_dim,
            "dtype": request.grid.dtype, "source": source, "backend": backend.name}


def _evaluate(caps, request: Request, backend, scenario: str, length: int, log) -> list[dict]:
    """Rows of one length from captures of one shape (each its own batch of one)."""
    started = time.perf_counter()
    quest = has_quest(request.grid)
    results = [evaluate_batch([cap], backend, request.grid) if quest else {} for cap in caps]
    metrics = with_selectors(_concat(results), caps, request.grid)
    log(f"{caps[0].source} {length} tokens: metrics of {len(caps)} capture(s) in "
        f"{time.perf_counter() - started:.1f} s")
    meta = _meta(caps[0], request, backend, scenario, caps[0].source)
    return rows.metric_rows(meta, length, metrics, request.dense_layers)


def with_selectors(metrics: dict, caps: list[Capture], grid: FidelityGrid) -> dict:
    """Quest's metrics and every other selector's of the grid, [samples, ...] each (the
    selectors' NumPy references take one capture at a time)."""
    parts = [evaluate_selectors(cap, grid) for cap in caps]
    if parts and parts[0]:
        metrics = {**metrics, **{key: np.stack([p[key] for p in parts]) for key in parts[0]}}
    return metrics


def _concat(parts: list[dict]) -> dict:
    """{setting: metrics} of several batches, prompts concatenated along the first axis."""
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def synthetic_rows(request: Request, backend, log):
    """Random and drift caches shaped like the scenario's model, at each length."""
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


def _prompts(loaded, request: Request, length: int) -> list[prompts.Prompt]:
    if loaded.tokenizer is None:  # random weights: random tokens, no answer to check
        vocab = loaded.model.config.vocab_size
        return [prompts.random_tokens(vocab, length, request.seed + i)
                for i in range(request.prompts)]
    if request.source == "natural":
        return prompts.natural(loaded.tokenizer, length, request.prompts)
    if request.source in ("multikey", "aggregate"):
        make = (prompts_spread.multikeys if request.source == "multikey"
                else prompts_spread.aggregates)
        return make(loaded.tokenizer, length, request.seed)
    return prompts.passkeys(loaded.tokenizer, length, request.prompt_depths(), request.seed)


def _prompt_tokens(loaded, length: int, steps: int) -> int:
    """Prompt tokens for a length: `length`, less room for the decode steps at the context's
    edge (an 8k prompt of an 8k model); ConfigError beyond the context."""
    if not loaded.context:
        return length
    if length > loaded.context:
        raise ConfigError(f"prompt of {length} tokens exceeds {loaded.name}'s context of "
                          f"{loaded.context} tokens")
    return min(length, loaded.context - steps + 1)


def chunk_size(model, tokens: int, memory: int | None = None) -> int:
    """Prompts per chunk within CHUNK_SHARE of the host's memory (`memory` bytes, default this
    host's): captured k and v plus the model's cache, fp32."""
    c = model.config
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_prompt = 4 * c.num_hidden_layers * kv_heads * tokens * head_dim * 4
    memory = memory or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, int(CHUNK_SHARE * memory) // per_prompt)


class _Tally:
    """Seconds spent per phase of one length, summed over its chunks; each phase logged and
    added to `phases` (the whole run's); while a phase runs, a progress line every
    PROGRESS_SECONDS, with the phase's expected seconds (`expected`) where known."""

    def __init__(self, log, what: str, phases: dict | None = None,
                 expected: dict | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.log, self.what = log, what
        self.phases = {} if phases is None else phases
        self.expected = expected or {}

    def beat(self, phase: str, share: float = 1.0):
        """The progress lines of `phase` (a share of this length's work: one chunk's)."""
        expected = self.expected.get(phase)
        return heartbeat(self.log, f"{self.what}: {phase}",
                         expected * share if expected else None)

    def add(self, phase: str, started: float, on=None) -> None:
        """Time since `started` to `phase`, once the device of tensor `on` (if any) is idle."""
        if on is not None and on.is_cuda:
            import torch
            torch.cuda.synchronize(on.device)
        took = time.perf_counter() - started
        self.seconds[phase] = self.seconds.get(phase, 0.0) + took
        self.phases[phase] = self.phases.get(phase, 0.0) + took
        self.log(f"{self.what}: {phase} {took:.1f} s")


def _chunk(loaded, chunk, request: Request, backend, source: str, tally: _Tally):
    """(metrics, {setting: answers}, each prompt's info, the rows' meta) of one chunk.

    The captures stay on the model's device and the metrics are computed there
    (evaluate_device.py); only other selectors' NumPy references take host copies. torch runs on
    one thread throughout: on the shared 2-core CPU (2026-12-01, load about 4) capturing 4
    prompts of 2K tokens took 25 s wall on one thread and 55 s on two (twice the CPU time:
    the second thread waits on the other jobs); the metrics and the task are small ops
    either way."""
    from questprof.fidelity.evaluate_device import evaluate_captured
    from questprof.fidelity.model_run import base_indexes, capture
    grid, answers, share = request.grid, {}, min(1.0, len(chunk) / request.prompts)
    with one_thread():
        started = time.perf_counter()
        with tally.beat("capture", share):
            captured = capture(loaded, chunk, request.steps, source)
        tally.add("capture", started, captured.queries)
        started = time.perf_counter()
        with tally.beat("index", share):
            bases = {s: base_indexes(captured, backend, s, grid.dtype, 0)
                     for s in grid.page_sizes}
        tally.add("index", started)
        started = time.perf_counter()
        with tally.beat("metrics", share):
            quest = evaluate_captured(captured, backend, grid, bases) if has_quest(grid) else {}
            metrics = with_selectors(quest, captured.captures if others(grid) else [], grid)
        tally.add("metrics", started)
        if request.task and (chunk[0].answer or loaded.tokenizer is None):
            started = time.perf_counter()
            with tally.beat("task", share):
                answers = _task(loaded, chunk, captured, bases, request)
            tally.add("task", started)
    return metrics, answers, captured.infos, _meta(captured, request, backend, source, source)


def _task(loaded, chunk, captured, bases: dict, request: Request) -> dict:
    """{setting key: [task_answers.Answer per prompt]}: every selector and budget of a page size
    in one decode (Quest in the first --mode, keyed (S, B, mode); the others per head, keyed
    (S, B, 'per-head', name) as their metrics)."""
    from questprof.fidelity.task_decode import decode_settings
    grid, mode, answers = request.grid, request.grid.modes[0], {}
    for size in grid.page_sizes:
        settings = [(name, b) for name in grid.selectors for b in grid.budgets if b % size == 0]
        got = decode_settings(loaded, chunk, captured, bases[size], settings, size, mode,
                              request.dense_layers, request.forced)
        for (name, b), value in got.items():
            key = (size, b, mode) if name == QUEST else (size, b, "per-head", name)
            answers[key] = value
    return answers


def _load(request: Request, log, phases: dict | None, pace: Pace):
    """The loaded model, with progress lines while it loads; where its shape was not known
    before (the run's announcement then had no estimate), the estimate of the rest after."""
    shape = known_shape(request.model)
    expected = pace.expected(shape_dims(shape) if shape is not None else None, request)
    name, started = model_name(request.model), time.perf_counter()
    with heartbeat(log, f"{name}: load", expected.get("load")):
        loaded = load_model(request.model, request.seed)
    _Tally(log, loaded.name, phases).add("load", started)
    if not expected:
        rest = pace.expected(model_dims(loaded.model), request)
        log(f"{loaded.name}: the rest takes about "
            f"{sum(v for k, v in rest.items() if k != 'load') / 60:.1f} min")
    return loaded


def model_rows(request: Request, backend, log, phases: dict | None = None,
               pace: Pace | None = None):
    """Captures of a real model's decode steps on passkey or natural prompts, then the task;
    seconds per phase added to `phases`; progress lines paced by `pace`."""
    from questprof.fidelity.model_run import check_fits
    pace = pace or Pace()
    loaded = _load(request, log, phases, pace)
    dims = model_dims(loaded.model)
    source = request.source if loaded.tokenizer is not None else "random-tokens"
    for length in request.lengths:
        batch = _prompts(loaded, request, _prompt_tokens(loaded, length, request.steps))
        for prompt in batch:  # fail before the first capture when any prompt is too long
            check_fits(loaded, prompt, request.steps)
        size = chunk_size(loaded.model, len(batch[0].ids) + request.steps)
        expected = pace.expected(dims, replace(request, lengths=(length,)))
        tally = _Tally(log, f"{loaded.name} {length} tokens", phases, expected)
        parts, answers, infos = [], {}, []
        for i in range(0, len(batch), size):
            metrics, got, info, meta = _chunk(loaded, batch[i:i + size], request, backend,
                                              source, tally)
            parts.append(metrics)
            infos += info
            for key, value in got.items():
                answers.setdefault(key, []).extend(value)
        started = time.perf_counter()
        made = rows.metric_rows(meta, length, _concat(parts), request.dense_layers)
        if answers and batch[0].answer:
            made += list(task_rows(loaded, batch, infos, answers, meta, length))
        tally.add("rows", started)
        times = ", ".join(f"{k} {v:.1f} s" for k, v in tally.seconds.items())
        log(f"{loaded.name} {length} tokens, {len(batch)} prompt(s) in chunks of "
            f"{min(size, len(batch))}: {times} in all")
        yield from made


def task_rows(loaded, batch, infos: list[dict], answers: dict, meta: dict, length: int):
    """Task rows: answered with dense attention and with each selector at every page size and
    budget, with where the answer first left dense's (rows.divergence_fields)."""
    dense = [bool(info["dense_correct"]) for info in infos]
    for key, got in answers.items():
        page_size, budget, mode = key[:3]
        row = rows.task_row(meta, length, page_size, budget, mode, dense,
                            [a.correct for a in got])
        row["selector"] = key[3] if len(key) > 3 else QUEST
        row.update(rows.divergence_fields(got))
        row["passkey_keys"] = "|".join(p.answer for p in batch)
        row["passkey_quest_answers"] = "|".join(loaded.tokenizer.decode(a.tokens).strip()
                                                for a in got)
        yield row


def fidelity_rows(request: Request, backend, log=lambda msg: None, phases: dict | None = None,
                  pace: Pace | None = None):
    """Every result row of `request`, as they are ready (a generator); a real model's run adds
    its seconds per phase (load, capture, index, metrics, task, rows) to `phases` and logs
    progress lines paced by `pace`."""
    if request.source in ("synthetic", "cache"):
        yield from {"synthetic": synthetic_rows, "cache": cache_rows}[request.source](
            request, backend, log)
    else:
        yield from model_rows(request, backend, log, phases, pace)
