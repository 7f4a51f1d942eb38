"""Measured link bytes without a GPU: the calibration's arithmetic and its refusals, the one
configure of CUPTI's collector (DRAM and PCIe together, else DRAM alone and a link window
refused in one line), the verdict on link rows, and the rows and report of the host tier with
and without measured link bytes (measure/link.py, commands/link_bytes.py)."""

from __future__ import annotations

import types

import pandas as pd
import pytest
from fake_cupti import install as install_fake_cupti

from questprof.commands import bytes as bytes_cmd
from questprof.commands import link_bytes
from questprof.commands.bytes_verdict import (
    EXIT_FAIL,
    EXIT_OK,
    judge,
    link_table,
    verdict,
)
from questprof.core import model, tier
from questprof.core.config import Config, ModelShape
from questprof.measure import cupti, link
from questprof.results import COLUMNS, dram_read, make_row

MIB = 1 << 20
LLAMA = ModelShape("llama3-8b", layers=32, q_heads=32, kv_heads=8, head_dim=128, dtype="bf16")
# The H200's zero-copy read of 8 x 256 MiB counted 1.0938x its bytes (2026-12-02, 8ff47d2).
H200_FACTOR = 1.09375


def host(mode="shared-mean", length=16384, budget=1024, **kw) -> Config:
    return Config(LLAMA, length, 1, 16, budget, mode, kv_tier="host", **kw)


def calibration(factor=H200_FACTOR, spread=0.0, known=256 * MIB) -> link.Calibration:
    return link.Calibration(known, factor * known, factor * known * (1 + spread), 1e6)


# -- the calibration's arithmetic ------------------------------------------------------------

def test_factor_is_counted_over_known_and_calibrated_divides_by_it():
    cal = calibration()
    assert cal.factor == pytest.approx(H200_FACTOR)
    assert cal.why_not() is None and cal.spread == 0.0
    # dense over the host tier at 16K: 64 MiB per layer counted as 70 MiB raw
    assert cal.calibrated(H200_FACTOR * 64 * MIB) == pytest.approx(64 * MIB)
    got = cal.as_dict()
    assert got["metric"] == "pcie__read_bytes.sum" and got["reason"] is None
    assert got["factor"] == pytest.approx(H200_FACTOR) and got["known"] == 256 * MIB


@pytest.mark.parametrize(("cal", "said"), [
    (calibration(factor=0.0), "the host link here is not PCIe"),
    (link.Calibration(256 * MIB, float("nan"), 0.0), "the host link here is not PCIe"),
    (calibration(factor=2.5), "outside 0.5..2.0x"),
    (calibration(spread=0.03), "+3.00% apart"),
])
def test_a_calibration_that_does_not_hold_is_one_reason(cal, said):
    why = cal.why_not()
    assert said in why and "\n" not in why


def test_a_window_subtracts_the_idle_link_and_divides_by_the_repeats(monkeypatch):
    seen = {}

    def window(run, interval_ns, metrics):
        run()
        seen["metrics"], seen["interval"] = metrics, interval_ns
        return cupti.Window((1000.0 + 2 * 50.0,), 2.0, 20)

    monkeypatch.setattr(cupti, "window", window)
    calls = []
    got = link.measure(lambda: calls.append(1), 4, 0.03, idle=50.0)
    assert got == pytest.approx(250.0) and len(calls) == 4  # (1100 - 50 B/s x 2 s) / 4
    assert seen["metrics"] == ("pcie__read_bytes.sum",) and seen["interval"] == cupti.INTERVAL_NS
    with pytest.raises(ValueError):
        link.measure(lambda: None, 0, 0.03, 0.0)


# -- one configure per process ---------------------------------------------------------------

class Decoded(list):
    """A decoded window whose samples all completed."""

    num_populated_samples = num_completed_samples = 3


