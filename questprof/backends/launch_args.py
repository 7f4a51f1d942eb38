"""What the CuPy launchers (backends/cupy.py) check before a launch: the cache's dtypes, storage
and shape against the built kernels, q against the cache, a selection against both, and how the
CTA rows of attention cover the q heads. Only NumPy dtypes and array attributes are read, so CI
checks these rules without CuPy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from questprof.backends import variants
from questprof.core.layout import PagedKV, storage_dtype
from questprof.core.reference import reserved_positions
from questprof.core.stages import check_mode

_INT32 = np.dtype(np.int32)


def cache_tags(kv: PagedKV) -> tuple[str, str, str]:
    """Template tags (queries, K / V, summaries) of a cache the kernels run; ValueError naming the
    caches they run otherwise."""
    key = (kv.dtype, kv.kv_dtype, kv.summary_dtype)
    if key not in variants.CACHES:
        built = ", ".join(f"{q} queries over {k} with {s} summaries" for q, k, s in variants.CACHES)
        raise ValueError(f"the cupy kernels are not built for {kv.dtype} queries over a "
                         f"{kv.kv_dtype} cache with {kv.summary_dtype} summaries: they take {built}")
    return tuple(variants.TAGS[x] for x in key)


def check_kv(kv: PagedKV) -> tuple[str, str, str]:
    """cache_tags(kv) after checking its shape, storage and page tables."""
    tags = cache_tags(kv)
    problem = (variants.shape_problem(kv.head_dim, kv.page_size) or variants.layout_problem(
        kv.layout, kv.dtype, kv.kv_dtype, kv.summary_dtype, kv.head_dim))
    if problem:
        raise ValueError(problem)
    wants = {"k": kv.kv_dtype, "v": kv.kv_dtype, "summary": kv.summary_dtype}
    for name, dtype in wants.items():
        arr, want = getattr(kv, name), storage_dtype(dtype)
        if arr.dtype != want or not arr.flags.c_contiguous:
            raise ValueError(f"kv.{name} must be C-contiguous {want}, got {arr.dtype}")
    if kv.is_fp8:
        for name in ("k_scale", "v_scale"):
            arr = getattr(kv, name)
            if arr.dtype != np.float32 or arr.shape != (kv.kv_heads,) or not arr.flags.c_contiguous:
                raise ValueError(f"kv.{name} must be C-contiguous float32 [{kv.kv_heads}]")
    for name in ("kv_indptr", "kv_indices", "last_page_len"):
        if getattr(kv, name).dtype != _INT32:
            raise ValueError(f"kv.{name} must be int32")
    return tags


def check_q(q, kv: PagedKV) -> tuple[int, int]:
    """(q_heads, group) of q [B, Hq, d] against the cache."""
    if q.ndim != 3 or q.shape[0] != kv.batch or q.shape[2] != kv.head_dim:
        raise ValueError(f"q must be [{kv.batch}, Hq, {kv.head_dim}], got {tuple(q.shape)}")
    if q.dtype != storage_dtype(kv.dtype) or not q.flags.c_contiguous:
        raise ValueError(f"q must be C-contiguous {storage_dtype(kv.dtype)}, got {q.dtype}")
    q_heads = int(q.shape[1])
    if q_heads % kv.kv_heads:
        raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv.kv_heads}")
    return q_heads, q_heads // kv.kv_heads


def check_scores(scores, kv: PagedKV) -> None:
    """scores must be float32 [Hs, nnz] over the cache's page list."""
    nnz = int(kv.kv_indices.size)
    if scores.ndim != 2 or scores.shape[1] != nnz or scores.dtype != np.float32:
        raise ValueError(f"scores must be float32 [Hs, {nnz}], got {scores.dtype} {scores.shape}")


def check_budget(k_pages: int, sinks: int, window: int) -> None:
    if k_pages < 1 or sinks < 0 or window < 0:
        raise ValueError(f"k_pages {k_pages} must be >= 1, sinks and window >= 0")
    reserved_positions(k_pages + 1, k_pages, sinks, window)  # raises when they exceed the budget


def attention_rows(q_heads: int, g: int, kv: PagedKV, sel, count):
    """(GroupPlan of a CTA row, sel_per_q, pages of the longest row, K) for dense (sel None) or a
    selection: one page list per KV head (dense, shared modes) serves the whole group on tiles;
    one per q head (per-head, g > 1) gives each q head its own row (tile 1)."""
    if sel is None:
        return variants.plan_group(g), 0, max(kv.pages()), 1
    if sel.ndim != 3 or sel.shape[1] != kv.batch or sel.dtype != _INT32:
        raise ValueError(f"sel must be int32 [Hs, {kv.batch}, K], got {sel.dtype} {sel.shape}")
    heads, k_sel = int(sel.shape[0]), int(sel.shape[2])
    if heads not in (q_heads, kv.kv_heads):
        raise ValueError(f"sel has {heads} heads: expected q_heads {q_heads} or kv_heads {kv.kv_heads}")
    if count is None or count.shape not in ((kv.batch,), (heads, kv.batch)) or count.dtype != _INT32:
        raise ValueError(f"count must be int32 [{kv.batch}] or [{heads}, {kv.batch}]")
    per_q = heads == q_heads and g > 1
    plan = variants.GroupPlan(1, g, 1) if per_q else variants.plan_group(g)
    return plan, int(per_q), min(k_sel, max(kv.pages())), k_sel


