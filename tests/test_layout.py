"""Page tables, append plans and dtype storage."""

from dataclasses import replace

import numpy as np
import pytest

from questprof.core import layout


@pytest.mark.parametrize("length,pages,last", [(1, 1, 1), (15, 1, 15), (16, 1, 16), (17, 2, 1),
                                               (65536 + 5, 4097, 5)])
def test_page_tables_tail(length, pages, last):
    indptr, indices, tail = layout.page_tables([length], 16, pages)
    assert indptr.tolist() == [0, pages] and tail.tolist() == [last]
    assert sorted(indices.tolist()) == list(range(pages))


def test_page_tables_ragged_and_shuffled():
    rng = np.random.default_rng(0)
    indptr, indices, last = layout.page_tables([1, 33, 16], 16, 10, rng)
    assert indptr.tolist() == [0, 1, 4, 5] and last.tolist() == [1, 1, 16]
    assert len(set(indices.tolist())) == 5 and max(indices) < 10
    with pytest.raises(ValueError):
        layout.page_tables([100], 16, 3)


def test_append_plan_decode_and_prefill():
    indptr, indices = np.array([0, 3, 4]), np.array([7, 2, 5, 9])
    plan = layout.append_plan(indptr, indices, np.array([1, 4]), [1, 1], 4)
    assert plan.page_ids.tolist() == [5, 9] and plan.first.tolist() == [0, 3]
    assert plan.end.tolist() == [1, 4]
    plan = layout.append_plan(indptr, indices, np.array([1, 4]), [6, 4], 4)
    assert plan.page_ids.tolist() == [7, 2, 5, 9]
    assert plan.first.tolist() == [3, 0, 0, 0] and plan.end.tolist() == [4, 4, 1, 4]
    with pytest.raises(ValueError):
        layout.append_plan(indptr, indices, np.array([1, 4]), [10, 1], 4)


def test_bf16_round_trip_rounds_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -3.5, 65504.0, np.inf, np.nan], dtype=np.float32)
    back = layout.from_storage(layout.to_storage(x, "bf16"), "bf16")
    assert back[:6].tolist() == [1.0, 1.0, 1.015625, -3.5, 65536.0, np.inf]
    assert np.isnan(back[6])
    with pytest.raises(ValueError):
        layout.storage_dtype("fp8")


@pytest.mark.parametrize("shape, offset", [((3, 5), 0), ((7, 11), 29), ((9, 10), 95),
                                           ((40, 7), 13)])
def test_tiled_repeats_the_tile_from_offset_and_keeps_no_larger_base(shape, offset):
    """Element j is tile[(offset + j) % tile.size]; a pool smaller than the tile does not keep the
    whole tile alive (a view of it did: 8 MiB per small pool on a GPU)."""
    tile = np.arange(100, dtype=np.float32) * 1.5
    out = layout.tiled(np, tile, shape, offset)
    total = int(np.prod(shape))
    np.testing.assert_array_equal(out.ravel(), tile[(offset + np.arange(total)) % tile.size])
    held = out.base.nbytes if out.base is not None else out.nbytes
    assert held <= 2 * out.nbytes


def test_token_major_pages_round_trip_and_keep_their_heads():
    """PagedKV.token_major: K and V as [N, S, Hkv, d] C-contiguous copies (the blocks of
    transformers' and vLLM's paged caches); head_major gives the same values back as views;
    kv_heads and head_dim read either layout; a layout of another name is refused."""
    rng = np.random.default_rng(3)
    kv = layout.random_paged_kv(rng, [5, 16, 17], 16, 3, 64, "bf16", spare_pages=2)
    nhd = kv.token_major()
    assert nhd.layout == "NHD" and nhd.k.shape == (kv.num_pages, 16, 3, 64)
    assert nhd.k.flags.c_contiguous and nhd.v.flags.c_contiguous
    assert (nhd.kv_heads, nhd.head_dim, nhd.num_pages) == (3, 64, kv.num_pages)
    np.testing.assert_array_equal(nhd.k[4, 7, 2], kv.k[4, 2, 7])
    back = nhd.head_major()
    np.testing.assert_array_equal(back.k, kv.k)
    np.testing.assert_array_equal(back.v, kv.v)
    assert kv.head_major() is kv and nhd.token_major() is nhd
    with pytest.raises(ValueError, match="layout 'HDN'"):
        layout.PagedKV(kv.k, kv.v, kv.summary, kv.kv_indptr, kv.kv_indices, kv.last_page_len,
                       kv.lengths, 16, "bf16", layout="HDN")


def test_the_reference_reads_token_major_pages_as_head_major_ones():
    """The NumPy backend (the float64 reference) over token-major pages gives what it gives over
    the same pages head-major, bit for bit: summaries, dense and sparse attention, the step."""
    from conftest import full_plan
    from questprof.backends import get_backend

    rng = np.random.default_rng(5)
    kv = layout.random_paged_kv(rng, [1, 15, 16, 17, 16 * 40 + 3], 16, 2, 64, "fp16",
                                spare_pages=3)
    q = layout.random_queries(rng, 5, 8, 64, "fp16")
    nhd, ref = replace(kv.token_major(), summary=kv.summary.copy()), get_backend("numpy")
    assert nhd.summary is not kv.summary
    ref.summary(kv, full_plan(kv))
    ref.summary(nhd, full_plan(nhd))
    np.testing.assert_array_equal(nhd.summary, kv.summary)
    for stage in (lambda c: ref.attention(q, c), lambda c: ref.quest(q, c, 4, "per-head")):
        for got, want in zip(stage(nhd), stage(kv)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype,kv_dtype,summary,d,needle", [
    ("bf16", "fp8_e4m3", "fp16", 128, "fp16 and bf16 caches"),
    ("fp16", "fp16", "fp16", 96, "head dims 64, 128, not 96"),
    ("fp32", "fp32", "fp32", 128, "fp16 and bf16 caches")])
def test_token_major_pages_are_refused_where_no_kernel_reads_them(dtype, kv_dtype, summary, d,
                                                                  needle):
    from questprof.backends import variants

    assert needle in variants.layout_problem("NHD", dtype, kv_dtype, summary, d)
    assert variants.layout_problem("HND", dtype, kv_dtype, summary, d) is None
    assert variants.layout_problem("NHD", "bf16", "bf16", "bf16", 64) is None


def test_token_major_pages_are_refused_by_the_paths_that_read_head_major_ones():
    """The float32 CPU path's working copies and the page cache read whole pages of one head:
    token-major pages get one line, not a misread."""
    from questprof.backends.numpy_fp32 import NumpyFp32Backend
    from questprof.backends.page_cache_numpy import NumpyPageCache

    rng = np.random.default_rng(9)
    nhd = layout.random_paged_kv(rng, [40, 17], 16, 2, 64, "fp16", spare_pages=2).token_major()
    with pytest.raises(ValueError, match="float32 CPU path .* head-major"):
        NumpyFp32Backend().put(nhd)
    sel = np.zeros((1, 2, 2, 2), dtype=np.int32)
    with pytest.raises(ValueError, match="page cache reads head-major"):
        NumpyPageCache(nhd, sel, np.ones(2, dtype=np.int32), 4)

