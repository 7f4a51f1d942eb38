"""Context-parallel Quest equals single-device Quest: the step of one rank as a pure function
of arrays and a communicator (a world of 1, threads of a fake world), gloo ranks, NCCL ranks."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from questprof.core import sharding as cp
from questprof.core import layout, reference as ref
from questprof.core.config import Config, ModelShape
from questprof.backends.numpy import NumpyBackend


def _case(seed, lengths, page_size=8, kv_heads=2, q_heads=4, d=16):
    rng = np.random.default_rng(seed)
    kv = layout.random_paged_kv(rng, lengths, page_size, kv_heads, d, "fp32", spare_pages=5,
                                tail_fill=np.nan)
    NumpyBackend().summary(kv, layout.append_plan(kv.kv_indptr, kv.kv_indices, kv.last_page_len,
                                                  kv.lengths, page_size))
    return kv, layout.random_queries(rng, len(lengths), q_heads, d, "fp32")


def _single(kv, q, k_pages, mode):
    backend = NumpyBackend()
    sel, count = backend.topk(backend.estimate(q, kv, mode), kv, k_pages)
    out, lse = backend.attention(q, kv, sel, count)
    return out, lse, sel, count


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("mode", ref.MODES)
def test_exact_global_topk_and_merge_equal_single_device(world, mode):
    kv, q = _case(world, [100, 7, 1, 33], 8)
    out, lse, sel, count = _single(kv, q, 4, mode)
    out2, lse2, sel2, count2 = cp.simulate(NumpyBackend(), q, kv, 4, world, mode)
    np.testing.assert_array_equal(sel2, sel)
    np.testing.assert_array_equal(count2, count)
    np.testing.assert_allclose(out2, out, rtol=0, atol=1e-6)
    np.testing.assert_allclose(lse2, lse, rtol=0, atol=1e-5)


def test_shards_cover_every_page_once():
    pages = np.array([1, 5, 16, 17])
    shards = [cp.shard_bounds(pages, 3, r) for r in range(3)]
    assert (shards[0].lo == 0).all() and (shards[-1].hi == pages).all()
    for a, b in zip(shards, shards[1:]):
        assert (a.hi == b.lo).all()


def test_merge_ignores_empty_partials():
    out = np.stack([np.ones((1, 2, 4)), np.zeros((1, 2, 4))]).astype(np.float32)
    lse = np.array([[[0.5, 1.0]], [[-np.inf, -np.inf]]], dtype=np.float32)
    merged, mlse = cp.merge(out, lse)
    np.testing.assert_array_equal(merged, np.ones((1, 2, 4)))
    np.testing.assert_array_equal(mlse, lse[0])


def test_cheap_variant_misses_are_counted():
    kv, q = _case(5, [200, 64], 8, kv_heads=2, q_heads=2)
    backend = NumpyBackend()
    _, _, sel, count = _single(kv, q, 8, "per-head")
    shards = [cp.shard_bounds(kv.pages(), 4, r) for r in range(4)]
    scores = []
    for s in shards:
        part = cp.local_kv(kv, s)
        scores.append((backend.estimate(q, part), part.kv_indptr))
    kept = cp.local_only(scores, shards, kv.pages(), 8)
    rate = cp.miss_rate(sel, count, kept)
    assert 0.0 <= rate < 1.0
    assert cp.miss_rate(sel, count, [[set(range(p)) for p in kv.pages()]] * 2) == 0.0


@pytest.mark.parametrize("mode", ref.MODES)
def test_held_work_splits_the_single_device_reads(mode):
    """Ranks' summary pages and selected tokens add up to one device's; one device's tokens are
    the valid tokens of the union of each KV head's picks."""
    kv, q = _case(4, [100, 7, 1, 33], 8, kv_heads=2, q_heads=4)
    _, _, sel, count = _single(kv, q, 4, mode)
    whole = cp.held_work(kv, cp.shard_bounds(kv.pages(), 1, 0), sel, count, 2)
    parts = [cp.held_work(kv, cp.shard_bounds(kv.pages(), 3, r), sel, count, 2) for r in range(3)]
    assert tuple(map(sum, zip(*parts))) == whole
    assert whole[0] == sum(kv.pages()) * 2
    group, want = sel.shape[0] // 2, 0
    for b, pages in enumerate(kv.pages()):
        for h in range(2):
            for p in set(sel[h * group:(h + 1) * group, b, :count[b]].ravel().tolist()):
                want += kv.last_page_len[b] if p == pages - 1 else kv.page_size
    assert whole[1] == want


class Strict(np.ndarray):
    """An array whose values the host may not read: bool(), int(), float(), item(), tolist(),
    a scalar out of indexing, or a boolean mask (its result's size is a device value) raise.
    The step's glue between stages runs on these, as it must on a GPU without synchronising."""

    def _read(self, *args, **kwargs):
        raise AssertionError("the step read a device value on the host")

    __bool__ = __int__ = __float__ = __index__ = item = tolist = _read

    def __getitem__(self, key):
        _no_mask(key)
        got = super().__getitem__(key)
        if not isinstance(got, np.ndarray):
            self._read()
        return got

    def __setitem__(self, key, value):
        _no_mask(key)
        super().__setitem__(key, value)

    def __array_function__(self, func, types, args, kwargs):
        return _strict(func._implementation(*_plain(args), **_plain(kwargs)))


