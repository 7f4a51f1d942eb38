"""Token-major pages (NHD: [N, S, Hkv, d], transformers' and vLLM's blocks) read in place by the
attention and summary kernels: on the GPU their outputs equal the same cache's head-major ones
bit for bit (the same arithmetic at other addresses), and the float64 reference within the
tests' tolerance. Ragged batches with tails of 1, S-1, S and S+1 tokens, NaN in the unused tail
slots, outputs poisoned before each launch, every group of the tiles, head dims 64 and 128."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conftest import TOL, full_plan, make_case, poison, rel_err
from questprof.core import reference
from questprof.core.layout import from_storage, random_queries
from questprof.core.stages import MODES

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("q_heads,kv_heads,d,s,dtype", [
    (4, 4, 128, 16, "fp16"), (8, 2, 128, 16, "bf16"), (28, 4, 128, 16, "bf16"),
    (32, 2, 64, 8, "fp16"), (9, 3, 64, 128, "bf16"), (71, 1, 128, 16, "fp16")])
def test_token_major_pages_give_the_head_major_bits(gpu, rng, q_heads, kv_heads, d, s, dtype):
    lengths = [1, s - 1, s, s + 1, 37 * s + 3]
    kv = make_case(rng, lengths, s, kv_heads, d, dtype, spare_pages=5, tail_fill=np.nan)
    q = random_queries(rng, len(lengths), q_heads, d, dtype)
    hnd, dev_q, host = gpu.put(kv), gpu.asarray(q), gpu.to_host
    nhd = gpu.put(replace(kv.token_major(), summary=kv.summary.copy()))
    assert nhd.layout == "NHD"
    for c in (hnd, nhd):  # summaries from the pages, each cache its own
        poison()
        gpu.summary(c, full_plan(kv))
    np.testing.assert_array_equal(host(nhd.summary), host(hnd.summary))
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
