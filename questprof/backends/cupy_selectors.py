"""The selectors' kernel forms on the CuPy backend (core.selectors.KernelForm): summaries of c
boxes per page or FP8 summaries over a 16-bit cache (summary.cu), their estimate (estimate.cu,
BOXES), a top-K that keeps a count per row for the dynamic budgets (topk.cu), then attention
over each row's count. The same kernels and launch layers as backends/cupy.py; a form's
summaries live beside the cache (FormSummary), which keeps its own for plain Quest.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from questprof.backends import cupy as ops
from questprof.backends.launch_args import check_budget, form_tags, topk_rule
from questprof.core.fp8 import E4M3
from questprof.core.layout import AppendPlan, PagedKV, to_storage
from questprof.core.selection import fp8_box_scale
from questprof.core.selectors import KernelForm

_NULL, _i32 = np.uint64(0), np.int32
_INF_BITS = {"fp16": 0x7C00, "bf16": 0x7F80}  # magnitudes above are NaN


@dataclass
class FormSummary:
    """A form's summaries of one cache: [N, Hkv, boxes, 2, d] in `dtype` storage (the cache's, or
    fp8_e4m3 codes in units of `scale`, float32 [Hkv], for quest-fp8)."""

    summary: object
    form: KernelForm
    dtype: str
    scale: object = None


def key_scale(kv: PagedKV):
    """float32 [Hkv]: the FP8 summaries' scale, fp8_box_scale of each KV head's largest key
    magnitude over the whole pool (NaN slots not counted; unused slots may widen it, which
    keeps every bound)."""
    mag = kv.k.view(cupy.uint16) & 0x7FFF
    mag = cupy.where(mag > _INF_BITS[kv.dtype], 0, mag).max(axis=(0, 2, 3))
    if kv.dtype == "fp16":
        amax = mag.astype(cupy.uint16).view(cupy.float16).astype(cupy.float64)
    else:
        amax = (mag.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)
    return cupy.asarray(fp8_box_scale(cupy.asnumpy(amax)).astype(np.float32))


def summaries(kv: PagedKV, form: KernelForm, plan: AppendPlan) -> FormSummary:
    """A fresh FormSummary of kv for `form` (NaN until written), built over `plan`."""
    _, _, tag = form_tags(kv, form)
    dtype = E4M3 if form.fp8 else kv.summary_dtype
    shape = (kv.num_pages, kv.kv_heads, form.boxes, 2, kv.head_dim)
    nan = to_storage(np.array([np.nan]), dtype)
    summ = cupy.full(shape if form.boxes > 1 else shape[:2] + shape[3:], nan[0], dtype=nan.dtype)
    fs = FormSummary(summ, form, dtype, key_scale(kv) if form.fp8 else None)
    summary(kv, fs, plan)
    return fs


def summary(kv: PagedKV, fs: FormSummary, plan: AppendPlan) -> None:
    """Apply `plan` to fs.summary in place: each box's slots of [first, end)."""
    _, kv_tag, tag = form_tags(kv, fs.form)
    if len(plan) == 0:
        return
    args = [ops._device_int32(x) for x in (plan.page_ids, plan.first, plan.end)]
    expr = f"summary_kernel<{kv_tag}, {tag}, {kv.head_dim}, {fs.form.boxes}>"
    ops.load_kernel("summary", expr)((len(plan),), (ops.SUM_THREADS,), (
        kv.k, fs.summary, *args, _i32(kv.kv_heads), _i32(kv.page_size),
        _NULL if fs.scale is None else fs.scale))


def estimate(q, kv: PagedKV, fs: FormSummary, mode: str = "per-head", launch=ops._plain):
    """Scores [Hs, nnz] float32 of a form: the largest bound of each page's boxes that hold
    keys, from boxes or FP8 summaries."""
    q_tag, _, tag = form_tags(kv, fs.form)
    return ops.launch_estimate(q, kv, fs.summary, (q_tag, tag), mode,
                               _NULL if fs.scale is None else fs.scale, fs.form.boxes, launch)


def topk(scores, kv: PagedKV, k_pages: int, form: KernelForm, launch=ops._plain):
    """(sel [Hs, B, K], count): count [B] for a fixed K, [Hs, B] for a dynamic budget (the
    tail page and the pages its rule keeps of the K best; sinks and window are not theirs)."""
    check_budget(k_pages, 0, 0)
    rule = topk_rule(form, kv.head_dim, k_pages)
    return ops.topk(scores, kv, k_pages, launch=launch, rule=rule)


def quest(q, kv: PagedKV, fs: FormSummary, k_pages: int, mode: str = "per-head",
          launch=ops._plain):
    """One decode step of the form, estimate -> top-K -> attention: (out [B, Hq, d], lse)."""
    scores = estimate(q, kv, fs, mode, launch=launch)
    sel, count = topk(scores, kv, k_pages, fs.form, launch=launch)
    return ops.attention(q, kv, sel, count, launch=launch)
