"""The HBM page cache on the CPU (core/page_cache.py, the rule; backends/page_cache_numpy.py, its
NumPy path; core/reuse_trace.py, the replayed selections; workload/replay.py through `sweep`).
The GPU kernel is held to the same reference in tests/test_page_cache_gpu.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
from typer.testing import CliRunner

from questprof import results
from questprof.cli import app
from questprof.core import reuse_trace
from questprof.core.page_cache import LRUPages, SlotTable, check_capacity, step_tables

S = 16


def test_lru_counts_misses_and_drops_the_least_recent():
    cache = LRUPages(3)
    assert cache.read([1, 2, 3]) == 3
    assert cache.read([2, 4]) == 1  # 1 (stamp 1, lowest position) goes
    assert set(cache.held) == {2, 3, 4}
    assert cache.read([1]) == 1  # 1 is read again after it was evicted: a miss; 3 goes
    assert set(cache.held) == {1, 2, 4}
    assert cache.read([1, 2, 4]) == 0


def test_lru_thrashes_where_a_step_reads_more_than_it_holds():
    """Per-head unions can exceed C (questprof reuse): the step's lowest positions go too."""
    cache = LRUPages(2, [5, 6, 7])
    assert set(cache.held) == {6, 7}
    assert cache.read([5, 6, 7]) == 1


def test_slot_table_places_misses_and_keeps_the_tail_last():
    table = SlotTable(4)
    got = table.step([0, 3, 9], tail=9)
    assert (got.hits, got.misses) == (0, 3)
    assert table.page == [0, 3, -1, 9]  # 9 took slot 2, then swapped with the free slot 3
    assert got.slots == (0, 1, 3) and got.swap == (2, False, False)
    assert dict(got.fetch) == {0: 0, 3: 1, 9: 3}
    got = table.step([3, 5, 9], tail=9)
    assert (got.hits, got.misses) == (2, 1) and table.page == [0, 3, 5, 9]
    got = table.step([6, 7, 9], tail=9)  # two misses: 0 (stamp 1) and 3 (stamp 2) go
    assert (got.hits, got.misses) == (1, 2)
    assert table.page == [6, 7, 5, 9] and got.swap is None
    got = table.step([0, 5, 9], tail=9)  # 0 again after its eviction: a miss; of 6 and 7
    assert (got.hits, got.misses) == (2, 1)  # (both stamp 3) 6, the lower position, goes
    assert table.page == [0, 7, 5, 9]


def test_a_new_tail_swaps_with_the_old_one():
    table = SlotTable(3)
    table.step([1, 4], tail=4)
    got = table.step([4, 5], tail=5)  # the request grew a page: 5 misses into slot 0 or 1
    assert table.page[2] == 5 and 4 in table.page
    at, tail_moves, other_moves = got.swap
    assert not tail_moves and other_moves  # 4's contents leave slot 2 for 5's fetched slot
    assert dict(got.fetch)[5] == 2


@pytest.mark.parametrize("capacity, k", [(3, 4), (2.5, 2)])
def test_a_cache_smaller_than_a_step_is_refused(capacity, k):
    with pytest.raises(ValueError, match="cannot hold a step's"):
        check_capacity(capacity, k)
    with pytest.raises(ValueError, match="C >= K"):
        SlotTable(3).step([0, 1, 2, 3], tail=3)


def test_a_step_without_its_tail_is_refused():
    with pytest.raises(ValueError, match="without the tail page 9"):
        SlotTable(4).step([0, 1], tail=9)


def _lengths():
    return [1, S - 1, S, S + 1, 300, 1000]  # tails of 1, S-1, S, S+1; a one-token request


