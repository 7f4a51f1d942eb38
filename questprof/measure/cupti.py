"""DRAM bytes of a region through CUPTI PM sampling (cupti-python's `cupti.pm_sampling`).

The GPU samples dram__bytes_read.sum and dram__bytes_write.sum every `interval_ns` of GPU time;
the completed samples of a window are summed. The process's one collector is configured once,
with pcie__read_bytes.sum too where CUPTI accepts it (JOINT: measure/link.py counts the host
link's bytes from the same collector; on the H200 of 2026-12-02 a second configure left every
later window without a completed sample). A window starts and ends with a few idle intervals
so the last bytes of the region land in a completed sample (an open sample is dropped on stop),
the first sample (which spans the time since the previous window) is left out, and an idle
window of the same length is measured and subtracted. On an H200 (2026-11-29) a 2 GiB read
summed to within 0.0004% and 8 layers of dense attention to within 0.006% of their bytes.
Every CUPTI failure becomes CuptiError with CUPTI's own text.
"""

from __future__ import annotations

import atexit
import functools
import math
import time
from dataclasses import dataclass

from questprof import backends

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
LINK_METRIC = "pcie__read_bytes.sum"  # bytes the GPU reads over PCIe (measure/link.py)
JOINT = (*METRICS, LINK_METRIC)  # what the one configure of a process asks for first
INTERVAL_NS = 100_000  # ~310 samples a 30 ms window (pads too); 10 us: 10x the decoding, same sums
MAX_SAMPLES = 20_000
HW_BUFFER = 512 << 20  # cupti-python's default
PAD_INTERVALS = 5  # idle intervals before and after the region


class CuptiError(RuntimeError):
    """A CUPTI call failed; the message holds the step and CUPTI's text."""


def _text(exc: BaseException) -> str:
    """CUPTI's own words for an exception of cupti-python (its result name when it has one)."""
    status = getattr(exc, "status", None)
    if status is None:
        return f"{type(exc).__name__}: {exc}"
    try:
        import cupti.cupti as cc

        return f"{cc.Result(status).name} ({int(status)}): {exc}"
    except (ImportError, ValueError):  # no cupti.cupti, or a status Result does not name
        return f"CUPTI status {status}: {exc}"


def _check(step: str, fn, *args, **kwargs):
    """fn(...) with every cupti-python failure turned into CuptiError naming `step`."""
    try:
        return fn(*args, **kwargs)
    except CuptiError:
        raise
    except Exception as exc:  # deliberately any: cupti-python raises cuptiError and wraps it in
        # ValueError / RuntimeError; each becomes one CuptiError naming the step
        raise CuptiError(f"CUPTI {step}: {_text(exc)}") from None


def available(metrics: tuple[str, ...] = METRICS) -> tuple[bool, str | None]:
    """(True, None) when a PM-sampling session of `metrics` (DRAM bytes by default) configures,
    starts, stops and decodes on the current GPU (an empty window of ~1 ms), else (False,
    CUPTI's text); never raises. Enabling a collector is not enough: on an H200 (cupti-python
    13.4 over CUPTI 13.0.85) enable succeeded and configure failed."""
    reason = backends.gpu_unavailable_reason()
    if reason:
        return False, f"CUPTI: {reason}"
    try:
        import cupti.pm_sampling  # noqa: F401
    except Exception as exc:  # deliberately any: an optional package whose failure is the reason
        return False, (f"CUPTI: cupti-python is not importable ({type(exc).__name__}: {exc}); "
                       "install cupti-python and nvidia-cuda-cupti")
    try:
        window(lambda: None, INTERVAL_NS, metrics)
        return True, None
    except Exception as exc:  # deliberately any: a window that fails (CUPTI, CuPy, torch's CUDA
        # start) means no byte counts here, and its words are the reason
        return False, str(exc) if isinstance(exc, CuptiError) else f"CUPTI: {_text(exc)}"


def release() -> None:
    """Disable this process's PM sampling (ncu in a child and NVML GPM want the counters).

    Measure with CUPTI before releasing: on an H200 (2026) a collector enabled again after a
    release failed at configure with ERROR_INVALID_PARAMETER (cause not isolated).
    """
    if _collector.cache_info().currsize:
        _check("disable", _collector().disable)
        _configured.clear()  # the next collector may reuse this one's id
        _collector.cache_clear()


def _init_cuda_through_torch() -> None:
    """Let torch create the CUDA context before CUPTI is enabled, when torch is there.

    On an H200 (2026-11-29, cupti-python 13.4.0, driver 580.159.04) configure failed with
    ERROR_INVALID_PARAMETER in every process where CuPy created the context first (3 of 3
    configurations), and summed the DRAM bytes of a 2 GiB read in every process where torch had
    initialised CUDA first (3 of 3). Cause not isolated; the order is what was measured to work.
    """
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")


