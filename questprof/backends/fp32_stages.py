"""Float32 stage math of the NumPy backend's fast path (backends/numpy_fp32.py).

The same stages, inputs and outputs as core/reference.py (which stays the specification, in
float64), computed on float32 working copies laid out head-major and in request order, so that
each stage is a few batched BLAS calls per request instead of Python loops over pages and heads:
estimate is two dot products per page folded into one (U = min(q,0).m + max(q,0).M, the same
bound as sum_j max(q_j m_j, q_j M_j) when m <= M), top-K a partition, attention a matmul of the
scores and one of the weights. tests/test_numpy_fp32.py holds it to the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from questprof.core.reference import reserved_positions
from questprof.core.stages import check_mode


@dataclass
class Working:
    """Float32 copies of one layer's cache, head-major in request order (position j = the j-th
    entry of kv_indices): k, v [Hkv, nnz, S, d] with the slots past a page's valid length 0;
    box [Hkv, nnz, 2d], each page's [min | max]; valid [nnz] valid slots; indptr [B + 1]."""

    k: np.ndarray
    v: np.ndarray
    box: np.ndarray
    valid: np.ndarray
    indptr: np.ndarray


def group(q_heads: int, kv_heads: int) -> int:
    """q heads per KV head."""
    if q_heads % kv_heads:
        raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    return q_heads // kv_heads


def estimate(q: np.ndarray, w: Working, mode: str = "per-head") -> np.ndarray:
    """Upper bounds U_p(q) [Hs, nnz] float32 from q [B, Hq, d] float32 (reference.estimate)."""
    check_mode(mode)
    batch, q_heads, d = q.shape
    kv_heads = w.box.shape[0]
    g = group(q_heads, kv_heads)
    u = np.empty((q_heads, w.box.shape[1]), dtype=np.float32)
    for b in range(batch):
        lo, hi = int(w.indptr[b]), int(w.indptr[b + 1])
        qc = np.concatenate([np.minimum(q[b], 0), np.maximum(q[b], 0)], axis=-1)  # [Hq, 2d]
        qc = qc.reshape(kv_heads, g, 2 * d).transpose(0, 2, 1)                   # [Hkv, 2d, g]
        part = np.matmul(w.box[:, lo:hi], qc)                                     # [Hkv, P, g]
        u[:, lo:hi] = part.transpose(0, 2, 1).reshape(q_heads, hi - lo)
    if mode == "per-head":
        return u
    u = u.reshape(kv_heads, g, -1)
    return u.max(axis=1) if mode == "shared-max" else u.mean(axis=1, dtype=np.float32)


def minmax(keys: np.ndarray, first: np.ndarray, end: np.ndarray):
    """(min, max) [H, n, d] over slots [first, end) of keys [H, n, S, d] (float32, or the uint8
    order keys of FP8 codes: backends/fp32_fp8.py)."""
    size = keys.shape[2]
    if (first == 0).all() and (end == size).all():
        return keys.min(axis=2), keys.max(axis=2)
    slots = np.arange(size)[None, :, None]
    inside = ((slots >= first[:, None, None]) & (slots < end[:, None, None]))[None]
    if keys.dtype.kind == "f":
        big, small = np.inf, -np.inf
    else:
        big, small = np.iinfo(keys.dtype).max, np.iinfo(keys.dtype).min
    big, small = keys.dtype.type(big), keys.dtype.type(small)
    return np.where(inside, keys, big).min(axis=2), np.where(inside, keys, small).max(axis=2)


def _best(u: np.ndarray, m: int) -> np.ndarray:
    """Mask [H, R] of the m largest of each row of u, ties to the lower index (NaN ranks last
    among equals only through the threshold: scores are finite in practice)."""
    rows, width = u.shape
    if m >= width:
        return np.ones((rows, width), dtype=bool)
    threshold = np.partition(u, width - m, axis=1)[:, width - m:width - m + 1]
    above = u > threshold
    tied = u == threshold
    need = m - above.sum(axis=1, keepdims=True)
    return above | (tied & (np.cumsum(tied, axis=1) <= need))


def topk(scores, kv_indptr, k_pages: int, sinks: int = 0, window: int = 0):
    """(sel [Hs, B, K] int32 ascending, -1 padded; count [B] int32): reference.topk's choice
    (reserved sinks and tail window, then the best scores, ties to the lower position)."""
    indptr = np.asarray(kv_indptr)
    heads, batch = scores.shape[0], len(indptr) - 1
    sel = np.full((heads, batch, k_pages), -1, dtype=np.int32)
    count = np.zeros(batch, dtype=np.int32)
    for b in range(batch):
        lo, hi = int(indptr[b]), int(indptr[b + 1])
        pages = hi - lo
        count[b] = min(k_pages, pages)
        keep = reserved_positions(pages, k_pages, sinks, window)
        chosen = np.zeros((heads, pages), dtype=bool)
        chosen[:, keep] = True
        if count[b] > len(keep):
            rest = np.flatnonzero(~chosen[0])
            chosen[:, rest] = _best(np.asarray(scores[:, lo:hi])[:, rest], count[b] - len(keep))
        sel[:, b, :count[b]] = np.nonzero(chosen)[1].reshape(heads, count[b])
    return sel, count


