"""Timing of one stage over a cold-cache pass of all simulated layers.

GPU backends are timed with CUDA events around a whole pass (each layer has its own KV pool, so
the working set is many times the 60 MiB L2 of an H200); the NumPy backend with perf_counter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from questprof import model

# A pass of the smallest timed stage (estimate or sparse attention) reads >= 8x L2: every call
# starts cold, and the graph launch of a pass is spread over enough kernels. With one layer
# (a pool >= 4x L2 was the sweep's old rule) longchat-7b 32K on an H200 timed Quest at 57.8 us
# per layer in the sweep against 37.9 us in the bench, which used this rule.
COLD_FACTOR = 8


@dataclass(frozen=True)
class Timing:
    """Per-layer times (ms) of each timed pass, and how they were taken."""

    samples_ms: tuple[float, ...]
    method: str  # "cuda-events", "cuda-graph" or "perf-counter"
    clocks: dict | None = None  # NVML right after the timed passes (see `clock_fields`)

    def pct(self, q: float) -> float:
        return float(np.percentile(self.samples_ms, q))

    @property
    def median(self) -> float:
        return self.pct(50)

    def summary(self) -> dict[str, float]:
        """median, p20, p80, p95 in ms per layer."""
        return {"median_ms": self.median, "p20_ms": self.pct(20), "p80_ms": self.pct(80),
                "p95_ms": self.pct(95)}

    def clock_fields(self) -> dict:
        """sm_clock_mhz, mem_clock_mhz, throttled for a results row (None where NVML is not)."""
        clocks = self.clocks or {}
        return {k: clocks.get(k) for k in ("sm_clock_mhz", "mem_clock_mhz", "throttled")}


def _clocks() -> dict | None:
    """NVML clocks and throttle reasons now, None without NVML (never raises)."""
    from questprof.measure import nvml

    if not nvml.available()[0]:
        return None
    try:
        return nvml.snapshot()
    except Exception:  # a clock read must never fail a timing
        return None


def cold_layers(cfg, l2_bytes: int, pool_budget: float) -> int:
    """Simulated layers of a cold pass for cfg: >= COLD_FACTOR x L2 read by its smallest timed
    stage, at least 2, and no more pools than pool_budget bytes hold (then at least 1)."""
    work = model.stage_work(cfg)
    smallest = max(1.0, min(work["estimate"].read, work["attention"].read))
    want = max(2, -(-COLD_FACTOR * l2_bytes // int(smallest)))
    return int(max(1, min(want, pool_budget // model.kv_pool_bytes(cfg))))


def _pass(run_layer: Callable[[int], object], layers: int) -> None:
    for layer in range(layers):
        run_layer(layer)


def _time_cpu(run_layer, layers: int, warmup: int, repeats: int) -> Timing:
    for _ in range(warmup):
        _pass(run_layer, layers)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        _pass(run_layer, layers)
        samples.append((time.perf_counter() - start) * 1e3 / layers)
    return Timing(tuple(samples), "perf-counter")


def _time_gpu(run_layer, layers: int, warmup: int, repeats: int, graph: bool) -> Timing:
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        launch = lambda: _pass(run_layer, layers)  # noqa: E731
        if graph:
            stream.begin_capture()
            _pass(run_layer, layers)
            captured = stream.end_capture()
            launch = lambda: captured.launch(stream)  # noqa: E731
        for _ in range(warmup):
            launch()
        events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
        for start, end in events:
            start.record(stream)
            launch()
            end.record(stream)
        stream.synchronize()
    clocks = _clocks()  # right after the passes: the clocks the load ran at (throttling shows)
    samples = [cupy.cuda.get_elapsed_time(s, e) / layers for s, e in events]
    return Timing(tuple(samples), "cuda-graph" if graph else "cuda-events", clocks)


def time_layers(backend, run_layer: Callable[[int], object], layers: int, warmup: int = 3,
                repeats: int = 20, graph: bool = False) -> Timing:
    """Time `run_layer(l)` for l in 0..layers-1 as one pass; ms per layer for each repeat.

    On a GPU backend run_layer must only launch work (no synchronisation, no host copies).
    """
    if layers < 1 or repeats < 1:
        raise ValueError("layers and repeats must be at least 1")
    if backend.is_gpu:
        return _time_gpu(run_layer, layers, warmup, repeats, graph)
    return _time_cpu(run_layer, layers, warmup, repeats)