def test_slot_tables_of_a_ragged_batch_count_as_the_rule():
    trace = reuse_trace.synthetic(_lengths(), S, 8, 2, 12, 0.6, seed=3)
    pages = np.array([-(-n // S) for n in _lengths()])
    tables = [[SlotTable(12) for _ in pages] for _ in range(2)]
    rules = [[LRUPages(12) for _ in pages] for _ in range(2)]
    for sel in trace.sel:
        slot_sel, hits, misses, _ = step_tables(tables, sel, pages)
        for h, b in np.ndindex(2, len(pages)):
            chosen = sel[h, b][sel[h, b] >= 0]
            assert misses[h, b] == rules[h][b].read(chosen)
            assert hits[h, b] + misses[h, b] == len(chosen)
            held = tables[h][b].page
            assert [held[s] for s in slot_sel[h, b][:len(chosen)]] == list(chosen)
            assert held[-1] == pages[b] - 1  # the tail page in the last slot
            assert (slot_sel[h, b][len(chosen):] == -1).all()


def test_a_synthetic_trace_keeps_the_overlap_asked_for():
    trace = reuse_trace.synthetic([4096, 2048], S, 32, 2, 20, 0.8, seed=1)
    assert trace.sel.shape == (20, 2, 2, 32)
    assert (np.diff(trace.sel, axis=-1) > 0).all()  # ascending, no repeats
    assert (trace.sel[..., 0, -1] == 255).all() and (trace.sel[..., 1, -1] == 127).all()
    # round(0.8 x 31) = 25 of the previous step's non-tail pages, and the tail: 26 of 32
    assert reuse_trace.overlap(trace) == pytest.approx(26 / 32)
    with pytest.raises(ValueError, match="outside 0..1"):
        reuse_trace.synthetic([4096], S, 32, 2, 4, 1.5)


def test_a_trace_file_round_trips_and_is_checked_against_the_shape(tmp_path):
    trace = reuse_trace.synthetic([2048], S, 16, 2, 4, 0.5)
    back = reuse_trace.load(reuse_trace.save(trace, tmp_path / "t.npz"))
    assert np.array_equal(back.sel, trace.sel) and back.lengths == (2048,)
    reuse_trace.check(back, [2048], S, 16, 2)
    with pytest.raises(ValueError, match="this configuration has"):
        reuse_trace.check(back, [4096], S, 16, 2)
    with pytest.raises(ValueError, match="is not a reuse trace"):
        reuse_trace.load(tmp_path / "missing.npz")
    for name, content in (("empty", b""), ("garbage", b"PK\x03\x04garbage")):
        path = tmp_path / f"{name}.npz"  # EOFError (click's bare "Aborted."), BadZipFile
        path.write_bytes(content)
        with pytest.raises(ValueError, match="is not a reuse trace"):
            reuse_trace.load(path)
    np.savez(tmp_path / "nan.npz", sel=np.array([[[[0.0, np.nan]]]]), lengths=[2048],
             page_size=S)
    with pytest.raises(ValueError, match="NaN"):
        reuse_trace.load(tmp_path / "nan.npz")


def _pool(rng, lengths, dtype="fp16"):
    """A NumPy PagedKV (pages shuffled, NaN in spare pages) and q."""
    from questprof.core.layout import PagedKV, page_tables, pages_for, to_storage

    n = sum(pages_for(x, S) for x in lengths) + 5
    indptr, indices, last = page_tables(lengths, S, n, rng)
    k, v = (np.full((n, 2, S, 64), np.nan, np.float32) for _ in range(2))
    for x in (k, v):
        x[indices] = rng.standard_normal((len(indices), 2, S, 64), dtype=np.float32)
    summ = np.zeros((n, 2, 2, 64), dtype=np.float16)
    kv = PagedKV(to_storage(k, dtype), to_storage(v, dtype), summ, indptr, indices, last,
                 tuple(lengths), S, dtype)
    q = to_storage(rng.standard_normal((len(lengths), 4, 64), dtype=np.float32), dtype)
    return kv, q


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_the_numpy_path_reads_the_chosen_pages_from_its_slots(dtype):
    from questprof.backends.numpy import NumpyBackend
    from questprof.backends.page_cache_numpy import NumpyPageCache

    backend, rng = NumpyBackend(), np.random.default_rng(7)
    kv, q = _pool(rng, _lengths(), dtype)
    trace = reuse_trace.synthetic(_lengths(), S, 6, 2, 8, 0.5, seed=2)
    cache = NumpyPageCache(kv, trace.sel, trace.count, 9)
    rules = [[LRUPages(9) for _ in _lengths()] for _ in range(2)]
    for t in range(2 * trace.steps):  # wraps around the trace once
        view, slot_sel, count = cache.step()
        got, _ = backend.attention(q, view, slot_sel, count)
        want, _ = backend.attention(q, kv, trace.sel[t % trace.steps], count)
        assert np.array_equal(got, want)  # the same pages, exactly
        misses = sum(rules[h][b].read(trace.sel[t % trace.steps, h, b][
            trace.sel[t % trace.steps, h, b] >= 0]) for h in range(2) for b in range(6))
        assert int(cache.step_counts[..., 1].sum()) == misses
    assert cache.totals()[2] == 2 * trace.steps


def _sweep(tmp_path, *extra):
    out = tmp_path / "run"
    got = CliRunner().invoke(app, [
        "sweep", "--scenario", "smoke", "--lengths", "2k", "--budget", "256", "--mode",
        "shared-mean", "--out", str(out), "--repeats", "2", "--warmup", "0", "--backend",
        "numpy", "--no-fidelity", "--no-e2e", *extra])
    return got, out


def test_a_cpu_sweep_replays_reuse_through_the_page_cache(tmp_path):
    got, out = _sweep(tmp_path, "--kv-tier", "host", "--hbm-pages", "32", "--reuse-overlap",
                      "0.8", "--reuse-steps", "8")
    assert got.exit_code == 0, got.output
    rows = {r["stage"]: r for r in results.read_rows(out) if r["impl"] == "ours"}
    for stage in ("attention", "quest"):
        r = rows[stage]
        assert r["cache_steps"] > 0 and r["cache_hits"] > 0 and r["cache_misses"] > 0
        assert r["cache_miss_rate"] == r["replayed_miss_rate"] == r["miss_rate"]
        assert r["reuse_overlap"] == pytest.approx(13 / 16)  # round(0.8 x 15) + the tail
        page = 2 * 16 * 64 * 2  # K and V of one 16-token page of one KV head, fp16
        assert r["cache_link_bytes"] == pytest.approx(
            r["cache_misses"] * page / r["cache_steps"] / r["sim_layers"])
    assert rows["attention"]["link_bytes"] == pytest.approx(rows["attention"]["cache_link_bytes"])
    assert rows["dense"].get("cache_steps") is None


def test_a_replay_counts_the_timed_passes_only_and_their_mean_time(tmp_path):
    """The untimed passes (warmup) run steps of the trace too: the counts, the replayed miss rate
    and mean_ms are of the timed passes alone, the same steps."""
    from questprof.measure import timing

    seen = []
    real = timing._time_cpu

    def spy(run_layer, layers, warmup, repeats, timed):
        assert (warmup, repeats) == (3, 2)
        got = real(run_layer, layers, warmup, repeats, timed)
        seen.append(got.samples_ms)
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timing, "_time_cpu", spy)
        got, out = _sweep(tmp_path, "--kv-tier", "host", "--hbm-pages", "32", "--reuse-overlap",
                          "0.8", "--reuse-steps", "8", "--warmup", "3", "--repeats", "2")
    assert got.exit_code == 0, got.output
    rows = [r for r in results.read_rows(out) if r.get("cache_steps")]
    assert sorted(r["stage"] for r in rows) == ["attention", "quest"]
    means = {round(float(np.mean(s)), 12) for s in seen}
    for r in rows:
        assert r["cache_steps"] == 2  # the 2 timed passes, not the 3 warmup passes before them
        assert round(r["mean_ms"], 12) in means


@pytest.mark.parametrize("args, said", [
    (["--kv-tier", "host", "--hbm-pages", "1.5"], "as an integer"),
    (["--hbm-pages", "32"], "an HBM page cache serves a cache in host memory"),
    (["--kv-tier", "host", "--hbm-pages", "8"], "at least one step's 16 chosen pages"),
    (["--kv-tier", "host", "--hbm-pages", "1000000000000"], "holds at most 2048 pages"),
    (["--kv-tier", "host", "--reuse-overlap", "0.5"], "add --kv-tier host --hbm-pages C"),
    (["--kv-tier", "host", "--hbm-pages", "32", "--mode", "per-head", "--reuse-overlap", "0.5"],
     "per-head's union of G selections is not built"),
    (["--kv-tier", "host", "--hbm-pages", "32", "--reuse-overlap", "1.5"], "keeps, 0..1"),
    (["--kv-tier", "host", "--hbm-pages", "32", "--reuse-overlap", "nan"], "keeps, 0..1"),
    (["--kv-tier", "host", "--hbm-pages", "32", "--reuse-overlap", "0.5", "--reuse-steps", "0"],
     "at least 2"),
])
def test_bad_page_cache_input_is_one_line_and_exit_2(tmp_path, args, said):
    got, out = _sweep(tmp_path, *args)
    assert got.exit_code == 2, got.output
    assert said in " ".join(got.output.split())
    assert not out.exists()  # refused before the run wrote anything


def test_a_trace_for_another_shape_is_one_line_and_exit_2(tmp_path):
    path = reuse_trace.save(reuse_trace.synthetic([4096], S, 16, 2, 4, 0.5), tmp_path / "t.npz")
    got, _ = _sweep(tmp_path, "--kv-tier", "host", "--hbm-pages", "32", "--reuse-trace",
                    str(path))
    assert got.exit_code == 2, got.output
    lines = [line for line in got.output.splitlines() if "reuse trace" in line]
    assert len(lines) == 1 and "this configuration has" in lines[0]


def test_the_report_shows_hit_rate_against_c_and_the_model(tmp_path):
    from questprof.report import tier as report_tier

    got, out = _sweep(tmp_path, "--kv-tier", "host", "--hbm-pages", "32", "--reuse-overlap",
                      "0.8", "--reuse-steps", "8")
    assert got.exit_code == 0, got.output
    df, meta = results.load(out)
    html = report_tier.section(df, meta)
    assert "HBM page cache, replayed selections" in html and "hit rate (device)" in html
    assert "synthetic overlap 0.8" in html
    # no CUPTI count on the CPU: the link bytes are not judged (a '-' ratio, a '-' verdict)
    replayed = html[html.index("HBM page cache, replayed selections"):]
    assert "counted link / model" in replayed and "--bytes cupti" in replayed
    assert re.search(r">-</td>\s*<td[^>]*>-</td>", replayed), replayed
    # us / layer is the timed passes' mean (the steps counted), the median where there is none
    mean = df["stage"] == "attention"
    df.loc[mean, "mean_ms"], df.loc[mean, "median_ms"] = 0.4321, 0.1234
    df.loc[df["stage"] == "quest", ["mean_ms", "median_ms"]] = [float("nan"), 0.5678]
    shown = report_tier.section(df, meta)
    assert ">123.4<" not in shown  # one time per row in every table of the section
    shown = shown[shown.index("HBM page cache, replayed selections"):]
    assert ">432.1<" in shown and ">567.8<" in shown
    meta = {**meta, "link_ceilings": {"zero_copy_gbs": 50.0, "copy_gbs": 55.0},
            "ceilings": {"read_gbs": 4000.0}}
    rows = df[df["stage"] == "attention"]
    us = report_tier._model_us(rows, meta).iloc[0]
    r = rows.iloc[0]
    assert us == pytest.approx(1e6 * (r["link_bytes"] / 50e9 + r["tier_hbm_bytes"] / 4000e9))


def test_the_tier_line_names_the_replay_of_a_page_cache():
    """A host-tier sweep with a page cache and a replay says what the cache rows replay, not that
    every chosen page misses; without a replay it says the pools have no reuse."""
    from types import SimpleNamespace

    from questprof.commands.sweep_say import tier_line
    cfg = SimpleNamespace(kv_tier="host", summary_tier="hbm", hbm_pages=256)
    gpu = SimpleNamespace(is_gpu=True)
    line = tier_line(cfg, gpu, 0.82)
    assert "overlap 0.82" in line and "every chosen page misses" not in line
    assert "trace t.npz" in tier_line(cfg, gpu, None, "t.npz")
    assert "every chosen page misses" in tier_line(cfg, gpu)
    assert tier_line(SimpleNamespace(kv_tier="hbm"), gpu) == ""


def _broken(trace, how):
    """A copy of `trace` with one step made into something that is not a selection."""
    sel = trace.sel.copy()
    k = sel.shape[-1]
    if how == "2-d":
        sel = sel[:, 0, 0]
    elif how == "no tail":
        sel[3, 0, 0] = np.arange(k)  # pages 0..K-1: the tail (page 127) left out
    elif how == "past the row":
        sel[3, 0, 0, -1] = 5000
    elif how == "twice":
        sel[3, 0, 0, 1] = sel[3, 0, 0, 0]
    elif how == "padding first":
        sel[3, 0, 0, 0] = -1
    return reuse_trace.Trace(sel, trace.lengths, trace.page_size)


@pytest.mark.parametrize("how,said", [
    ("2-d", "has 2 dimensions"), ("no tail", "leaves out its tail page"),
    ("past the row", "names a page past"), ("twice", "not strictly ascending"),
    ("padding first", "a -1 before a chosen page")])
def test_a_trace_that_is_not_a_selection_is_one_line_and_exit_2(tmp_path, how, said):
    """Traces the page cache's kernel would read out of bounds or count apart from its rule
    (review of 2026-12-02): refused before any pool is built, in one line."""
    good = reuse_trace.synthetic([2048], S, 16, 2, 8, 0.5)
    reuse_trace.check(good, [2048], S, 16, 2)  # the synthetic trace is a selection
    path = reuse_trace.save(_broken(good, how), tmp_path / "t.npz")
    got, _ = _sweep(tmp_path, "--kv-tier", "host", "--hbm-pages", "32", "--reuse-trace",
                    str(path))
    assert got.exit_code == 2, got.output
    lines = [line for line in got.output.splitlines() if "reuse trace" in line]
    assert len(lines) == 1 and said in lines[0], got.output
