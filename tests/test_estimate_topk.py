"""estimate_topk (estimate and top-K as one kernel): the same scores as the estimate kernel, bit
for bit, and exactly the reference's selection of those scores."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_case, poison
from questprof.core import reference
from questprof.core.layout import PagedKV, random_queries, to_storage
from questprof.core.stages import MODES

pytestmark = pytest.mark.gpu


def _check(gpu, kv, q, k_pages, mode="per-head", sinks=0, window=0, launches=2):
    from questprof.backends import cupy as ops

    dev_kv, dev_q = gpu.put(kv), gpu.asarray(q)
    want_scores = gpu.to_host(ops.estimate(dev_q, dev_kv, mode))
    want_sel, want_count = reference.topk(want_scores, kv.kv_indptr, k_pages, sinks, window)
    for _ in range(launches):  # the second launch needs the row counts the first left at zero
        poison()
        scores, sel, count = (gpu.to_host(x) for x in ops.estimate_topk(
            dev_q, dev_kv, k_pages, mode, sinks, window))
        np.testing.assert_array_equal(scores, want_scores)
        np.testing.assert_array_equal(sel, want_sel)
        np.testing.assert_array_equal(count, want_count)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (16, 2), (32, 4)])
def test_modes_and_groups(gpu, rng, mode, q_heads, kv_heads):
    """G 1, 4, 8 q heads per KV head: per-head mode selects G rows per finished KV head."""
    kv = make_case(rng, [16 * 300 + 5, 1, 16 * 40, 17], 16, kv_heads, 128, "fp16", spare_pages=5)
    _check(gpu, kv, random_queries(rng, 4, q_heads, 128, "fp16"), 24, mode)


@pytest.mark.parametrize("dtype,d,s", [("fp16", 128, 16), ("bf16", 64, 8), ("fp16", 64, 64)])
@pytest.mark.parametrize("k_pages", [1, 5, 64])
def test_tails_and_rows_shorter_than_a_tile(gpu, rng, dtype, d, s, k_pages):
    """One-token request, tails 1, S-1, S, S+1; rows shorter than a tile (32 units at d 128,
    64 at d 64) share tiles, so one tile finishes several rows."""
    lengths = [1, s - 1, s, s + 1, 37 * s + 3, 300 * s + 5]
    kv = make_case(rng, lengths, s, 4, d, dtype, spare_pages=5)
    _check(gpu, kv, random_queries(rng, len(lengths), 4, d, dtype), k_pages)


def test_many_short_requests(gpu, rng):
    """300 requests of 1-3 pages: one tile holds the units of many rows."""
    lengths = list(rng.integers(1, 48, size=300))
    kv = make_case(rng, lengths, 16, 2, 128, "fp16", spare_pages=3)
    _check(gpu, kv, random_queries(rng, len(lengths), 2, 128, "fp16"), 2, "shared-max")


@pytest.mark.parametrize("pages,k_pages", [(2048, 128), (8193, 256)])
def test_long_rows_keys_in_shared_memory_or_not(gpu, rng, pages, k_pages):
    """2048 pages keep their keys in shared memory; 8193 (over FUSED_KEYS_LIMIT) re-read them."""
    kv = make_case(rng, [16 * pages - 3, 16 * 50], 16, 2, 128, "fp16")
    _check(gpu, kv, random_queries(rng, 2, 2, 128, "fp16"), k_pages)


@pytest.mark.parametrize("sinks,window", [(1, 0), (2, 3)])
def test_sinks_and_window(gpu, rng, sinks, window):
    kv = make_case(rng, [16 * 200 + 7, 16 * 9, 5], 16, 2, 128, "bf16")
    _check(gpu, kv, random_queries(rng, 3, 4, 128, "bf16"), 16, "shared-mean", sinks, window)


def test_integer_scores_tie_to_lower_positions(gpu, rng):
    """Summaries and q of small integers: scores are exact integers with many ties."""
    kv = make_case(rng, [16 * 700 + 9, 16 * 64], 16, 2, 64, "fp16")
    kv.summary[...] = to_storage(rng.integers(-2, 3, size=kv.summary.shape).astype(np.float64),
                                 "fp16")
    q = to_storage(rng.integers(-1, 2, size=(2, 2, 64)).astype(np.float64), "fp16")
    _check(gpu, kv, q, 40)


@pytest.mark.parametrize("blocks", [1, 3, 7])
def test_blocks_with_many_tiles_and_rows(gpu, rng, monkeypatch, blocks):
    """A grid of a few blocks (the launcher sizes it from the SMs): each block scores a run of
    many tiles, all its threads count, and several rows finish in one pass."""
    from questprof.backends import cupy as ops

    monkeypatch.setattr(ops, "_estimate_grid", lambda kv, nnz, g: blocks)
    lengths = [16 * 90 + 5, 3, 16 * 7, 16 * 33 + 1] + list(rng.integers(1, 40, size=40))
    kv = make_case(rng, lengths, 16, 4, 64, "fp16", spare_pages=5)
    _check(gpu, kv, random_queries(rng, len(lengths), 8, 64, "fp16"), 6)


def test_a_request_without_pages_gets_an_empty_selection(gpu, rng):
    """A context-parallel shard can hold no page of a request: count 0 and -1s, as topk."""
    kv = make_case(rng, [16 * 40 + 3, 16 * 9], 16, 2, 128, "fp16")
    empty = PagedKV(kv.k, kv.v, kv.summary, np.array([0, 41, 41, 50], dtype=np.int32),
                    kv.kv_indices, np.array([3, 16, 16], dtype=np.int32), (16 * 40 + 3, 0, 16 * 9),
                    16, "fp16")
    _check(gpu, empty, random_queries(rng, 3, 2, 128, "fp16"), 4)