class Collector:
    """A PM-sampling collector that refuses the metric sets in `refuse` and samples each
    configured metric at its position (1000 x (position + 1) per sample, 3 samples)."""

    refuse: set = set()
    configured: list = []

    def __init__(self, device_index):
        type(self).configured = []

    def configure(self, metrics, **kwargs):
        if tuple(metrics) in self.refuse:
            raise RuntimeError("CUPTI_ERROR_INVALID_PARAMETER")
        self.configured.append(tuple(metrics))
        self.metrics = tuple(metrics)

    def decode(self, max_samples):
        values = [1000.0 * (i + 1) for i in range(len(self.metrics))]
        return Decoded([types.SimpleNamespace(metric_values=values)] * 3)  # the first left out

    enable = disable = start = stop = lambda self: None


@pytest.fixture
def collector(monkeypatch):
    """A visible device (fake CuPy) and the fake collector above as cupti-python's."""
    install_fake_cupti(monkeypatch, Collector)
    yield Collector
    Collector.refuse = set()
    cupti._collector.cache_clear()


def test_dram_and_link_windows_share_one_configure(collector):
    """The first window configures DRAM and PCIe together; each window sums its own metrics."""
    assert cupti.available() == (True, None)
    assert link.available() == (True, None)
    assert collector.configured == [cupti.JOINT]
    assert link.window_bytes(lambda: None, cupti.INTERVAL_NS)[0] == 2 * 3000.0  # third metric
    read, write, _, _ = cupti._window(lambda: None, cupti.INTERVAL_NS)
    assert (read, write) == (2 * 1000.0, 2 * 2000.0)
    assert cupti.joint_refusal() is None


def test_where_the_joint_set_is_refused_dram_runs_alone_and_a_link_window_says_why(collector):
    collector.refuse = {cupti.JOINT}
    assert cupti.available() == (True, None)
    assert collector.configured == [cupti.METRICS]  # the refusal did no harm
    assert "CUPTI_ERROR_INVALID_PARAMETER" in cupti.joint_refusal()
    works, why = link.available()
    assert not works and "pcie__read_bytes.sum would need a second configure" in why
    assert collector.configured == [cupti.METRICS]  # never configured twice
    assert cupti._window(lambda: None, cupti.INTERVAL_NS)[:2] == (2000.0, 4000.0)


def test_a_link_window_first_configures_the_joint_set_and_a_later_interval_keeps_it(collector):
    assert link.window_bytes(lambda: None, cupti.INTERVAL_NS)[0] == 6000.0
    cupti._window(lambda: None, 10 * cupti.INTERVAL_NS)  # a longer window keeps the interval
    assert collector.configured == [cupti.JOINT]
    cupti.release()
    assert cupti._configured == {}


# -- the run's link counting as row fields ---------------------------------------------------

def test_no_host_tier_no_link_run_and_reasons_become_rows(monkeypatch):
    hbm = Config(LLAMA, 16384, 1, 16, 1024, "shared-mean")
    assert link_bytes.prepare([hbm], None) is None
    assert link_bytes.fields(None, host()) == {}
    run = link_bytes.prepare([hbm, host()], "no GPU here")
    assert not run.counting and link_bytes.fields(run, host()) == {"link_reason": "no GPU here"}
    assert link_bytes.fields(run, hbm) == {}
    monkeypatch.setattr(link, "available", lambda: (False, "CUPTI configure: refused"))
    why = link_bytes.prepare([host()], None).reason
    assert why == "pcie__read_bytes.sum: CUPTI configure: refused"


def test_a_failing_or_unstable_calibration_is_the_runs_reason(monkeypatch):
    monkeypatch.setattr(link, "available", lambda: (True, None))

    def fails():
        raise RuntimeError("cudaErrorMemoryAllocation")

    monkeypatch.setattr(link, "calibrate", fails)
    run = link_bytes.prepare([host()], None)
    assert run.reason.startswith("link calibration failed: RuntimeError")
    monkeypatch.setattr(link, "calibrate", lambda: calibration(spread=0.05))
    run = link_bytes.prepare([host()], None)
    assert not run.counting and "apart" in run.reason
    assert run.as_meta()["factor"] == pytest.approx(H200_FACTOR)  # the figures stay for meta


