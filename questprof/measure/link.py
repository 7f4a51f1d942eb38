"""Bytes over the host link (PCIe) of a region, through CUPTI PM sampling of pcie__read_bytes.sum,
calibrated on a zero-copy read of known size in the same run.

The host tier (core/tier.py, backends/host_tier.py) keeps K and V pages in mapped pinned host
memory that the kernels read in place: those bytes never reach DRAM, so only a link counter sees
them. On the H200 (2026-12-02, commit 8ff47d2, tools/link_bytes_probe.py) PM sampling
configured with `pcie__read_bytes.sum` ("# of bytes of PCIe read data, at 512B granularity",
`ncu --query-metrics --chip gh100`); the names tried before it were refused (pcie__read_bytes,
pcie__cycles_*: ERROR_INVALID_PARAMETER); those tried after it in the same process (the rest,
pcie__write_bytes.sum's empty window included) followed a configure and settle nothing: the
probe now runs each metric in a fresh process. Over 8 repeats of 256 MiB the
counter summed to 1.0469x the known bytes for a pinned host-to-device copy (copy engine) and
1.0938x for a kernel reading mapped pinned memory in place (zero-copy): it counts, with an
overhead that depends on the kind of access. So every figure is calibrated on a zero-copy read by
a kernel (the ceilings read kernel over a mapped buffer, how the host tier's pages are read),
measured in the same run: factor = counted / known, calibrated = counted / factor. Rows carry
both the raw and the calibrated figure.

Windows, idle subtraction and the first-sample rule are measure.cupti's (one collector per
process); rotations and their graph replay are measure.dram's. Every failure is one reason
string (available(), Calibration.why_not), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from questprof.measure import ceilings, cupti, dram

METRIC = cupti.LINK_METRIC  # "pcie__read_bytes.sum"
CALIBRATION_BYTES = 256 << 20  # the probe's size: 4.3x an H200's 60 MiB L2, so every read misses
CALIBRATION_REPEATS = 8  # the probe's: ~40 ms a window at the H200's ~54 GB/s zero-copy read
# A second calibration window must land within SPREAD of the first: the factor is then a
# property of the link, not of one window (on the H200, 2026-12-02: 6e-7 apart).
SPREAD = 0.02
# The zero-copy read counted 1.0938x on the H200: a factor outside this range is no protocol
# overhead but another link (NVLink-C2C on a GH200 crosses no PCIe) or a counter that misses.
FACTOR_RANGE = (0.5, 2.0)
TARGET_SECONDS = 0.03  # a stage's window, as measure.dram's CUPTI windows


@dataclass(frozen=True)
class Calibration:
    """A zero-copy read of `known` bytes counted twice in one run (bytes per read, the idle
    link subtracted), and the idle link's counter rate in bytes per second."""

    known: float
    counted: float
    again: float
    idle_rate: float = 0.0

    @property
    def factor(self) -> float:
        """Counted over known bytes of the first window (NaN where nothing was known)."""
        return self.counted / self.known if self.known > 0 else float("nan")

    @property
    def spread(self) -> float:
        """The second window's count over the first's, minus 1."""
        return self.again / self.counted - 1 if self.counted > 0 else float("inf")

    def why_not(self) -> str | None:
        """Why the counter's figures are no link byte count here, or None when they are."""
        mib = f"{self.known / 2**20:,.0f} MiB"
        if not self.counted > 0:
            return (f"{METRIC} counted {self.counted:,.0f} B over a zero-copy read of {mib}: "
                    "the host link here is not PCIe, or the counter does not see it")
        lo, hi = FACTOR_RANGE
        if not lo <= self.factor <= hi:
            return (f"{METRIC} counted {self.factor:.3f}x a zero-copy read of {mib} (outside "
                    f"{lo}..{hi}x): not a byte count of this link")
        if abs(self.spread) > SPREAD:
            return (f"two zero-copy reads of {mib} counted {self.spread:+.2%} apart (more than "
                    f"{SPREAD:.0%}): the counter's overhead is not stable here")
        return None

    def calibrated(self, raw: float) -> float:
        """Bytes that crossed the link, from the counter's `raw` bytes of zero-copy reads."""
        return raw / self.factor

    def as_dict(self) -> dict:
        """For meta.json: the figures, the factor, the spread and why not, if not."""
        return {**asdict(self), "metric": METRIC, "factor": self.factor,
                "spread": self.spread, "reason": self.why_not()}


@dataclass(frozen=True)
class LinkBytes:
    """Link bytes of one call (a layer of a stage): the counter's, and calibrated by `factor`."""

    raw: float
    calibrated: float
    factor: float


