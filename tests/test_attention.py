"""Paged decode attention (dense and over a selection) against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TOL, make_case, poison, rel_err
from questprof.core import reference
from questprof.core.layout import from_storage, random_queries

pytestmark = pytest.mark.gpu


def _reference(kv, q, sel=None, count=None):
    f = lambda x: from_storage(x, kv.dtype)  # noqa: E731
    return reference.attention(f(q), f(kv.k), f(kv.v), kv.kv_indptr, kv.kv_indices,
                               kv.last_page_len, sel, count)


def _run(gpu, kv, q, sel=None, count=None):
    poison()
    dev_sel = None if sel is None else gpu.asarray(sel)
    dev_count = None if count is None else gpu.asarray(count)
    out, lse = gpu.attention(gpu.asarray(q), gpu.put(kv), dev_sel, dev_count)
    return from_storage(gpu.to_host(out), kv.dtype), gpu.to_host(lse)


def _check(gpu, kv, q, sel=None, count=None):
    out, lse = _run(gpu, kv, q, sel, count)
    ref_out, ref_lse = _reference(kv, q, sel, count)
    assert rel_err(out, ref_out) < TOL[kv.dtype]
    assert rel_err(lse, ref_lse) < 1e-5
    return out


def _case(rng, lengths, s, q_heads, kv_heads, d, dtype, **kwargs):
    kv = make_case(rng, lengths, s, kv_heads, d, dtype, spare_pages=7, **kwargs)
    return kv, random_queries(rng, len(lengths), q_heads, d, dtype)


@pytest.mark.parametrize("dtype,d,s", [("fp16", 128, 16), ("bf16", 128, 8), ("fp16", 64, 32),
                                       ("bf16", 64, 64), ("fp16", 128, 64), ("fp16", 64, 8)])
def test_dense_tails_ragged(gpu, rng, dtype, d, s):
    lengths = [1, s - 1, s, s + 1, 37 * s + 3]  # one-token request, every tail case, splits
    _check(gpu, *_case(rng, lengths, s, 4, 4, d, dtype))


@pytest.mark.parametrize("fill", [np.nan, 6e4, -np.inf])
def test_unused_tail_slots_change_nothing(gpu, rng, fill):
    lengths = [3, 16 * 40 + 5, 17]
    kv, q = _case(rng, lengths, 16, 4, 2, 128, "fp16", tail_fill=fill)
    out = _check(gpu, kv, q)
    indptr, indices = np.asarray(kv.kv_indptr), np.asarray(kv.kv_indices)
    for b, n in enumerate(np.asarray(kv.last_page_len)):  # ordinary values in the same slots
        tail = indices[indptr[b + 1] - 1]
        kv.k[tail, :, n:] = rng.standard_normal(kv.k[tail, :, n:].shape)
        kv.v[tail, :, n:] = rng.standard_normal(kv.v[tail, :, n:].shape)
    np.testing.assert_array_equal(_run(gpu, kv, q)[0], out)


@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (8, 4), (16, 2)])
def test_dense_gqa(gpu, rng, q_heads, kv_heads):
    _check(gpu, *_case(rng, [16 * 300 + 1, 5, 16 * 64], 16, q_heads, kv_heads, 128, "bf16"))


def _selection(rng, kv, heads, k_pages):
    scores = rng.standard_normal((heads, len(np.asarray(kv.kv_indices))), dtype=np.float32)
    return reference.topk(scores, kv.kv_indptr, k_pages)


@pytest.mark.parametrize("mode_heads", ["q", "kv"])
@pytest.mark.parametrize("dtype,q_heads,kv_heads", [("fp16", 8, 2), ("bf16", 4, 4),
                                                    ("fp16", 16, 4)])
def test_sparse_modes(gpu, rng, mode_heads, dtype, q_heads, kv_heads):
    kv, q = _case(rng, [16 * 500 + 9, 16 * 3, 1, 16 * 90], 16, q_heads, kv_heads, 128, dtype)
    sel, count = _selection(rng, kv, q_heads if mode_heads == "q" else kv_heads, 64)
    _check(gpu, kv, q, sel, count)


@pytest.mark.parametrize("mode_heads", ["q", "kv"])
def test_budget_covering_all_pages_equals_dense(gpu, rng, mode_heads):
    kv, q = _case(rng, [16 * 50 + 3, 16, 1], 16, 8, 2, 128, "fp16")
    sel, count = _selection(rng, kv, 8 if mode_heads == "q" else 2, 64)
    sparse, _ = _run(gpu, kv, q, sel, count)
    dense, _ = _run(gpu, kv, q)
    assert rel_err(sparse, dense) < 1e-3


def test_page_order_and_batch_invariance(gpu, rng):
    """A request's output does not depend on where its pages live or who shares the batch."""
    kv, q = _case(rng, [16 * 70 + 2, 300], 16, 4, 4, 128, "fp16")
    both, _ = _run(gpu, kv, q)
    ids = np.asarray(kv.kv_indices).copy()
    alone = type(kv)(kv.k, kv.v, kv.summary, np.array([0, 71], np.int32), ids[:71],
                     kv.last_page_len[:1], kv.lengths[:1], 16, "fp16")
    np.testing.assert_allclose(_run(gpu, alone, q[:1])[0], both[:1], rtol=2e-3, atol=2e-3)


def test_many_rows_long_splits(gpu, rng):
    """256 CTA rows with >1024 pages: the launcher caps a split at 512 staged pages."""
    lengths = [8 * 1040 + 3, 5, 8 * 1100, 8 * 600]
    _check(gpu, *_case(rng, lengths, 8, 64, 64, 64, "fp16"))

