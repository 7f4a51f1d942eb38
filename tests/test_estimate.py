"""Estimate kernel (U_p(q) per page, MHA and GQA modes) against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_case, poison, rel_err
from questprof.core import reference
from questprof.core.layout import from_storage, random_queries

pytestmark = pytest.mark.gpu


def _run(gpu, rng, lengths, page_size, q_heads, kv_heads, head_dim, dtype, mode):
    kv = make_case(rng, lengths, page_size, kv_heads, head_dim, dtype, spare_pages=5)
    q = random_queries(rng, len(lengths), q_heads, head_dim, dtype)
    want = reference.estimate(from_storage(q, dtype), from_storage(kv.summary, dtype),
                              kv.kv_indptr, kv.kv_indices, mode)
    poison()
    got = gpu.to_host(gpu.estimate(gpu.asarray(q), gpu.put(kv), mode))
    assert got.shape == want.shape and got.dtype == np.float32
    return got, want


@pytest.mark.parametrize("mode", reference.MODES)
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (8, 4), (16, 2)])
def test_modes_and_groups(gpu, rng, mode, q_heads, kv_heads):
    got, want = _run(gpu, rng, [1, 17, 200, 64], 16, q_heads, kv_heads, 128, "fp16", mode)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("dtype,head_dim,page_size", [("bf16", 64, 8), ("fp16", 64, 32),
                                                      ("bf16", 128, 64)])
def test_dtypes_dims_and_ragged_batch(gpu, rng, dtype, head_dim, page_size):
    lengths = [page_size - 1, 1, 5 * page_size + 1, page_size]
    got, want = _run(gpu, rng, lengths, page_size, 4, 1, head_dim, dtype, "per-head")
    assert rel_err(got, want) < 1e-5


def test_many_pages_all_units_written(gpu, rng):
    """More units than one grid row of blocks, and a unit count that is not a block multiple."""
    got, want = _run(gpu, rng, [16 * 1001 + 3, 9], 16, 8, 8, 128, "fp16", "shared-max")
    assert rel_err(got, want) < 1e-5