def test_counted_fields_and_the_quest_step_summed(monkeypatch):
    run = link_bytes.LinkRun(calibration())
    got = {"estimate": 0.0, "topk": 0.0, "attention": H200_FACTOR * 4 * MIB}

    def stage_bytes(launch, calls, cal, pass_ms):
        raw = got[launch(0)]
        return link.LinkBytes(raw, cal.calibrated(raw), cal.factor)

    monkeypatch.setattr(link, "stage_bytes", stage_bytes)
    parts = [link_bytes.fields(run, host(), lambda layer, s=s: s, 4) for s in got]
    assert parts[2]["calibrated_link_bytes"] == pytest.approx(4 * MIB)
    assert parts[2]["measured_link_bytes"] == pytest.approx(H200_FACTOR * 4 * MIB)
    quest = link_bytes.summed(parts)
    assert quest["calibrated_link_bytes"] == pytest.approx(4 * MIB)
    assert quest["link_factor"] == pytest.approx(H200_FACTOR)
    assert link_bytes.fields(run, host()) == {}  # summed rows have no launch of their own
    assert link_bytes.summed([{}, {"link_reason": "why"}]) == {"link_reason": "why"}
    assert link_bytes.summed([{}, {}]) == {}

    def broken(*args):
        raise RuntimeError("CUPTI decode: only 0 of 15 samples completed")

    monkeypatch.setattr(link, "stage_bytes", broken)
    failed = link_bytes.fields(run, host(), lambda layer: None, 4)
    assert failed["link_reason"].startswith("link bytes not counted: RuntimeError: CUPTI decode")


# -- the byte model and the verdict ----------------------------------------------------------

def test_link_reads_and_writes_of_the_tier_model():
    parts = tier.tier_bytes(host(summary_tier="host"))
    summary = parts["summary"]
    assert summary.link_write == 8 * 2 * 256  # the new min/max (M_s 256 B) back to the host
    assert summary.link_read == summary.link - summary.link_write
    assert parts["dense"].link_read == parts["dense"].link == 8 * 2 * 256 * 16384
    assert tier.tier_bytes(host())["summary"].link_write == 0.0


def test_per_head_zero_copy_moves_every_q_heads_pages():
    """H200, 2026-12-02, llama3-8b 16K budget 1024 per-head over mapped host memory: the link
    carried 4.0000x K pages per KV head (calibrated 16,778,246 B), not their union (13.1 MB)."""
    cfg = host("per-head")
    zero = tier.tier_bytes(cfg, fetch="zero-copy")["attention"]
    assert zero.link == model.per_head_kv_read(cfg) == 4 * 8 * 2 * 256 * 1024 == 16_777_216
    union = model.stage_work(cfg)["attention"]
    assert zero.hbm == union.total_bytes - union.read  # in HBM it replaces the union's read
    assert zero.hbm_read == union.unmodelled_read  # what DRAM still reads: q, page tables
    quest = tier.quest_tier_bytes(cfg, fetch="zero-copy")
    assert quest.hbm_read == model.quest_work(cfg).total_read - union.read
    assert tier.tier_bytes(cfg, fetch="gather")["attention"].link == union.read
    shared = tier.tier_bytes(host(), fetch="zero-copy")["attention"]
    assert shared.link == 8 * 2 * 256 * 1024  # shared modes: one page set per KV head
    assert tier.link_rho(cfg, fetch="zero-copy") == pytest.approx(4 * 64 / 1024)


