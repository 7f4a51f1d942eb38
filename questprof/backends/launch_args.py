"""What the CuPy launchers (backends/cupy.py) check before a launch: the cache's dtypes, storage
and shape against the built kernels, q against the cache, a selection against both, and how the
CTA rows of attention cover the q heads. Only NumPy dtypes and array attributes are read, so CI
checks these rules without CuPy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from questprof.backends import constants, variants
from questprof.core.layout import PagedKV, storage_dtype
from questprof.core.reference import reserved_positions

_INT32 = np.dtype(np.int32)
_PS = constants.load()  # the persistent step's constants (PS_*)


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
    problem = variants.shape_problem(kv.head_dim, kv.page_size)
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
    if form.boxes > 1 and (kv.page_size % form.boxes
                           or not variants.boxes_built(kv.head_dim, form.boxes)):
        built = ", ".join(f"{c} at head dim {d}" for d in variants.BOX_HEAD_DIMS
                          for c in variants.BOXES if c > 1 and variants.boxes_built(d, c))
        raise ValueError(f"{form.boxes} boxes per page are not built for head dim "
                         f"{kv.head_dim}, page size {kv.page_size} (built: {built}, boxes "
                         "dividing the page size)")
    return q_tag, kv_tag, variants.TAGS["fp8_e4m3"] if form.fp8 else summary_tag


STOPS = {"estimate": 1, "select": 2, "all": 3}  # what a launch runs (PS_STOP_* of quest_step.cuh)


@dataclass(frozen=True)
class StepTuning:
    """A build of the persistent step and its launch: quest_step.cuh's QS_* options (threads per
    CTA, CTAs per SM its registers are sized for; defaults kernels/constants.cuh's PS_*) and
    two launch arguments: `queue_ctas`, CTAs that start on the queue of select and attention
    tickets while the others score the estimate (at most the grid less one), and `att_waves`,
    attention tickets per CTA of the grid that the splits aim at (persistent_splits)."""

    threads: int = _PS["PS_THREADS"]
    ctas_per_sm: int = _PS["PS_CTAS_PER_SM"]
    queue_ctas: int = 16
    att_waves: float = 3.0

    def defines(self) -> tuple[str, ...]:
        """-D options of this build (none for the default one)."""
        pairs = (("QS_THREADS", self.threads, _PS["PS_THREADS"]),
                 ("QS_CTAS", self.ctas_per_sm, _PS["PS_CTAS_PER_SM"]))
        return tuple(f"{name}={value}" for name, value, default in pairs if value != default)


DEFAULT_TUNING = StepTuning()
# The builds and launches tools/quest_step_probe.py times against the default (and the GPU tests
# check): threads per CTA, CTAs per SM, CTAs on the queue from the start.
TUNINGS = {"default": DEFAULT_TUNING, "queue-0": StepTuning(queue_ctas=0),
           "queue-32": StepTuning(queue_ctas=32), "splits-x1": StepTuning(att_waves=1.0),
           "splits-x6": StepTuning(att_waves=6.0),
           "threads-128x3": StepTuning(threads=128, ctas_per_sm=3, att_waves=2.0)}


def persistent_problem(q_heads: int, kv_heads: int, head_dim: int, kv_dtype: str,
                       summary_dtype: str, mode: str, dtype: str = "") -> str | None:
    """Why the persistent Quest step (kernels/quest_step.cu) is not built for a shape, or None:
    16-bit caches with their own summaries, head dims PS_HEAD_DIMS, groups up to the largest of
    PS_GROUPS, per-head selection (any mode at one q head per KV head)."""
    dims, groups = _PS["PS_HEAD_DIMS"], _PS["PS_GROUPS"]
    g = q_heads // kv_heads if kv_heads and q_heads % kv_heads == 0 else 0
    built = "the persistent step is built for"
    if kv_dtype not in ("fp16", "bf16") or summary_dtype != kv_dtype or dtype not in ("", kv_dtype):
        return f"{built} fp16 / bf16 caches, not {kv_dtype}"
    if head_dim not in dims:
        return f"{built} head dims {', '.join(map(str, dims))}, not {head_dim}"
    if not 1 <= g <= groups[-1]:
        return f"{built} up to {groups[-1]} q heads per KV head, not {g or q_heads}"
    if mode != "per-head" and g > 1:
        return f"{built} per-head selection ({mode} at {g} q heads per KV head is not built)"
    return None


def persistent_ring_bytes(d: int) -> int:
    """Dynamic shared memory of a persistent-step CTA: ATT_WARPS rings of PS_STAGES stages of the
    CUDA-core attention tile (K and V rows of its tokens); top-K's keys use the same bytes."""
    return variants.ATT_WARPS * _PS["PS_STAGES"] * 2 * variants.tile_tokens(d, 1) * d * 2


def persistent_splits(rows: int, row_pages: int, page_size: int, d: int,
                      tickets: int) -> tuple[int, int]:
    """(splits, pages per split) of the persistent step's attention: about `tickets` attention
    tickets (StepTuning.att_waves per CTA of the grid), each warp at least two tiles, at most
    PS_MAX_SPLIT_PAGES pages."""
    min_pages = max(1, -(-2 * variants.ATT_WARPS * variants.tile_tokens(d, 1) // page_size))
    want = max(1, tickets // rows)
    per_split = min(_PS["PS_MAX_SPLIT_PAGES"], max(min_pages, -(-row_pages // want)))
    return -(-row_pages // per_split), per_split