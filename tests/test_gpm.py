"""NVML GPM as a byte source, on synthetic GPM windows: a figure is printed only where it can be
a byte count (issue 19: `summary ... nvml -159,770,017 B (-779313.90%)`)."""

import re
from types import SimpleNamespace

import numpy as np
import pytest

from questprof.commands import bytes as bytes_cmd
from questprof.commands import bytes_verdict
from questprof.core.config import Config
from questprof.core.scenarios import load_scenario
from questprof.measure import dram, nvml
from questprof.measure.nvml import GpmWindow

KNOWN = 10 * bytes_cmd.CALIBRATION_BYTES  # 10 calls of the 2 GiB read kernel
RNG = np.random.default_rng(19)
PCT = float(RNG.uniform(40, 60))  # a random utilisation of the calibration read, in percent


def cal(again_pct=PCT, first=GpmWindow(PCT, 0.3), tolerance=0.05):
    return nvml.calibration(first, GpmWindow(again_pct, 0.3), KNOWN, tolerance)


def test_a_calibration_that_repeats_holds_and_gives_its_full_scale():
    gpm = cal(PCT * 1.01)
    assert gpm.why_not is None and gpm.repeat_ratio == pytest.approx(1.01)
    assert gpm.full_scale_gbs == pytest.approx(KNOWN / (PCT / 100 * 0.3) / 1e9)


@pytest.mark.parametrize("again, first, why", [
    (PCT * 1.98, GpmWindow(PCT, 0.3), "+98.0% of the known bytes, beyond 5%"),  # H200, 2026-11-29
    (PCT, GpmWindow(PCT, 0.02), "a 20 ms window: GPM needs >= 100 ms"),
    (PCT, GpmWindow(float("nan"), 0.3), "GPM read nan% DRAM utilisation"),
    (PCT, GpmWindow(0.0, 0.3), "GPM read 0% DRAM utilisation"),
    (-3.0, GpmWindow(PCT, 0.3), "GPM read -3.0% DRAM utilisation"),
])
def test_a_calibration_that_does_not_hold_says_why(again, first, why):
    gpm = cal(again, first)
    assert gpm.why_not is not None and why in gpm.why_not


@pytest.mark.parametrize("stage, base, why", [
    (GpmWindow(PCT - 1, 0.3), GpmWindow(PCT, 0.3), "less than the same loop without it"),
    (GpmWindow(PCT + 20, 0.01), GpmWindow(PCT, 0.01), "a 10 ms window"),
    (GpmWindow(PCT * 1.004, 0.3), GpmWindow(PCT, 0.3), "under GPM's resolution there"),
    (GpmWindow(float("inf"), 0.3), GpmWindow(PCT, 0.3), "GPM read inf%"),
])
def test_a_difference_that_cannot_be_a_byte_count_is_none(stage, base, why):
    got = nvml.difference(stage, base, cal(), calls=7)
    assert got.bytes is None and why in got.why_not


def test_a_resolved_difference_is_bytes_per_call():
    gpm = cal()
    got = nvml.difference(GpmWindow(PCT + 20, 0.3), GpmWindow(PCT, 0.3), gpm, calls=7)
    assert got.why_not is None and got.bytes == pytest.approx(20 / PCT * KNOWN / 7)
    failed = cal(PCT * 1.5)  # the same windows under a calibration that did not hold
    assert nvml.difference(GpmWindow(PCT + 20, 0.3), GpmWindow(PCT, 0.3), failed, 7).bytes is None


def fake_gpm(monkeypatch, windows):
    """GPM gives these windows in turn (nothing runs); every other GPU call is a no-op."""
    given = iter(windows)
    monkeypatch.setattr(nvml, "gpm_window", lambda run: next(given))
    monkeypatch.setattr(dram, "repeats_for", lambda fn, seconds, call_ms=None: 10)
    monkeypatch.setattr("questprof.measure.cupti.release", lambda: None)
    monkeypatch.setattr("questprof.measure.ceilings.random_buffer", lambda n: None)
    monkeypatch.setattr("questprof.measure.ceilings.launch_read", lambda x, sink: None)


def test_gpm_stage_bytes_of_synthetic_windows(monkeypatch):
    fake_gpm(monkeypatch, [GpmWindow(PCT - 2, 0.3), GpmWindow(PCT, 0.3)])
    got = dram.gpm_stage_bytes(lambda layer: None, 3, lambda: None, cal())
    assert got.bytes is None and "less than" in got.why_not
    fake_gpm(monkeypatch, [])  # a failed calibration measures nothing more
    assert "beyond 5%" in dram.gpm_stage_bytes(lambda l: None, 3, None, cal(PCT * 2)).why_not


def gpm_check(monkeypatch, windows):
    """bytes --source nvml on the NumPy backend's smoke workload, GPM giving `windows`."""
    from questprof.backends.numpy import NumpyBackend
    from questprof.workload.pools import Workload

    cfg = Config(load_scenario("smoke").model, length=1000, batch=2, page_size=16, budget=128,
                 mode="per-head", seed=3)
    fake_gpm(monkeypatch, windows)
    monkeypatch.setattr(bytes_cmd, "_workload", lambda cfg, backend, *a: Workload(cfg, backend, 2))
    rows, rho = bytes_cmd._measure_source("nvml", [cfg], NumpyBackend(),
                                          SimpleNamespace(sink=None), False, "rotate", None)
    rows, status, lines = bytes_verdict.conclude(rows, 0.05, {"nvml": None}, ["nvml"])
    return rows, bytes_verdict.table(bytes_verdict.CheckResult(rows, rho, status, lines))


@pytest.mark.parametrize("windows, why", [
    # the calibration holds (its row keeps its figure); each stage's window is below the same
    # loop without it
    ([GpmWindow(PCT, 0.3)] * 2 + [GpmWindow(PCT - 1, 0.3), GpmWindow(PCT, 0.3)] * 6,
     "less than the same loop without it"),
    ([GpmWindow(PCT, 0.02)] * 14, "calibration read: a 20 ms window"),  # windows too short
    ([GpmWindow(PCT, 0.3), GpmWindow(PCT * 1.98, 0.3)] + [GpmWindow(PCT, 0.3)] * 12,
     "+98.0% of the known bytes"),
])
def test_no_gpm_row_prints_a_figure_that_cannot_be_a_byte_count(monkeypatch, windows, why):
    rows, text = gpm_check(monkeypatch, windows)
    assert [r["stage"] for r in rows] == ["calibration-read", *bytes_cmd.STAGES]
    assert all(r["bytes_source"] == "nvml" for r in rows)
    holds = "less than" in why
    assert (rows[0]["measured_read_bytes"] == pytest.approx(KNOWN / 10)) == holds
    for r in rows[1:] if holds else rows:
        assert r["measured_read_bytes"] is None and r["bytes_within"] is None
        assert r["note"].startswith("nvml: not a byte count here (") and why in r["note"]
    assert "nvml: not a byte count here" in text and not re.search(r"-\d", text)  # no figure < 0


def test_gpm_rows_that_resolve_carry_bytes(monkeypatch):
    windows = [GpmWindow(PCT, 0.3)] * 2 + [GpmWindow(PCT + 20, 0.3), GpmWindow(PCT, 0.3)] * 6
    rows, _ = gpm_check(monkeypatch, windows)
    per_pass = 20 / PCT * KNOWN / 10  # 10 repeats of the loop
    for r in rows[1:]:
        assert r["measured_read_bytes"] == pytest.approx(per_pass / r["sim_layers"])
        assert not (r.get("note") or "").startswith("nvml: not a byte count")