def link_row(stage="dense", modelled=64 * MIB, calibrated=64 * MIB, factor=H200_FACTOR, **kw):
    row = {"model": "llama3-8b", "length": 16384, "batch": 1, "page_size": 16, "budget": 1024,
           "mode": "shared-mean", "stage": stage, "impl": "ours", "bytes_source": "cupti",
           "kv_tier": "host", "read_bytes": modelled, "unmodelled_bytes": 12_300,
           "write_bytes": 8320, "measured_read_bytes": 1764.0, "measured_write_bytes": 0,
           "link_read_bytes": modelled, "measured_link_bytes": calibrated * factor,
           "calibrated_link_bytes": calibrated}
    row = {**row, **kw}
    # the tier model's HBM reads: all but the pages read over the link
    hbm_read = row["read_bytes"] + row["unmodelled_bytes"] - row["link_read_bytes"]
    return {"tier_hbm_read_bytes": hbm_read, **row}


def test_link_rows_are_judged_on_calibrated_bytes_and_dram_on_the_rest():
    ok = judge(link_row(calibrated=64 * MIB * 1.03))
    assert ok["link_within"] and ok["link_ratio"] == pytest.approx(1.03)
    assert dram_read(ok) == 12_300 and ok["bytes_within"] is None  # dense's DRAM: under 1 MiB
    estimate = judge(link_row("estimate", modelled=0, calibrated=217.0, read_bytes=4 * MIB,
                              measured_read_bytes=4 * MIB))
    assert estimate["link_within"] is None and estimate["link_ratio"] is None
    assert estimate["bytes_within"]  # summaries in HBM: judged as before
    small = judge(link_row("summary", modelled=2048, calibrated=2192))
    assert small["link_within"] is None and small["link_ratio"] == pytest.approx(2192 / 2048)
    status, lines = verdict([ok, estimate, small])
    assert status == EXIT_OK and "link reads: all 1 judged stage rows within 5%" in lines[0]


def test_a_link_row_off_the_model_fails_and_names_raw_and_calibrated():
    off = judge(link_row("attention", modelled=13_058_048, calibrated=16_777_484))
    status, lines = verdict([off, judge(link_row())])
    assert status == EXIT_FAIL and lines[0] == "1 of 2 judged link rows outside 5%:"
    assert "attention [cupti link]" in lines[1] and "+28.5% calibrated (raw +40.5%)" in lines[1]
    table = "\n".join(link_table([off]))
    assert "13,058,048" in table and "16,777,484" in table and "NO" in table


def test_rows_carry_the_link_columns_and_judge_dram_without_the_link():
    cfg = host()
    work = model.stage_work(cfg)["dense"]
    row = make_row(cfg, "dense", scenario="bytes", backend="cupy", work=work,
                   measured_read_bytes=12_300.0)
    assert set(COLUMNS) <= set(row) and row["link_read_bytes"] == work.read
    assert row["measured_link_bytes"] is None and row["link_reason"] is None
    assert row["tier_hbm_read_bytes"] == work.unmodelled_read == 12_300
    assert row["bytes_ratio"] == pytest.approx(1.0)  # against q and page tables, not the pages
    hbm = make_row(Config(LLAMA, 16384, 1, 16, 1024, "shared-mean"), "dense", scenario="x",
                   backend="cupy", work=work, measured_read_bytes=work.total_read)
    assert hbm["link_read_bytes"] is None and hbm["bytes_ratio"] == pytest.approx(1.0)


# -- the byte check over the host tier on the NumPy backend ----------------------------------

