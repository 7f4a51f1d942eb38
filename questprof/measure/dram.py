"""DRAM bytes of one call of a stage, per layer, through CUPTI or NVML GPM (ncu: measure.ncu).

Two protocols keep every call cold, as in a real decode step. `rotate` (CUPTI's default): the
stage runs over enough layers, each with its own pools, that one pass reads >= 8x the L2, and
the window's bytes are divided by the calls. `flush`: each call is followed by an L2-evicting
read (measure.ceilings.Flush), and the same loop without the stage is subtracted.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

from questprof.measure import cupti, nvml
from questprof.measure.ceilings import median_ms
from questprof.measure.timing import capture

SOURCES = ("cupti", "ncu", "nvml")
PROTOCOLS = ("rotate", "flush")
TARGET_SECONDS = {"cupti": 0.03, "nvml": 0.3}  # GPM averages over its window: make it longer


def repeats_for(fn, seconds: float, call_ms: float | None = None) -> int:
    """Repetitions of `fn` (asynchronous) that fill about `seconds` of GPU time, 3..2000;
    call_ms, when the caller has just timed fn, saves timing it again."""
    if call_ms is None:
        call_ms = median_ms(fn, repeats=3, warmup=1)
    return int(min(2000, max(3, math.ceil(seconds * 1e3 / max(call_ms, 1e-6)))))


@contextlib.contextmanager
def replayed(rotation: Callable[[], object]):
    """A launch of `rotation` (one pass over the layers) as a CUDA-graph replay on a stream of
    its own, or the rotation itself where capture fails. A measured window then costs one host
    launch per pass, not one per layer: launching each layer from Python made the windows host
    bound (31 s of the longchat-7b main job's 56 s of byte measurement on an H200, 2026-12-01,
    commit 5aeb93e, at 5-7x the GPU time they measured). The graph's kernels are those of the
    eager pass; replays happen before anything else allocates, as in measure.timing."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        rotation()  # outputs allocated and kernels loaded before the capture
        stream.synchronize()
        try:
            replay = capture(rotation, stream, uses_torch=False)
        except Exception:  # deliberately any: a capture that fails (CuPy's capture errors, a
            # launch that allocates while capturing) falls back to eager launches, same bytes
            stream.synchronize()
            replay = rotation
        yield replay
        stream.synchronize()


def _sync_loop(fn, repeats: int) -> None:
    import cupy

    for _ in range(repeats):
        fn()
    cupy.cuda.Device().synchronize()


def stage_bytes(source: str, launch: Callable[[int], object], calls: int, flush=None,
                protocol: str = "rotate", pass_ms: float | None = None,
                seconds: float | None = None, idle=None):
    """(read, write) DRAM bytes of one call of launch(layer), layers 0..calls-1, through CUPTI
    (GPM: gpm_stage_bytes). pass_ms: the time of one pass when known (skips a timing run);
    idle: a CUPTI IdleRate to subtract instead of an idle window per measurement."""
    if source != "cupti":
        raise ValueError(f"stage_bytes measures through CUPTI, not {source!r}")
    seconds = seconds or TARGET_SECONDS.get(source, 0.03)
    if source == "cupti" and protocol == "rotate":
        def rotation():
            for layer in range(calls):
                launch(layer)

        repeats = repeats_for(rotation, seconds, pass_ms)
        with replayed(rotation) as replay:
            got = cupti.measure(replay, repeats, seconds, idle)
        return got.read / calls, got.write / calls

    with_stage, without = _flushed(launch, calls, flush)
    repeats = repeats_for(with_stage, seconds)
    a = cupti.measure(with_stage, repeats, seconds)
    b = cupti.measure(without, repeats, seconds)
    return (a.read - b.read) / calls, (a.write - b.write) / calls


def _flushed(launch: Callable[[int], object], calls: int, flush):
    """(a pass of the stage with a flush after each call, the same flushes without the stage)."""
    def with_stage():
        for layer in range(calls):
            launch(layer)
            flush()

    def without():
        for _ in range(calls):
            flush()

    return with_stage, without


def gpm_calibration(fn, repeats: int, known_bytes: float, tolerance: float):
    """nvml.GpmCalibration from two GPM windows over `repeats` calls of fn, each moving
    known_bytes in DRAM: the first gives the full scale, the second checks that it holds."""
    run = lambda: _sync_loop(fn, repeats)  # noqa: E731
    first, again = nvml.gpm_window(run), nvml.gpm_window(run)
    return nvml.calibration(first, again, repeats * known_bytes, tolerance)


def gpm_stage_bytes(launch: Callable[[int], object], calls: int, flush, gpm):
    """nvml.GpmBytes: bytes (read + write) per call of launch(layer) through GPM under the flush
    protocol, or why they are not a byte count here (nothing runs when the calibration failed)."""
    if gpm.why_not is not None:
        return nvml.GpmBytes(None, gpm.why_not)
    with_stage, without = _flushed(launch, calls, flush)
    repeats = repeats_for(with_stage, TARGET_SECONDS["nvml"])
    cupti.release()
    stage = nvml.gpm_window(lambda: _sync_loop(with_stage, repeats))
    base = nvml.gpm_window(lambda: _sync_loop(without, repeats))
    return nvml.difference(stage, base, gpm, repeats * calls)
