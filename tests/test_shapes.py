"""Every kernel shape (issue 24) on the GPU against the float64 reference: every group of 1 to 16
q heads per KV head and a multi-query one (71 over 1), every head dim 64 to 256, page sizes 8 and
128, fp16 and bf16. Ragged batches with tails of 1, S-1, S and S+1 tokens and NaN in the unused
tail slots, outputs poisoned before each launch; the Quest step equals its stages composed bit
for bit, and top-K selects exactly the reference's pages of the kernel's own scores.

Each variant compiles on first use (NVRTC): the cases cover every value of every axis rather
than their product, so the file runs in a few minutes."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TOL, full_plan, make_case, poison, rel_err
from questprof.core import reference
from questprof.core.fp8 import E4M3
from questprof.core.layout import (encode_summary, from_storage, kv_values, quantized,
                                   random_paged_kv, random_queries, summary_values)
from questprof.core.stages import MODES

pytestmark = pytest.mark.gpu


def _case(rng, q_heads, kv_heads, d, s, dtype):
    """One-token request, tails S-1, S (one full page), S+1, and a row long enough to split."""
    lengths = [1, s - 1, s, s + 1, 37 * s + 3]
    kv = make_case(rng, lengths, s, kv_heads, d, dtype, spare_pages=5, tail_fill=np.nan)
    return kv, random_queries(rng, len(lengths), q_heads, d, dtype)


def _reference_attention(kv, q, sel=None, count=None):
    f = lambda x: from_storage(x, kv.dtype)  # noqa: E731
    return reference.attention(f(q), f(kv.k), f(kv.v), kv.kv_indptr, kv.kv_indices,
                               kv.last_page_len, sel, count)


def _check_step(gpu, kv, q, k_pages, mode):
    """quest() = estimate, topk, attention composed (bits); each stage = the reference."""
    dev_kv, dev_q, host = gpu.put(kv), gpu.asarray(q), gpu.to_host
    poison()
    out, lse = gpu.quest(dev_q, dev_kv, k_pages, mode)
    poison()
    scores = gpu.estimate(dev_q, dev_kv, mode)
    sel, count = gpu.topk(scores, dev_kv, k_pages)
    c_out, c_lse = gpu.attention(dev_q, dev_kv, sel, count)
    np.testing.assert_array_equal(host(out), host(c_out))
    np.testing.assert_array_equal(host(lse), host(c_lse))
    f = lambda x: from_storage(x, kv.dtype)  # noqa: E731
    want = reference.estimate(f(q), f(kv.summary), kv.kv_indptr, kv.kv_indices, mode)
    assert rel_err(host(scores), want) < 1e-5
    want_sel, want_count = reference.topk(host(scores), kv.kv_indptr, k_pages)
    np.testing.assert_array_equal(host(sel), want_sel)
    np.testing.assert_array_equal(host(count), want_count)
    want_out, want_lse = _reference_attention(kv, q, want_sel, want_count)
    assert rel_err(from_storage(host(out), kv.dtype), want_out) < TOL[kv.dtype]
    assert rel_err(host(lse), want_lse) < 1e-5


def _check_dense(gpu, kv, q):
    poison()
    out, lse = gpu.attention(gpu.asarray(q), gpu.put(kv))
    want_out, want_lse = _reference_attention(kv, q)
    assert rel_err(from_storage(gpu.to_host(out), kv.dtype), want_out) < TOL[kv.dtype]
    assert rel_err(gpu.to_host(lse), want_lse) < 1e-5


GROUPS = [*range(1, 17), 71]  # 71: Falcon-7B's multi-query group, 5 chunks of 15 and 11


@pytest.mark.parametrize("g", GROUPS)
def test_every_group(gpu, rng, g):
    """Tiles 1-16 exact and masked (3 on 4, 5-7 on 8, 9-15 on 16), 71 in chunks; every mode."""
    kv_heads = 1 if g > 16 else 2
    kv, q = _case(rng, g * kv_heads, kv_heads, 128, 16, "bf16" if g in (3, 12) else "fp16")
    _check_dense(gpu, kv, q)
    for mode in MODES:
        _check_step(gpu, kv, q, 5, mode)


# (head dim, page size, group, dtype): every head dim at pages 8 and 128, groups and dtypes
# rotating (Phi-3-mini: MHA d 96; Gemma-2-9B: 2 per KV head at d 256; GPT-OSS: 8 at d 64).
HEAD_DIMS = [(64, 8, 1, "bf16"), (64, 128, 16, "fp16"), (80, 8, 3, "fp16"), (80, 128, 2, "bf16"),
             (96, 8, 1, "fp16"), (96, 128, 5, "bf16"), (128, 8, 6, "bf16"), (128, 128, 4, "fp16"),
             (192, 8, 8, "bf16"), (192, 128, 1, "fp16"), (256, 8, 2, "fp16"),
             (256, 128, 16, "bf16")]


@pytest.mark.parametrize("d,s,g,dtype", HEAD_DIMS)
def test_every_head_dim_and_page_size(gpu, rng, d, s, g, dtype):
    kv, q = _case(rng, 2 * g, 2, d, s, dtype)
    _check_dense(gpu, kv, q)
    _check_step(gpu, kv, q, 4, "per-head")
    _check_step(gpu, kv, q, 4, MODES[1 + HEAD_DIMS.index((d, s, g, dtype)) % 2])


@pytest.mark.parametrize("d,s,dtype", [(64, 128, "fp16"), (80, 8, "bf16"), (96, 128, "fp16"),
                                       (128, 128, "bf16"), (192, 8, "fp16"), (256, 8, "bf16")])
def test_summary_every_head_dim(gpu, rng, d, s, dtype):
    """min / max bit for bit; slots past each request's tail hold NaN and are never read."""
    kv = random_paged_kv(rng, [1, s - 1, s, s + 1, 3 * s + 5], s, 3, d, dtype, spare_pages=4,
                         tail_fill=np.nan)
    plan = full_plan(kv)
    want = reference.summary(from_storage(kv.summary, dtype), from_storage(kv.k, dtype), plan)
    dev = gpu.put(kv)
    poison()
    gpu.summary(dev, plan)
    np.testing.assert_array_equal(from_storage(gpu.to_host(dev.summary), dtype), want)


