"""Token-major pages (NHD: [N, S, Hkv, d], transformers' and vLLM's blocks) read in place by the
attention and summary kernels: on the GPU their outputs equal the same cache's head-major ones
bit for bit (the same arithmetic at other addresses), and the float64 reference within the
tests' tolerance. Ragged batches with tails of 1, S-1, S and S+1 tokens, NaN in the unused tail
slots and in the summaries before the kernel writes them, outputs poisoned before each launch,
every group of the tiles (and 71 per KV head), head dims 64 and 128, pages 8 to 128."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conftest import TOL, full_plan, make_case, poison, rel_err
from questprof.core import reference
from questprof.core.layout import append_plan, from_storage, random_queries, to_storage
from questprof.core.stages import MODES

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("q_heads,kv_heads,d,s,dtype", [
    (4, 4, 128, 16, "fp16"), (8, 2, 128, 16, "bf16"), (28, 4, 128, 16, "bf16"),
    (32, 2, 64, 8, "fp16"), (9, 3, 64, 128, "bf16"), (142, 2, 128, 16, "fp16")])
def test_token_major_pages_give_the_head_major_bits(gpu, rng, q_heads, kv_heads, d, s, dtype):
    lengths = [1, s - 1, s, s + 1, 37 * s + 3]
    kv = make_case(rng, lengths, s, kv_heads, d, dtype, spare_pages=5, tail_fill=np.nan)
    q = random_queries(rng, len(lengths), q_heads, d, dtype)
    want_summary = kv.summary.copy()  # the reference's (make_case)
    unset = to_storage(np.full(kv.summary.shape, np.nan), dtype)  # a summary never written shows
    hnd, dev_q, host = gpu.put(replace(kv, summary=unset.copy())), gpu.asarray(q), gpu.to_host
    nhd = gpu.put(replace(kv.token_major(), summary=unset.copy()))
    assert nhd.layout == "NHD" and nhd.kv_heads == kv_heads
    tails = append_plan(kv.kv_indptr, kv.kv_indices, kv.last_page_len, [1] * len(lengths), s)
    for c in (hnd, nhd):  # each cache its own summaries: a prefill, then a decode's merge
        poison()
        gpu.summary(c, full_plan(kv))
        gpu.summary(c, tails)
    np.testing.assert_array_equal(host(nhd.summary), host(hnd.summary))
    used = np.asarray(kv.kv_indices)  # the spare pages keep the NaN both were given
    np.testing.assert_array_equal(host(nhd.summary)[used], want_summary[used])
    poison()
    want = [host(x) for x in gpu.attention(dev_q, hnd)]
    poison()
    got = [host(x) for x in gpu.attention(dev_q, nhd)]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    f = lambda x: from_storage(x, dtype)  # noqa: E731
    ref_out, _ = reference.attention(f(q), f(kv.k), f(kv.v), kv.kv_indptr, kv.kv_indices,
                                     kv.last_page_len)
    assert rel_err(from_storage(got[0], dtype), ref_out) < TOL[dtype]
    for mode in MODES:
        poison()
        want = [host(x) for x in gpu.quest(dev_q, hnd, 4, mode)]
        poison()
        got = [host(x) for x in gpu.quest(dev_q, nhd, 4, mode)]
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_token_major_pages_are_refused_by_the_host_tier(gpu, rng):
    """The host tier's gather and page cache read whole pages of one head: one line."""
    from questprof.backends.host_tier import host_tier

    kv = make_case(rng, [40, 17], 16, 2, 128, "fp16", spare_pages=2)
    with pytest.raises(ValueError, match="head-major"):
        host_tier(gpu.put(kv.token_major()))
