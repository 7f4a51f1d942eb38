"""The NumPy backend's float32 path (what a sweep times on a CPU) against the float64 reference:
summaries exact, scores and outputs within the tolerance table, top-K the same pages."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TOL, full_plan, rel_err
from questprof.backends import get_backend, timing_backend
from questprof.backends.numpy import NumpyBackend
from questprof.backends.numpy_fp32 import NumpyFp32Backend
from questprof.core import reference
from questprof.core.layout import (append_plan, from_storage, kv_values, page_tables,
                                   random_paged_kv, random_queries, summary_values)

FAST = NumpyFp32Backend()


def _case(rng, lengths, s, q_heads, kv_heads, d, dtype, spare=5, **kwargs):
    """(host cache with the reference's summaries, the same put on the fast backend, q)."""
    kv = random_paged_kv(rng, lengths, s, kv_heads, d, dtype, spare_pages=spare, **kwargs)
    fast = FAST.put(kv.with_arrays(np.copy))
    FAST.summary(fast, full_plan(fast))
    NumpyBackend().summary(kv, full_plan(kv))
    return kv, fast, random_queries(rng, len(lengths), q_heads, d, dtype)


def _ref_attention(kv, q, sel=None, count=None):
    f = lambda x: from_storage(x, kv.dtype)  # noqa: E731
    return reference.attention(f(q), f(kv.k), f(kv.v), kv.kv_indptr, kv.kv_indices,
                               kv.last_page_len, sel, count)


def _gap(scores, indptr, k_pages) -> float:
    """Smallest gap between the K-th and (K+1)-th best score of any (head, request)."""
    gaps = [np.inf]
    for b in range(len(indptr) - 1):
        u = np.sort(scores[:, indptr[b]:indptr[b + 1] - 1], axis=1)[:, ::-1]  # tail always kept
        k = k_pages - 1
        if 0 < k < u.shape[1]:
            gaps.append(float(np.min(u[:, k - 1] - u[:, k])))
    return min(gaps)


def _check_scores_and_selection(want, got, kv, fast, k_pages: int = 6):
    """Scores within fp32 of the reference's and, with no near-tie (the boundary gap is 4x the
    largest score error), the reference's pages exactly: (sel, count) of the fast path."""
    assert got.dtype == np.float32 and rel_err(got, want) < TOL["fp32"]
    assert _gap(want, kv.kv_indptr, k_pages) > 4 * np.abs(got - want).max()
    sel, count = FAST.topk(got, fast, k_pages)
    want_sel, want_count = reference.topk(want, kv.kv_indptr, k_pages)
    np.testing.assert_array_equal(sel, want_sel)
    np.testing.assert_array_equal(count, want_count)
    return sel, count


CASES = [  # (dtype, page size, q heads, kv heads, d): tails 1, S-1, S, S+1 in every case
    ("fp32", 16, 4, 4, 64), ("fp16", 8, 8, 2, 128), ("bf16", 16, 8, 4, 64),
    ("fp16", 1, 4, 1, 32), ("fp32", 32, 16, 2, 128),
]


@pytest.mark.parametrize("dtype,s,q_heads,kv_heads,d", CASES)
@pytest.mark.parametrize("mode", ["per-head", "shared-max", "shared-mean"])
def test_stages_agree_with_reference(rng, dtype, s, q_heads, kv_heads, d, mode):
    lengths = [1, max(s - 1, 1), s, s + 1, 23 * s + 3]
    kv, fast, q = _case(rng, lengths, s, q_heads, kv_heads, d, dtype, tail_fill=np.nan)
    np.testing.assert_array_equal(fast.summary, kv.summary)  # min and max are exact
    f = lambda x: from_storage(x, dtype)  # noqa: E731
    want = reference.estimate(f(q), f(kv.summary), kv.kv_indptr, kv.kv_indices, mode)
    k_pages = 6
    sel, count = _check_scores_and_selection(want, FAST.estimate(q, fast, mode), kv, fast, k_pages)
    for args in ((), (sel, count)):
        out, lse = FAST.attention(q, fast, *args)
        ref_out, ref_lse = _ref_attention(kv, q, *args)
        assert out.dtype == kv.k.dtype and lse.dtype == np.float32
        assert rel_err(f(out), ref_out) < TOL[dtype] and rel_err(lse, ref_lse) < TOL["fp32"]
    np.testing.assert_array_equal(FAST.quest(q, fast, k_pages, mode)[0],
                                  FAST.attention(q, fast, sel, count)[0])


FP8_CASES = [  # (queries, summaries, scales, page size, q heads, kv heads, d)
    ("fp16", "fp8_e4m3", "tensor", 16, 8, 2, 64), ("bf16", "fp16", "head", 8, 4, 4, 128),
    ("fp16", "fp16", "tensor", 32, 16, 2, 64), ("bf16", "fp8_e4m3", "head", 16, 6, 3, 32),
]


@pytest.mark.parametrize("dtype,summary,scale,s,q_heads,kv_heads,d", FP8_CASES)
def test_fp8_stages_agree_with_reference(rng, dtype, summary, scale, s, q_heads, kv_heads, d):
    """An FP8 (e4m3) cache on the fp32 path: summaries equal the reference's (the codes' own
    min and max, or fp16 rounded outward), scores and outputs within the tolerance table."""
    lengths = [1, max(s - 1, 1), s, s + 1, 23 * s + 3]
    kv, fast, q = _case(rng, lengths, s, q_heads, kv_heads, d, dtype, tail_fill=np.nan,
                        kv_dtype="fp8_e4m3", summary_dtype=summary, kv_scale=scale)
    assert fast.is_fp8 and fast.summary.dtype == kv.summary.dtype
    np.testing.assert_array_equal(fast.summary, kv.summary)
    qf = from_storage(q, dtype)
    want = reference.estimate(qf, summary_values(kv), kv.kv_indptr, kv.kv_indices)
    sel, count = _check_scores_and_selection(want, FAST.estimate(q, fast), kv, fast)
    k, v = kv_values(kv, "k")[...], kv_values(kv, "v")[...]
    for args in ((), (sel, count)):
        out, lse = FAST.attention(q, fast, *args)
        ref_out, ref_lse = reference.attention(qf, k, v, kv.kv_indptr, kv.kv_indices,
                                               kv.last_page_len, *args)
        assert rel_err(from_storage(out, dtype), ref_out) < TOL[dtype]
        assert rel_err(lse, ref_lse) < TOL["fp32"]


@pytest.mark.parametrize("summary", ["fp8_e4m3", "fp16"])
def test_fp8_append_then_summary_equals_reference(rng, summary):
    """A token written into the tail page (first > 0): its summary merges with the stored one
    as the reference merges exact values."""
    s, lengths = 16, [16 * 5 - 2, 16 * 3 - 1]
    kv, fast, q = _case(rng, lengths, s, 4, 2, 64, "fp16", spare=0, kv_dtype="fp8_e4m3",
                        summary_dtype=summary, kv_scale="head")
    FAST.attention(q, fast)  # the working copies are read now, before the write
    plan = append_plan(kv.kv_indptr, kv.kv_indices, kv.last_page_len + 1, [1, 1], s)
    new = rng.integers(0, 0x7F, size=(2, 2, 2, 64)).astype(np.uint8)  # finite codes
    for cache in (kv, fast):
        cache.last_page_len += 1
        for b, (page, slot) in enumerate(zip(plan.page_ids, plan.first)):
            cache.k[page, :, slot], cache.v[page, :, slot] = new[0, b], new[1, b]
    NumpyBackend().summary(kv, plan)
    FAST.summary(fast, plan)
    np.testing.assert_array_equal(fast.summary, kv.summary)
    out, _ = FAST.attention(q, fast)
    ref_out, _ = reference.attention(from_storage(q, "fp16"), kv_values(kv, "k")[...],
                                     kv_values(kv, "v")[...], kv.kv_indptr, kv.kv_indices,
                                     kv.last_page_len)
    assert rel_err(from_storage(out, "fp16"), ref_out) < TOL["fp16"]


@pytest.mark.parametrize("sinks,window", [(0, 0), (1, 0), (2, 3), (0, 7)])
def test_topk_equals_reference_on_ties(rng, sinks, window):
    lengths = [16 * 40, 16 * 9 - 3, 5, 16 * 300 + 1]
    nnz = sum(-(-n // 16) for n in lengths)
    indptr = page_tables(lengths, 16, nnz)[0]
    scores = rng.integers(-3, 3, size=(3, nnz)).astype(np.float32)  # many ties
    scores[0, :20] = -0.0
    for k_pages in (8, 16, 64):
        got = FAST.topk(scores, _Tables(indptr), k_pages, sinks, window)
        want = reference.topk(scores, indptr, k_pages, sinks, window)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


class _Tables:
    """Top-K reads only the page table."""

    def __init__(self, indptr):
        self.kv_indptr = indptr


def test_sparse_counts_per_head_and_empty_heads(rng):
    kv, fast, q = _case(rng, [16 * 20 + 3, 7], 16, 8, 2, 64, "fp16")
    sel = np.full((8, 2, 5), -1, dtype=np.int32)
    count = np.array([[5, 1], [0, 1], [3, 0], [1, 1], [5, 1], [2, 1], [4, 0], [0, 0]],
                     dtype=np.int32)
    for h in range(8):
        for b, pages in enumerate((21, 1)):
            sel[h, b, :count[h, b]] = np.sort(rng.choice(pages, count[h, b], replace=False))
    out, lse = FAST.attention(q, fast, sel, count)
    ref_out, ref_lse = _ref_attention(kv, q, sel, count)
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse)) and np.isinf(lse).sum() == 5
    assert rel_err(from_storage(out, "fp16"), ref_out) < TOL["fp16"]
    ok = np.isfinite(ref_lse)
    assert rel_err(lse[ok], ref_lse[ok]) < TOL["fp32"]


def test_append_then_summary_keeps_the_copies_current(rng):
    """Write a decoded token into storage, run `summary` on its plan: the next stages see it."""
    s, lengths = 16, [16 * 5 - 2, 16 * 3 - 1]
    kv, fast, q = _case(rng, lengths, s, 4, 4, 64, "bf16", spare=0)
    FAST.attention(q, fast)  # the working copies are read now, before the write
    plan = append_plan(kv.kv_indptr, kv.kv_indices, kv.last_page_len + 1, [1, 1], s)
    new_k, new_v = (rng.standard_normal((2, 4, 64)).astype(np.float32) for _ in range(2))
    for cache in (kv, fast):
        cache.last_page_len += 1
        for b, (page, slot) in enumerate(zip(plan.page_ids, plan.first)):
            cache.k[page, :, slot] = new_k[b].view(np.uint32) >> 16
            cache.v[page, :, slot] = new_v[b].view(np.uint32) >> 16
    NumpyBackend().summary(kv, plan)
    FAST.summary(fast, plan)
    np.testing.assert_array_equal(fast.summary, kv.summary)
    out, lse = FAST.attention(q, fast)
    ref_out, ref_lse = _ref_attention(kv, q)
    assert rel_err(from_storage(out, "bf16"), ref_out) < TOL["bf16"]
    assert rel_err(lse, ref_lse) < TOL["fp32"]
    tables = page_tables([lengths[0] + 40], s, kv.num_pages, rng)  # new pages: laid out anew
    for cache in (kv, fast):
        cache.kv_indptr, cache.kv_indices, cache.last_page_len = tables
        cache.lengths = (lengths[0] + 40,)
    NumpyBackend().summary(kv, full_plan(kv))
    FAST.summary(fast, full_plan(fast))
    np.testing.assert_array_equal(fast.summary, kv.summary)
    out, lse = FAST.attention(q[:1], fast)
    ref_out, ref_lse = _ref_attention(kv, q[:1])
    assert rel_err(from_storage(out, "bf16"), ref_out) < TOL["bf16"]
    assert rel_err(lse, ref_lse) < TOL["fp32"]


def test_a_cache_not_put_reads_storage_each_call(rng):
    kv, fast, q = _case(rng, [40, 9], 8, 4, 2, 32, "fp16")
    out, lse = FAST.attention(q, kv)  # the host cache itself, never put
    np.testing.assert_array_equal(out, FAST.attention(q, fast)[0])
    assert rel_err(FAST.estimate(q, kv), FAST.estimate(q, fast)) == 0


def test_output_does_not_depend_on_batch_neighbours(rng):
    kv, fast, q = _case(rng, [16 * 9 + 2, 16 * 30, 3], 16, 4, 2, 64, "fp16")
    solo = random_paged_kv(rng, [16 * 30], 16, 2, 64, "fp16", shuffle=False)
    indptr = np.asarray(kv.kv_indptr)
    pages = np.asarray(kv.kv_indices)[indptr[1]:indptr[2]]
    solo.k[:30], solo.v[:30] = kv.k[pages], kv.v[pages]
    solo = FAST.put(solo)
    FAST.summary(solo, full_plan(solo))
    together = FAST.quest(q, fast, 4, "per-head")[0][1]
    alone = FAST.quest(q[1:2], solo, 4, "per-head")[0][0]
    np.testing.assert_array_equal(together, alone)


def test_the_sweep_times_the_fp32_path():
    cpu = get_backend("numpy")
    timed = timing_backend(cpu)
    assert timed.name == "numpy-fp32" and not timed.is_gpu
    assert timed.host_copies("fp16") == 3 and timed.host_copies("fp32") == 2
    assert timed.host_copies("fp8_e4m3") == 5  # one byte a value, four of float32 copies
    assert cpu.name == "numpy"  # the float64 reference stays the NumPy backend itself


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "fp8_e4m3"])
def test_pools_tiled_read_from_the_tile_equal_a_cast_of_storage(dtype):
    """Workload's pools: copies read from the tile are the copies a cast (FP8: a decode) of
    storage gives."""
    from questprof.core.config import Config
    from questprof.core.scenarios import ShapeOptions, load_scenario
    from questprof.workload.pools import Workload

    shape = load_scenario("smoke", ShapeOptions(kv_dtype=dtype, kv_scale=(
        "head" if dtype == "fp8_e4m3" else None))).model
    work = Workload(Config(shape, 16 * 37 + 5, 3, 16, 64), FAST, 2)
    for kv in work.kvs:
        tiled = kv._fp32_copies.w
        cast = FAST.put(kv.with_arrays(np.copy))
        FAST.summary(cast, full_plan(cast))
        np.testing.assert_array_equal(tiled.k, cast._fp32_copies.w.k)
        np.testing.assert_array_equal(tiled.v, cast._fp32_copies.w.v)
        np.testing.assert_array_equal(tiled.box, cast._fp32_copies.w.box)
    ref = Workload(Config(shape, 16 * 37 + 5, 3, 16, 64), NumpyBackend(), 2)
    for kv, want in zip(work.kvs, ref.kvs):
        np.testing.assert_array_equal(kv.summary, want.summary)


