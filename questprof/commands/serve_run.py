"""The runs of `questprof serve`: the model loaded once, every (policy, concurrency) through
transformers' loop, each run's rows on disk as soon as it ends."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

from questprof import results
from questprof.backends import get_backend
from questprof.commands.serve_args import ServeArgs
from questprof.core.config import ConfigError
from questprof.core.machine import git_fields, machine_info
from questprof.serving.inplace import TORCH_TAGS, InPlaceDecode, check_loop
from questprof.serving.latency import summarize, token_gaps_ms
from questprof.serving.loop import LoopSettings, OwnAttention, serve
from questprof.serving.models import load_serving_model, requests_for
from questprof.serving.paged_attention import HostDecode, Policy
from questprof.serving.stages_decode import StagesDecode
from questprof.serving.step_time import shares
from questprof.workload.pools import host_free_bytes

SERVE, REQUEST, STEP = "serve", "serve-request", "serve-step"  # rows of a run, request, forward
PREFILL_CHUNK = 8192  # tokens per forward when --max-batch-tokens is not given
# --engine: paged_attention.HostDecode, stages_decode.StagesDecode, inplace.InPlaceDecode,
# loop.OwnAttention (transformers' own attention, the baseline)
ENGINES = ("host", "kernels", "inplace", "transformers")


def check_fits(args: ServeArgs, policies, specs, layers: int) -> None:
    """ConfigError in one line, before any run: a Quest policy whose dense layers take every
    layer (it would select nothing and still say quest), or cache pages too few for the longest
    request (transformers stops with a RuntimeError)."""
    if any(p.name != "dense" for p in policies) and args.dense_layers >= layers:
        raise ConfigError(f"--dense-layers {args.dense_layers}: the model has {layers} layers, so "
                          "Quest would select in none; lower it below the layer count")
    need = max(-(-(s.prompt + s.output) // args.page_size) for s in specs) + 1
    if args.num_blocks is not None and args.num_blocks < need:
        raise ConfigError(f"--num-blocks {args.num_blocks}: the longest request needs {need} "
                          f"pages of {args.page_size} tokens")


def check_scaling(engine: str, model) -> None:
    """ConfigError in one line where questprof's stages would decode (kernels, inplace) a model
    whose attention scales scores otherwise than 1/sqrt(head dim), as they do."""
    if engine not in ("kernels", "inplace"):
        return
    for module in model.modules():
        scaling, d = getattr(module, "scaling", None), getattr(module, "head_dim", None)
        if scaling is not None and d and abs(float(scaling) * d ** 0.5 - 1) > 1e-6:
            raise ConfigError(f"--engine {engine}: questprof's stages scale scores by "
                              f"1/sqrt({d}); this model's attention by {float(scaling):.6g}")


def check_dtype(engine_name: str, model) -> None:
    """ConfigError in one line, before any run, where the kernels would decode a model whose
    cache they do not read: the in-place decode and the CuPy stages take fp16 and bf16 (the
    refusal came from inside transformers' loop, as its traceback)."""
    if not (engine_name.startswith("inplace") or engine_name.endswith(":cupy")):
        return
    if str(model.dtype) not in TORCH_TAGS:
        raise ConfigError(f"--engine {engine_name.split(':')[0]} decodes fp16 and bf16 caches "
                          f"with the kernels; this model is {model.dtype}: give a config with "
                          "torch_dtype float16 or bfloat16")


def _settings(args: ServeArgs, concurrency: int, requests):
    """The loop's settings: with no --num-blocks, cache pages for the `concurrency` longest
    requests at once (a batch holds no more; transformers queues a request until its pages are
    free); with no --max-batch-tokens, the longest prompt in one forward up to PREFILL_CHUNK
    (transformers 5.24 sizes both from the GPU's memory and, on a CPU, stalls without a word)."""
    size = args.page_size
    pages = sorted((-(-(len(r.prompt) + r.output) // size) + 1 for r in requests), reverse=True)
    blocks = args.num_blocks or sum(pages[:concurrency]) + 8
    tokens = args.max_batch_tokens or min(max(len(r.prompt) for r in requests) + concurrency,
                                          PREFILL_CHUNK)
    return LoopSettings(size, concurrency, blocks, tokens, args.cuda_graph)


CPU_BANNER = ("No usable GPU: the model runs on the CPU (torch), so its latencies are this "
              "host's, not a GPU serving engine's (the decode engine still runs the same steps)")
CACHE_SHARE = 0.9  # of the free memory the cache may take: the rest for activations


def check_memory(model, pages: int, page_size: int, free_bytes: int | None = None) -> None:
    """ConfigError in one line where `pages` cache pages do not fit in the free memory beside the
    model, the GPU's or (a CPU model) the host's (transformers would stop allocating them with a
    traceback). `free_bytes`: the free memory, asked of the device or the host when None (a host
    that does not say is not checked)."""
    cuda = model.device.type == "cuda"
    if free_bytes is None:
        if cuda:
            import torch
            free_bytes = torch.cuda.mem_get_info(model.device)[0]
        else:
            free_bytes = host_free_bytes()
            if free_bytes is None:
                return
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim \
        * model.dtype.itemsize  # K and V of every layer, in the model's dtype
    need = pages * page_size * per_token
    if need > CACHE_SHARE * free_bytes:
        where = "the GPU's" if cuda else "the host's"
        raise ConfigError(f"{pages} cache pages of {page_size} tokens take {need / 2**30:.1f} "
                          f"GiB, more than {CACHE_SHARE:.0%} of {where} "
                          f"{free_bytes / 2**30:.1f} GiB free beside the model: lower "
                          "--concurrency or --lengths, or give --num-blocks")


def _shape_fields(log) -> dict:
    """The decode steps' ragged shapes: how many, and per step the mean and largest count of
    requests, active pages and pages read."""
    nan = float("nan")  # without our attention (transformers' own) only the clock saw them
    steps = log.steps or [{"requests": p["decode_requests"], "active_pages": nan,
                           "pages_read": nan} for p in log.parts if p["decode_requests"]]
    out = {"steps": len(steps), "selections": log.selections}
    for key in ("requests", "active_pages", "pages_read"):
        values = np.array([s[key] for s in steps], dtype=float)
        out[f"step_{key}_mean"] = float(values.mean()) if len(values) else float("nan")
        out[f"step_{key}_max"] = float(values.max()) if len(values) else float("nan")
    return out


def run_rows(base: dict, served, log) -> list[dict]:
    """A run's rows: one per request (its token gaps, TTFT), one per forward (where its time
    went: serving/step_time.py), then the run's summary with each part's share of the decode
    steps."""
    rows = [{**base, "stage": STEP, "step": i, **parts, "status": "ok"}
            for i, parts in enumerate(log.parts)]
    for s in served:
        gaps = token_gaps_ms(s.timestamps)
        rows.append({**base, "stage": REQUEST, "request": s.index, "length": s.prompt_len,
                     "tokens": len(s.timestamps), "token_ms": [float(g) for g in gaps],
                     "ttft_ms": (s.timestamps[0] - s.added) * 1e3 if s.timestamps else None,
                     "status": "ok"})
    summary = summarize(served)
    rows.append({**base, "stage": SERVE, "requests": len(served), **summary.fields(),
                 **_shape_fields(log), **shares(log.parts), "status": "ok"})
    return rows


def decode_engine(name: str, log=print):
    """(engine for loop.serve, its name in rows): host -> HostDecode, kernels -> StagesDecode
    over the backend (CuPy on a GPU, else the NumPy reference, said in a line), inplace ->
    InPlaceDecode over it (ConfigError where the loop does not hand attention its cache)."""
    if name not in ENGINES:
        raise ConfigError(f"bad --engine {name!r}: expected one of {', '.join(ENGINES)}")
    if name == "host":
        return HostDecode(), "host"
    if name == "transformers":
        return OwnAttention(), "transformers"
    if name == "inplace":
        check_loop()
    backend = get_backend("auto")
    if getattr(backend, "fallback_reason", None):
        log(f"--engine {name} without a GPU ({backend.fallback_reason}): the NumPy reference "
            "runs the stages")
    if name == "inplace":
        return InPlaceDecode(backend), f"inplace:{backend.name}"
    return StagesDecode(backend), f"kernels:{backend.name}"


def _base(args: ServeArgs, loaded, policy: Policy, concurrency: int, engine: str) -> dict:
    cfg = loaded.model.config
    return {"model": loaded.name, "policy": policy.name, "concurrency": concurrency,
            "page_size": policy.page_size, "budget": policy.budget,
            "k_pages": policy.k_pages, "dense_layers": policy.dense_layers,
            "crossover": policy.crossover if policy.name == "hybrid" else None,
            "layers": cfg.num_hidden_layers, "q_heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "impl": "transformers" if engine.startswith("transformers") else "questprof_paged",
            "backend": str(loaded.model.device), "engine": engine, "mode": "per-head"}


def grid(policies: list, concurrency: list, rounds: int) -> list[tuple[int, object, int]]:
    """(round, policy, concurrency) in the order they run: the grid once per round, its order
    reversed every other round (A B, B A, A B...), so a drift of the machine over the process
    falls on each setting alike."""
    once = [(p, c) for p in policies for c in concurrency]
    return [(r, p, c) for r in range(rounds) for p, c in (once if r % 2 == 0 else once[::-1])]


def run_all(args: ServeArgs, policies, specs, concurrency, target: Path, command: str,
            log) -> Path:
    """Every (policy, concurrency) over the mix, --rounds times (grid); rows appended as each
    run ends."""
    engine, engine_name = decode_engine(args.engine, log)
    engine_name += ":graphs" if args.cuda_graph else ""
    loaded = load_serving_model(args.model, args.seed)
    check_fits(args, policies, specs, int(loaded.model.config.num_hidden_layers))
    check_scaling(args.engine, loaded.model)
    check_dtype(engine_name, loaded.model)
    if args.cuda_graph and loaded.model.device.type != "cuda":
        raise ConfigError("--cuda-graph needs a GPU: the model runs on the CPU")
    requests = requests_for(specs, int(loaded.model.config.vocab_size), args.seed)
    check_memory(loaded.model, _settings(args, max(concurrency), requests).num_blocks,
                 args.page_size)
    if loaded.model.device.type != "cuda":
        log(CPU_BANNER)
    meta = {"command": command, "scenario": f"serve {loaded.name}", "started": results.now(),
            "serve": {k: str(v) for k, v in asdict(args).items()},
            "device": loaded.model.device.type,  # where the model ran: cpu, cuda
            "machine": machine_info(), **git_fields()}
    with results.ResultsWriter(target, meta) as writer:
        for r, policy, c in grid(policies, concurrency, args.rounds):
            log(f"serve {loaded.name}: {policy.name}, {len(requests)} requests, concurrency {c}"
                + (f", round {r + 1} of {args.rounds}" if args.rounds > 1 else ""))
            served, steps = serve(loaded.model, requests, policy, _settings(args, c, requests),
                                  engine)
            base = {**_base(args, loaded, policy, c, engine_name), "round": r}
            writer.extend(run_rows(base, served, steps))
    return target
