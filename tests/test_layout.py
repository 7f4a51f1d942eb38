"""Page tables, append plans and dtype storage."""

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
