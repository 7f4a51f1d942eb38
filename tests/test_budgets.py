"""Per-layer budgets: the smallest-per-layer rule, budgets.toml, the sweep timing a table."""

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from questprof.cli import app
from questprof.core.budgets import BudgetTable, read_table, to_toml, write_table
from questprof.core.config import ConfigError
from questprof.report.budgets import per_layer, saving_line, section_html

HEADS, LENGTH, PAGE = 8, 1024, 16
# mass recall per (layer, budget): every head's value, or (one head's, the others')
RECALL = {1: {32: 0.95, 64: 0.96, 128: 0.99},
          2: {32: 0.85, 64: 0.95, 128: 0.99},
          3: {32: (0.5, 0.95), 64: (0.5, 0.95), 128: (0.5, 0.99)}}


def _rows(selector_noise: bool = False) -> pd.DataFrame:
    """Head rows of 4 layers (layer 0 kept dense), 8 heads, budgets 32, 64, 128 of 1024."""
    rng = np.random.default_rng(3)
    rows = []
    for budget in (32, 64, 128, 1024):
        for layer in range(4):
            for head in range(HEADS):
                value = RECALL.get(layer, {}).get(budget, 1.0 if budget == LENGTH else 0.7)
                if isinstance(value, tuple):
                    value = value[0] if head == 0 else value[1]
                rows.append({"stage": "fidelity", "status": "ok", "source": "passkey",
                             "model": "tiny", "length": LENGTH, "page_size": PAGE,
                             "budget": budget, "mode": "per-head", "layer": layer,
                             "head": head, "step": None, "dense_layer": layer == 0,
                             "mass_recall": value + 1e-4 * rng.random(), "kv_heads": 1,
                             "head_dim": 4, "samples": 5, "selector": "quest"})
    if selector_noise:  # another selector's rows must not move Quest's table
        rows += [{**r, "selector": "streaming", "mass_recall": 0.1} for r in rows]
    return pd.DataFrame(rows)


def test_smallest_budget_per_layer_on_known_rows():
    got = per_layer(_rows(selector_noise=True), 0.9)
    # layer 0 dense (kept); 1 reaches at 32; 2 at 64; 3 never (one head at 0.5): dense
    assert got.table.budgets == (None, 32, 64, None)
    assert got.table.uniform_budget == 64  # p10 over the 24 sparse pairs reaches 0.9 at 64
    per_token = 2 * 1 * 4 * 2
    pages = LENGTH // PAGE
    assert got.table_bytes == per_token * (LENGTH + (pages + 32) + (pages + 64) + LENGTH)
    assert got.uniform_bytes == per_token * (LENGTH + 3 * (pages + 64))
    assert got.dense_bytes == per_token * 4 * LENGTH
    assert "reads 61% more" in saving_line(got)  # layer 3 dense costs more than it saves
    html = section_html(_rows(), 0.9)
    assert "budgets-table" in html and "kept dense" in html and "no budget below" in html


def test_budgets_toml_round_trip(tmp_path):
    table = BudgetTable((None, 32, 64, None), 16, "shared-max", "SmolLM2 \"q4\"", 0.9, 64,
                        {"source": "passkey", "length": 2048})
    back = read_table(write_table(table, tmp_path / "budgets.toml"), layers=4)
    assert back == table and back.info == table.info
    assert back.k_pages() == (None, 2, 4, None) and back.text() == "dense,32,64,dense"


@pytest.mark.parametrize("body, words", [
    ("page_size = 16\n[layers]\n0 = 24\n", "not whole pages"),
    ("page_size = 16\n[layers]\n0 = 32\n2 = 64\n", "layer 1 missing"),
    ("page_size = 16\n[layers]\n0 = \"sparse\"\n", "not whole pages"),
    ("page_size = 16\nmode = \"max\"\n[layers]\n0 = 32\n", "mode 'max'"),
    ("[layers]\n0 = 32\n", "page_size"),
    ("page_size = 16\n", "no [layers]"),
    ("page_size = = 16\n", "not TOML"),
    ("page_size = 16\n[layers]\n-1 = 32\n0 = 32\n", "layer -1 in [layers]: layers are numbered"),
])
def test_bad_tables_are_one_line(tmp_path, body, words):
    path = tmp_path / "b.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
        read_table(path)


def test_a_table_of_another_layer_count_is_refused(tmp_path):
    path = write_table(BudgetTable((32, 64), 16), tmp_path / "b.toml")
    with pytest.raises(ConfigError, match="has 2 layers; the model has 3"):
        read_table(path, layers=3)
    path.write_text("page_size = 16\n[layers]\n0 = 32\n1 = 64\n5 = 64\n")  # said "layer 2 missing"
    with pytest.raises(ConfigError, match=r"layer 5 in \[layers\], past the model's 2 layers \(0..1\)"):
        read_table(path, layers=2)


