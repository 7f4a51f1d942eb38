"""NVML: clocks, power, memory, throttle reasons and GPM DRAM bandwidth utilisation.

Every NVML status becomes NvmlError with NVML's own text (nvmlErrorString through pynvml).
GPM's DRAM_BW_UTIL is a whole-device percentage whose 100% is not the datasheet: on an H200
(2026-11-29) it read 86.2% while CUPTI counted 4.54 TB/s, so 100% ~ 5.27 TB/s. It is turned
into bytes only through a full scale calibrated on a kernel of known bytes (`calibration`), and
only where that calibration holds and a window resolves the bytes (`difference`).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

# Reasons that lower clocks because of power or heat (idle, app clocks, sync boost do not).
THROTTLES = {
    0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal",
    0x40: "hw_thermal", 0x80: "hw_power_brake",
}
OTHER_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x10: "sync_boost",
                 0x100: "display_clock"}


class NvmlError(RuntimeError):
    """An NVML call failed; the message holds the call and NVML's error text."""


def _call(fn, *args):
    """fn(*args) with pynvml's NVMLError turned into NvmlError naming the call."""
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise NvmlError(f"{fn.__name__}: {exc}") from None


@functools.cache
def _init() -> None:
    import pynvml

    _call(pynvml.nvmlInit)


def available() -> tuple[bool, str | None]:
    """(True, None) when NVML answers for the current GPU, else (False, why); never raises."""
    try:
        handle()
        return True, None
    except (ImportError, NvmlError) as exc:  # no pynvml, or any NVML status (no library, no driver)
        return False, f"NVML: {type(exc).__name__}: {exc}"


def handle():
    """NVML handle of CuPy's current device (matched by PCI bus id), else of device 0."""
    import pynvml

    _init()
    try:
        import cupy

        bus_id = cupy.cuda.Device().pci_bus_id
    except (ImportError, RuntimeError):  # no CuPy, or no device (CUDARuntimeError): NVML's first
        return _call(pynvml.nvmlDeviceGetHandleByIndex, 0)
    return _call(pynvml.nvmlDeviceGetHandleByPciBusId, bus_id.encode())


def _reasons(mask: int) -> tuple[list[str], bool]:
    names = [n for bit, n in {**THROTTLES, **OTHER_REASONS}.items() if mask & bit]
    return names, any(mask & bit for bit in THROTTLES)


def _read(unavailable: dict, fields: tuple[str, ...], fn, *args):
    """fn(*args) through _call, or None with NVML's reason recorded for each output field."""
    try:
        return _call(fn, *args)
    except NvmlError as exc:
        unavailable.update(dict.fromkeys(fields, str(exc)))
        return None


def snapshot() -> dict:
    """Clocks (MHz), power (W), memory used (bytes), throttle reasons of the current GPU now.

    Keys: sm_clock_mhz, mem_clock_mhz, power_w, memory_used_bytes, reasons (list), throttled;
    a field NVML cannot give is None and `unavailable` maps its key to NVML's reason.
    """
    ok, why = available()
    if not ok:
        return {"sm_clock_mhz": None, "mem_clock_mhz": None, "power_w": None,
                "memory_used_bytes": None, "reasons": [], "throttled": None,
                "unavailable": {"all": why}}
    import pynvml

    h, missing = handle(), {}
    clock = pynvml.nvmlDeviceGetClockInfo
    mw = _read(missing, ("power_w",), pynvml.nvmlDeviceGetPowerUsage, h)
    mem = _read(missing, ("memory_used_bytes",), pynvml.nvmlDeviceGetMemoryInfo, h)
    reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons",
                      getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
    mask = _read(missing, ("reasons", "throttled"), reasons, h)
    names, throttled = _reasons(mask) if mask is not None else ([], None)
    return {"sm_clock_mhz": _read(missing, ("sm_clock_mhz",), clock, h, pynvml.NVML_CLOCK_SM),
            "mem_clock_mhz": _read(missing, ("mem_clock_mhz",), clock, h, pynvml.NVML_CLOCK_MEM),
            "power_w": None if mw is None else mw / 1e3,
            "memory_used_bytes": None if mem is None else int(mem.used),
            "reasons": names, "throttled": throttled, "unavailable": missing}


def gpm_available() -> tuple[bool, str | None]:
    """(True, None) when the current GPU supports GPM metrics, else (False, why); never raises."""
    try:
        import pynvml

        support = _call(pynvml.nvmlGpmQueryDeviceSupport, handle())
        if not support.isSupportedDevice:
            return False, "NVML GPM: this GPU does not support GPM metrics (Hopper or later)"
        return True, None
    except (ImportError, AttributeError, NvmlError) as exc:  # no pynvml, one without GPM, a status
        return False, f"NVML GPM: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class GpmWindow:
    """GPM DRAM bandwidth utilisation (percent of GPM's own full scale) over `seconds`."""

    dram_util_pct: float
    seconds: float

    def bytes(self, full_scale_gbs: float) -> float:
        """Bytes moved (read + write) at a calibrated full scale in GB/s."""
        return self.dram_util_pct / 100 * full_scale_gbs * 1e9 * self.seconds


