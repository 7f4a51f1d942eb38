"""Analytic bytes, FLOPs, rho and Amdahl: the single source of every formula in questprof.

Notation, per layer: B requests of L tokens each, S tokens per page, P = ceil(L/S) pages per
request, K = min(budget // S, P) selected pages, Hq query heads, Hkv KV heads, g = Hq / Hkv,
M = d * (bytes of the cache's dtype) per key or value vector, M_s = d * (bytes of the summaries'
dtype) per min or max vector, Hs = Hq (per-head) or Hkv (shared modes) score rows.
The paper's bytes per KV head per request: T_dense = 2ML, T_index = 2M_sP, T_selected = 2MKS, so
rho = (T_index + T_selected) / T_dense = (M_s/M)/S + K/P: 1/S + K/P when summaries and cache
share a dtype, 2/S + K/P for fp16 summaries over an FP8 cache (queries, outputs: the model's
dtype). Token counts are exact: the tail page holds last = L - (P-1)S valid tokens, all read.

`cfg` is a questprof.core.config.Config (duck-typed: model, length, batch, page_size, budget, mode);
`shape` is a questprof.core.config.ModelShape. All bytes and FLOPs are per layer, whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from questprof.core.fp8 import E4M3
from questprof.core.layout import DTYPE_BYTES, pages_for
from questprof.core.stages import QUEST_STAGES, STAGES

INDEX_BYTES = 4  # int32 page ids, positions, counts, indptr
FLOAT_BYTES = 4  # float32 scores and lse
# Cold-pass rule: a pass of the smallest timed stage (estimate or sparse attention) reads >= 8x L2: every call
# starts cold, and the graph launch of a pass is spread over enough kernels. With one layer
# (a pool >= 4x L2) longchat-7b 32K on an H200 timed Quest at 57.8 us per layer against
# 37.9 us under this rule.
COLD_FACTOR = 8
GROUP_CHUNK = 16  # the most q heads one attention CTA row serves (QP_GROUPS' largest tile)


def pages(length: int, page_size: int) -> int:
    """P = ceil(L / S): pages holding `length` tokens."""
    return pages_for(length, page_size)


def last_page_len(length: int, page_size: int) -> int:
    """Valid tokens in the tail page, 1..S."""
    return length - (pages(length, page_size) - 1) * page_size


def k_pages(budget: int, page_size: int, pages: int | None = None) -> int:
    """K = budget // S pages; capped at `pages` when given (uncapped it is the top-K width)."""
    k = budget // page_size
    return k if pages is None else min(k, pages)


def is_dense(k: int, pages: int) -> bool:
    """K >= P: Quest would select every page, so the sweep runs (and counts) dense attention."""
    return k >= pages


def rho(page_size: int, k: int, pages: int, summary_ratio: float = 1.0) -> float:
    """The paper's byte ratio (M_s/M)/S + K/P, K capped at P (then 1/S + 1: see `is_dense`)."""
    return summary_ratio / page_size + min(k, pages) / pages


def selector_rho(page_size: int, read: float, pages: int, boxes=1.0, ms=2, m=2) -> float:
    """boxes x (ms/m)/S + read/P: c boxes per page (0: none), ms/m bytes of summary/key element."""
    return boxes * ms / m / page_size + read / pages


def summary_ratio(shape) -> float:
    """M_s / M: bytes of a summary vector over those of a key vector (2 for fp16 over FP8)."""
    return summary_vector_bytes(shape) / vector_bytes(shape)


def rho_text(shape) -> str:
    """Which formula of rho applies to the shape's cache and summaries, in words."""
    return rho_words(kv_dtype(shape), summary_dtype(shape))


def rho_words(kv: str, summary: str) -> str:
    """'1/S + K/P'; over an FP8 cache '2/S + K/P (fp16 summaries over an FP8 cache)' or FP8's."""
    formula = f"{DTYPE_BYTES[summary] / DTYPE_BYTES[kv]:g}/S + K/P"
    if kv != E4M3:
        return formula
    return f"{formula} ({'FP8' if summary == E4M3 else summary} summaries over an FP8 cache)"


@dataclass(frozen=True)
class StageWork:
    """Work of one stage over a layer and the batch; bytes and FLOPs.

    read: bytes the formula counts (KV vectors, summaries); unmodelled_read: q, scores,
    selections, page tables; write: scores, selections, out, lse, summaries.
    bound: True when `read` is an upper bound (GQA per-head union of pages not measured).
    """

    stage: str
    read: float
    unmodelled_read: float
    write: float
    flops: float
    bound: bool = False

    @property
    def total_read(self) -> float:
        return self.read + self.unmodelled_read

    @property
    def total_bytes(self) -> float:
        return self.total_read + self.write