def test_the_byte_checks_link_fields_and_rho_over_a_numpy_workload(monkeypatch):
    from questprof.backends.numpy import NumpyBackend
    from questprof.workload.pools import Workload

    cfg = host("per-head", length=1024, budget=256)
    work = Workload(cfg, NumpyBackend(), 1)
    keys = [(s, "ours") for s in bytes_cmd.STAGES]
    counted = {"dense": tier.tier_bytes(cfg)["dense"].link,
               "quest": tier.quest_tier_bytes(cfg, fetch="zero-copy", union_pages=work.union).link}
    monkeypatch.setattr(link, "stage_bytes", lambda launch, calls, cal, pass_ms=None:
                        link.LinkBytes(0.0, 0.0, cal.factor))
    links = bytes_cmd._links(work, "cupti", keys, link_bytes.LinkRun(calibration()))
    assert set(links) == set(keys) and all("calibrated_link_bytes" in v for v in links.values())
    why = bytes_cmd._links(work, "ncu", keys, link_bytes.LinkRun())
    assert why[("dense", "ours")] == {
        "link_reason": "link bytes are counted through CUPTI; this row's source is ncu"}
    rows = [make_row(cfg, s, scenario="bytes", backend="numpy", work=work.work(s),
                     union=work.union, calibrated_link_bytes=counted.get(s, 0.0))
            for s, _ in keys]
    (rho,) = bytes_cmd._link_rho(rows, cfg, "cupti", work.union)
    assert rho["rho_measured"] == pytest.approx(rho["rho_model"])
    assert rho["rho_model"] == pytest.approx(tier.link_rho(cfg, fetch="zero-copy"))
    assert bytes_cmd._link_rho([{**r, "calibrated_link_bytes": None} for r in rows], cfg,
                               "cupti", work.union) == []


