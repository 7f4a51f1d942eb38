"""FP8 (e4m3) KV caches on the GPU against the float64 reference of the dequantized cache: the
summary kernel's fp16 summaries rounded outward and FP8 summaries (min / max codes), both bit for
bit; the estimate over either; dense and sparse attention dequantizing K and V on load; the
Quest step equal to its stages composed. Scales per tensor and per KV head (the heads' ranges
spread over 1x-8x so per-head scales differ), fp16 and bf16 queries, ragged batches with tails
of 1, S-1, S, S+1 and NaN codes in unused tail slots."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TOL, full_plan, poison, rel_err
from questprof.core import reference
from questprof.core.fp8 import E4M3
from questprof.core.layout import (append_plan, encode_summary, from_storage, kv_values,
                                   quantized, random_paged_kv, random_queries, summary_values,
                                   to_storage)
from questprof.core.stages import MODES

pytestmark = pytest.mark.gpu


def _fp8_cache(rng, lengths, s, kv_heads, d, dtype, per, summ, build=True):
    """An FP8 copy of a random cache whose KV heads span 1x-8x in range; summaries built by the
    reference (build) or left poisoned."""
    kv = random_paged_kv(rng, lengths, s, kv_heads, d, dtype, spare_pages=5, tail_fill=np.nan)
    spread = 2.0 ** np.linspace(0, 3, kv_heads)[None, :, None, None]
    kv.k[...] = to_storage(from_storage(kv.k, dtype) * spread, dtype)
    kv.v[...] = to_storage(from_storage(kv.v, dtype) * spread[:, ::-1], dtype)
    kv = quantized(kv, per, summ)
    if build:
        kv.summary[...] = _reference_summary(kv, full_plan(kv))
    return kv


def _reference_summary(kv, plan):
    new = reference.summary(summary_values(kv), kv_values(kv, "k"), plan)
    return encode_summary(new, kv)


def _lengths(s):
    return [1, s - 1, s, s + 1, 37 * s + 3]


@pytest.mark.parametrize("summ", [E4M3, "fp16"])
@pytest.mark.parametrize("d,s,per", [(128, 16, "tensor"), (80, 8, "head"), (256, 128, "head"),
                                     (64, 32, "tensor")])
def test_summary_both_forms_bit_for_bit(gpu, rng, summ, d, s, per):
    """A prefill, then a one-token append that merges into existing boxes (and opens pages)."""
    kv = _fp8_cache(rng, _lengths(s), s, 3, d, "bf16", per, summ, build=False)
    prefill = full_plan(kv)
    dev = gpu.put(kv)
    poison()
    gpu.summary(dev, prefill)
    want = _reference_summary(kv, prefill)
    got = gpu.to_host(dev.summary)
    np.testing.assert_array_equal(from_storage(got, summ), from_storage(want, summ))
    kv.summary[...] = want
    plan = append_plan(kv.kv_indptr, kv.kv_indices, kv.last_page_len, [1] * 5, s)
    dev = gpu.put(kv)
    gpu.summary(dev, plan)
    np.testing.assert_array_equal(from_storage(gpu.to_host(dev.summary), summ),
                                  from_storage(_reference_summary(kv, plan), summ))


def _check_step(gpu, kv, q, k_pages, mode):
    """quest() = the stages composed (bits); each stage = the float64 reference."""
    dev_kv, dev_q, host = gpu.put(kv), gpu.asarray(q), gpu.to_host
    poison()
    out, lse = gpu.quest(dev_q, dev_kv, k_pages, mode)
    scores = gpu.estimate(dev_q, dev_kv, mode)
    sel, count = gpu.topk(scores, dev_kv, k_pages)
    c_out, c_lse = gpu.attention(dev_q, dev_kv, sel, count)
    np.testing.assert_array_equal(host(out), host(c_out))
    np.testing.assert_array_equal(host(lse), host(c_lse))
    qf = from_storage(q, kv.dtype)
    want = reference.estimate(qf, summary_values(kv), kv.kv_indptr, kv.kv_indices, mode)
    assert rel_err(host(scores), want) < 1e-5
    want_sel, want_count = reference.topk(host(scores), kv.kv_indptr, k_pages)
    np.testing.assert_array_equal(host(sel), want_sel)
    np.testing.assert_array_equal(host(count), want_count)
    want_out, want_lse = reference.attention(qf, kv_values(kv, "k"), kv_values(kv, "v"),
                                             kv.kv_indptr, kv.kv_indices, kv.last_page_len,
                                             want_sel, want_count)
    assert rel_err(from_storage(host(out), kv.dtype), want_out) < TOL[kv.dtype]
    assert rel_err(host(lse), want_lse) < 1e-5


def _check_dense(gpu, kv, q):
    poison()
    out, lse = gpu.attention(gpu.asarray(q), gpu.put(kv))
    want_out, want_lse = reference.attention(
        from_storage(q, kv.dtype), kv_values(kv, "k"), kv_values(kv, "v"), kv.kv_indptr,
        kv.kv_indices, kv.last_page_len)
    assert rel_err(from_storage(gpu.to_host(out), kv.dtype), want_out) < TOL[kv.dtype]
    assert rel_err(gpu.to_host(lse), want_lse) < 1e-5


# (q heads, KV heads, head dim, page size, queries, scales, summaries): Llama-3.1-8B both ways,
# then every head dim with groups, scales and summary forms rotating (D 80 and 96 end on 1 and 2
# pieces of 16 dims, D 64 keeps rows of 4 pieces, 71 q heads run in 5 chunks).
CASES = [(32, 8, 128, 16, "bf16", "tensor", E4M3), (32, 8, 128, 16, "fp16", "head", "fp16"),
         (6, 2, 80, 8, "fp16", "head", E4M3), (4, 4, 96, 128, "bf16", "tensor", "fp16"),
         (16, 8, 256, 8, "bf16", "head", E4M3), (32, 2, 64, 128, "fp16", "tensor", E4M3),
         (14, 2, 192, 16, "fp16", "head", "fp16"), (71, 1, 128, 16, "bf16", "head", E4M3)]


@pytest.mark.parametrize("q_heads,kv_heads,d,s,dtype,per,summ", CASES)
def test_fp8_dense_and_quest_step(gpu, rng, q_heads, kv_heads, d, s, dtype, per, summ):
    kv = _fp8_cache(rng, _lengths(s), s, kv_heads, d, dtype, per, summ)
    q = random_queries(rng, 5, q_heads, d, dtype)
    _check_dense(gpu, kv, q)
    _check_step(gpu, kv, q, 5, "per-head")
    _check_step(gpu, kv, q, 5, MODES[1 + CASES.index((q_heads, kv_heads, d, s, dtype, per, summ))
                                     % 2])


def test_fp8_unused_tail_codes_change_nothing(gpu, rng):
    """NaN codes (and any other) in slots past a request's tail never reach the output."""
    kv = _fp8_cache(rng, [3, 16 * 40 + 5, 17], 16, 2, 128, "fp16", "head", E4M3)
    q = random_queries(rng, 3, 8, 128, "fp16")
    out = gpu.to_host(gpu.attention(gpu.asarray(q), gpu.put(kv))[0])
    indptr, indices = np.asarray(kv.kv_indptr), np.asarray(kv.kv_indices)
    for b, n in enumerate(np.asarray(kv.last_page_len)):
        tail = indices[indptr[b + 1] - 1]
        kv.k[tail, :, n:] = rng.integers(0, 256, size=kv.k[tail, :, n:].shape)
        kv.v[tail, :, n:] = rng.integers(0, 256, size=kv.v[tail, :, n:].shape)
    np.testing.assert_array_equal(gpu.to_host(gpu.attention(gpu.asarray(q), gpu.put(kv))[0]), out)