RULES = {"": 0, "gap": 1, "topp": 2}  # KernelForm.rule -> topk.cu's RULE_* code
RULE_BYTES = 16  # shared memory per page of K of a dynamic rule (topk.cuh, dynamic_select)
RULE_SMEM_LIMIT = 200 * 1024  # the top-K kernel's dynamic shared memory (backends/cupy.py)


@dataclass(frozen=True)
class TopkRule:
    """topk.cu's dynamic budget: `code` (RULES; 0 a fixed K), its parameter and the logits'
    scaling of the bounds (1 / sqrt(d), as attention's softmax)."""

    code: int = 0
    param: float = 0.0
    scaling: float = 0.0

    def shared_bytes(self, k_pages: int) -> int:
        """Dynamic shared memory the rule needs at a budget of k_pages (0 for a fixed K)."""
        return RULE_BYTES * k_pages if self.code else 0


NO_RULE = TopkRule()


def topk_rule(form, head_dim: int, k_pages: int) -> TopkRule:
    """The TopkRule of a core.selectors.KernelForm; ValueError when its K does not fit."""
    rule = TopkRule(RULES[form.rule], float(form.param), 1 / math.sqrt(head_dim))
    if rule.shared_bytes(k_pages) > RULE_SMEM_LIMIT:
        raise ValueError(f"a dynamic budget of {k_pages} pages does not fit the top-K kernel's "
                         f"shared memory: at most {RULE_SMEM_LIMIT // RULE_BYTES} pages")
    return rule


def form_tags(kv: PagedKV, form) -> tuple[str, str, str]:
    """(queries, keys, summaries) template tags of a KernelForm's kernels on cache kv;
    ValueError naming what is built otherwise."""
    q_tag, kv_tag, summary_tag = check_kv(kv)
    if form.fp8 or form.boxes > 1:
        if kv.is_fp8:
            raise ValueError("the selectors' FP8 summaries and boxes run over fp16 / bf16 caches "
                             f"only, not {kv.kv_dtype}")
    if form.fp8 and form.boxes > 1:
        raise ValueError("FP8 summaries with boxes are not built")
    if (form.fp8 or form.boxes > 1) and kv.layout != "HND":
        raise ValueError("the selectors' FP8 summaries and boxes read head-major (HND) pages "
                         "only, not token-major (NHD) ones")
    if form.boxes > 1 and (kv.page_size % form.boxes
                           or not variants.boxes_built(kv.head_dim, form.boxes)):
        built = ", ".join(f"{c} at head dim {d}" for d in variants.BOX_HEAD_DIMS
                          for c in variants.BOXES if c > 1 and variants.boxes_built(d, c))
        raise ValueError(f"{form.boxes} boxes per page are not built for head dim "
                         f"{kv.head_dim}, page size {kv.page_size} (built: {built}, boxes "
                         "dividing the page size)")
    return q_tag, kv_tag, variants.TAGS["fp8_e4m3"] if form.fp8 else summary_tag


@dataclass(frozen=True)
class Checked:
    """What the checks of one launcher call found: the template tags (queries, K / V,
    summaries), q's heads and group (0 without q) and the top-K rule (a form's, else NO_RULE)."""

    tags: tuple[str, str, str]
    q_heads: int = 0
    group: int = 0
    rule: TopkRule = NO_RULE


def check_call(kv: PagedKV, q=None, mode: str | None = None, scores=None, budget=None,
               form=None, cache: bool = True) -> Checked:
    """Every check of one launcher call, each once (backends/cupy.py, cupy_selectors.py): the
    cache (with a KernelForm's summaries: form_tags; cache=False for top-K alone, which reads
    the page tables and the scores only, so a cache of tables without K and V runs it), q, the
    mode, scores, the budget (k_pages, sinks, window) and a form's top-K rule at that budget."""
    tags = form_tags(kv, form) if form is not None else check_kv(kv) if cache else ()
    if mode is not None:
        check_mode(mode)
    q_heads, group = check_q(q, kv) if q is not None else (0, 0)
    if scores is not None:
        check_scores(scores, kv)
    rule = NO_RULE
    if budget is not None:
        check_budget(*budget)
        if form is not None:
            rule = topk_rule(form, kv.head_dim, budget[0])
    return Checked(tags, q_heads, group, rule)
