"""Step-to-step reuse (fidelity/reuse.py) and `questprof reuse`, without a model: hand-counted
cache replays and synthetic captures."""

import numpy as np
import pytest
from typer.testing import CliRunner

from questprof import results
from questprof.backends import get_backend
from questprof.cli import app
from questprof.commands import reuse as reuse_cmd
from questprof.commands.reuse_args import ReuseArgs
from questprof.core.config import ConfigError
from questprof.core.page_cache import LRUPages
from questprof.fidelity.capture import Capture
from questprof.fidelity.reuse import kv_head_sets, layer_reuse, replay


def test_lru_evicts_the_least_recently_selected():
    cache = LRUPages(2)
    assert cache.read({1, 2}) == 2
    assert cache.read({2, 3}) == 1 and list(cache.held) == [2, 3]  # 1 went
    assert cache.read({1}) == 1 and list(cache.held) == [3, 1]


def test_replay_counts_by_hand():
    # warm start {1, 2}; then {2, 3} (keeps 2) and {1, 3} (keeps 3): 4 pages read, 2 kept.
    # C = 2: 3 misses and evicts 1, then 1 misses again: 2; C = 3 holds 1, 2, 3: 1 miss.
    pages, kept, misses = replay([{1, 2}, {2, 3}, {1, 3}], (2, 3))
    assert (pages, kept, misses) == (4, 2, {2: 2, 3: 1})


def test_kv_head_sets_are_the_union_of_the_groups_rows():
    sel = np.array([[[0, 5, 7]], [[1, 5, 7]], [[2, 3, 7]], [[2, 4, 7]]])  # [Hs 4, B 1, K 3]
    assert kv_head_sets(sel, 3, 2) == [{0, 1, 5, 7}, {2, 3, 4, 7}]
    assert kv_head_sets(sel, 2, 4) == [{0, 5}, {1, 5}, {2, 3}, {2, 4}]


def capture(steps=6, length=400, seed=0, layers=3):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((layers, 2, length, 64), dtype=np.float32)
    values = rng.standard_normal((layers, 2, length, 64), dtype=np.float32)
    drift = rng.standard_normal((layers, 1, 4, 64), dtype=np.float32)
    queries = drift + 0.1 * rng.standard_normal((layers, steps, 4, 64), dtype=np.float32)
    return Capture(queries, keys, values, 0.125, "synthetic", "test")


def test_misses_fall_as_the_cache_grows_and_stay_within_the_pages_read():
    caps = [capture(seed=1), capture(seed=2)]
    got = layer_reuse(caps, 1, 16, 64, "shared-mean", (4, 8, 16), get_backend("numpy"))
    assert got.pages == 5 * 2 * 2 * 4  # 5 counted steps x 2 requests x 2 KV heads x K 4
    assert got.misses[4] >= got.misses[8] >= got.misses[16] >= 0  # LRU is a stack algorithm
    assert 0.0 <= got.miss_rate(16) <= 1.0 - got.overlap + 1e-12  # a kept page never misses


def test_bad_settings_are_one_line():
    with pytest.raises(ConfigError, match="at least one step's 16 chosen pages"):
        reuse_cmd.settings(ReuseArgs(budget="256", hbm_pages="8"))
    with pytest.raises(ConfigError, match="at least 2 decode steps"):
        reuse_cmd.settings(ReuseArgs(steps=1))
    with pytest.raises(ConfigError, match="reuse takes one length"):  # before the model loads
        reuse_cmd.settings(ReuseArgs(length="2k,4k"))


def test_reuse_into_a_sweeps_directory_keeps_its_meta(monkeypatch, tmp_path):
    """The tier section asks for `reuse --out SWEEP_DIR`: the sweep's meta stays, reuse's joins."""
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "meta.json").write_text('{"scenario": "smoke", "grid": {"lengths": [2048]}}')
    monkeypatch.setattr(reuse_cmd, "captures", lambda args, log: ("synthetic", [capture(seed=3)]))
    got = CliRunner().invoke(app, ["reuse", "--budget", "64", "--mode", "shared-mean",
                                   "--dense-layers", "1", "--out", str(out)])
    assert got.exit_code == 0, got.output
    meta = results.load(out)[1]
    assert meta["scenario"] == "smoke" and meta["grid"] == {"lengths": [2048]}
    assert meta["reuse"]["kind"] == "reuse"


def test_the_command_writes_rows_and_prints_the_table(monkeypatch, tmp_path):
    caps = [capture(seed=3)]
    monkeypatch.setattr(reuse_cmd, "captures", lambda args, log: ("synthetic", caps))
    out = tmp_path / "reuse"
    got = CliRunner().invoke(app, ["reuse", "--budget", "64", "--mode", "shared-mean",
                                   "--dense-layers", "1", "--out", str(out)])
    assert got.exit_code == 0, got.output
    assert "miss rate" in got.stdout and "results:" in got.stdout
    rows = results.read_rows(out)
    every = [r for r in rows if r["layer"] is None]
    assert [r["hbm_pages"] for r in every] == [4, 8, 16]
    assert len(rows) == 3 * (2 + 1)  # 2 layers >= dense_layers and their sum, per C
    per_layer = [r for r in rows if r["layer"] is not None and r["hbm_pages"] == 4]
    assert every[0]["misses"] == sum(r["misses"] for r in per_layer)
    assert every[0]["link_bytes_model"] == pytest.approx(sum(r["link_bytes_model"]
                                                             for r in per_layer))
