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
from questprof.core import reuse_trace
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
    # a page size the kernels do not take was refused after the model's 23-42 s load, or as a
    # budget that is not whole pages; a budget over the prompt measured a reuse of 1
    with pytest.raises(ConfigError, match="page size 3 is not supported"):
        reuse_cmd.settings(ReuseArgs(page_size="3", budget="3"))
    with pytest.raises(ConfigError, match="page size 3 is not supported"):
        reuse_cmd.settings(ReuseArgs(page_size="3"))
    with pytest.raises(ConfigError, match="covers the whole 2048-token prompt"):
        reuse_cmd.settings(ReuseArgs(budget="4096"))


def test_reuse_without_torch_names_what_to_install(monkeypatch, tmp_path):
    """Its modules import torch at load: a ModuleNotFoundError traceback before, one line now."""
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else find(name, *a))
    got = CliRunner().invoke(app, ["reuse", "--model", str(tmp_path), "--out", str(tmp_path / "o")])
    assert got.exit_code == 2 and "Traceback" not in got.output
    said = " ".join(got.stderr.split())
    assert "reuse needs torch" in said and "pip install" in said
    assert not (tmp_path / "o").exists()


def test_a_trace_out_that_cannot_be_written_is_refused_before_the_model_loads(monkeypatch,
                                                                              tmp_path):
    monkeypatch.setattr(reuse_cmd, "captures", lambda *a: pytest.fail("the model was loaded"))
    for where, says in ((tmp_path, "a directory"), (tmp_path / "no" / "t.npz", "does not exist")):
        got = CliRunner().invoke(app, ["reuse", "--budget", "64", "--mode", "shared-mean",
                                       "--trace-out", str(where)])
        assert got.exit_code == 2 and says in " ".join(got.stderr.split()), got.output


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


def test_a_second_reuse_run_into_the_same_directory_is_refused(monkeypatch, tmp_path):
    """It appended its rows to the first run's; a sweep's directory is still joined (above)."""
    monkeypatch.setattr(reuse_cmd, "captures", lambda args, log: ("synthetic", [capture(seed=3)]))
    args = ["reuse", "--budget", "64", "--mode", "shared-mean", "--dense-layers", "1", "--out",
            str(tmp_path / "r")]
    assert CliRunner().invoke(app, args).exit_code == 0
    before = (tmp_path / "r" / "rows.jsonl").read_bytes()
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "already holds a run's reuse rows" in again.stderr
    assert (tmp_path / "r" / "rows.jsonl").read_bytes() == before


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


def _lru_miss_rate(trace, capacity: int) -> float:
    """LRUPages over a trace as `questprof reuse` replays: warm with step 0, steps 1..T-1."""
    misses = pages = 0
    for h, b in np.ndindex(trace.sel.shape[1:3]):
        rows = [row[row >= 0] for row in trace.sel[:, h, b]]
        cache = LRUPages(capacity, rows[0])
        misses += sum(cache.read(row) for row in rows[1:])
        pages += sum(len(row) for row in rows[1:])
    return misses / pages


def _reuse_with_trace(monkeypatch, tmp_path, caps, *flags):
    monkeypatch.setattr(reuse_cmd, "captures", lambda args, log: ("synthetic", caps))
    out = tmp_path / "reuse"
    got = CliRunner().invoke(app, ["reuse", "--budget", "64", "--mode", "shared-mean,per-head",
                                   "--dense-layers", "1", "--out", str(out),
                                   "--trace-out", str(tmp_path / "t.npz"), *flags])
    return got, out


@pytest.mark.parametrize("layer", [None, 2])
def test_the_trace_written_replays_to_the_rows_miss_rate(monkeypatch, tmp_path, layer):
    """Steps 395..400 tokens share 25 pages: the trace holds every step the rows count."""
    caps = [capture(seed=4), capture(seed=5)]
    flags = [] if layer is None else ["--trace-layer", str(layer)]
    got, out = _reuse_with_trace(monkeypatch, tmp_path, caps, *flags)
    assert got.exit_code == 0, got.output
    said = results.load(out)[1]["trace"]
    trace = reuse_trace.load(tmp_path / "t.npz")
    reuse_trace.check(trace, [400, 400], 16, 4, 2)  # as sweep --reuse-trace checks it
    assert said["mode"] == "shared-mean" and said["first_step"] == 0 and trace.steps == 6
    rows = {(r["layer"], r["hbm_pages"]): r for r in results.read_rows(out)
            if r["mode"] == "shared-mean"}
    if layer is None:  # the median of layers 1 and 2: the lower overlap
        layer = min((1, 2), key=lambda n: (rows[n, 4]["overlap"], n))
    assert said["layer"] == layer
    for c in (4, 8, 16):
        assert said["miss_rate"][str(c)] == rows[layer, c]["miss_rate"] == _lru_miss_rate(trace, c)
    assert said["overlap"] == rows[layer, 4]["overlap"] == pytest.approx(reuse_trace.overlap(trace))


