"""Measured end-to-end decode steps (sweep's `e2e` rows): a random-weight decoder shaped like the
scenario's model (workload.decoder), dense against Quest, timed whole and attention alone.

The default GPU main job runs it at E2E_LENGTHS so the report's Amdahl section is measured;
`--e2e/--no-e2e` overrides. Rows land in the sweep's results directory with stage 'e2e'.
"""

from __future__ import annotations

import dataclasses
import gc

from questprof.backends import get_backend
from questprof.core import model
from questprof.core.config import Config, ModelShape
from questprof.core.layout import DTYPE_BYTES
from questprof.measure.timing import time_call
from questprof.results import append_rows, make_row
from questprof.workload.decoder import DecodeRun, build_cache, build_decoder

E2E_LENGTHS = (8192, 32768, 131072)  # where the default GPU main job measures whole steps
HEADROOM_BYTES = 2 * 2**30  # cuBLAS workspaces, graph pools, activations, scores, selections
PASSES = ("step_ms_dense", "step_ms_quest", "attention_ms_dense", "attention_ms_quest")


def memory_reason(need_bytes: float, free_bytes: float, what: str) -> str | None:
    """Why `what` does not fit in free device memory, or None when it does."""
    if need_bytes <= free_bytes:
        return None
    return (f"{what} needs {need_bytes / 2**30:.1f} GiB (with {HEADROOM_BYTES / 2**30:.0f} GiB "
            f"headroom) but {free_bytes / 2**30:.1f} GiB is free")


def _free_bytes(device: str) -> float:
    """Free device memory after returning cached blocks of torch and CuPy."""
    if device == "cpu":  # no collection either: 0.3 s each inside the test suite's heap
        return float("inf")  # CPU runs are smoke runs; the OS reports what does not fit
    gc.collect()
    import cupy
    import torch
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()
    return float(torch.cuda.mem_get_info()[0])


def _figures(cfg: Config, ms: dict) -> dict:
    """Attention share, speedups, the Amdahl and 4-bit predictions from the four medians."""
    fraction = min(ms["attention_ms_dense"] / ms["step_ms_dense"], 1.0)
    speedup = ms["attention_ms_dense"] / ms["attention_ms_quest"]
    ratio = model.weight_bytes(cfg.model, 4) / model.weight_bytes(cfg.model, 16)
    return {**ms, "attention_fraction": fraction, "attention_speedup": speedup,
            "amdahl_predicted": model.amdahl_speedup(fraction, speedup),
            "measured_speedup": ms["step_ms_dense"] / ms["step_ms_quest"],
            "predicted_4bit": model.predicted_4bit(fraction, speedup, ratio)}


def _measure_point(dec, cfg: Config, backend, scenario: str, steps: int, warmup: int,
                   graph: bool) -> dict:
    """The e2e row of one length: four timed passes (whole steps and attention alone)."""
    cache = build_cache(dec, backend, cfg.length, cfg.batch, cfg.page_size, cfg.seed)
    run = DecodeRun(dec, cache, backend, cfg.budget, cfg.page_size, cfg.mode, cfg.seed)
    run.step(quest=False, save_q=True)  # q of every layer for the attention-only passes
    backend.synchronize()
    calls = {"step_ms_dense": lambda: run.step(False), "step_ms_quest": lambda: run.step(True),
             "attention_ms_dense": lambda: run.attention_pass(False),
             "attention_ms_quest": lambda: run.attention_pass(True)}
    ms, timings, notes = {}, {}, []
    for name, fn in calls.items():
        t = time_call(backend, fn, warmup, steps, graph, uses_torch=True)
        ms[name], timings[name] = t.median, t
        notes += [f"{name}: {t.note}"] if t.note else []
    quest = timings["step_ms_quest"].summary()
    quest["method"] = "+".join(sorted({t.method for t in timings.values()}))
    return make_row(cfg, "e2e", scenario=scenario, backend=backend.name, timing=quest,
                    reason="; ".join(notes) or None, steps=steps, **_figures(cfg, ms))


def measure_e2e(shape: ModelShape, lengths, page_size: int, budget: int, batch: int = 1,
                backend=None, steps: int = 10, warmup: int = 2, *, mode: str = "per-head",
                seed: int = 0, scenario: str | None = None,
                graph: bool | None = None) -> list[dict]:
    """Measured decode steps, dense vs Quest, one row (stage 'e2e') per length (tokens).

    Times are medians in ms per whole step (all layers); attention_ms_* time the attention calls
    alone (summary + estimate + topk + attention under Quest) over all layers in the same run.
    On CPU the decoder runs in float32 whatever the shape says (the rows' dtype says fp32).
    graph: CUDA-graph the timed passes (None = on a GPU backend), as serving engines run decode.
    """
    if backend is None:
        backend = get_backend("auto")
    device = "cuda" if backend.is_gpu else "cpu"
    run_shape = shape if backend.is_gpu or shape.is_fp8 else dataclasses.replace(shape,
                                                                                 dtype="fp32")
    cfgs = [Config(run_shape, n, batch, page_size, budget, mode, seed) for n in lengths]
    scenario = scenario or shape.name
    skip = lambda cfg, why: make_row(cfg, "e2e", scenario=scenario, backend=backend.name,  # noqa: E731
                                     status="skipped", reason=why, steps=steps)
    if shape.is_fp8:  # the decoder writes its new keys in the model's dtype, not as e4m3
        return [skip(cfg, "end-to-end steps over an FP8 KV cache are not built yet")
                for cfg in cfgs]
    if shape.tp > 1:  # the decoder's hidden size is its q heads x head_dim: one GPU's only
        return [skip(cfg, f"end-to-end steps of one GPU of tp {shape.tp} are not built yet")
                for cfg in cfgs]
    bits = 8 * DTYPE_BYTES[run_shape.dtype]
    reason = memory_reason(model.weight_bytes(run_shape, bits) + HEADROOM_BYTES,
                           _free_bytes(device), "the weights")
    if reason:
        return [skip(cfg, reason) for cfg in cfgs]
    dec = build_decoder(run_shape, device, seed)
    graph = backend.is_gpu if graph is None else graph
    rows = []
    for cfg in cfgs:
        need = run_shape.layers * model.kv_pool_bytes(cfg) + HEADROOM_BYTES
        reason = memory_reason(need, _free_bytes(device), f"the KV caches of {cfg.length} tokens")
        rows.append(skip(cfg, reason) if reason else
                    _measure_point(dec, cfg, backend, scenario, steps, warmup, graph))
    del dec
    _free_bytes(device)
    return rows


def run_e2e(scenario, configs, backend, out_dir, page_size: int, budget: int,
            lengths=None, steps: int = 10) -> list[dict]:
    """e2e rows at `lengths` (default: the grid's), appended to out_dir."""
    lengths = sorted(lengths or {c.length for c in configs})
    batch = min(c.batch for c in configs)
    rows = measure_e2e(scenario.model, lengths, page_size, budget, batch, backend,
                       steps=steps, scenario=scenario.name)
    append_rows(out_dir, rows, e2e={"page_size": page_size, "budget": budget, "batch": batch,
                                    "lengths": lengths})
    return rows