@pytest.mark.parametrize("g", [7, 16])
@pytest.mark.parametrize("tune", ["split=bytes,value=64k", "split=tokens,value=128",
                                  "ctas=1", "ctas=2", "ctas=1,stages=4", "stages=6",
                                  "merge=wide", "ctas=2,merge=wide"])
def test_tuning_choices(gpu, rng, monkeypatch, g, tune):
    """Every QP_TUNE choice (backends/variants.py, Tuning) gives the reference's outputs: rows cut by a floor in bytes or by tokens (splits of 8 pages: the longest row merges 5
    partials), 1 or 2 CTAs per SM, rings of 4 and 6 stages (D 128, tiles 8 and 16, page size at
    launch; the Quest step's sparse rows too), the wide merge of the splits; G 7 on tile 8."""
    monkeypatch.setenv("QP_TUNE", tune)
    kv, q = _case(rng, 2 * g, 2, 128, 16, "bf16" if g == 7 else "fp16")
    _check_dense(gpu, kv, q)
    for mode in MODES:
        _check_step(gpu, kv, q, 5, mode)


# (q heads per KV head, queries, FP8 cache, QP_TUNE, CTAs per SM the launch plans for 5 dense
# rows of 38 pages): 1 for tile 16 over a 16-bit cache (variants.FEW_ROW_SPLITS; d1ee607: tile 4
# keeps 2; tile 8 too for 5 rows), 1 wherever a deep ring leaves room for only one.
FEW_ROWS = [(4, "fp16", False, "", 2), (7, "bf16", False, "", 2), (16, "bf16", False, "", 1),
            (16, "bf16", False, "stages=4", 1),
            (8, "fp16", False, "stages=6", 1), (4, "bf16", True, "stages=6", 1),
            (16, "fp16", True, "ctas=1,stages=4", 1)]


