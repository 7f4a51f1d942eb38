"""The sweep on the NumPy backend: rows, the quest row, dense budgets, resume, out-of-memory."""

import dataclasses
from collections import Counter

import numpy as np
import pandas as pd
import pytest

from questprof import results
from questprof.backends.numpy import NumpyBackend
from questprof.commands import sweep
from questprof.commands.sweep import Options
from questprof.core import model
from questprof.core.scenarios import expand, load_scenario
from questprof.workload import pools


def fast(**over):
    return {"opts": Options(repeats=2, warmup=0, **over)}


STAGES = sweep.ROW_STAGES


@pytest.fixture(scope="module")
def smoke():
    return load_scenario("smoke")


def configs(scenario, lengths="256,1000", budgets="64,1024"):
    return expand(scenario, lengths=lengths, budgets=budgets)


class Interrupt(Exception):
    pass


def stop_after(n):
    def progress(row, done, total):
        if done == n:
            raise Interrupt(f"stopped after {n} rows")
    return progress


def by_stage(rows):
    return {(r["config_key"], r["stage"]): r for r in rows}


def test_rows_for_every_configuration_and_stage(tmp_path, smoke):
    points = configs(smoke)
    seen = []
    rows = sweep.run_sweep(smoke, points, NumpyBackend(), tmp_path, progress=lambda r, d, t:
                           seen.append((d, t)), **fast())
    assert len(rows) == len(points) * len(STAGES) == len(results.load(tmp_path)[0])
    assert seen[-1] == (len(rows), len(rows))
    assert set(results.COLUMNS) <= set(rows[0])
    assert (tmp_path / results.PARQUET).is_file()
    sparse = by_stage(rows)[(points[0].key(), "quest")]  # 256 tokens, budget 64
    parts = [by_stage(rows)[(points[0].key(), s)] for s in model.QUEST_STAGES]
    assert sparse["status"] == "ok" and sparse["median_ms"] > 0  # timed as one pass of its own
    assert sparse["read_bytes"] == pytest.approx(sum(r["read_bytes"] for r in parts))
    assert sparse["rho_formula"] == pytest.approx(1 / 16 + 4 / 16)
    assert all(r["bandwidth_gbs"] > 0 for r in rows if r["status"] == "ok")


def test_dense_budget_records_quest_as_dense(tmp_path, smoke):
    point = configs(smoke, lengths="1000", budgets="1024")[0]
    rows = by_stage(sweep.run_sweep(smoke, [point], NumpyBackend(), tmp_path, **fast()))
    quest, dense = rows[(point.key(), "quest")], rows[(point.key(), "dense")]
    assert quest["status"] == "ok" and quest["median_ms"] == dense["median_ms"]
    assert "dense" in quest["reason"]
    assert rows[(point.key(), "topk")]["status"] == "skipped"


def test_interrupt_keeps_rows_and_resume_finishes_without_redoing(tmp_path, smoke):
    points = configs(smoke)
    total = len(points) * len(STAGES)
    with pytest.raises(Interrupt):  # 8 rows: one configuration and two stages of the next
        sweep.run_sweep(smoke, points, NumpyBackend(), tmp_path, progress=stop_after(8),
                        command="questprof sweep first", **fast())
    kept = results.read_rows(tmp_path)
    assert len(kept) == 8 and len(results.load(tmp_path)[0]) == 8
    assert len(pd.read_parquet(tmp_path / results.PARQUET)) == 8
    new = sweep.run_sweep(smoke, points, NumpyBackend(), tmp_path, resume=True,
                          command="questprof sweep --resume", **fast())
    assert len(new) == total - 8
    every = results.read_rows(tmp_path)
    assert Counter((r["config_key"], r["stage"]) for r in every).most_common(1)[0][1] == 1
    assert len(every) == total
    key = points[1].key()  # its estimate ran before the interrupt, topk and attention after
    rows = by_stage(every)
    assert all(rows[(key, s)]["status"] == "ok" for s in STAGES)
    meta = results.load(tmp_path)[1]
    assert meta["finished"] and len(meta["resumed"]) == 1
    assert meta["command"] == "questprof sweep first"
    assert meta["resumed_commands"] == ["questprof sweep --resume"]


class OutOfMemoryError(Exception):
    """Looks like cupy.cuda.memory.OutOfMemoryError to the sweep."""


class DenseOOM(NumpyBackend):
    def attention(self, q, kv, sel=None, count=None):
        if sel is None:
            raise OutOfMemoryError("out of memory allocating 1,048,576 bytes")
        return super().attention(q, kv, sel, count)


def test_out_of_memory_in_a_stage_is_a_skipped_row(tmp_path, smoke):
    points = configs(smoke)
    rows = by_stage(sweep.run_sweep(smoke, points, DenseOOM(), tmp_path, **fast()))
    dense = rows[(points[0].key(), "dense")]
    assert dense["status"] == "skipped" and "out of memory" in dense["reason"]
    assert rows[(points[0].key(), "quest")]["status"] == "ok"
    assert len(rows) == len(points) * len(STAGES)


def test_out_of_memory_while_building_skips_the_configuration(tmp_path, smoke, monkeypatch):
    points = configs(smoke, budgets="64")
    real = sweep.Workload

    def build(cfg, backend, layers, pools=None):
        if cfg.length == 1000:
            raise MemoryError()
        return real(cfg, backend, layers, pools)

    monkeypatch.setattr(sweep, "Workload", build)
    rows = sweep.run_sweep(smoke, points, NumpyBackend(), tmp_path, **fast())
    status = Counter((r["length"], r["status"]) for r in rows)
    assert status == {(256, "ok"): 6, (1000, "skipped"): 6}