def test_the_json_of_a_check_without_a_gpu_says_why_no_link_is_counted(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from questprof.cli import app

    monkeypatch.setattr(bytes_cmd, "gpu_unavailable_reason", lambda: "no CUDA device")
    out = tmp_path / "check.json"
    got = CliRunner().invoke(app, ["bytes", "--scenario", "smoke", "--lengths", "2k",
                                   "--budget", "256", "--kv-tier", "host", "--json", str(out)])
    assert got.exit_code == 3 and "Traceback" not in got.output
    data = json.loads(out.read_text())
    assert data["link"]["reason"].startswith("no GPU here") and data["rows"] == []
    assert any(line.startswith("link bytes not measured: no GPU here") for line in data["message"])


@pytest.mark.parametrize("where, says", [("", "a directory; name the file"),
                                         ("no/such/check.json", "does not exist")])
def test_a_json_path_that_cannot_be_written_is_refused_before_measuring(tmp_path, monkeypatch,
                                                                        where, says):
    """A directory as --json was an IsADirectoryError traceback, a missing folder a raw errno,
    each after the whole measurement."""
    from typer.testing import CliRunner

    from questprof.cli import app

    monkeypatch.setattr(bytes_cmd, "run_check", lambda *a, **k: pytest.fail("measured"))
    got = CliRunner().invoke(app, ["bytes", "--scenario", "smoke", "--lengths", "2k",
                                   "--budget", "256", "--json", str(tmp_path / where)])
    assert got.exit_code == 2 and "Traceback" not in got.output
    assert says in " ".join(got.stderr.split())


# -- sweep rows and the report's tier section ------------------------------------------------

def sweep(tmp_path, monkeypatch, counting: bool):
    """A NumPy sweep over the host tier (smoke, 2k), the link counted by fakes when asked."""
    from questprof.backends.numpy import NumpyBackend
    from questprof.commands import sweep as sweep_mod
    from questprof.core.scenarios import load_scenario

    smoke = load_scenario("smoke")
    cfg = Config(smoke.model, 2048, 1, 16, 256, "per-head", kv_tier="host")
    opts = sweep_mod.Options(repeats=2, warmup=0, graph=False)
    if counting:  # CUPTI's part faked: DRAM bytes and link windows
        opts = sweep_mod.Options(repeats=2, warmup=0, graph=False, bytes_source="cupti")
        monkeypatch.setattr(sweep_mod, "link_why_not", lambda *a: None)
        monkeypatch.setattr(link, "available", lambda: (True, None))
        monkeypatch.setattr(link, "calibrate", calibration)
        monkeypatch.setattr(sweep_mod, "_bytes", lambda work, stage, state, ms: {
            "measured_read_bytes": 1.0, "measured_write_bytes": 0.0, "bytes_source": "cupti"})
        monkeypatch.setattr(link, "stage_bytes", lambda launch, calls, cal, pass_ms=None:
                            link.LinkBytes(H200_FACTOR * 1000, 1000.0, cal.factor))
    sweep_mod.run_sweep(smoke, [cfg], NumpyBackend(), tmp_path, opts)
    from questprof import results

    return results.load(tmp_path)


def test_a_sweep_over_the_host_tier_counts_link_bytes_where_cupti_does(tmp_path, monkeypatch):
    from questprof.report import tier as tier_report

    df, meta = sweep(tmp_path, monkeypatch, counting=True)
    ours = df[df["impl"] == "ours"].set_index("stage")
    assert ours.loc["dense", "calibrated_link_bytes"] == 1000.0
    assert ours.loc["dense", "measured_link_bytes"] == pytest.approx(H200_FACTOR * 1000)
    assert ours.loc["quest", "calibrated_link_bytes"] == 3000.0  # estimate + top-K + attention
    assert ours["link_factor"].dropna().unique().tolist() == [pytest.approx(H200_FACTOR)]
    assert meta["link_bytes"]["factor"] == pytest.approx(H200_FACTOR)
    html = tier_report.section(df, meta)
    assert "measured MB (calibrated)" in html and "calibrated / model" in html
    assert "counted 1.0938x the bytes of a zero-copy read of 256 MiB" in html


def test_a_cpu_sweep_says_why_no_link_is_counted(tmp_path, monkeypatch):
    from questprof.report import tier as tier_report

    df, meta = sweep(tmp_path, monkeypatch, counting=False)
    ours = df[df["impl"] == "ours"]
    assert ours["calibrated_link_bytes"].isna().all()
    assert set(ours["link_reason"]) == {link_bytes.cpu_reason(types.SimpleNamespace(
        name="numpy-fp32"))}
    assert meta["link_bytes"]["reason"].startswith("the numpy-fp32 backend runs on the CPU")
    html = tier_report.section(df, meta)
    assert "measured MB" not in html and "Link bytes not measured here: the numpy-fp32" in html


def test_the_tier_section_of_rows_without_link_columns(tmp_path):
    """A directory from before measured link bytes (no such columns, no meta key) draws as
    before."""
    from questprof.report import tier as tier_report

    base = {"impl": "ours", "kv_tier": "host", "model": "a", "length": 32768, "batch": 1,
            "page_size": 16, "budget": 2048, "mode": "shared-mean", "summary_tier": "hbm",
            "hbm_pages": 0, "link_bytes": 8e6}
    df = pd.DataFrame([{**base, "stage": s, "median_ms": ms}
                       for s, ms in (("dense", 2.0), ("quest", 0.5))])
    html = tier_report.section(df, {})
    assert "link MB" in html and "measured MB" not in html and "not measured" not in html


def test_the_reports_dram_check_leaves_the_link_out_and_draws_no_host_rho():
    """A host-tier dense row read 1.8 kB of DRAM: its modelled DRAM read is q and page tables
    (under 1 MiB: not judged), not the 64 MiB that crossed the link."""
    from questprof.report import hardware

    rows = pd.DataFrame([{**link_row(s, modelled=m), "status": "ok", "median_ms": 1.0,
                          "rho_formula": 0.125, "rho_model": 0.125}
                         for s, m in (("estimate", 0), ("topk", 0), ("attention", 4 * MIB),
                                      ("dense", 64 * MIB))])
    rows.loc[rows["stage"] == "estimate", ["read_bytes", "measured_read_bytes",
                                           "tier_hbm_read_bytes"]] = 4 * MIB
    got = hardware.byte_rows(rows).set_index("stage")
    assert got.loc["dense", "modelled_read"] == 12_300 and got.loc["dense", "small"]
    assert not got["off"].any()
    assert hardware.measured_rho(rows).empty
