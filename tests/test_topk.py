"""Top-K kernel: exactly the reference's page set, fed the same float32 scores."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import poison
from questprof.core import reference
from questprof.core.layout import PagedKV, page_tables

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, params=["", "tk_keys=0", "tk_threads=256,tk_keys=16",
                                      "tk_threads=256,tk_keys=8"])
def form(request, monkeypatch):
    """Every test under the launch rule (keys in registers where a row fits), the shared-memory
    form forced, and the register forms of 256 x 16 and 256 x 8 keys (longer rows fall back to
    the shared-memory form inside the kernel)."""
    monkeypatch.setenv("QP_TUNE", request.param)
    return request.param


def _tables(gpu, lengths, page_size=16):
    """A PagedKV holding only page tables (top-K reads no keys)."""
    nnz = sum(-(-n // page_size) for n in lengths)
    indptr, indices, last = page_tables(lengths, page_size, nnz)
    arrays = {name: gpu.asarray(x) for name, x in
              (("kv_indptr", indptr), ("kv_indices", indices), ("last_page_len", last))}
    return PagedKV(None, None, None, lengths=tuple(lengths), page_size=page_size,
                   dtype="fp16", **arrays), indptr


def _check(gpu, scores, lengths, k_pages, sinks=0, window=0):
    kv, indptr = _tables(gpu, lengths)
    want_sel, want_count = reference.topk(scores, indptr, k_pages, sinks, window)
    poison()
    sel, count = gpu.topk(gpu.asarray(scores), kv, k_pages, sinks, window)
    np.testing.assert_array_equal(gpu.to_host(count), want_count)
    np.testing.assert_array_equal(gpu.to_host(sel), want_sel)


@pytest.mark.parametrize("k_pages", [1, 4, 16, 64])
def test_ragged_small(gpu, rng, k_pages):
    lengths = [1, 16 * k_pages, 16 * k_pages + 1, 16 * 300 + 7, 33]
    nnz = sum(-(-n // 16) for n in lengths)
    _check(gpu, rng.standard_normal((3, nnz), dtype=np.float32), lengths, k_pages)


def test_ties_go_to_lower_positions(gpu, rng):
    lengths = [16 * 2000, 16 * 77]
    scores = rng.integers(-3, 3, size=(4, 2077)).astype(np.float32)
    scores[0, :50] = -0.0  # -0 ties with +0
    _check(gpu, scores, lengths, 256)


@pytest.mark.parametrize("copies", [1, 3, 100])
def test_ties_at_the_kth_score(gpu, rng, copies):
    """Random rows whose K-th largest score is copied to `copies` spread positions: the range
    select's last bin holds one key value several times, and its ties go to the lower positions."""
    lengths, k_pages = [16 * 8192, 16 * 2048 - 5, 16 * 5000 + 1], 128
    indptr = np.concatenate([[0], np.cumsum([-(-n // 16) for n in lengths])])
    scores = rng.standard_normal((3, indptr[-1]), dtype=np.float32)
    for h in range(3):
        for b in range(len(lengths)):
            row = scores[h, indptr[b]:indptr[b + 1] - 1]  # the tail page is always in
            kth = np.sort(row)[-(k_pages - 1)]
            row[rng.choice(row.size, copies, replace=False)] = kth
    _check(gpu, scores, lengths, k_pages)


@pytest.mark.parametrize("sinks,window", [(1, 0), (4, 8), (2, 1), (0, 31)])
def test_sinks_and_window_count_in_budget(gpu, rng, sinks, window):
    lengths = [16 * 500, 16 * 40 - 3, 16 * 33]
    nnz = sum(-(-n // 16) for n in lengths)
    _check(gpu, rng.standard_normal((2, nnz), dtype=np.float32), lengths, 32, sinks, window)


@pytest.mark.parametrize("pages,k_pages", [(16384, 1024), (16384, 256), (8192, 256),
                                           (60000, 512)])
def test_long_rows(gpu, rng, pages, k_pages):
    """16384 pages = 128K tokens at S = 8; 60000 pages overflow shared memory (global path)."""
    lengths = [16 * pages, 16 * 3 + 1]
    scores = rng.standard_normal((2, pages + 4), dtype=np.float32)
    _check(gpu, scores, lengths, k_pages)


@pytest.mark.parametrize("pages", [1000, 2048, 3000, 8192])
def test_rows_over_one_wave(gpu, rng, pages):
    """More rows than SMs (2 heads x 70 requests), ragged around `pages` pages: the forms of the
    rule's over-wave table (256 x 8 keys to 2,048 pages, 512 x 16 to 8,192)."""
    lengths = [16 * pages - int(n) for n in rng.integers(0, 16 * 40, 70)]
    nnz = sum(-(-n // 16) for n in lengths)
    _check(gpu, rng.standard_normal((2, nnz), dtype=np.float32), lengths, 128)


@pytest.mark.parametrize("kind", ["extremes", "decades", "near-equal", "constant"])
def test_score_ranges(gpu, rng, kind):
    """The range select narrows [min, max] of the row: huge spans (infinities, NaN, +-1e30,
    subnormals, both signs), spans of 60 decades, a span of a few ulps, and no span at all."""
    pages = 5000
    if kind == "extremes":
        scores = rng.choice(np.array([-1e30, 1e30, 1e-40, -1e-40, 0.0, -0.0, 5.0, np.inf, -np.inf,
                                      np.nan],
                                     dtype=np.float32), size=(2, pages + 3))
    elif kind == "decades":
        scores = (rng.standard_normal((2, pages + 3)) * 10.0 ** rng.integers(-30, 30, (2, pages + 3)))
    elif kind == "near-equal":
        scores = 40 + rng.random((2, pages + 3)) * 1e-5
    else:
        scores = np.full((2, pages + 3), 2.5)
    _check(gpu, scores.astype(np.float32), [16 * pages, 16 * 2 + 5], 300, sinks=2, window=3)


def test_budget_too_small_for_reservations(gpu, rng):
    kv, _ = _tables(gpu, [160])
    with pytest.raises(ValueError):
        gpu.topk(gpu.asarray(rng.standard_normal((1, 10), dtype=np.float32)), kv, 4, 3, 2)
