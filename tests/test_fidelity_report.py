"""The fidelity part of the report: summaries, the recommendation under the floor, the HTML."""

import numpy as np
import pytest

from questprof.report import fidelity as fidelity_report
from questprof.report import fidelity_frames as ff
from questprof.report import write_report
from questprof.results import frame as results_frame

BUDGETS = {256: 0.8, 1024: 0.95}  # budget -> mass recall of every head: only 1024 passes 0.9


def _speed_rows():
    rows = []
    for budget, quest_ms in ((256, 0.1), (1024, 0.3)):
        for stage, ms in (("dense", 1.0), ("quest", quest_ms)):
            rows.append({"stage": stage, "median_ms": ms, "status": "ok", "length": 32768,
                         "batch": 1, "page_size": 16, "budget": budget, "mode": "per-head",
                         "backend": "cupy"})
    return rows


def _fidelity_rows(rng):
    rows = []
    for budget, recall in BUDGETS.items():
        for layer in range(4):
            for head in range(3):
                value = recall + rng.uniform(-0.01, 0.01)
                rows.append({"stage": "fidelity", "status": "ok", "source": "passkey",
                             "model": "m", "length": 4096, "batch": 1, "page_size": 16,
                             "budget": budget, "mode": "per-head", "layer": layer, "head": head,
                             "step": None, "dense_layer": layer < 1, "mass_recall": value,
                             "oracle_mass": value + 0.01, "top10_recall": 1.0,
                             "page_recall": 0.9, "output_rel_error": 1 - value,
                             "bound_slack": 50.0, "stale_mass_recall": value})
    return rows


@pytest.fixture
def frame():
    rng = np.random.default_rng(0)
    return results_frame(_speed_rows() + _fidelity_rows(rng))


def test_summary_leaves_the_dense_layers_out(frame):
    s = ff.summary(frame)
    assert list(s["heads"]) == [9, 9]  # 3 sparse layers x 3 heads per budget
    assert ff.dense_layer_summary(frame)["heads"].tolist() == [3, 3]


def test_recommendation_is_the_fastest_setting_above_the_floor(frame):
    rec = ff.recommend(frame, 0.9)
    assert rec["measured"]
    assert rec["setting"]["budget"] == 1024 and rec["fastest"]["budget"] == 256
    assert rec["setting"]["speedup"] == pytest.approx(1.0 / 0.3)
    assert ff.recommend(frame, 0.7)["setting"]["budget"] == 256
    assert ff.recommend(frame, 0.99)["setting"] is None


def test_a_budget_that_covers_the_context_is_never_recommended(frame):
    """A budget of the whole context selects every page: it reached the floor and was
    recommended as "the fastest setting" after the line that no budget below the context does."""
    covers = frame.copy()
    covers.loc[covers["budget"] == 1024, "budget"] = 4096  # the fidelity length
    assert ff.recommend(covers, 0.9)["setting"] is None
    said = " ".join(fidelity_report.recommend.advice(covers, 0.9))
    assert "No measured setting with a budget below the context" in said
    assert "Recommended" not in said


def test_without_speed_rows_the_formula_ranks(frame):
    rec = ff.recommend(frame[frame["stage"] == "fidelity"], 0.9)
    assert not rec["measured"] and rec["setting"]["budget"] == 1024


def test_report_shows_floor_recommendation_and_frontier(frame, tmp_path):
    html = write_report(frame, {"min_recall": 0.9, "scenario": "t"}, tmp_path).read_text()
    assert "Fidelity floor" in html and "≥ 0.9" in html
    glance = fidelity_report.glance(frame, {"min_recall": 0.9})
    assert "budget 1k" in glance and "misses the floor" in glance
    assert "fig-fidelity-frontier" in html and "fig-fidelity-heat" in html
    assert "9. Fidelity" in html


def test_report_without_fidelity_rows_has_no_fidelity_section(tmp_path):
    html = write_report(results_frame(_speed_rows()), {}, tmp_path).read_text()
    assert "Fidelity floor" not in html and "9. Fidelity" not in html


def test_glance_highlights_the_recommended_setting_not_the_fastest(frame, tmp_path):
    """Budget 256 is faster but misses the 0.9 floor: the highlighted row is budget 1k."""
    html = write_report(frame, {"min_recall": 0.9, "scenario": "t"}, tmp_path).read_text()
    table = html[html.index("glance-table"):html.index("</table>", html.index("glance-table"))]
    best = [row for row in table.split("<tr") if "class=\"best\"" in row]
    assert len(best) == 1 and ">1k<" in best[0]
    assert "Highlighted: page 16, budget 1k, the fastest setting that keeps" in html
    plain = write_report(results_frame(_speed_rows()), {}, tmp_path / "plain").read_text()
    assert "Highlighted: the fastest page size and budget" in plain


@pytest.fixture(scope="module")
def fidelity_only(tmp_path_factory):
    """A synthetic fidelity run on the CPU whose rows come a second after it starts (a real
    model's load and capture come before any row); its directory, which the tests only read
    (one run for the module: 1.2 CPU-s and the 1.1 s wait each)."""
    import time

    from typer.testing import CliRunner

    from questprof.cli import app
    from questprof.commands import fidelity

    real = fidelity.fidelity_rows

    def late(*args, **kwargs):
        time.sleep(1.1)
        yield from real(*args, **kwargs)

    out = tmp_path_factory.mktemp("fidelity-only") / "fid"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(fidelity, "fidelity_rows", late)
        result = CliRunner().invoke(app, ["fidelity", "--source", "synthetic", "--scenario",
                                          "smoke", "--lengths", "1k", "--steps", "2",
                                          "--page-size", "16", "--budget", "64,128", "--backend",
                                          "numpy", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_a_fidelity_only_report_has_no_dead_parts(fidelity_only):
    """Its navigation linked sections 1-7 that were not on the page, its glance spoke of
    crossovers, a CPU banner said "times are CPU times" over a page without a time."""
    import re

    html = (fidelity_only / "report.html").read_text(encoding="utf-8")
    nav = re.search(r"<nav>(.*?)</nav>", html).group(1)
    anchors = re.findall(r'href="#([^"]+)"', nav)
    assert anchors == ["glance", "fidelity", "machine"]
    assert all(f'<section id="{a}">' in html for a in anchors)
    assert "Crossover" not in html and "crossover" not in html
    assert "times are CPU times" not in html and "nothing to compare" not in html
    assert "No skipped rows" not in html and "This run timed nothing" in html
    assert "frontier needs speed rows" not in html  # said once, in the glance's lede


def test_a_fidelity_run_stamps_its_start_and_its_seconds(fidelity_only):
    """meta.json said started = finished and job_seconds null for a 3.5-minute run."""
    import json
    from datetime import datetime

    meta = json.loads((fidelity_only / "meta.json").read_text())
    started, finished = (datetime.fromisoformat(meta[k]) for k in ("started", "finished"))
    assert (finished - started).total_seconds() >= 1
    assert meta["job_seconds"] >= 1.1
