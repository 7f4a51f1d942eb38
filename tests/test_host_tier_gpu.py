"""The host tier on a GPU (backends/host_tier.py): pools in mapped pinned host memory read in
place, the gather path into an HBM staging pool, and the link ceilings; each against the float64
reference through tools/host_tier_check.py's check (ragged batch, tails, NaN in unused pages)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tool

pytestmark = pytest.mark.gpu


def test_both_fetch_paths_match_the_float64_reference(gpu):
    check = tool("host_tier_check")
    errors = check.check(seed=3)
    assert set(errors) == {"zero-copy attention", "dense over host", "gather + attention"}
    assert all(e <= check.TOL for e in errors.values()), errors


def test_mapped_memory_is_host_memory_the_kernels_read(gpu):
    import cupy

    from questprof.backends.host_tier import MappedHost, is_host_memory, mapped_empty

    x = mapped_empty((1 << 16,), np.float32)
    x[...] = cupy.arange(x.size, dtype=cupy.float32)
    assert is_host_memory(x) and not is_host_memory(cupy.zeros(4))
    assert float(x.sum()) == float(np.arange(x.size, dtype=np.float64).sum())
    host = MappedHost(64)
    host.host_view((16,), np.float32)[:] = 7.0  # the CPU's writes are the kernel's reads
    assert host.nbytes == 64


def test_gather_fills_the_staging_pool_in_selection_order(gpu):
    import cupy

    from questprof.backends import cupy as ops
    from questprof.backends.host_tier import gather, host_tier, staging_pool

    check = tool("host_tier_check")
    kv, q = check._pool(np.random.default_rng(5), [300, 1000])
    sel, _ = ops.topk(ops.estimate(q, kv, "shared-mean"), kv, 4)
    host = host_tier(kv)
    staging = staging_pool(host, 4)
    gather(host, sel, staging)
    sel_h, indptr = cupy.asnumpy(sel), cupy.asnumpy(kv.kv_indptr)
    indices, k, got = (cupy.asnumpy(a) for a in (kv.kv_indices, kv.k, staging.k))
    for h in range(sel_h.shape[0]):
        for b in range(sel_h.shape[1]):
            for j, pos in enumerate(sel_h[h, b]):
                page = indices[indptr[b] + pos]
                assert np.array_equal(got[b * 4 + j, h], k[page, h])


def test_link_ceilings_are_measured(gpu):
    from questprof.measure.ceilings import measure_link_ceilings

    got = measure_link_ceilings(64 << 20, repeats=3)
    assert got["copy_gbs"] > 1 and got["zero_copy_gbs"] > 1