def kv_dtype(shape) -> str:
    """The KV cache's dtype (the model's unless the shape says fp8_e4m3)."""
    return getattr(shape, "kv_dtype", "") or shape.dtype


def summary_dtype(shape) -> str:
    """The summaries' dtype (the cache's unless the shape says otherwise)."""
    return getattr(shape, "summary_dtype", "") or kv_dtype(shape)


def vector_bytes(shape) -> int:
    """M: bytes of one key or value vector of one head, in the cache's dtype."""
    return shape.head_dim * DTYPE_BYTES[kv_dtype(shape)]


def summary_vector_bytes(shape) -> int:
    """M_s: bytes of one min or max vector of one head's page summary."""
    return shape.head_dim * DTYPE_BYTES[summary_dtype(shape)]


def io_vector_bytes(shape) -> int:
    """Bytes of one query or output vector of one head, in the model's dtype."""
    return shape.head_dim * DTYPE_BYTES[shape.dtype]


def scale_bytes(shape, tensors: int) -> int:
    """float32 per-KV-head scales of `tensors` FP8 tensors (k_scale, v_scale) read by a call."""
    return tensors * shape.kv_heads * FLOAT_BYTES if kv_dtype(shape) == E4M3 else 0


def score_heads(cfg) -> int:
    """Hs: rows of scores and selections (one per q head in per-head mode, per KV head shared)."""
    return cfg.model.q_heads if cfg.mode == "per-head" else cfg.model.kv_heads


def union_pages_bound(cfg) -> int:
    """Upper bound on pages one KV head reads in per-head mode: min(g(K-1) + 1, P) (the tail
    page is in every head's selection, so g heads of K pages share at least it)."""
    p = pages(cfg.length, cfg.page_size)
    k = k_pages(cfg.budget, cfg.page_size, p)
    return min(cfg.model.group * (k - 1) + 1, p)


def shard_read(shape, summary_pages: int, kv_tokens: int) -> int:
    """Formula bytes (T_index + T_selected) of `summary_pages` page summaries and `kv_tokens` K
    and V vectors, both counted per KV head: one rank's share of context-parallel Quest."""
    return 2 * (summary_vector_bytes(shape) * summary_pages + vector_bytes(shape) * kv_tokens)


def _tokens(pages_read: float, cfg) -> float:
    """Valid tokens in `pages_read` pages of a request, the tail page (always read) included."""
    return (pages_read - 1) * cfg.page_size + last_page_len(cfg.length, cfg.page_size)


def _q_bytes(cfg) -> int:
    return cfg.batch * cfg.model.q_heads * io_vector_bytes(cfg.model)