def available() -> tuple[bool, str | None]:
    """(True, None) when PM sampling of METRIC configures and samples here, else (False, why)."""
    return cupti.available((METRIC,))


def window_bytes(run: Callable[[], object], interval_ns: int) -> tuple[float, float]:
    """(counted bytes, busy seconds) of METRIC over a sampled window around `run()`."""
    got = cupti.window(run, interval_ns, (METRIC,))
    return got.sums[0], got.seconds


def idle_rate(seconds: float = 0.02) -> float:
    """The counter's bytes per second over an idle window of `seconds`."""
    counted, took = window_bytes(lambda: time.sleep(seconds), cupti.INTERVAL_NS)
    return counted / took


def measure(launch: Callable[[], object], repeats: int, expected_seconds: float,
            idle: float) -> float:
    """Counted bytes of one `launch()` (asynchronous), `repeats` summed, the idle link's bytes
    over the window (`idle` B/s) subtracted."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")

    def region():
        for _ in range(repeats):
            launch()

    counted, seconds = window_bytes(region, cupti._interval(expected_seconds))
    return (counted - idle * seconds) / repeats


def zero_copy_read(nbytes: int):
    """(launch, seconds) of the read kernel over `nbytes` of mapped pinned host memory, read in
    place (measure.ceilings.launch_read, as measure_link_ceilings reads it); the buffer lives as
    long as `launch`."""
    import cupy

    from questprof.backends.host_tier import mapped_empty

    if nbytes % 16:
        raise ValueError(f"{nbytes} bytes is not a whole number of float4")
    mapped = mapped_empty((nbytes // 4,), np.float32)
    mapped[...] = 0  # values the read kernel's sink never fires on
    sink = cupy.zeros(1, dtype=cupy.float32)
    launch = lambda: ceilings.launch_read(mapped, sink)  # noqa: E731
    return launch, ceilings.median_ms(launch, repeats=3, warmup=1) * 1e-3


def calibrate(nbytes: int = CALIBRATION_BYTES, repeats: int = CALIBRATION_REPEATS) -> Calibration:
    """The counter calibrated on `repeats` zero-copy reads of `nbytes`, in two windows, and the
    idle link's rate."""
    read, seconds = zero_copy_read(nbytes)
    idle = idle_rate()
    first, again = (measure(read, repeats, repeats * seconds, idle) for _ in range(2))
    return Calibration(float(nbytes), first, again, idle)


def read_bytes(nbytes: int, calibration: Calibration,
               repeats: int = CALIBRATION_REPEATS) -> LinkBytes:
    """Link bytes of one zero-copy read of `nbytes` (a known size: the calibration's check)."""
    read, seconds = zero_copy_read(nbytes)
    raw = measure(read, repeats, repeats * seconds, calibration.idle_rate)
    return LinkBytes(raw, calibration.calibrated(raw), calibration.factor)


def stage_bytes(launch: Callable[[int], object], calls: int, calibration: Calibration,
                pass_ms: float | None = None, seconds: float = TARGET_SECONDS) -> LinkBytes:
    """Link bytes of one call of launch(layer), layers 0..calls-1, over a cold rotation replayed
    as a CUDA graph (measure.dram.replayed); pass_ms: one pass's time where known."""
    def rotation():
        for layer in range(calls):
            launch(layer)

    if pass_ms is None:
        pass_ms = ceilings.median_ms(rotation, repeats=3, warmup=1)
    repeats = dram.repeats_for(rotation, seconds, pass_ms)
    # a pass over the link can take 0.1-1 s: a window longer than the process's one interval
    # holds raises (measure.cupti.check_span) and the row says why
    expected = max(seconds, repeats * pass_ms * 1e-3)
    with dram.replayed(rotation) as replay:
        raw = measure(replay, repeats, expected, calibration.idle_rate) / calls
    return LinkBytes(raw, calibration.calibrated(raw), calibration.factor)


def main(argv=None) -> int:
    """Calibrate, then count a zero-copy read of --check-mib; one JSON object on stdout. In a
    fresh process (tests/test_link_gpu.py): CUPTI wants torch to create the CUDA context."""
    parser = argparse.ArgumentParser(description="the link counter on this GPU, as JSON")
    parser.add_argument("--check-mib", type=int, default=96)
    args = parser.parse_args(argv)
    works, why = available()
    if not works:
        print(json.dumps({"reason": why}))
        return 1
    calibration = calibrate()
    out = {"calibration": calibration.as_dict(), "check_bytes": args.check_mib << 20}
    if calibration.why_not() is None:
        out["check"] = asdict(read_bytes(args.check_mib << 20, calibration))
    print(json.dumps(out))
    return 0 if calibration.why_not() is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
