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
from questprof.backends import params
from questprof.backends.launch_args import check_call, form_tags
from questprof.core.fp8 import E4M3
from questprof.core.layout import AppendPlan, PagedKV, to_storage
from questprof.core.selection import fp8_box_scale
from questprof.core.selectors import KernelForm

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
    ops.run_summary(kv, fs.summary, (kv_tag, tag), plan, fs.scale, fs.form.boxes)


def estimate(q, kv: PagedKV, fs: FormSummary, mode: str = "per-head", launch=ops._plain):
    """Scores [Hs, nnz] float32 of a form: the largest bound of each page's boxes that hold
    keys, from boxes or FP8 summaries."""
    c = check_call(kv, q, mode, form=fs.form)
    return ops.run_estimate(q, kv, params.paged_cache(kv), fs.summary, (c.tags[0], c.tags[2]),
                            mode, c.group, fs.scale, fs.form.boxes, launch)


def topk(scores, kv: PagedKV, k_pages: int, form: KernelForm, launch=ops._plain):
    """(sel [Hs, B, K], count): count [B] for a fixed K, [Hs, B] for a dynamic budget (the
    tail page and the pages its rule keeps of the K best; sinks and window are not theirs)."""
    c = check_call(kv, scores=scores, budget=(k_pages, 0, 0), form=form)
    return ops.run_topk(scores, kv, params.paged_cache(kv), k_pages, launch=launch, rule=c.rule)


def quest(q, kv: PagedKV, fs: FormSummary, k_pages: int, mode: str = "per-head",
          launch=ops._plain):
    """One decode step of the form, estimate -> top-K -> attention: (out [B, Hq, d], lse); every
    check runs once, the three launches share one PagedCache."""
    c = check_call(kv, q, mode, budget=(k_pages, 0, 0), form=fs.form)
    cache = params.paged_cache(kv)
    scores = ops.run_estimate(q, kv, cache, fs.summary, (c.tags[0], c.tags[2]), mode, c.group,
                              fs.scale, fs.form.boxes, launch)
    sel, count = ops.run_topk(scores, kv, cache, k_pages, launch=launch, rule=c.rule)
    return ops.run_attention(q, kv, cache, c.tags, c.group, sel, count, launch=launch)