def _smoke_layers() -> int:
    from questprof.core.scenarios import load_scenario
    return load_scenario("smoke").model.layers


def _sweep_table(path, out):
    """`sweep --budgets-file path` on the smoke scenario at 1k (NumPy, no extras); its directory."""
    result = CliRunner().invoke(app, ["sweep", "--scenario", "smoke", "--backend", "numpy",
                                      "--lengths", "1k", "--batch", "1", "--budgets-file",
                                      str(path), "--repeats", "1", "--no-e2e",
                                      "--no-fidelity", "--bytes", "none", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_the_sweep_times_a_table_layer_by_layer(tmp_path):
    layers = _smoke_layers()
    budgets = tuple([None] + [16 * (2 + i % 3) for i in range(layers - 1)])
    path = write_table(BudgetTable(budgets, 16), tmp_path / "budgets.toml")
    out = _sweep_table(path, tmp_path / "run")
    from questprof.results import load
    df, meta = load(out)
    assert set(df["page_size"]) == {16} and set(df["budget"]) == {max(budgets[1:])}
    quest = df[(df["stage"] == "quest") & (df["impl"] == "ours")].iloc[0]
    assert quest["layer_budgets"] == BudgetTable(budgets, 16).text()
    assert quest["budgets_file"] == str(path)
    assert quest["sim_layers"] % layers == 0
    assert 0 < quest["rho_model"] < 1
    assert meta["args"]["budgets_file"] == str(path)


def test_a_table_budget_beyond_the_context_still_walks_the_table(tmp_path):
    """The grid's budget (the table's largest) covers every page at 1k: the Quest step still
    runs each layer's own budget, not dense attention."""
    budgets = (2048,) + (64,) * (_smoke_layers() - 1)
    path = write_table(BudgetTable(budgets, 16), tmp_path / "budgets.toml")
    out = _sweep_table(path, tmp_path / "run")
    from questprof.results import load
    df, _ = load(out)
    quest = df[(df["stage"] == "quest") & (df["impl"] == "ours")].iloc[0]
    assert quest["status"] == "ok" and quest["layer_budgets"].startswith("2048,64")
    assert 0 < quest["rho_model"] < 1 and pd.isna(quest["reason"])


@pytest.mark.parametrize("body", ["page_size = 16\n[layers]\n0 = 24\n",
                                  "page_size = 16\n[layers]\n0 = 32\n"])
def test_the_sweep_refuses_a_bad_table_in_one_line(tmp_path, body):
    path = tmp_path / "budgets.toml"
    path.write_text(body)
    result = CliRunner().invoke(app, ["sweep", "--scenario", "smoke", "--backend", "numpy",
                                      "--budgets-file", str(path), "--out",
                                      str(tmp_path / "run")])
    assert result.exit_code == 2
    assert "budget table" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


def test_to_toml_says_how_to_time_it():
    assert "--budgets-file" in to_toml(BudgetTable((16,), 16))


def test_a_fidelity_run_where_no_layer_reaches_the_floor_writes_no_table(tmp_path):
    """Synthetic smoke caches reach 0.9 in no sparse layer: the table would be all "dense",
    and timing it showed budget 8 and speedups over a pass of dense layers."""
    out = tmp_path / "fid"
    result = CliRunner().invoke(app, ["fidelity", "--source", "synthetic", "--scenario", "smoke",
                                      "--lengths", "1k", "--steps", "2", "--page-size", "8",
                                      "--budget", "64,128", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "every layer would stay dense, so there is no per-layer table to time" in result.output
    assert "No budgets.toml is written" in result.output and "--budgets-file" not in result.output
    assert not (out / "budgets.toml").exists()
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "no per-layer table to time" in html and "--budgets-file" not in html


def test_the_sweep_refuses_an_all_dense_table_in_one_line(tmp_path):
    path = write_table(BudgetTable((None,) * _smoke_layers(), 8), tmp_path / "budgets.toml")
    result = CliRunner().invoke(app, ["sweep", "--scenario", "smoke", "--backend", "numpy",
                                      "--budgets-file", str(path), "--out",
                                      str(tmp_path / "run")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: budget table") and "keeps every layer dense" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag, value", [("--page-size", "32"), ("--budget", "512"),
                                         ("--mode", "shared-mean")])
def test_a_flag_the_table_sets_otherwise_is_refused(tmp_path, flag, value):
    """The table sets the page size, the largest budget and the mode: a flag saying otherwise
    was dropped in silence (the rows showed the table's S 16)."""
    budgets = tuple([None] + [32] * (_smoke_layers() - 1))
    path = write_table(BudgetTable(budgets, 16), tmp_path / "budgets.toml")
    result = CliRunner().invoke(app, ["sweep", "--scenario", "smoke", "--backend", "numpy",
                                      "--lengths", "1k", "--budgets-file", str(path), flag, value,
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert f"{flag} {value}: budget table" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()
