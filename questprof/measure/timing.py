"""The one timing loop of questprof: a pass of run_layer(0..layers-1), warmed up, repeated.

GPU backends are timed with CUDA events around a whole pass on one stream (each layer has its
own KV pool, so the working set is many times the L2), optionally as a CUDA-graph replay of the
pass, the way serving engines run decode; the NumPy backend with perf_counter. Work launched
through torch (peers, the end-to-end decoder) joins the same stream and, for graphs, is captured
with torch's own graph API so its allocator stays consistent. A single call (ceilings) is a pass
of one layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from questprof.measure import nvml

CLOCK_FIELDS = ("sm_clock_mhz", "mem_clock_mhz", "throttled")


@dataclass(frozen=True)
class Timing:
    """Per-layer times (ms) of each timed pass, how they were taken, and the clocks they ran at."""

    samples_ms: tuple[float, ...]
    method: str  # "cuda-events", "cuda-graph" or "perf-counter"
    clocks: dict | None = None  # NVML right after the timed passes
    note: str | None = None  # why a graph was asked for and not used

    def pct(self, q: float) -> float:
        return float(np.percentile(self.samples_ms, q))

    @property
    def median(self) -> float:
        return self.pct(50)

    def summary(self) -> dict:
        """median, p20, p80, p95 in ms per layer, the method, and the clock fields."""
        clocks = self.clocks or {}
        return {"median_ms": self.median, "p20_ms": self.pct(20), "p80_ms": self.pct(80),
                "p95_ms": self.pct(95), "method": self.method,
                **{k: clocks.get(k) for k in CLOCK_FIELDS}}


def _clocks() -> dict | None:
    """NVML clocks and throttle reasons now, None without NVML or when an NVML call fails."""
    if not nvml.available()[0]:
        return None
    try:
        return nvml.snapshot()
    except nvml.NvmlError:  # any NVML status: the clocks are context, never fail a timing
        return None


def _pass(run_layer: Callable[[int], object], layers: int) -> None:
    for layer in range(layers):
        run_layer(layer)


def _time_cpu(run_layer, layers: int, warmup: int, repeats: int, timed) -> Timing:
    for _ in range(warmup):
        _pass(run_layer, layers)
    if timed is not None:
        timed()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        _pass(run_layer, layers)
        samples.append((time.perf_counter() - start) * 1e3 / layers)
    return Timing(tuple(samples), "perf-counter")


def capture(launch, stream, uses_torch: bool):
    """A replay function of `launch` captured as a CUDA graph on `stream`."""
    if uses_torch:
        import torch

        graph = torch.cuda.CUDAGraph()
        # relaxed: CuPy's pool may still cudaMalloc during capture (not recorded into the graph)
        with torch.cuda.graph(graph, stream=torch.cuda.ExternalStream(stream.ptr),
                              capture_error_mode="relaxed"):
            launch()
        return graph.replay
    stream.begin_capture()
    try:
        launch()
    finally:
        captured = stream.end_capture()
    return lambda: captured.launch(stream)


class _Streams:
    """The CuPy stream a timing runs on, with torch's current stream set to the same one."""

    def __init__(self, stream, uses_torch: bool):
        self.stream, self.torch_ctx = stream, None
        if uses_torch:
            import torch

            self.torch_ctx = torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr))

    def __enter__(self):
        self.stream.__enter__()
        if self.torch_ctx is not None:
            self.torch_ctx.__enter__()
        return self.stream

    def __exit__(self, *exc):
        if self.torch_ctx is not None:
            self.torch_ctx.__exit__(*exc)
        self.stream.__exit__(*exc)


def _time_gpu(run_layer, layers: int, warmup: int, repeats: int, graph: bool,
              uses_torch: bool, timed) -> Timing:
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    launch, note = (lambda: _pass(run_layer, layers)), None
    with _Streams(stream, uses_torch):
        launch()  # compiles kernels and fills the memory pools before any capture
        stream.synchronize()
        run = launch
        if graph:
            try:
                run = capture(launch, stream, uses_torch)
            except Exception as exc:  # deliberately any: a capture that fails (CuPy's, torch's or a
                # peer's own error) is timed as eager launches, and the row's method says why
                stream.synchronize()
                note = f"CUDA graph capture failed ({type(exc).__name__}: {exc}); eager launches"
        for _ in range(warmup):
            run()
        if timed is not None:
            stream.synchronize()
            timed()
        events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
        for start, end in events:
            start.record(stream)
            run()
            end.record(stream)
        stream.synchronize()
    clocks = _clocks()  # right after the passes: the clocks the load ran at (throttling shows)
    samples = [cupy.cuda.get_elapsed_time(s, e) / layers for s, e in events]
    method = "cuda-graph" if graph and note is None else "cuda-events"
    return Timing(tuple(samples), method, clocks, note)


def time_layers(backend, run_layer: Callable[[int], object], layers: int, warmup: int = 3,
                repeats: int = 20, graph: bool = False, uses_torch: bool = False,
                timed: Callable[[], object] | None = None) -> Timing:
    """Time `run_layer(l)` for l in 0..layers-1 as one pass; ms per layer for each repeat.

    On a GPU backend run_layer must only launch work (no synchronisation, no host copies);
    uses_torch=True when it launches torch work, which then runs on the timed stream too.
    `timed` runs once, after the untimed passes (the first launch, the warmup) have finished and
    before the timed ones: what it starts counting counts the timed passes only.
    """
    if layers < 1 or repeats < 1 or warmup < 0:
        raise ValueError("layers and repeats must be at least 1, warmup at least 0")
    if getattr(backend, "is_gpu", False):
        return _time_gpu(run_layer, layers, warmup, repeats, graph, uses_torch, timed)
    return _time_cpu(run_layer, layers, warmup, repeats, timed)


def time_call(backend, fn: Callable[[], object], warmup: int = 3, repeats: int = 20,
              graph: bool = False, uses_torch: bool = False) -> Timing:
    """Time single calls of `fn` (a ceiling kernel, a whole decode step): a pass of one layer."""
    return time_layers(backend, lambda _: fn(), 1, warmup, repeats, graph, uses_torch)