def _no_mask(key):
    for k in key if isinstance(key, tuple) else (key,):
        if isinstance(k, np.ndarray) and k.dtype == bool:
            raise AssertionError("boolean mask: its size is a device value")


def _plain(x):
    if isinstance(x, np.ndarray):
        return x.view(np.ndarray)
    if isinstance(x, (tuple, list)):
        return type(x)(_plain(v) for v in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _strict(x):
    if isinstance(x, np.ndarray):
        return x.view(Strict)
    return tuple(_strict(v) for v in x) if isinstance(x, tuple) else x


class StrictBackend(NumpyBackend):
    """NumpyBackend whose stage outputs (and asarray) are Strict arrays."""

    def asarray(self, host_array):
        return _strict(np.asarray(host_array))

    def estimate(self, q, kv, mode="per-head"):
        return _strict(super().estimate(_plain(q), kv, mode))

    def topk(self, scores, kv, k_pages, sinks=0, window=0):
        return _strict(super().topk(_plain(scores), kv, k_pages, sinks, window))

    def attention(self, q, kv, sel=None, count=None):
        return _strict(super().attention(_plain(q), kv, _plain(sel), _plain(count)))


class ThreadWorld:
    """A fake world in one process: rank r's step runs in thread r; all_gather stacks."""

    def __init__(self, world, wrap=lambda a: a):
        self.world, self.wrap, self.slots = world, wrap, [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def comm(self, rank):
        world = self

        class Comm:
            def __init__(self):
                self.world, self.rank = world.world, rank

            def send(self, shape, dtype):
                return world.wrap(np.empty(shape, dtype))

            def all_gather(self, x):
                world.slots[rank] = np.array(_plain(x))
                world.barrier.wait()
                out = np.stack(world.slots)
                world.barrier.wait()
                return world.wrap(out)
        return Comm()

    def run(self, step):
        with ThreadPoolExecutor(self.world) as pool:
            return [f.result() for f in [pool.submit(step, r) for r in range(self.world)]]


def _ranks(backend, kv, q, world, k_pages, mode, step, wrap=lambda a: a):
    """Every rank's result of `step` (cp.exact_step or cp.cheap_step) in a ThreadWorld."""
    heads = q.shape[1] if mode == "per-head" else kv.kv_heads
    fake = ThreadWorld(world, wrap)

    def rank(r):
        shard = cp.shard_bounds(kv.pages(), world, r)
        host = cp.local_kv(kv, shard)
        plan = cp.make_plan(backend, kv, host, shard, heads, k_pages, mode)
        return step(backend, fake.comm(r), backend.asarray(q), backend.put(host), plan)
    return fake.run(rank)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("mode", ref.MODES)
def test_exact_step_on_a_fake_world_equals_single_device(world, mode):
    kv, q = _case(10 + world, [100, 7, 1, 33], 8)
    out, lse, sel, count = _single(kv, q, 4, mode)
    for out2, lse2, sel2, count2 in _ranks(NumpyBackend(), kv, q, world, 4, mode, cp.exact_step):
        np.testing.assert_array_equal(sel2, sel)
        np.testing.assert_array_equal(count2, count)
        np.testing.assert_allclose(out2, out, rtol=0, atol=1e-6)
        np.testing.assert_allclose(lse2, lse, rtol=0, atol=1e-5)


def test_exact_step_on_a_world_of_one():
    kv, q = _case(21, [64, 9], 8)
    out, lse, sel, _ = _single(kv, q, 3, "per-head")
    shard = cp.shard_bounds(kv.pages(), 1, 0)
    plan = cp.make_plan(NumpyBackend(), kv, cp.local_kv(kv, shard), shard, 4, 3, "per-head")
    out2, lse2, sel2, _ = cp.exact_step(NumpyBackend(), cp.LocalComm(), q, kv, plan)
    np.testing.assert_array_equal(sel2, sel)
    np.testing.assert_allclose(out2, out, rtol=0, atol=1e-6)


@pytest.mark.parametrize("step", [cp.exact_step, cp.cheap_step])
def test_step_reads_no_device_value_on_the_host(step):
    """The glue between stages only launches array operations: it runs on Strict arrays."""
    kv, q = _case(7, [100, 40], 8)
    for got in _ranks(StrictBackend(), kv, q, 2, 4, "per-head", step, _strict):
        assert isinstance(got[0], Strict)
    with pytest.raises(AssertionError, match="device value"):
        bool(_strict(np.ones(1)) > 0)


def test_cheap_step_attends_each_ranks_own_pages():
    """Cheap variant on 2 ranks: the merge of each rank's K/2 local picks, which on one rank is
    the single-device step."""
    kv, q = _case(8, [120, 50], 8)
    out, lse, _, _ = _single(kv, q, 6, "per-head")
    (out1, lse1), = _ranks(NumpyBackend(), kv, q, 1, 6, "per-head", cp.cheap_step)
    np.testing.assert_allclose(out1, out, rtol=0, atol=1e-6)
    backend, parts = NumpyBackend(), []
    for r in range(2):
        local = cp.local_kv(kv, cp.shard_bounds(kv.pages(), 2, r))
        parts.append(_single(local, q, 3, "per-head")[:2])
    want = cp.merge(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
    for got in _ranks(backend, kv, q, 2, 6, "per-head", cp.cheap_step):
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-6)


def _config(length=300, batch=2, budget=80):
    shape = ModelShape("tiny", 2, q_heads=4, kv_heads=2, head_dim=64, dtype="fp32")
    return Config(shape, length, batch, 16, budget, seed=3)


def test_rank_layers_are_the_workloads_layers():
    """Layer l built for the ranks is layer l of the single-GPU Workload (same seed)."""
    from questprof.workload import parallel_step as ps
    from questprof.workload.pools import Workload

    cfg, backend = _config(), NumpyBackend()
    work = Workload(cfg, backend, 2)
    rng = np.random.default_rng(cfg.seed)
    tables = ps.global_tables(cfg, rng)
    tile = layout.to_storage(rng.standard_normal(layout.TILE, dtype=np.float32), "fp32")
    got = ps.global_layer(cfg, backend, tables, tile, 1)
    for name in ("k", "v", "summary", "kv_indptr", "kv_indices", "last_page_len"):
        np.testing.assert_array_equal(getattr(got, name), getattr(work.kvs[1], name))


def test_gloo_ranks_equal_single_device():
    torch = pytest.importorskip("torch", reason="torch (CPU) is installed by .ci/run")
    assert torch.distributed.is_available()
    from questprof.commands import context_parallel as distributed

    cfg = _config()
    timing = {"warmup": 0, "repeats": 1, "graph": False}
    ranks, = distributed.launch(2, [cfg], "gloo", timing=timing, layers=2)
    check = ranks[0]["single"][1]
    assert check["exact_same_pages"] and check["exact_rel_err"] < 1e-6
    for r in ranks:
        np.testing.assert_array_equal(r["host"]["sel"], ranks[0]["host"]["sel"])
        np.testing.assert_allclose(r["host"]["out"], ranks[0]["host"]["out"], rtol=0, atol=0)
    rows = distributed.phase_rows("tiny", cfg, 2, ranks, "numpy+gloo")
    from questprof.workload.parallel_step import PHASES
    assert [r["phase"] for r in rows] == [*PHASES, distributed.SINGLE]
    assert all(r["stage"] == "context-parallel" and r["median_ms"] > 0 for r in rows)
    host = rows[0]
    assert host["single_read_bytes"] / 2 <= host["gpu_read_bytes_max"] < host["single_read_bytes"]
    assert 0 <= host["cheap_variant_miss_rate"] < 1


@pytest.mark.gpu
def test_nccl_ranks_equal_single_gpu():
    """Two GPUs over NCCL: the exact step, captured as one CUDA graph per rank with its
    all-gathers, picks exactly the single-GPU pages and matches its output (fp16)."""
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs for NCCL ranks")
    from questprof.commands import context_parallel as distributed

    shape = ModelShape("nccl", 2, q_heads=32, kv_heads=8, head_dim=128, dtype="fp16")
    cfg = Config(shape, 20000, 2, 16, 1024, seed=5)
    ranks, = distributed.launch(2, [cfg], "nccl", timing={"warmup": 1, "repeats": 3,
                                                          "graph": True}, layers=2)
    check = ranks[0]["single"][1]
    assert check["exact_same_pages"] and check["exact_rel_err"] < 1e-3, check
    np.testing.assert_array_equal(ranks[1]["host"]["out"], ranks[0]["host"]["out"])
    for r in ranks:
        assert r["times"]["exact_step"]["method"] == "cuda-graph"


def test_report_says_from_which_length_two_gpus_beat_one():
    import pandas as pd

    from questprof.report import parallel

    times = {8192: (0.05, 0.04), 32768: (0.06, 0.08), 131072: (0.09, 0.2)}  # (step, one GPU)
    rows = [{"stage": "context-parallel", "gpus": 2, "length": n, "batch": 1, "page_size": 16,
             "budget": 4096, "phase": phase, "median_ms": ms, "cheap_variant_miss_rate": 0.02,
             "gpu_read_bytes_max": 5.0, "single_read_bytes": 10.0}
            for n, (step, one) in times.items()
            for phase, ms in (("exact_step", step), ("single_gpu_step", one),
                              ("gather_candidates", 0.01))]
    v = parallel.verdict(pd.DataFrame(rows))
    assert list(v["beats"]) == [False, True, True]
    np.testing.assert_allclose(v["goal_ms"], [1.5 * (one / 2 + 0.01) for _, one in
                                              times.values()])
    assert parallel.beats_from(v) == ["2 GPUs beat one with the exact step from 32k tokens: "
                                      "batch 1, page size 16, budget 4k."]
    html = parallel.section(pd.DataFrame(rows))
    assert 'id="cp-verdict"' in html and 'id="cp-table"' in html