def test_pools_in_lent_memory_equal_layout_tiled(rng):
    from questprof.core.layout import tiled
    from questprof.workload.pools import _tiled_into

    tile = rng.standard_normal(1000).astype(np.float16)
    for shape, offset in (((3, 2, 7, 5), 0), ((50, 2, 16, 8), 977), ((1, 1, 2, 4), 5120)):
        out = np.empty(np.prod(shape) + 9, np.float16)
        np.testing.assert_array_equal(_tiled_into(out, tile, offset, shape),
                                      tiled(np, tile, shape, offset))


def test_arena_lends_its_memory_only_when_nothing_made_from_it_lives():
    from questprof.backends.arena import Arena

    arena = Arena()
    a = arena.take(1000).view(np.float32).reshape(10, 25)
    b = arena.take(500)  # a lives: fresh memory
    assert not np.shares_memory(a, b) and arena.spare() == 0
    del a
    assert arena.spare() == 1000
    c = arena.take(800)
    assert np.shares_memory(c, arena.buf) and not np.shares_memory(c, arena.take(10))
    del c
    assert arena.spare() == 1000
    arena.take(2000)  # more than it holds: a larger buffer, free again once the view is gone
    assert arena.spare() == 2000


def test_workloads_one_after_another_reuse_memory_and_agree():
    """A sweep's pools, built in a row on one backend, share memory and still read right."""
    from questprof.core.config import Config
    from questprof.core.scenarios import load_scenario
    from questprof.workload.pools import Workload

    shape, backend = load_scenario("smoke").model, NumpyFp32Backend()
    outs = []
    for length in (16 * 40, 16 * 21 + 3, 16 * 40):
        work = Workload(Config(shape, length, 2, 16, 128), backend, 1)
        outs.append(work.launcher("dense")(0)[0])
        ref = Workload(Config(shape, length, 2, 16, 128), NumpyBackend(), 1)
        want = _ref_attention(ref.kvs[0], ref.q)[0]
        assert rel_err(from_storage(outs[-1], "fp16"), want) < TOL["fp16"]
        del work
    np.testing.assert_array_equal(outs[0], outs[2])
    assert backend.spare_bytes() > 0