def gpm_window(run) -> GpmWindow:
    """Run `run()` (it must synchronise) between two GPM samples of the current GPU."""
    import pynvml

    h = handle()
    first, second = _call(pynvml.nvmlGpmSampleAlloc), _call(pynvml.nvmlGpmSampleAlloc)
    try:
        _call(pynvml.nvmlGpmSampleGet, h, first)
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        _call(pynvml.nvmlGpmSampleGet, h, second)
        query = pynvml.c_nvmlGpmMetricsGet_t()
        query.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        query.numMetrics = 1
        query.sample1, query.sample2 = first, second
        query.metrics[0].metricId = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
        _call(pynvml.nvmlGpmMetricsGet, query)
        status = query.metrics[0].nvmlReturn
        if status != pynvml.NVML_SUCCESS:
            text = pynvml.nvmlErrorString(status)
            text = text.decode(errors="replace") if isinstance(text, bytes) else text
            raise NvmlError(f"nvmlGpmMetricsGet(DRAM_BW_UTIL): {text}")
        return GpmWindow(float(query.metrics[0].value), seconds)
    finally:
        _call(pynvml.nvmlGpmSampleFree, first)
        _call(pynvml.nvmlGpmSampleFree, second)


# NVML's GPM documentation asks for its two samples more than 100 ms apart (the counters'
# internal refresh): a shorter window is not a measurement of that window.
GPM_MIN_SECONDS = 0.1
# Least relative uncertainty of one GPM window: the calibration's repeat is one draw, not a
# bound (on an H200, 2026-11-29, three repeats of the same read came out +15%, +94%, +98%).
GPM_RESOLUTION = 0.01


def window_why_not(window: GpmWindow) -> str | None:
    """Why a GPM window cannot be turned into bytes, or None."""
    pct, ms = window.dram_util_pct, window.seconds * 1e3
    if not math.isfinite(pct) or pct < 0:
        return f"GPM read {pct}% DRAM utilisation"
    if window.seconds < GPM_MIN_SECONDS:
        return f"a {ms:.0f} ms window: GPM needs >= {GPM_MIN_SECONDS * 1e3:.0f} ms between samples"
    return None


@dataclass(frozen=True)
class GpmCalibration:
    """GPM's full scale from a read of known bytes, and a second window over the same read."""

    full_scale_gbs: float  # GB/s at 100%; nan when the calibration gave none
    repeat_ratio: float  # the second window's bytes / the known bytes; nan without a full scale
    why_not: str | None  # why no GPM figure is a byte count here; None when the calibration holds


@dataclass(frozen=True)
class GpmBytes:
    """Bytes (read + write) per call GPM saw, or None and why that is not a byte count here."""

    bytes: float | None
    why_not: str | None = None


def calibration(first: GpmWindow, again: GpmWindow, known_bytes: float,
                tolerance: float) -> GpmCalibration:
    """Full scale from `first` (a run moving known_bytes in DRAM); it holds when `again`, the
    same run, reads back within `tolerance` of known_bytes. The read kernel of
    kernels/ceilings.cu moves exactly its buffer (checked against CUPTI to 0.002% on an H200)."""
    why = window_why_not(first) or window_why_not(again)
    if why is None and first.dram_util_pct == 0:
        why = "GPM read 0% DRAM utilisation"
    if why is not None:
        return GpmCalibration(math.nan, math.nan, f"calibration read: {why}")
    full = known_bytes / (first.dram_util_pct / 100 * first.seconds) / 1e9
    ratio = again.bytes(full) / known_bytes
    if abs(ratio - 1) > tolerance:
        why = (f"a repeat of its calibration read measured {ratio - 1:+.1%} of the known bytes, "
               f"beyond {tolerance:.0%}")
    return GpmCalibration(full, ratio, why)


def difference(stage: GpmWindow, base: GpmWindow, gpm: GpmCalibration, calls: int) -> GpmBytes:
    """Bytes per call of what `stage`'s window ran beyond `base`'s (the same loop without the
    stage), over `calls` calls: a byte count only where the calibration holds, both windows are
    long enough and the difference stands above both windows' uncertainty."""
    why = gpm.why_not or window_why_not(stage) or window_why_not(base)
    if why is not None:
        return GpmBytes(None, why)
    with_stage, without = stage.bytes(gpm.full_scale_gbs), base.bytes(gpm.full_scale_gbs)
    moved = with_stage - without
    if moved < 0:
        return GpmBytes(None, f"the loop with the stage measured {-moved:,.0f} B less than "
                              "the same loop without it")
    spread = max(abs(gpm.repeat_ratio - 1), GPM_RESOLUTION)
    resolution = spread * (with_stage + without)
    if moved < resolution:
        return GpmBytes(None, f"{moved:,.0f} B over the window, under GPM's resolution there "
                              f"({spread:.1%} of the two windows: {resolution:,.0f} B)")
    return GpmBytes(moved / calls)
