"""The HBM page cache's kernels (kernels/page_cache.cu) against the rule's reference
(core/page_cache.py) slot for slot, and attention over its slots against the float64 reference:
ragged batches (tails of 1, S-1, S, S+1 tokens and a one-token request), NaN in the unused tail
slots and in the cache's unfilled slots, fp16, bf16 and E4M3 caches in mapped host memory, both
shared modes' own selections, and a CUDA graph of the step replaying a trace."""

from __future__ import annotations

import numpy as np
import pytest

from questprof.core import reuse_trace
from questprof.core.layout import from_storage, kv_values, random_paged_kv, random_queries
from questprof.core.page_cache import SlotTable, step_tables

pytestmark = pytest.mark.gpu

S, KV_HEADS, Q_HEADS, D = 16, 2, 8, 128
LENGTHS = [1, S - 1, S, S + 1, 300, 1000]
TOL = {"fp16": 1e-3, "bf16": 1e-2, "fp8_e4m3": 1e-2}


def _host_pool(dtype: str, seed: int = 0):
    """(kv in HBM, the same kv with K and V in mapped host memory, q) of LENGTHS."""
    import cupy

    from questprof.backends.host_tier import host_tier

    rng = np.random.default_rng(seed)
    fp8 = dtype == "fp8_e4m3"  # a bf16 model over an E4M3 cache (the host tier moves its codes)
    kv = random_paged_kv(rng, LENGTHS, S, KV_HEADS, D, "bf16" if fp8 else dtype,
                         spare_pages=5, tail_fill=np.nan, kv_dtype=dtype if fp8 else None)
    kv = kv.with_arrays(cupy.asarray)
    q = cupy.asarray(random_queries(rng, len(LENGTHS), Q_HEADS, D, kv.dtype))
    return kv, host_tier(kv), q


def _cache(host, trace, capacity):
    import cupy

    from questprof.backends.page_cache_cupy import CupyPageCache

    return CupyPageCache(host, cupy.asarray(trace.sel), cupy.asarray(trace.count), capacity)


@pytest.mark.parametrize("capacity, k_pages", [(8, 8), (11, 8), (40, 24), (300, 260)])
def test_the_step_kernel_keeps_the_reference_tables(gpu, capacity, k_pages):
    """C a power of two and not (the sort's padding), over a trace that wraps around once; K
    260 runs the ballot scan in two chunks of the CTA's 256 threads, the second of padding only
    (the longest request has 63 pages, and C 300 holds every page: no eviction there)."""
    import cupy

    kv, host, _ = _host_pool("fp16")
    trace = reuse_trace.synthetic(LENGTHS, S, k_pages, KV_HEADS, 10, 0.6, seed=4)
    cache = _cache(host, trace, capacity)
    pages = np.diff(cupy.asnumpy(kv.kv_indptr))
    tables = [[SlotTable(capacity) for _ in LENGTHS] for _ in range(KV_HEADS)]
    indptr, indices = cupy.asnumpy(kv.kv_indptr), cupy.asnumpy(kv.kv_indices)
    k_host = cupy.asnumpy(kv.k)
    for t in range(2 * trace.steps):  # wraps around once
        cache.step()
        want_sel, hits, misses, _ = step_tables(tables, trace.sel[t % trace.steps], pages)
        got = cache.host_tables()
        assert np.array_equal(got["slot_sel"], want_sel)
        assert np.array_equal(got["step_counts"][..., 0], hits)
        assert np.array_equal(got["step_counts"][..., 1], misses)
        k_slots = cupy.asnumpy(cache.k_slots)
        for h, b in np.ndindex(KV_HEADS, len(LENGTHS)):
            held = tables[h][b].page
            assert list(got["slot_page"][h, b]) == held
            for s, pos in enumerate(held):
                if pos >= 0:  # bit for bit the host page, NaN tail slots included
                    page = indices[indptr[b] + pos]
                    assert k_slots[b * capacity + s, h].tobytes() == k_host[page, h].tobytes()


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp8_e4m3"])
def test_attention_over_the_slots_matches_the_float64_reference(gpu, dtype):
    import cupy

    from questprof.backends import cupy as ops

    kv, host, q = _host_pool(dtype, seed=1)
    trace = reuse_trace.synthetic(LENGTHS, S, 6, KV_HEADS, 6, 0.5, seed=2)
    cache = _cache(host, trace, 9)
    for t in range(trace.steps):
        view, slot_sel, count = cache.step()
        out, _ = ops.attention(q, view, slot_sel, count)
        want = _reference(q, kv, trace.sel[t], cupy.asnumpy(count))
        got = from_storage(cupy.asnumpy(out), kv.dtype).astype(np.float64)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= TOL[dtype], (t, err)


def _reference(q, kv, sel, count):
    """The float64 reference's out [B, Hq, d] over the host pool's own pages (never NaN ones)."""
    import cupy

    from questprof.core import reference

    h = kv.with_arrays(cupy.asnumpy)
    out, _ = reference.attention(from_storage(cupy.asnumpy(q), kv.dtype), kv_values(h, "k"),
                                 kv_values(h, "v"), h.kv_indptr, h.kv_indices, h.last_page_len,
                                 sel, count)
    return out


@pytest.mark.parametrize("mode", ["shared-mean", "shared-max"])
def test_quest_selections_of_the_shared_modes_hit_after_the_first_step(gpu, mode):
    import cupy

    from questprof.backends import cupy as ops
    from questprof.backends.page_cache_cupy import CupyPageCache
    from questprof.core.layout import rebuild_plan

    kv, host, q = _host_pool("fp16", seed=3)
    indptr, indices = cupy.asnumpy(kv.kv_indptr), cupy.asnumpy(kv.kv_indices)
    valid = np.full(len(indices), S, dtype=np.int32)
    valid[indptr[1:] - 1] = cupy.asnumpy(kv.last_page_len)
    ops.summary(kv, rebuild_plan(indices, valid))
    sel, count = ops.topk(ops.estimate(q, kv, mode), kv, 4)
    cache = CupyPageCache(host, sel[None], count, 4)
    want, _ = ops.attention(q, kv, sel, count)
    for step in range(3):
        view, slot_sel, c = cache.step()
        got, _ = ops.attention(q, view, slot_sel, c)  # the same pages; splits may differ
        a, b = (from_storage(cupy.asnumpy(x), kv.dtype).astype(np.float64) for x in (got, want))
        assert np.linalg.norm(a - b) <= TOL["fp16"] * np.linalg.norm(b)
        counts = cache.host_tables()["step_counts"]
        chosen = (cupy.asnumpy(sel) >= 0).sum(axis=-1)
        assert np.array_equal(counts[..., 0 if step else 1], chosen)


def test_a_graph_of_the_step_replays_the_trace(gpu):
    import cupy

    from questprof.workload.replay import Mirror

    _, host, _ = _host_pool("bf16", seed=5)
    trace = reuse_trace.synthetic(LENGTHS, S, 8, KV_HEADS, 7, 0.7, seed=6)
    cache = _cache(host, trace, 16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        cache.step()
        graph = stream.end_capture()
        for _ in range(25):
            graph.launch()
    stream.synchronize()
    hits, misses, steps = cache.totals()
    assert steps == 25
    assert (hits, misses) == Mirror(trace, 16).advance(25)