def kv_reads(shape) -> int:
    """Times dense (and shared-mode) attention reads a KV head's pages: a group over GROUP_CHUNK
    q heads runs in ceil(g / GROUP_CHUNK) chunks, a CTA row each, each reading them (71: 5)."""
    return -(-shape.group // GROUP_CHUNK)


def _summary(cfg) -> StageWork:
    """Decode append of one token per request: read its key (and the old min/max unless the
    token opens a fresh page), write the page's min/max; 2d comparisons per KV head. fp16
    summaries of an FP8 cache read k_scale to dequantize; FP8 ones compare codes."""
    m, b, vec, svec = cfg.model, cfg.batch, vector_bytes(cfg.model), summary_vector_bytes(cfg.model)
    fresh = last_page_len(cfg.length, cfg.page_size) == 1
    read = b * m.kv_heads * (vec + (0 if fresh else 2 * svec))
    scales = scale_bytes(m, 1) if summary_dtype(m) != kv_dtype(m) else 0
    plan = b * 3 * INDEX_BYTES  # AppendPlan: page id, first, end per request
    return StageWork("summary", read, plan + scales, b * m.kv_heads * 2 * svec,
                     b * m.kv_heads * 2 * m.head_dim)


def _estimate(cfg) -> StageWork:
    """Read 2M_s per page per KV head (T_index), write float32 scores [Hs, nnz]; ~3d FLOPs per
    page per q head (two products, a max, an add per dimension, products shared). FP8
    summaries read k_scale too."""
    m, b = cfg.model, cfg.batch
    nnz = b * pages(cfg.length, cfg.page_size)
    tables = (nnz + b + 1) * INDEX_BYTES + (scale_bytes(m, 1) if summary_dtype(m) == E4M3 else 0)
    return StageWork("estimate", nnz * m.kv_heads * 2 * summary_vector_bytes(m),
                     _q_bytes(cfg) + tables,
                     score_heads(cfg) * nnz * FLOAT_BYTES, 3 * m.head_dim * m.q_heads * nnz)


def _topk(cfg) -> StageWork:
    """Read scores, write int32 selections [Hs, B, budget // S] and counts [B]; about one
    comparison per score (a radix/threshold select is linear in nnz)."""
    b, hs = cfg.batch, score_heads(cfg)
    nnz = b * pages(cfg.length, cfg.page_size)
    width = k_pages(cfg.budget, cfg.page_size)
    return StageWork("topk", 0, (hs * nnz + b + 1) * INDEX_BYTES,
                     (hs * b * width + b) * INDEX_BYTES, hs * nnz)


def _attention(cfg, union_pages: float | None) -> StageWork:
    """Sparse attention over the selected pages' valid tokens (T_selected, exact tail);
    4d FLOPs per token per q head (q.k and p.v)."""
    m, b, hs = cfg.model, cfg.batch, score_heads(cfg)
    p = pages(cfg.length, cfg.page_size)
    k = k_pages(cfg.budget, cfg.page_size, p)
    read_pages, bound = float(k), False
    if cfg.mode == "per-head" and m.group > 1 and k < p:
        if union_pages is None:
            read_pages, bound = float(union_pages_bound(cfg)), True
        elif not k <= union_pages <= min(m.group * k, p):
            raise ValueError(f"mean union of {union_pages} pages is outside {k}..{min(m.group * k, p)}")
        else:
            read_pages = float(union_pages)
    reads = 1 if cfg.mode == "per-head" else kv_reads(m)  # per-head: the union of q heads' rows
    kv = b * m.kv_heads * 2 * vector_bytes(m) * _tokens(read_pages, cfg) * reads
    tables = (2 * hs * b * k + 3 * b + 1) * INDEX_BYTES  # positions, their page ids, indptr/last/count
    tables += scale_bytes(m, 2)
    write = b * m.q_heads * (io_vector_bytes(m) + FLOAT_BYTES)  # out + lse
    flops = b * m.q_heads * _tokens(k, cfg) * 4 * m.head_dim
    return StageWork("attention", kv, _q_bytes(cfg) + tables, write, flops, bound)


def per_head_kv_read(cfg) -> float:
    """K and V bytes of per-head sparse attention where no page read serves another q head:
    each q head's own K chosen pages, B x Hq x 2M x tokens(K). Over mapped host memory
    (core/tier.py) the link carried exactly this on the H200 (2026-12-02, llama3-8b 16K budget
    1024 per-head: 4 x K pages per KV head, calibrated +0.0016% and +0.006% in two runs), where in HBM the group's other
    q heads read the pages the first one brought into L2 (the union, _attention)."""
    m = cfg.model
    k = k_pages(cfg.budget, cfg.page_size, pages(cfg.length, cfg.page_size))
    return cfg.batch * m.q_heads * 2 * vector_bytes(m) * _tokens(k, cfg)


def _dense(cfg) -> StageWork:
    """Dense paged decode over all L tokens (T_dense): the baseline."""
    m, b, nnz = cfg.model, cfg.batch, cfg.batch * pages(cfg.length, cfg.page_size)
    kv = b * m.kv_heads * 2 * vector_bytes(m) * cfg.length * kv_reads(m)
    tables = (nnz + 2 * b + 1) * INDEX_BYTES + scale_bytes(m, 2)  # kv_indices, indptr, last
    write = b * m.q_heads * (io_vector_bytes(m) + FLOAT_BYTES)
    return StageWork("dense", kv, _q_bytes(cfg) + tables, write,
                     b * m.q_heads * cfg.length * 4 * m.head_dim)


def stage_work(cfg, union_pages: float | None = None) -> dict[str, StageWork]:
    """Work of every stage in STAGES for one configuration.

    union_pages: measured mean pages read per (request, KV head) in GQA per-head mode; None
    uses `union_pages_bound` and marks attention `bound`. Shared modes read K pages per KV head.
    """
    return {"summary": _summary(cfg), "estimate": _estimate(cfg), "topk": _topk(cfg),
            "attention": _attention(cfg, union_pages), "dense": _dense(cfg)}


def total(works, stage: str) -> StageWork:
    """Sum of several StageWork under one name (bound if any part is)."""
    works = list(works)
    sums = {f.name: sum(getattr(w, f.name) for w in works)
            for f in fields(StageWork) if f.name not in ("stage", "bound")}
    return StageWork(stage, bound=any(w.bound for w in works), **sums)


def quest_work(cfg, union_pages: float | None = None) -> StageWork:
    """One Quest step of a layer: estimate + topk + attention (the summary append is separate)."""
    work = stage_work(cfg, union_pages)
    return total((work[s] for s in QUEST_STAGES), "quest")


def quest_rho(cfg, union_pages: float | None = None) -> float:
    """Modelled rho with exact tokens: (index + selected bytes) / dense bytes."""
    work = stage_work(cfg, union_pages)
    return (work["estimate"].read + work["attention"].read) / work["dense"].read


def intensity(work: StageWork) -> float:
    """Arithmetic intensity for the roofline, FLOPs per byte moved (all reads and writes)."""
    return work.flops / work.total_bytes if work.total_bytes else math.inf


def amdahl_step_time(fraction: float, speedup: float) -> float:
    """Step time relative to the original, (1 - f) + f / s, when a fraction f is sped up s x."""
    if not 0.0 <= fraction <= 1.0 or speedup <= 0:
        raise ValueError(f"need 0 <= fraction <= 1 and speedup > 0, got {fraction}, {speedup}")
    return (1.0 - fraction) + fraction / speedup


def amdahl_speedup(fraction: float, speedup: float) -> float:
    """End-to-end speedup 1 / ((1 - f) + f / s)."""
    return 1.0 / amdahl_step_time(fraction, speedup)


def step_attention_time(shape, dense_time: float, quest_time: float) -> float:
    """Attention time of a decode step over all layers: the first dense_layers stay dense."""
    return shape.dense_layers * dense_time + (shape.layers - shape.dense_layers) * quest_time


def _hidden(shape) -> int:
    """The model's hidden size as the weights count it: all its q heads x head_dim."""
    return shape.q_heads * getattr(shape, "tp", 1) * shape.head_dim


def mlp_width(shape) -> int:
    """MLP intermediate size: the shape's, else 8/3 * hidden rounded up to 256 (11008 at 4096)."""
    return shape.intermediate or -(-(8 * _hidden(shape)) // (3 * 256)) * 256


def weight_params(shape) -> int:
    """Weights one GPU reads in a decode step, h = q_heads * tp * head_dim: per layer q/o
    2h * q_heads * d (2h^2 at tp 1), k/v 2h * kv_heads * d (replicated heads on every GPU),
    gated MLP 3h * intermediate / tp; the LM head vocab * h / tp. Norms and the embedding row
    (one per request) are negligible."""
    tp, hidden = getattr(shape, "tp", 1), _hidden(shape)
    attn = 2 * hidden * (shape.q_heads + shape.kv_heads) * shape.head_dim
    return shape.layers * (attn + 3 * hidden * mlp_width(shape) // tp) + shape.vocab * hidden // tp


def weight_bytes(shape, bits: float = 16) -> float:
    """Bytes of weights per decode step at `bits` per weight (quantisation scales not counted)."""
    return weight_params(shape) * bits / 8


def kv_pool_bytes(cfg) -> int:
    """Device bytes of one layer's K, V pools and summaries for the batch ([N, Hkv, S, d] x 2 +
    [N, Hkv, 2, d]), N = B * P: to check a point fits before building it."""
    m, n = cfg.model, cfg.batch * pages(cfg.length, cfg.page_size)
    return n * m.kv_heads * 2 * (vector_bytes(m) * cfg.page_size + summary_vector_bytes(m))


def predicted_4bit(fraction: float, speedup: float, weight_ratio: float) -> float:
    """Amdahl speedup with the step's non-attention part scaled by `weight_ratio`.

    Assumption (the paper's AWQ case): the non-attention time of a decode step is bound by
    reading the weights (at small batch each projection is a GEMV that reads every weight once
    and does 2 FLOPs per weight), so 4-bit weights shrink it by weight_bytes(4) / weight_bytes(16)
    while attention, over an fp16 KV cache, keeps its time. Dequantisation work and scales are
    ignored, so this is an upper bound; at larger batch the MLP turns compute-bound and it
    overstates more. Relative to the fp16 dense step: dense = (1-f) r + f, Quest = (1-f) r + f/s.
    """
    dense = (1.0 - fraction) * weight_ratio + fraction
    return amdahl_speedup(fraction / dense, speedup)


def cold_layers(cfg, l2: int, pool_budget: float) -> int:
    """Simulated layers of a cold pass for cfg: >= COLD_FACTOR x L2 read by its smallest timed
    stage, at least 2, and no more pools than pool_budget bytes hold (then at least 1)."""
    work = stage_work(cfg)
    smallest = max(1.0, min(work["estimate"].read, work["attention"].read))
    want = max(2, -(-COLD_FACTOR * l2 // int(smallest)))
    return int(max(1, min(want, pool_budget // kv_pool_bytes(cfg))))


def cold_read_layers(nbytes: int, l2: int) -> int:
    """Buffers of `nbytes` a cold pass of a plain read walks (the same COLD_FACTOR rule)."""
    return max(2, -(-COLD_FACTOR * l2 // max(nbytes, 1)))
