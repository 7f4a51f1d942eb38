"""The recommendation names what it rests on and how sure it is: the fidelity model and its
shape, prompts and length, a proxy said as such, intervals, "not decided", and a sweep without
fidelity rows that says so (report rendering and the command line)."""

import numpy as np
import pytest
from typer.testing import CliRunner

from questprof import results
from questprof.cli import app
from questprof.fidelity.metrics import METRICS
from questprof.fidelity.rows import metric_rows, task_row
from questprof.report import glance_lines, write_report
from questprof.report import recommend as rc
from questprof.results import frame as results_frame

BIG = {"model": "big-7b", "layers": 32, "q_heads": 32, "kv_heads": 32, "head_dim": 128}
SMALL = {"model": "small-135m", "layers": 30, "q_heads": 9, "kv_heads": 3, "head_dim": 64}
# budget -> (p10, lo, hi): 256 misses 0.9 outright, 512 is not decided, 1024 clears it
P10 = {256: (0.80, 0.74, 0.85), 512: (0.91, 0.88, 0.94), 1024: (0.95, 0.93, 0.97)}


def _speed_rows(length=32768, shape=BIG):
    rows = []
    for budget, quest_ms in ((256, 0.1), (512, 0.2), (1024, 0.3)):
        for stage, ms in (("dense", 1.0), ("quest", quest_ms)):
            rows.append({**shape, "stage": stage, "median_ms": ms, "status": "ok",
                         "length": length, "batch": 1, "page_size": 16, "budget": budget,
                         "mode": "per-head", "backend": "cupy"})
    return rows


def _fidelity_rows(rng, length=4096, shape=SMALL, intervals=True, prompts=20):
    rows = []
    for budget, (p10, lo, hi) in P10.items():
        base = {**shape, "stage": "fidelity", "status": "ok", "source": "passkey",
                "length": length, "batch": 1, "page_size": 16, "budget": budget,
                "mode": "per-head", "samples": prompts, "step": None}
        for layer in range(2, 6):
            for head in range(3):
                value = p10 + (0.0 if head else rng.uniform(0.0, 0.01))  # p10 over heads: p10
                rows.append({**base, "layer": layer, "head": head, "dense_layer": False,
                             "mass_recall": value, "oracle_mass": value,
                             "top10_recall": 1.0, "page_recall": 0.9,
                             "output_rel_error": 1 - value, "bound_slack": 1.0,
                             "stale_mass_recall": value})
        if intervals:
            rows.append({**base, "layer": None, "head": None, "dense_layer": False, "steps": 8,
                         "mass_recall": p10 + 0.02, "mass_recall_p10": p10,
                         "mass_recall_p10_lo": lo, "mass_recall_p10_hi": hi,
                         "mass_recall_lo": p10, "mass_recall_hi": p10 + 0.04})
        task = task_row({**shape, "scenario": "passkey", "source": "passkey"}, length, 16,
                        budget, "per-head", [True] * 12 + [False] * 8,
                        [True] * 11 + [False] * 9)
        rows.append(task)
    return rows


def _frame(**kw):
    rng = np.random.default_rng(0)
    speed = kw.pop("speed", True)
    return results_frame((_speed_rows() if speed else []) + _fidelity_rows(rng, **kw))


def test_a_proxy_source_is_named_in_the_recommendation():
    text = " ".join(rc.advice(_frame(), 0.9))
    assert "Recommended: page 16, budget 512, per-head: 5.00x at 32k (measured speedup)" in text
    assert ("20 passkey prompts at 4k of small-135m (9 q / 3 KV heads of 64 dims, 30 layers), "
            "a proxy: fidelity of small-135m at 4k stands in for big-7b (32 q / 32 KV heads of "
            "128 dims, 32 layers) at 32k") in text


def test_the_sweeps_own_model_at_its_length_is_no_proxy():
    rng = np.random.default_rng(1)
    df = results_frame(_speed_rows(4096, SMALL) + _fidelity_rows(rng))
    text = " ".join(rc.advice(df, 0.9))
    assert "the sweep's own model at its length" in text and "proxy" not in text


def test_not_decided_and_what_cannot_be_told_from_the_floor():
    lines = rc.advice(_frame(), 0.9)
    text = " ".join(lines)
    assert "(95% interval 0.880-0.940)" in text
    assert "Not decided: the floor 0.9 lies inside this setting's 95% interval" in text
    assert "whole interval clears it: page 16, budget 1k, per-head, 3.33x" in text
    # at floor 0.75 budget 256 is not decided either, and budget 512 is decided
    low = " ".join(rc.advice(_frame(), 0.75))
    assert "Decided: its whole 95% interval clears the floor 0.75" not in low  # 256 is chosen
    assert "Not decided" in low and "Recommended: page 16, budget 256" in low
    high = " ".join(rc.advice(_frame(), 0.85))
    assert "Decided: its whole 95% interval clears the floor 0.85" in high
    assert "Indistinguishable from the floor (their intervals hold 0.85): page 16, budget 256, " \
        "per-head (0.800, 0.740-0.850)" in high


def test_task_accuracy_carries_n_and_a_wilson_interval():
    text = " ".join(rc.advice(_frame(), 0.9))
    assert "Quest 11/20 (55%, 95% interval 34%-74%), dense 12/20 (60%, 95% interval 39%-78%)" \
        in text
    assert rc.fmt_share(0.6, 5) == "3/5 (60%, 95% interval 23%-88%)"
    assert rc.fmt_share(0.0, 20) == "0/20 (0%, 95% interval 0%-16%)"


def test_older_rows_say_what_they_do_not_record():
    rng = np.random.default_rng(2)
    rows = _fidelity_rows(rng, intervals=False, prompts=None,
                          shape={"model": None, "layers": None})
    text = " ".join(rc.advice(results_frame(_speed_rows() + rows), 0.9))
    assert "interval not recorded" in text and "source not recorded" in text
    assert "How sure: these rows carry no intervals" in text


