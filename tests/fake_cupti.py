"""A fake cupti-python on a visible fake device, for the CPU tests of measure/cupti.py and
measure/link.py: `install` puts a Collector class where cupti-python's would be."""

from __future__ import annotations

import sys
import types

from questprof.measure import cupti


def install(monkeypatch, collector) -> None:
    """cupti.pm_sampling.Collector = collector, a fake CuPy device, no torch; cupti's per-process
    state (configure cache, refused joint sets, collector) starts empty."""
    device = types.SimpleNamespace(id=0, synchronize=lambda: None)
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1), Device=lambda: device),
        zeros=lambda n: None)
    package, sampling = types.ModuleType("cupti"), types.ModuleType("cupti.pm_sampling")
    sampling.Collector, package.pm_sampling = collector, sampling
    for name, module in (("cupy", fake_cupy), ("cupti", package), ("cupti.pm_sampling", sampling),
                         ("torch", None)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(cupti, "PAD_INTERVALS", 0)
    monkeypatch.setattr(cupti, "_configured", {})
    monkeypatch.setattr(cupti, "_joint_refused", {})
    monkeypatch.setattr(cupti.atexit, "register", lambda fn: None)
    cupti._collector.cache_clear()