def test_a_configuration_too_big_for_free_memory_is_skipped(tmp_path, smoke, monkeypatch):
    monkeypatch.setattr(pools, "free_bytes", lambda backend: 1 << 20)
    rows = sweep.run_sweep(smoke, configs(smoke, "256", "64"), NumpyBackend(), tmp_path, **fast())
    assert {r["status"] for r in rows} == {"skipped"}
    assert rows[0]["reason"] == "does not fit in host memory"  # one cause; figures apart
    assert rows[0]["free_gib"] == pytest.approx(1 / 1024) and rows[0]["need_gib"] > 0


class FakeGpu:
    is_gpu = True


def test_sim_layers_make_a_cold_pass_within_free_memory(smoke, monkeypatch):
    monkeypatch.setattr(pools, "l2_bytes", lambda: 60 << 20)
    monkeypatch.setattr(pools, "free_bytes", lambda backend: 80 << 30)
    small, big = configs(smoke, lengths="1000,1m", budgets="64")
    assert pools.sim_layers(small, FakeGpu()) == model.cold_layers(small, 60 << 20, 40 << 30) > 2
    monkeypatch.setattr(pools, "free_bytes", lambda backend: 2 * model.kv_pool_bytes(big))
    assert pools.sim_layers(big, FakeGpu()) == 1
    assert pools.sim_layers(small, NumpyBackend()) == 1
    assert pools.sim_layers(small, FakeGpu(), layers=7) == 7


def test_union_pages():
    sel = np.array([[[0, 2, 3]], [[1, 2, 3]], [[0, 2, 3]], [[0, 2, 3]]], dtype=np.int32)
    assert pools.union_pages(sel, np.array([3]), group=2) == pytest.approx((4 + 3) / 2)
    assert pools.union_pages(sel, np.array([2]), group=2) == pytest.approx((3 + 2) / 2)


def test_options_are_frozen_and_each_run_gathers_its_own_state(tmp_path, monkeypatch, smoke):
    """Options are settled before a run; what a run gathers (shared timings, byte seconds, the
    CPU's pools) is its RunState, so a second run with the same Options times every stage."""
    opts = fast()["opts"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.repeats = 3
    calls, real = [], sweep._measure
    monkeypatch.setattr(sweep, "_measure", lambda *args: calls.append(args[1]) or real(*args))
    for out in ("first", "second"):
        sweep.run_sweep(smoke, configs(smoke, "256", "64"), NumpyBackend(), tmp_path / out, opts)
    assert sorted(calls) == sorted(list(STAGES) * 2)


def test_budget_independent_stages_are_timed_once(tmp_path, monkeypatch):
    """Dense, summary and estimate do not depend on the budget: one timing serves every budget."""
    calls = []
    real = sweep._measure

    def counted(work, stage, impl, opts, *peer):
        calls.append(stage)
        return real(work, stage, impl, opts, *peer)

    monkeypatch.setattr(sweep, "_measure", counted)
    scenario = load_scenario("smoke")
    points = expand(scenario, lengths="4k", budgets="256,512,1024")
    rows = sweep.run_sweep(scenario, points, NumpyBackend(), tmp_path, **fast())
    assert sorted(calls) == sorted(["summary", "estimate", "dense"]
                                   + ["topk", "attention", "quest"] * 3)
    dense = {r["median_ms"] for r in rows if r["stage"] == "dense"}
    assert len(dense) == 1 and len([r for r in rows if r["stage"] == "dense"]) == 3


def test_cold_layers_make_the_smallest_stage_outgrow_l2():
    """A pass of the smallest timed stage reads >= 8x L2; pools stay within the budget."""
    from questprof.core.config import Config
    from questprof.core.model import COLD_FACTOR, cold_layers

    shape = load_scenario("longchat-7b").model
    l2 = 60 << 20
    for length in (2048, 32768, 131072):
        cfg = Config(shape, length, 1, 16, 2048)
        work = model.stage_work(cfg)
        smallest = min(work["estimate"].read, work["attention"].read)
        layers = cold_layers(cfg, l2, 1 << 40)
        assert layers >= 2 and layers * smallest >= COLD_FACTOR * l2
        assert (layers - 1) * smallest < COLD_FACTOR * l2 or layers == 2
    big = Config(shape, 131072, 8, 16, 2048)
    assert cold_layers(big, l2, 20 << 30) == 1  # one 16 GiB pool fits a 20 GiB budget


def test_quest_bytes_are_the_sum_of_its_stages():
    parts = {s: {"measured_read_bytes": r, "measured_write_bytes": w, "bytes_source": "cupti"}
             for s, r, w in (("estimate", 100.0, 1.0), ("topk", 10.0, 2.0),
                             ("attention", 1000.0, 3.0))}
    got = sweep._summed_bytes(parts)
    assert got == {"measured_read_bytes": 1110.0, "measured_write_bytes": 6.0,
                   "bytes_source": "cupti-sum"}
    del parts["topk"]
    assert sweep._summed_bytes(parts) == {}


def test_over_the_host_tier_the_peers_are_skipped_rows_that_say_why(tmp_path, smoke):
    """torch SDPA reads a cache of its own in HBM: beside host-tier rows it would compare HBM
    with the link (it did on the H200, 2026-12-02: 37 us against our 2,624 us over the link)."""
    from questprof.core import tier

    point = dataclasses.replace(configs(smoke, lengths="256", budgets="64")[0], kv_tier="host")
    rows = sweep.run_sweep(smoke, [point], NumpyBackend(), tmp_path, **fast(peers=True))
    sdpa = [r for r in rows if r["impl"] == sweep.SDPA]
    assert [(r["status"], r["reason"]) for r in sdpa] == [("skipped", tier.PEERS_REASON)]
    assert {r["status"] for r in rows if r["impl"] == "ours"} == {"ok"}