def test_a_tail_page_that_moves_leaves_the_steps_before_it_out(monkeypatch, tmp_path):
    """Steps at 384..389 tokens: step 0 has 24 pages, the rest 25 (tail page 24)."""
    caps = [capture(length=389, seed=6)]
    got, out = _reuse_with_trace(monkeypatch, tmp_path, caps)
    assert got.exit_code == 0, got.output
    said = results.load(out)[1]["trace"]
    trace = reuse_trace.load(tmp_path / "t.npz")
    reuse_trace.check(trace, [389], 16, 4, 2)
    assert said["first_step"] == 1 and trace.steps == 5
    assert said["miss_rate"]["8"] == _lru_miss_rate(trace, 8)


@pytest.mark.parametrize("flags, says", [
    (["--trace-layer", "3"], "--trace-layer 3: synthetic's layers measured are 1..2"),
    (["--trace-layer", "0"], "--trace-layer 0: synthetic's layers measured are 1..2"),
    (["--trace-mode", "per-head"], "a trace is of a shared mode"),
    (["--trace-mode", "shared-max"], "--trace-mode shared-max: this run selects with"),
    (["--budget", "64,128"], "give one --page-size and one --budget"),
])
def test_a_trace_the_run_cannot_write_is_one_line(monkeypatch, tmp_path, flags, says):
    got, _ = _reuse_with_trace(monkeypatch, tmp_path, [capture(seed=4)], *flags)
    assert got.exit_code == 2
    assert says in " ".join(got.stderr.split()) and len(got.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.npz").exists()


def test_trace_flags_without_trace_out_are_one_line():
    with pytest.raises(ConfigError, match="add --trace-out"):
        reuse_cmd.trace_setting(ReuseArgs(trace_layer=3))
    with pytest.raises(ConfigError, match="trace is of a shared mode"):
        reuse_cmd.trace_setting(ReuseArgs(mode="per-head", budget="256", trace_out="t.npz"))


def test_the_sweep_replays_the_written_trace_as_whole_passes(monkeypatch, tmp_path):
    """The smoke scenario has the fixture's shape; a window of 6 steps is one whole pass of the
    trace after the sweep's warm pass: LRUPages cycling through it, not reuse's count."""
    got, _ = _reuse_with_trace(monkeypatch, tmp_path, [capture(seed=4), capture(seed=5)])
    assert got.exit_code == 0, got.output
    trace = reuse_trace.load(tmp_path / "t.npz")
    out = tmp_path / "sweep"
    got = CliRunner().invoke(app, [
        "sweep", "--scenario", "smoke", "--lengths", "400", "--batch", "2", "--page-size", "16",
        "--budget", "64", "--mode", "shared-mean", "--kv-tier", "host", "--hbm-pages", "8",
        "--reuse-trace", str(tmp_path / "t.npz"), "--backend", "numpy", "--no-e2e",
        "--no-fidelity", "--bytes", "none", "--repeats", "6", "--warmup", "0", "--out", str(out)])
    assert got.exit_code == 0, got.output
    misses = pages = 0
    for h, b in np.ndindex(trace.sel.shape[1:3]):
        cache, rows = LRUPages(8), [row[row >= 0] for row in trace.sel[:, h, b]]
        for row in rows:  # the warm pass
            cache.read(row)
        misses += sum(cache.read(row) for row in rows)
        pages += sum(len(row) for row in rows)
    replayed = [r for r in results.read_rows(out) if r.get("cache_steps")]
    assert sorted(r["stage"] for r in replayed) == ["attention", "quest"]
    for r in replayed:
        assert r["cache_steps"] == trace.steps
        assert r["replayed_miss_rate"] == r["cache_miss_rate"] == misses / pages