def _softmax_out(s: np.ndarray, v: np.ndarray):
    """(out [H, g, d], lse [H, g]) of scores s [H, n, g] (-inf where masked; overwritten) and
    values v [H, n, d]; a head with every score masked gets out 0 and lse -inf."""
    m = s.max(axis=1, keepdims=True) if s.shape[1] else np.full((s.shape[0], 1, s.shape[2]),
                                                                  -np.inf, np.float32)
    m[m == -np.inf] = 0
    np.subtract(s, m, out=s)
    np.exp(s, out=s)
    total = s.sum(axis=1)                                           # [H, g]
    o = np.matmul(s.transpose(0, 2, 1), v)                          # [H, g, d]
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(total[..., None] == 0, 0, o / total[..., None])
        lse = np.where(total == 0, -np.inf, m[:, 0] + np.log(total))
    return out, lse


def _dense(qb: np.ndarray, w: Working, b: int):
    """Attention of request b over all its valid tokens: qb [Hkv, d, g] (scaled)."""
    lo, hi = int(w.indptr[b]), int(w.indptr[b + 1])
    kv_heads, _, size, d = w.k.shape
    n = (hi - lo - 1) * size + int(w.valid[hi - 1]) if hi > lo else 0
    k = w.k[:, lo:hi].reshape(kv_heads, -1, d)[:, :n]
    v = w.v[:, lo:hi].reshape(kv_heads, -1, d)[:, :n]
    return _softmax_out(np.matmul(k, qb), v)


def _sparse(qs: np.ndarray, w: Working, lo: int, pos: np.ndarray, cnt: np.ndarray,
            kv_head: np.ndarray):
    """Attention of one request over selected pages: qs [Hs, d, r] (scaled), pos [Hs, c]
    positions within the request (entries past cnt[h] ignored), kv_head [Hs]. One head at a
    time, its pages gathered into buffers that stay in cache (np.take into them: 0.5 ns a
    value against 0.8 for fancy indexing on the 2-core machine, 2026-12-01)."""
    heads, c = pos.shape
    _, _, size, d = w.k.shape
    ok = np.arange(c)[None, :] < cnt[:, None]
    j = lo + np.where(ok, pos, 0)
    dead = ~(ok[:, :, None] & (np.arange(size) < w.valid[j][:, :, None])).reshape(heads, -1)
    out = np.empty((heads, qs.shape[2], d), dtype=np.float32)
    lse = np.empty((heads, qs.shape[2]), dtype=np.float32)
    k, v = (np.empty((c, size, d), dtype=np.float32) for _ in range(2))
    for h in range(heads):
        np.take(w.k[kv_head[h]], j[h], axis=0, out=k, mode="clip")
        np.take(w.v[kv_head[h]], j[h], axis=0, out=v, mode="clip")
        s = np.matmul(k.reshape(-1, d), qs[h])                    # [c * S, r]
        s[dead[h]] = -np.inf
        o, l = _softmax_out(s[None], v.reshape(1, -1, d))
        out[h], lse[h] = o[0], l[0]
    return out, lse


def attention(q: np.ndarray, w: Working, sel=None, count=None):
    """(out [B, Hq, d], lse [B, Hq]) float32 from q [B, Hq, d] float32: reference.attention
    over the selected pages (all pages when sel is None); count [B] or [Hs, B]."""
    batch, q_heads, d = q.shape
    kv_heads = w.k.shape[0]
    g = group(q_heads, kv_heads)
    qs = q * np.float32(1 / np.sqrt(d))
    out = np.zeros((batch, q_heads, d), dtype=np.float32)
    lse = np.full((batch, q_heads), -np.inf, dtype=np.float32)
    if sel is None:
        for b in range(batch):
            qb = qs[b].reshape(kv_heads, g, d).transpose(0, 2, 1)
            o, l = _dense(qb, w, b)
            out[b], lse[b] = o.reshape(q_heads, d), l.reshape(q_heads)
        return out, lse
    sel = np.asarray(sel)
    heads = sel.shape[0]
    r = 1 if heads == q_heads else g  # q heads per selection head
    count = np.broadcast_to(np.asarray(count), (heads, batch))
    kv_head = (np.arange(heads) * r) // g
    for b in range(batch):
        c = int(count[:, b].max(initial=0))
        if c == 0:
            continue
        qb = qs[b].reshape(heads, r, d).transpose(0, 2, 1)
        o, l = _sparse(qb, w, int(w.indptr[b]), sel[:, b, :c], count[:, b], kv_head)
        out[b], lse[b] = o.reshape(q_heads, d), l.reshape(q_heads)
    return out, lse
