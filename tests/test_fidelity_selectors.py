"""`questprof fidelity --selector`: every selector's rows on the same captures, and its report."""

import re

import pandas as pd
import pytest
from typer.testing import CliRunner

from questprof import results
from questprof.cli import app
from questprof.core.selectors import name_list
from questprof.report.selectors import points, quest_only

ARGS = ("--source", "synthetic", "--scenario", "smoke", "--lengths", "1k", "--steps", "2",
        "--page-size", "16", "--budget", "64,256", "--backend", "numpy")


def run(*args):
    return CliRunner().invoke(app, ["fidelity", *ARGS, *[str(a) for a in args]])


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("sel") / "run"
    result = run("--selector", "quest,streaming,h2o,oracle,quest-boxes:2,quest-gap:0.5,bnb:10",
                 "--out", out)
    assert result.exit_code == 0, result.output
    return out


def test_the_help_names_every_selector_of_the_registry():
    result = CliRunner().invoke(app, ["fidelity", "--help"])
    assert result.exit_code == 0
    flat = re.sub(r"[│\s]+", " ", result.stdout)  # Rich wraps help in a box
    assert f"or 'all': {name_list()} (docs/FIDELITY.md)" in flat


def test_rows_of_every_selector_on_the_same_settings(compared):
    df, meta = results.load(compared)
    fid = df[(df["stage"] == "fidelity") & df["head"].notna()]
    names = {"quest", "streaming", "h2o", "oracle", "quest-boxes:2", "quest-gap:0.5", "bnb:10"}
    assert set(fid["selector"]) == names
    assert set(meta["fidelity"]["selectors"]) == names
    counts = fid.groupby("selector").size()
    assert counts.nunique() == 1  # same sources, settings, layers and heads for each
    for col in ("selector_rho", "pages_read", "pages_read_p95", "pages_read_max"):
        assert fid[col].notna().all(), col
    bnb = fid[fid["selector"] == "bnb:10"]
    assert bnb["mass_bound"].notna().all() and (bnb["mass_bound"] <= 1).all()
    assert fid[fid["selector"] == "quest"]["mass_bound"].isna().all()


def test_oracle_keeps_at_least_quest_mass_per_head(compared):
    df, _ = results.load(compared)
    fid = df[(df["stage"] == "fidelity") & df["head"].notna()]
    key = ["source", "budget", "layer", "head"]
    quest = fid[fid["selector"] == "quest"].set_index(key)["mass_recall"]
    oracle = fid[fid["selector"] == "oracle"].set_index(key)["mass_recall"]
    assert (oracle >= quest.loc[oracle.index] - 1e-4).all()


def test_quest_rows_match_a_run_without_selectors(compared, tmp_path):
    assert run("--out", tmp_path / "plain").exit_code == 0
    plain, _ = results.load(tmp_path / "plain")
    both, _ = results.load(compared)
    key = ["source", "budget", "layer", "head", "step"]
    a = plain[plain["stage"] == "fidelity"].set_index(key)["mass_recall"].sort_index()
    b = quest_only(both[both["stage"] == "fidelity"]).set_index(key)["mass_recall"].sort_index()
    pd.testing.assert_series_equal(a, b)


def test_report_has_the_selectors_section_and_frontier(compared):
    df, _ = results.load(compared)
    html = (compared / "report.html").read_text()
    assert "Selectors: bytes against fidelity" in html and "selectors-table" in html
    pts = points(df)
    assert set(pts["selector"]) >= {"quest", "bnb:10"} and pts["frontier"].any()
    assert not pts[pts["selector"] == "oracle"]["frontier"].any()
    boxes = pts[pts["selector"] == "quest-boxes:2"].set_index(["source", "budget"])["rho"]
    quest = pts[pts["selector"] == "quest"].set_index(["source", "budget"])["rho"]
    assert (boxes - quest).round(6).eq(1 / 16).all()  # one more summary per page of 16


def test_without_quest_only_the_named_selectors_run(tmp_path):
    assert run("--selector", "quest-fp8", "--out", tmp_path / "fp8").exit_code == 0
    df, _ = results.load(tmp_path / "fp8")
    assert set(df[df["stage"] == "fidelity"]["selector"]) == {"quest-fp8"}


@pytest.mark.parametrize("selector, text", [
    ("quest,nope", "unknown selector 'nope'"), ("bnb:0", "whole number of tokens R >= 1"),
    ("quest-boxes:3", "3 boxes do not divide the page size 16")])
def test_bad_selectors_are_one_clear_line(selector, text, tmp_path):
    result = run("--selector", selector, "--out", tmp_path / "bad")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "bad").exists()
