"""Context-parallel Quest: each request's pages split across ranks by position.

A decode step in four phases, two of them collectives (an all-gather each):
  1. candidates: local estimate, then the local top-(K+1) with the local tail forced, which
     contains the local top-K; positions made global.
  2. select: every rank scatters all ranks' candidates into a global score row (-inf elsewhere)
     and runs the ordinary top-K on it: exactly the single-device selection, since the global
     top-K takes at most K pages from any one rank and those are that rank's local top-K.
  3. partial: attention over the selected pages this rank holds -> (out, lse).
  4. merge: out = sum_r exp(lse_r - lse) out_r with lse = logsumexp_r lse_r.
The cheap variant skips phase 2: each rank keeps its own K/N best pages (`local_only`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from questprof.core.layout import PagedKV


def _xp(array):
    try:
        import cupy
        return cupy.get_array_module(array)
    except ImportError:
        return np


@dataclass(frozen=True)
class Shard:
    """The positions [lo, hi) of each request's pages that one rank holds (host arrays)."""

    rank: int
    world: int
    lo: np.ndarray
    hi: np.ndarray


def shard_bounds(pages, world: int, rank: int) -> Shard:
    """Contiguous split by position: rank r holds ceil(P / world) pages from r * ceil(P / world)."""
    pages = np.asarray(pages)
    step = -(-pages // world)
    lo = np.minimum(rank * step, pages)
    return Shard(rank, world, lo, np.minimum(lo + step, pages))


def local_kv(kv: PagedKV, shard: Shard) -> PagedKV:
    """The rank's own pool: only its pages, renumbered 0..n-1, with local tables (host)."""
    indptr = np.asarray(kv.kv_indptr)
    ids = np.concatenate([kv.kv_indices[indptr[b] + shard.lo[b]: indptr[b] + shard.hi[b]]
                          for b in range(kv.batch)]).astype(np.int32)
    counts = shard.hi - shard.lo
    full = np.asarray(kv.pages())
    last = np.where(shard.hi == full, kv.last_page_len, kv.page_size).astype(np.int32)
    lengths = tuple(int(n) for n in np.maximum((counts - 1) * kv.page_size + last, 0))
    return PagedKV(kv.k[ids], kv.v[ids], kv.summary[ids],
                   np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
                   np.arange(len(ids), dtype=np.int32), last, lengths, kv.page_size, kv.dtype)


def tables_only(kv: PagedKV) -> PagedKV:
    """The global page tables with a one-page placeholder pool: all that `select` reads."""
    return kv.with_arrays(lambda a: a[:1] if a.ndim == 4 else a)


def candidates(backend, q, kv_local: PagedKV, shard: Shard, k_pages: int, mode: str):
    """Phase 1: (pos [Hs, B, K+1] int32 global positions or -1, score [Hs, B, K+1] float32)."""
    scores = backend.estimate(q, kv_local, mode)
    sel, _ = backend.topk(scores, kv_local, k_pages + 1)
    xp = _xp(scores)
    lo = backend.asarray(shard.lo.astype(np.int32))[None, :, None]
    start = kv_local.kv_indptr[:-1][None, :, None]
    flat = xp.clip(start + sel, 0, max(scores.shape[1] - 1, 0))
    heads = xp.arange(scores.shape[0])[:, None, None]
    score = scores[heads, flat] if scores.shape[1] else xp.zeros(sel.shape, np.float32)
    ok = sel >= 0
    return xp.where(ok, sel + lo, -1).astype(np.int32), xp.where(ok, score, -np.inf).astype(np.float32)


def select(backend, pos, score, kv: PagedKV, k_pages: int):
    """Phase 2 from gathered candidates [W, Hs, B, K+1]: the exact global (sel, count)."""
    xp = _xp(score)
    heads = pos.shape[1]
    glob = xp.full((heads, int(kv.kv_indptr[-1])), -np.inf, dtype=np.float32)
    flat = kv.kv_indptr[:-1][None, None, :, None] + pos
    h = xp.broadcast_to(xp.arange(heads)[None, :, None, None], pos.shape)
    ok = pos >= 0
    glob[h[ok], flat[ok]] = score[ok]
    return backend.topk(glob, kv, k_pages)


def partial(backend, q, kv_local: PagedKV, shard: Shard, sel, count):
    """Phase 3: attention over the selected pages held here -> (out, lse) of this rank."""
    xp = _xp(sel)
    lo = backend.asarray(shard.lo.astype(np.int32))[None, :, None]
    hi = backend.asarray(shard.hi.astype(np.int32))[None, :, None]
    taken = xp.arange(sel.shape[2])[None, None, :] < count[None, :, None]
    mine = taken & (sel >= lo) & (sel < hi)
    order = xp.argsort(~mine, axis=-1)  # any order: attention does not depend on page order
    local = xp.take_along_axis(xp.where(mine, sel - lo, -1), order, axis=-1).astype(np.int32)
    return backend.attention(q, kv_local, local, mine.sum(axis=-1).astype(np.int32))


def merge(out, lse, dtype: str):
    """Phase 4 from gathered partials out [W, B, Hq, d], lse [W, B, Hq]: float32 (out, lse)."""
    xp = _xp(lse)
    out = to_float32(out, dtype, xp)
    top = lse.max(axis=0)
    safe = xp.where(xp.isfinite(top), top, 0)
    w = xp.exp(lse - safe[None])
    total = w.sum(axis=0)
    merged = (w[..., None] * out).sum(axis=0) / total[..., None]
    return merged.astype(np.float32), (safe + xp.log(total)).astype(np.float32)


def to_float32(x, dtype: str, xp):
    if dtype == "bf16" and x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def local_only(scores_by_rank, shards, pages, k_pages: int):
    """Cheap variant on the host: each rank keeps its K // N best pages (the true tail forced on
    the rank holding it). Returns the kept global positions per (head, request) as sets."""
    world = len(shards)
    keep = max(k_pages // world, 1)
    heads, batch = scores_by_rank[0][0].shape[0], len(pages)
    chosen = [[set() for _ in range(batch)] for _ in range(heads)]
    for shard, (scores, indptr) in zip(shards, scores_by_rank):
        for b in range(batch):
            u = scores[:, indptr[b]:indptr[b + 1]]
            if shard.hi[b] == pages[b] and u.shape[1]:
                u = u.copy()
                u[:, -1] = np.inf
            for h in range(heads):
                best = np.lexsort((np.arange(u.shape[1]), -u[h]))[:keep]
                chosen[h][b] |= {int(p + shard.lo[b]) for p in best}
    return chosen


def miss_rate(exact_sel, exact_count, approx) -> float:
    """Share of the exact global top-K pages that the cheap variant does not keep."""
    exact_sel = np.asarray(exact_sel)
    missed = total = 0
    for h in range(exact_sel.shape[0]):
        for b in range(exact_sel.shape[1]):
            want = set(exact_sel[h, b, : exact_count[b]].tolist())
            missed += len(want - approx[h][b])
            total += len(want)
    return missed / max(total, 1)


def simulate(backend, q, kv: PagedKV, k_pages: int, world: int, mode: str = "per-head"):
    """All ranks of one decode step in one process (host arrays): (out, lse, sel, count)."""
    shards = [shard_bounds(kv.pages(), world, r) for r in range(world)]
    parts = [backend.put(local_kv(kv, s)) for s in shards]
    cands = [candidates(backend, q, p, s, k_pages, mode) for p, s in zip(parts, shards)]
    pos, score = (np.stack([c[i] for c in cands]) for i in (0, 1))
    sel, count = select(backend, pos, score, kv, k_pages)
    partials = [partial(backend, q, p, s, sel, count) for p, s in zip(parts, shards)]
    out, lse = merge(np.stack([p[0] for p in partials]), np.stack([p[1] for p in partials]), kv.dtype)
    return out, lse, sel, count


def held_work(kv: PagedKV, shard: Shard, sel, count, kv_heads: int) -> tuple[int, int]:
    """(summary pages, KV tokens) one rank reads, each summed over requests and KV heads: the
    pages it holds, and per KV head the union of its group's selected pages that it holds
    (valid tokens only: the request's tail page counts last_page_len)."""
    sel, count = np.asarray(sel), np.asarray(count)
    group, full, size = sel.shape[0] // kv_heads, np.asarray(kv.pages()), kv.page_size
    tokens = 0
    for b in range(kv.batch):
        for h in range(kv_heads):
            picks = sel[h * group:(h + 1) * group, b, :count[b]]
            held = np.unique(picks[(picks >= shard.lo[b]) & (picks < shard.hi[b])])
            short = size - int(kv.last_page_len[b])  # invalid slots of the tail page
            tokens += held.size * size - int((held == full[b] - 1).sum()) * short
    return int((shard.hi - shard.lo).sum()) * kv_heads, tokens
