"""The sentence atop "At a glance", and the machine table saying how the rows were timed."""

import re

import pandas as pd
import pytest

from questprof.report import frames, glance_lines, write_report
from questprof.report.verdict import sentence
from test_report import META, synthetic, table_rows


def test_the_glance_opens_with_one_verdict(tmp_path):
    """"On this machine, for this model, Quest at page P, budget B is X times faster than dense
    attention at L, and the whole decode step Y times"."""
    df = synthetic()
    pairs = frames.paired(df)
    best = pairs[(pairs["batch"] == 1) & (pairs["length"] == 131072)].sort_values("speedup").iloc[-1]
    html = write_report(df, META, tmp_path / "r.html").read_text(encoding="utf-8")
    glance = html[html.index('<section id="glance">'):]
    said = re.search(r'<p class="verdict">(.*?)</p>', glance).group(1)
    assert glance.index(said) < glance.index("glance-table")
    assert said.startswith(f"On this machine (NVIDIA H200), for gqa-8b, Quest at page "
                           f"{best.page_size}, budget {frames.fmt_tokens(best.budget)} is "
                           f"{best.speedup:.2f} times faster than dense attention at 128k tokens "
                           "(batch 1), and the whole decode step ")
    assert "(modelled: Amdahl over attention&#x27;s share of the bytes" in said
    assert glance_lines(df, META)[0] == said.replace("&#x27;", "'")


def test_the_verdict_takes_a_measured_step_and_says_ties():
    df = synthetic(lengths=[8192], batches=(1,), page_sizes=(16,), budgets=(512,))
    pairs = frames.paired(df)
    e2e = {"stage": "e2e", "status": "ok", "length": 8192, "batch": 1, "page_size": 16,
           "budget": 512, "mode": "per-head", "measured_speedup": 1.31,
           "attention_fraction": 0.4}
    rows = pd.concat([df, pd.DataFrame([e2e])], ignore_index=True)
    assert sentence(pairs, rows, META, None).endswith(
        "and the whole decode step 1.31 times (measured).")
    tie = pairs.assign(speedup=1.007, speedup_lo=0.98, speedup_hi=1.03)
    assert "ties (1.01x, within the p20..p80 spreads) with dense attention" in sentence(
        tie, rows, META, None)


def test_the_machine_table_says_a_cpu_run_timed_no_graph(tmp_path):
    """timing.graph True stood over a CPU run's perf-counter passes."""
    df = synthetic(lengths=[8192], batches=(1,), page_sizes=(16,), budgets=(512,))
    df["method"] = "perf-counter"
    meta = {**META, "timing": {"repeats": 7, "graph": True}}
    rows = table_rows(write_report(df, meta, tmp_path / "r.html").read_text(), "machine-table")
    assert ["timing.graph", "False (asked; timed by perf-counter)"] in rows
    df["method"] = "cuda-graph"
    rows = table_rows(write_report(df, meta, tmp_path / "g.html").read_text(), "machine-table")
    assert ["timing.graph", "True"] in rows


def test_a_cpu_sweep_records_no_graph(tmp_path):
    import json

    from typer.testing import CliRunner

    from questprof.cli import app

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["sweep", "--scenario", "smoke", "--lengths", "2k",
                                      "--backend", "numpy", "--repeats", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "meta.json").read_text())
    assert meta["timing"]["graph"] is False and meta["args"]["graph"] is True
    assert "On this machine (the CPU, NumPy), for smoke" in result.stdout