def test_setting_rows_are_computed_with_intervals():
    rng = np.random.default_rng(3)
    metrics = {(16, 256, "per-head"): rng.uniform(0.7, 1.0, (5, 4, 3, len(METRICS), 6))}
    rows = metric_rows({**SMALL, "source": "passkey"}, 2048, metrics, dense_layers=1)
    setting = [r for r in rows if r["layer"] is None and r["step"] is None]
    assert len(setting) == 1
    s = setting[0]
    assert s["mass_recall_p10_lo"] <= s["mass_recall_p10"] <= s["mass_recall_p10_hi"]
    assert s["mass_recall_lo"] <= s["mass_recall"] <= s["mass_recall_hi"]
    assert (s["samples"], s["steps"], s["bootstrap"]) == (5, 3, 1000)
    again = metric_rows({**SMALL, "source": "passkey"}, 2048, metrics, dense_layers=1)
    assert [r for r in again if r["layer"] is None and r["step"] is None][0] == s


def test_report_renders_source_intervals_and_frontier_verdicts(tmp_path):
    html = write_report(_frame(), {"min_recall": 0.9, "scenario": "t"}, tmp_path).read_text()
    assert "<b>Recommended</b>" in html and "stands in for big-7b" in html
    assert "<b>Not decided</b>" in html
    assert "frontier-table" in html and "not decided" in html and "passes" in html
    assert "11/20 (55%, 95% interval 34%-74%)" in html  # the passkey table


def test_a_sweep_without_fidelity_says_it_ranks_by_speed_alone(tmp_path):
    df = results_frame(_speed_rows())
    html = write_report(df, {"scenario": "t"}, tmp_path / "run").read_text()
    assert "<b>Ranked by speed alone</b>: what each setting loses in attention was not measured" \
        in html
    command = ("questprof fidelity --source passkey --model smollm2 --lengths 8k --page-size 16 "
               f"--budget 256,512,1024 --out {tmp_path / 'run'}")
    assert command in html
    assert "by speed alone: what each setting loses in attention was not measured" in html
    lines = glance_lines(df, {}, "somewhere")
    assert lines[0].startswith("On this machine") and lines[2].endswith("--out somewhere")
    # a scenario such as smoke is a shape, not a transformers folder: the line says the shape
    assert "--model PATH (a transformers folder or .gguf file of a model of the shape timed " \
        "here: 32 q / 32 KV heads of 128 dims, 32 layers)" in lines[3], lines[3]
    assert glance_lines(df, {"command": "questprof bench --out b"}) == []  # no choice to make


def test_questprof_report_prints_the_glance(tmp_path):
    out = tmp_path / "run"
    with results.ResultsWriter(out, {"scenario": "t"}) as writer:
        for row in _speed_rows():
            writer.append(row)
    got = CliRunner().invoke(app, ["report", str(out)])
    assert got.exit_code == 0, got.output
    assert "Ranked by speed alone" in got.output and f"--out {out}" in got.output
    with results.ResultsWriter(tmp_path / "fid", {"scenario": "t", "min_recall": 0.9}) as w:
        for row in _speed_rows() + _fidelity_rows(np.random.default_rng(4)):
            w.append(row)
    got = CliRunner().invoke(app, ["report", str(tmp_path / "fid")])
    assert got.exit_code == 0, got.output
    assert "Recommended: page 16, budget 512" in got.output
    assert "(95% interval 0.880-0.940)" in got.output


@pytest.mark.parametrize("floor", [0.5, 0.99])
def test_floor_extremes(floor):
    text = " ".join(rc.advice(_frame(), floor))
    if floor == 0.99:
        assert "No measured setting with a budget below the context reaches it on 20 passkey " \
               "prompts at 4k" in text
    else:
        assert "Decided: its whole 95% interval clears the floor 0.5" in text


class _Backend:
    def __init__(self, is_gpu):
        self.is_gpu = is_gpu


def test_the_sweeps_fidelity_plan(monkeypatch):
    from questprof.commands import fidelity as fid
    monkeypatch.setattr(fid, "real_model_available", lambda: True)
    gpu, cpu = _Backend(True), _Backend(False)
    assert fid.sweep_fidelity_plan(None, None, gpu) == "smollm2"  # the GPU main job's default
    assert fid.sweep_fidelity_plan(None, None, gpu, choices=1) is None  # nothing to rank
    assert fid.sweep_fidelity_plan(None, None, cpu) is None
    assert fid.sweep_fidelity_plan(True, None, gpu) == "synthetic"
    assert fid.sweep_fidelity_plan(False, None, gpu) is None
    assert fid.sweep_fidelity_plan(None, "/models/longchat", cpu) == "/models/longchat"
    monkeypatch.setattr(fid, "real_model_available", lambda: False)
    assert fid.sweep_fidelity_plan(None, None, gpu) is None


def test_sweep_with_a_fidelity_model_adds_its_rows(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "run"
    got = CliRunner().invoke(app, ["sweep", "--scenario", "smoke", "--lengths", "2k",
                                   "--budget", "256,1024", "--backend", "numpy",
                                   "--fidelity-model", "random:smoke", "--out", str(out)])
    assert got.exit_code == 0, got.output
    df, meta = results.load(out)
    fid = df[df["stage"] == "fidelity"]
    assert set(fid["source"]) == {"random-tokens"} and set(fid["samples"]) == {20}
    assert meta["fidelity"]["model"] == "random:smoke"
    assert "20 random-token prompts (random weights) at 2k of random:smoke" in got.output
    assert "Ranked by speed alone" not in got.output
