"""NumPy float64 reference of every Quest stage: the specification the kernels are checked against.

Inputs are float64 values (see layout.from_storage), or fp16/fp32 arrays that are widened to
float64 page by page as they are read; an FP8 cache is read dequantized (layout.kv_values,
layout.summary_values: e4m3 value x scale, exact in float64), and summary() returns exact
min/max that layout.encode_summary rounds outward into the summary dtype. Page tables are int
arrays.
Shapes: q [B, Hq, d]; k, v [N, Hkv, S, d]; summary [N, Hkv, 2, d];
scores [Hs, nnz] aligned with kv_indices, Hs = Hq for `per-head`, Hkv for the shared modes;
selections [Hs, B, K] page positions within each request (ascending, -1 padded) and count [B].
"""

from __future__ import annotations

import numpy as np

from questprof.core.stages import MODES, check_mode


def summary(summ: np.ndarray, k: np.ndarray, plan) -> np.ndarray:
    """Summary append/rebuild: a new [N, Hkv, 2, d] with the plan's pages updated from k."""
    out = np.array(summ, dtype=np.float64, copy=True)
    for page, first, end in zip(plan.page_ids, plan.first, plan.end):
        keys = np.asarray(k[page, :, first:end, :], dtype=np.float64)
        lo, hi = keys.min(axis=1), keys.max(axis=1)
        if first > 0:
            lo, hi = np.minimum(lo, out[page, :, 0]), np.maximum(hi, out[page, :, 1])
        out[page, :, 0], out[page, :, 1] = lo, hi
    return out


def _group(q_heads: int, kv_heads: int) -> int:
    if q_heads % kv_heads:
        raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    return q_heads // kv_heads


def estimate(q, summ, kv_indptr, kv_indices, mode: str = "per-head") -> np.ndarray:
    """Upper bounds U_p(q) = sum_j max(q_j m_pj, q_j M_pj): [Hs, nnz]."""
    check_mode(mode)
    batch, q_heads, _ = q.shape
    kv_heads = summ.shape[1]
    g = _group(q_heads, kv_heads)
    req = np.repeat(np.arange(batch), np.diff(kv_indptr))
    box = summ[np.asarray(kv_indices)]                      # [nnz, Hkv, 2, d]
    box = np.repeat(box, g, axis=1)                         # [nnz, Hq, 2, d]
    qq = q[req][:, :, None, :]                              # [nnz, Hq, 1, d]
    u = np.maximum(qq * box[:, :, 0:1], qq * box[:, :, 1:2]).sum(axis=(2, 3)).T  # [Hq, nnz]
    if mode == "per-head":
        return u
    u = u.reshape(kv_heads, g, -1)
    return u.max(axis=1) if mode == "shared-max" else u.mean(axis=1)


def reserved_positions(pages: int, k_pages: int, sinks: int = 0, window: int = 0) -> list[int]:
    """Positions always kept: the first `sinks`, the last max(window, 1) (the tail page)."""
    if sinks + max(window, 1) > k_pages:
        raise ValueError(f"sinks {sinks} + window {max(window, 1)} exceed the budget of {k_pages} pages")
    keep = set(range(min(sinks, pages))) | set(range(max(pages - max(window, 1), 0), pages))
    return sorted(keep)


def topk(scores, kv_indptr, k_pages: int, sinks: int = 0, window: int = 0):
    """K best pages per (head, request), tail page always in; ties go to the lower position.

    Returns (sel [Hs, B, K] int32 ascending positions padded with -1, count [B] int32).
    """
    indptr = np.asarray(kv_indptr)
    heads, batch = scores.shape[0], len(indptr) - 1
    sel = np.full((heads, batch, k_pages), -1, dtype=np.int32)
    count = np.zeros(batch, dtype=np.int32)
    for b in range(batch):
        pages = int(indptr[b + 1] - indptr[b])
        count[b] = min(k_pages, pages)
        keep = reserved_positions(pages, k_pages, sinks, window)
        for h in range(heads):
            u = scores[h, indptr[b]:indptr[b + 1]].astype(np.float64)
            rest = np.setdiff1d(np.arange(pages), keep)
            order = rest[np.lexsort((rest, -u[rest]))]
            chosen = np.sort(np.concatenate([keep, order[: count[b] - len(keep)]])).astype(np.int32)
            sel[h, b, : count[b]] = chosen
    return sel, count


def attention(q, k, v, kv_indptr, kv_indices, last_page_len, sel=None, count=None):
    """Exact decode attention over the selected pages (all pages when sel is None).

    count is [B] or, for selections of different sizes per head, [Hs, B]; a head with no page
    gets out = 0 and lse = -inf (a partial that a log-sum-exp merge ignores).
    Returns (out [B, Hq, d], lse [B, Hq]) with lse the natural log of sum exp(q.k / sqrt(d)).
    """
    batch, q_heads, d = q.shape
    kv_heads, page_size = k.shape[1], k.shape[2]
    g = _group(q_heads, kv_heads)
    sel_group = 1 if sel is None or sel.shape[0] == q_heads else g
    if sel is not None:
        count = np.broadcast_to(np.asarray(count), (sel.shape[0], batch))
    out, lse = np.zeros((batch, q_heads, d)), np.full((batch, q_heads), -np.inf)
    for b in range(batch):
        ids = np.asarray(kv_indices[kv_indptr[b]:kv_indptr[b + 1]])
        valid = np.full(len(ids), page_size)
        valid[-1:] = last_page_len[b]
        for h in range(q_heads):
            hs = h // sel_group
            pos = np.arange(len(ids)) if sel is None else sel[hs, b, : count[hs, b]]
            if len(pos) == 0:
                continue
            ok = (np.arange(page_size)[None, :] < valid[pos][:, None]).ravel()
            keys = np.asarray(k[ids[pos], h // g].reshape(-1, d)[ok], dtype=np.float64)
            vals = np.asarray(v[ids[pos], h // g].reshape(-1, d)[ok], dtype=np.float64)
            s = keys @ q[b, h] / np.sqrt(d)
            m = s.max()
            w = np.exp(s - m)
            out[b, h] = w @ vals / w.sum()
            lse[b, h] = m + np.log(w.sum())
    return out, lse
