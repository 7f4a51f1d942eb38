"""Summary append / rebuild kernel against the float64 reference: bit-exact min and max."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import full_plan, poison
from questprof.core import reference
from questprof.core.layout import append_plan, from_storage, random_paged_kv, rebuild_plan, to_storage

pytestmark = pytest.mark.gpu


def _check(gpu, kv, plan):
    """Run the plan on the GPU and the reference from the same starting summary."""
    want = reference.summary(from_storage(kv.summary, kv.dtype), from_storage(kv.k, kv.dtype), plan)
    dev = gpu.put(kv)
    gpu.summary(dev, plan)
    got = from_storage(gpu.to_host(dev.summary), kv.dtype)
    np.testing.assert_array_equal(got, want)  # NaN where untouched, on both sides
    return dev


@pytest.mark.parametrize("dtype,head_dim,page_size", [
    ("fp16", 128, 16), ("bf16", 64, 8), ("fp16", 64, 64), ("bf16", 128, 32)])
def test_prefill_tails_and_nan_slots(gpu, rng, dtype, head_dim, page_size):
    s = page_size
    lengths = [1, s - 1, s, s + 1, 3 * s + 5]
    kv = random_paged_kv(rng, lengths, s, 3, head_dim, dtype, spare_pages=4, tail_fill=np.nan)
    poison()
    _check(gpu, kv, full_plan(kv))


def _prefix_plan(kv, n_tokens):
    """Rebuild plan of the first n_tokens[b] tokens of each request."""
    indptr, indices, s = np.asarray(kv.kv_indptr), np.asarray(kv.kv_indices), kv.page_size
    ids, valid = [], []
    for b, n in enumerate(n_tokens):
        for p in range(-(-n // s)):
            ids.append(indices[indptr[b] + p])
            valid.append(min(s, n - p * s))
    return rebuild_plan(ids, valid)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_decode_append_merges_and_reuses_pages(gpu, rng, dtype):
    s = 16
    lengths = [1, s, s + 1, 2 * s - 1, 40]  # the new token opens a page for 1 and s + 1
    kv = random_paged_kv(rng, lengths, s, 2, 128, dtype, spare_pages=3)
    # Stale finite boxes everywhere: a page the append opens is a reused physical page.
    kv.summary[...] = kv.k[:, :, :2, :]
    prefill = _prefix_plan(kv, [n - 1 for n in lengths])
    _check(gpu, kv, prefill)
    k = from_storage(kv.k, dtype)
    kv.summary[...] = to_storage(reference.summary(from_storage(kv.summary, dtype), k, prefill), dtype)
    plan = append_plan(kv.kv_indptr, kv.kv_indices, kv.last_page_len, [1] * len(lengths), s)
    assert (plan.first == 0).sum() == 2 and (plan.first > 0).sum() == 3
    _check(gpu, kv, plan)


def test_rebuild_after_rollback(gpu, rng):
    kv = random_paged_kv(rng, [64, 37], 16, 4, 128, "fp16")
    kv.summary[...] = kv.k[:, :, :2, :]  # boxes of keys that were rolled back
    pages = np.asarray(kv.kv_indices)[[1, 3, 6]]
    _check(gpu, kv, rebuild_plan(pages, [5, 16, 1]))