@functools.cache
def _collector():
    """One PM sampling collector per process, enabled on the current device (CUPTI allows one)."""
    import cupy
    from cupti import pm_sampling

    _init_cuda_through_torch()
    cupy.zeros(1)  # CUPTI needs the device's primary context to exist
    collector = pm_sampling.Collector(device_index=cupy.cuda.Device().id)
    _check("enable", collector.enable)
    atexit.register(collector.disable)
    return collector


@dataclass(frozen=True)
class DramBytes:
    """DRAM bytes of one repetition of a region, idle baseline subtracted.

    read, write: bytes per repetition; repeats: repetitions summed; seconds: busy window;
    idle_read, idle_write: bytes of the idle window of the same length (whole window).
    """

    read: float
    write: float
    repeats: int
    seconds: float
    samples: int
    idle_read: float
    idle_write: float


_configured: dict = {}  # id(collector) -> (interval_ns, the metrics it is configured with)
_joint_refused: dict = {}  # a joint metric set CUPTI refused -> its words


def _candidates(want: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Metric sets to configure for a window of `want`, first choice first: JOINT (DRAM and
    link bytes) holding `want`, then `want` alone. On the H200 (2026-12-02) JOINT configured,
    and a window of it summed the DRAM and PCIe bytes."""
    joint = tuple(dict.fromkeys((*JOINT, *want)))
    return [joint] if joint == tuple(want) else [joint, tuple(want)]


def _configure(collector, interval_ns: int, want: tuple[str, ...] = METRICS) -> tuple[int, tuple]:
    """(interval, metrics) the collector samples, `want` among the metrics: configured once per
    process, with the first candidate set CUPTI accepts (_candidates), at the first window's
    interval. Never twice: on the H200 (2026-12-02) every window after a second configure of
    one collector completed no sample (DRAM then DRAM + PCIe: 0 of 423; the probe's
    pcie__write_bytes.sum after pcie__read_bytes.sum: none), while configures CUPTI refused did
    no harm. A window that wants what the first configure left out is a CuptiError."""
    now = _configured.get(id(collector))
    if now is not None:
        if set(want) <= set(now[1]):
            return now
        raise CuptiError(f"CUPTI configure: this process samples {', '.join(now[1])}; "
                         f"{', '.join(m for m in want if m not in now[1])} would need a second "
                         "configure, after which no sample completed on an H200")
    joint, *alone = _candidates(tuple(want))
    if alone:
        try:
            return _set(collector, interval_ns, joint)
        except CuptiError as exc:
            _joint_refused[joint] = str(exc)
    return _set(collector, interval_ns, tuple(want))


def _set(collector, interval_ns: int, metrics: tuple[str, ...]) -> tuple[int, tuple]:
    """Configure the collector with `metrics` (CuptiError when CUPTI refuses) and remember it."""
    _check("configure", collector.configure, metrics=list(metrics),
           hardware_buffer_size=HW_BUFFER, sampling_interval=interval_ns)
    _configured[id(collector)] = (interval_ns, metrics)
    return interval_ns, metrics


def joint_refusal() -> str | None:
    """CUPTI's words where it refused JOINT in this process, else None (accepted, or not tried)."""
    return next(iter(_joint_refused.values()), None)


@dataclass(frozen=True)
class Window:
    """One sampled window: each asked metric's sum (first sample left out), the busy seconds
    around the region and the completed samples."""

    sums: tuple[float, ...]
    seconds: float
    samples: int


def window(run, interval_ns: int, metrics: tuple[str, ...] = METRICS) -> Window:
    """The sums of `metrics` over a sampled window around `run()`."""
    import cupy

    collector = _collector()
    interval_ns, configured = _configure(collector, interval_ns, tuple(metrics))
    pad = PAD_INTERVALS * interval_ns * 1e-9
    opened = time.perf_counter()
    _check("start", collector.start)
    try:
        time.sleep(pad)
        start = time.perf_counter()
        run()
        cupy.cuda.Device().synchronize()
        seconds = time.perf_counter() - start
        time.sleep(pad)
    finally:
        _check("stop", collector.stop)
    samples = decode_samples(check_span(time.perf_counter() - opened, interval_ns), interval_ns)
    data = _check("decode", collector.decode, max_samples=samples)
    if data.num_populated_samples > data.num_completed_samples + 1:
        raise CuptiError(f"CUPTI decode: only {data.num_completed_samples} of "
                         f"{data.num_populated_samples} samples completed: bytes would be lost")
    sums = sum_metrics(_check("metric evaluation", list, data),
                       [configured.index(m) for m in metrics])
    return Window(sums, seconds, data.num_completed_samples)


def _window(run, interval_ns: int) -> tuple[float, float, float, int]:
    """(read, write, seconds, samples) of the DRAM metrics over a window around `run()`."""
    got = window(run, interval_ns, METRICS)
    return (*got.sums, got.seconds, got.samples)


def check_span(open_seconds: float, interval_ns: int) -> float:
    """open_seconds, or a CuptiError when the window spanned more intervals than one decode
    holds (MAX_SAMPLES): the process's one interval is the first window's (_configure), so a
    longer window cannot widen it, and the samples past the decode's would be dropped."""
    spanned = math.ceil(open_seconds * 1e9 / interval_ns)
    if spanned + 64 > MAX_SAMPLES:
        raise CuptiError(f"CUPTI window of {open_seconds:.2f} s spans {spanned} intervals of "
                         f"{interval_ns / 1e3:.0f} us, over the {MAX_SAMPLES} samples one decode "
                         "holds: its bytes would be lost (measure fewer passes)")
    return open_seconds


def decode_samples(open_seconds: float, interval_ns: int) -> int:
    """Samples to provision when decoding a window that was open `open_seconds`: twice the
    intervals it spanned, plus slack, at most MAX_SAMPLES. cupti-python builds a fresh counter
    image of max_samples for every decode; at MAX_SAMPLES that took 28 ms a window on an H200
    (2026-12-01, commit 5aeb93e: 12.1 s of the longchat-7b main job's 426 windows). A window
    that held more samples than provisioned fails the completed-samples check below, never
    silently."""
    spanned = math.ceil(open_seconds * 1e9 / interval_ns)
    return int(min(MAX_SAMPLES, 2 * spanned + 64))


def sum_samples(samples) -> tuple[float, float]:
    """(read, write) DRAM bytes summed over a window's samples, its first sample left out
    (sum_metrics)."""
    read, write = sum_metrics(samples, [0, 1])
    return read, write


def sum_metrics(samples, positions) -> tuple[float, ...]:
    """The sum of each metric at `positions` of the samples' metric values, the first sample
    left out.

    The first sample of a session spans from the previous stop (from timestamp 0 after a
    configure) to the first trigger and holds every byte the GPU moved in between: on an H200
    (2026-11-29) it held exactly 4.00x the region's bytes after the 4 warm-up passes that ran
    between two windows, which made dense +14.8% and a plain 2 GiB read +6.25%; without it a
    2 GiB read was +0.0004% and 8 layers of dense +0.006%. The region starts PAD_INTERVALS idle
    intervals into the window, so the first sample holds none of it.
    """
    sums = [0.0] * len(positions)
    for sample in list(samples)[1:]:
        for i, at in enumerate(positions):
            sums[i] += sample.metric_values[at]
    return tuple(sums)


def _interval(seconds: float) -> int:
    """Sampling interval that keeps a padded window of `seconds` within MAX_SAMPLES / 2 samples:
    what the process's first window configures with (available() configures at INTERVAL_NS); a
    later window keeps that interval (_configure) and, longer than it holds, raises (check_span)."""
    need = seconds * 1e9 / (MAX_SAMPLES / 2 - 2 * PAD_INTERVALS)
    return max(INTERVAL_NS, int(math.ceil(need / INTERVAL_NS)) * INTERVAL_NS)


@dataclass(frozen=True)
class IdleRate:
    """DRAM bytes per second of an idle device, from one idle window (subtracted from later
    windows instead of an idle window of their own: that halves a measurement's time)."""

    read: float
    write: float


def idle_rate(seconds: float = 0.02) -> IdleRate:
    """The idle device's DRAM read and write rates over one window of `seconds`."""
    read, write, took, _ = _window(lambda: time.sleep(seconds), _interval(seconds))
    return IdleRate(read / took, write / took)


def measure(launch, repeats: int, expected_seconds: float = 0.05,
            idle: IdleRate | None = None) -> DramBytes:
    """DRAM bytes of one `launch()` (asynchronous, on the current stream), `repeats` summed.

    The caller warms the region up first (compilation, allocation) and picks `repeats` so the
    window is long enough for a stable sum (tens of ms on an H200 at 4.5 TB/s). The idle
    baseline is an idle window of the same length, or `idle`'s rates over the window.
    """
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    interval = _interval(expected_seconds)

    def region():
        for _ in range(repeats):
            launch()

    read, write, seconds, samples = _window(region, interval)
    if idle is None:
        idle_read, idle_write, _, _ = _window(lambda: time.sleep(seconds), interval)
    else:
        idle_read, idle_write = idle.read * seconds, idle.write * seconds
    return DramBytes((read - idle_read) / repeats, (write - idle_write) / repeats, repeats,
                     seconds, samples, idle_read, idle_write)


if __name__ == "__main__":  # `questprof doctor` probes in a fresh process (see core.machine)
    works, why = available()
    print("PM sampling configures, starts, stops and decodes" if works else why)
    raise SystemExit(0 if works else 1)