@pytest.mark.parametrize("g,dtype,fp8,tune,ctas", FEW_ROWS)
def test_few_rows_and_deep_rings(gpu, rng, monkeypatch, g, dtype, fp8, tune, ctas):
    """One KV head, 5 requests: 5 dense rows, planned as FEW_ROWS says (tests/test_variants.py
    checks the plans on a CPU); rings of 4 and 6 stages over 16-bit and FP8 caches. FP8 (E4M3
    summaries): dense and the estimate in every mode against the float64 reference of the
    dequantized cache."""
    from questprof.backends import variants

    monkeypatch.setenv("QP_TUNE", tune)
    kv, q = _case(rng, g, 1, 128, 16, dtype)
    tile, cache = variants.plan_group(g).tile, E4M3 if fp8 else dtype
    run = variants.attention_launch(5, 38, 128, tile, 16, cache, 132)
    assert run.ctas == ctas and run.stages == (int(tune[-1]) if tune else run.stages)
    if not fp8:
        _check_dense(gpu, kv, q)
        _check_step(gpu, kv, q, 5, "shared-max")
        return
    kv = quantized(kv, "tensor", E4M3)
    kv.summary[...] = encode_summary(reference.summary(summary_values(kv), kv_values(kv, "k"),
                                                       full_plan(kv)), kv)
    dev_kv, dev_q, f = gpu.put(kv), gpu.asarray(q), lambda x: from_storage(x, dtype)
    for mode in MODES:
        want = reference.estimate(f(q), summary_values(kv), kv.kv_indptr, kv.kv_indices, mode)
        assert rel_err(gpu.to_host(gpu.estimate(dev_q, dev_kv, mode)), want) < 1e-5
    poison()
    out, lse = gpu.attention(dev_q, dev_kv)
    want_out, want_lse = reference.attention(f(q), kv_values(kv, "k"), kv_values(kv, "v"),
                                             kv.kv_indptr, kv.kv_indices, kv.last_page_len)
    assert rel_err(from_storage(gpu.to_host(out), dtype), want_out) < TOL[dtype]
    assert rel_err(gpu.to_host(lse), want_lse) < 1e-5


# QP_TUNE of the wide merge at 1, 2 and 130 splits for the longest row (FP8: 65, its splits at
# least 16 pages): the split rule by tokens makes the count independent of the GPU's SMs
WIDE = [("merge=wide,split=tokens,value=8192", 1), ("merge=wide,split=tokens,value=320", 2),
        ("merge=wide,split=tokens,value=128", 130)]


@pytest.mark.parametrize("tune,splits", WIDE)
@pytest.mark.parametrize("g,dtype,fp8", [(1, "fp16", False), (4, "bf16", False),
                                         (7, "fp16", False), (16, "bf16", False),
                                         (4, "fp16", True)])
def test_wide_merge(gpu, rng, monkeypatch, tune, splits, g, dtype, fp8):
    """The wide merge (kernels/attention_merge.cuh) gives the reference's outputs and lse at 1
    split (no merge), 2 and 130 (its lse take 2 rounds of loads at G 16; at G 1 4 slices share
    the splits), rows of every length merging empty splits (lse -inf), G 1, 4, 7 (tile 8), 16 and
    an FP8 cache; at 8-page splits the Quest step's sparse rows (20 pages: 3 splits) too."""
    from questprof.backends import variants

    monkeypatch.setenv("QP_TUNE", tune)
    longest = 37 * 16 + 3 if splits <= 2 else 130 * 128 - 3
    kv = make_case(rng, [1, 15, 17, 37 * 16 + 3, longest], 16, 2, 128, dtype, spare_pages=5,
                   tail_fill=np.nan)
    q = random_queries(rng, 5, 2 * g, 128, dtype)
    tile = variants.plan_group(g).tile
    run = variants.attention_launch(10, -(-longest // 16), 128, tile, 16,
                                    E4M3 if fp8 else dtype, 132)
    assert run.merge == ("wide" if splits > 1 else "old")
    assert run.splits == splits or splits > 2 and run.splits >= 64  # FP8: tiles of 32 tokens
    if not fp8:
        _check_dense(gpu, kv, q)
        for mode in ("per-head", "shared-max"):
            _check_step(gpu, kv, q, 20, mode)
        return
    kv = quantized(kv, "tensor", E4M3)
    poison()
    out, lse = gpu.attention(gpu.asarray(q), gpu.put(kv))
    f = lambda x: from_storage(x, dtype)  # noqa: E731
    want_out, want_lse = reference.attention(f(q), kv_values(kv, "k"), kv_values(kv, "v"),
                                             kv.kv_indptr, kv.kv_indices, kv.last_page_len)
    assert rel_err(from_storage(gpu.to_host(out), dtype), want_out) < TOL[dtype]
    assert rel_err(gpu.to_host(lse), want_lse) < 1e-5
