"""The report's selectors section with task rows, "At a glance" among selectors, budgets.toml."""

import pytest
from typer.testing import CliRunner

from questprof import results
from questprof.cli import app
from questprof.core.budgets import read_table
from questprof.report import glance_lines, write_report
from questprof.report.selectors import points

ARGS = ("fidelity", "--source", "synthetic", "--scenario", "smoke", "--lengths", "1k",
        "--steps", "2", "--page-size", "16", "--budget", "64,256,512", "--backend", "numpy",
        "--min-recall", "0.5")
NAMES = ("quest", "streaming", "h2o", "oracle", "quest-gap:0.5")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("seltask") / "run"
    result = CliRunner().invoke(app, [*ARGS, "--selector", ",".join(NAMES), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "budgets.toml" in result.output and "--budgets-file" in result.output
    return out, result.output


def _task_rows(df):
    """Task rows of the shape runner.task_rows writes, one per selector and budget."""
    base = df[(df["stage"] == "fidelity") & df["layer"].isna() & df["step"].isna()]
    rows = []
    for i, r in enumerate(base.drop_duplicates(["source", "budget", "selector"]).itertuples()):
        rows.append({"stage": "passkey", "scenario": r.scenario, "model": r.model,
                     "source": r.source, "length": r.length, "page_size": r.page_size,
                     "budget": r.budget, "mode": r.mode, "selector": r.selector, "status": "ok",
                     "samples": 5, "passkey_dense_correct": 1.0,
                     "passkey_quest_correct": (i % 6) / 5, "dense_agreement": 0.4,
                     "first_divergence": "-|-|1|2|3", "first_divergence_median": 2.0,
                     "forced_match": 0.875})
    return rows


def test_section_shows_task_accuracy_divergence_and_glance(run_dir):
    out, _ = run_dir
    df, meta = results.load(out)
    results.append_rows(out, _task_rows(df))
    df, meta = results.load(out)
    pts = points(df)
    assert pts["task_share"].notna().all() and (pts["task_n"] == 5).all()
    html = write_report(df, meta, out / "report.html").read_text()
    assert "task (in the loop)" in html and "teacher-forced match" in html
    assert "/5 (" in html and "0.875" in html
    assert "Among selectors" in html
    lines = glance_lines(df, meta, out)
    among = [line for line in lines if line.startswith("Among selectors")]
    assert len(among) == 1 and "rho" in among[0] and "floor 0.5" in among[0]
    assert "oracle at" not in among[0]  # a ceiling, never recommended


def test_budgets_toml_is_written_and_shown(run_dir):
    out, _ = run_dir
    table = read_table(out / "budgets.toml")
    df, meta = results.load(out)
    assert table.page_size == 16 and table.min_recall == 0.5
    layers = int(df[df["stage"] == "fidelity"]["layer"].max()) + 1
    assert table.layers == layers
    assert all(b is None or b in (64, 256, 512) for b in table.budgets)
    html = (out / "report.html").read_text()
    assert "Per-layer budgets (budgets.toml)" in html and "budgets-table" in html


def test_glance_without_other_selectors_says_nothing_of_them(tmp_path):
    out = tmp_path / "plain"
    assert CliRunner().invoke(app, [*ARGS, "--out", str(out)]).exit_code == 0
    df, meta = results.load(out)
    assert not [line for line in glance_lines(df, meta, out) if "Among selectors" in line]
