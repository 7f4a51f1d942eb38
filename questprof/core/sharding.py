"""Context-parallel Quest: each request's pages split across ranks by position.

A decode step in four phases and two all-gathers, every phase a pure function of backend arrays
(no host synchronisation, no branch on device values), so one rank's step is one CUDA graph:
  1. candidates: local estimate, then the local top-(K+1) (the local tail is forced, so K + 1
     pages contain the local top-K), written with their scores into the send buffer.
  2. select: every rank scatters all ranks' candidates into a global score row (-inf elsewhere)
     and runs the ordinary top-K on it: exactly the single-device selection, since the global
     top-K takes at most K pages from any one rank and those are that rank's local top-K.
  3. partial: attention over the selected pages this rank holds -> (out, lse).
  4. merge: out = sum_r exp(lse_r - lse) out_r with lse = logsumexp_r lse_r.
The cheap variant skips phases 1-2: each rank keeps its own K/N best pages (`local_only`).
`comm` is any object with send(shape, dtype) -> the array to fill, and all_gather(x) ->
[W, *x.shape] (torch.distributed on ranks, a stack in one process: `LocalComm`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from questprof.core.config import ConfigError
from questprof.core.layout import PagedKV


def tensor_parallel(shape, tp: int):
    """One GPU's share of a model shape under head-parallel tensor parallelism over tp GPUs, as
    vLLM shards attention: q_heads / tp query heads over kv_heads / tp KV heads, or over one
    KV head replicated on tp / kv_heads GPUs when kv_heads < tp (Llama-3.1-70B's 64 / 8 heads on
    8 GPUs: 8 q heads over 1 KV head). A split that does not divide the heads is a ConfigError
    in one line. `shape` holds the whole model's heads (tp 1)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp {tp!r} must be a whole number of GPUs, at least 1")
    if shape.tp != 1:
        raise ConfigError(f"model {shape.name} is already split over tp {shape.tp}")
    if tp == 1:
        return shape
    q, kv = shape.q_heads, shape.kv_heads
    if q % tp:
        raise ConfigError(f"tp {tp}: model {shape.name}'s {q} q heads do not split evenly over "
                          f"{tp} GPUs")
    if kv >= tp and kv % tp or kv < tp and tp % kv:
        raise ConfigError(f"tp {tp}: model {shape.name}'s {kv} KV heads neither split evenly "
                          f"over {tp} GPUs nor replicate evenly ({tp} is not a multiple of {kv})")
    return replace(shape, q_heads=q // tp, kv_heads=max(kv // tp, 1), tp=tp)


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
    """The rank's own pool: only its pages, renumbered 0..n-1, with local tables (host tables;
    the pool stays where kv's is). kv's tables must be host arrays."""
    indptr = np.asarray(kv.kv_indptr)
    ids = np.concatenate([kv.kv_indices[indptr[b] + shard.lo[b]: indptr[b] + shard.hi[b]]
                          for b in range(kv.batch)]).astype(np.int32)
    counts = shard.hi - shard.lo
    full = np.asarray(kv.pages())
    last = np.where(shard.hi == full, kv.last_page_len, kv.page_size).astype(np.int32)
    lengths = tuple(int(n) for n in np.maximum((counts - 1) * kv.page_size + last, 0))
    take = _xp(kv.k).asarray(ids)
    return replace(kv, k=kv.k[take], v=kv.v[take], summary=kv.summary[take],
                   kv_indptr=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
                   kv_indices=np.arange(len(ids), dtype=np.int32), last_page_len=last,
                   lengths=lengths)


def tables_only(kv: PagedKV) -> PagedKV:
    """The global page tables with a one-page placeholder pool: all that `select` reads."""
    return kv.with_arrays(lambda a: a[:1] if a.ndim == 4 else a)


@dataclass(frozen=True)
class StepPlan:
    """What one rank's step needs besides the layer's pool, built once (backend arrays).

    glob: global tables (placeholder pool) for the global top-K; lo, hi [1, B, 1] this rank's
    page range; row_off [Hs, B, 1] flat offset of each local score row; base [W, Hs, B, 1]
    flat offset into the global score row of each rank's local position 0; row_k [Hs, B, 1]
    flat offset of each selection row; arange [K].
    """

    glob: PagedKV
    world: int
    heads: int
    k_pages: int
    mode: str
    lo: object
    hi: object
    row_off: object
    base: object
    row_k: object
    arange: object

    @property
    def dummy(self) -> int:
        """Flat index of the global score row's spare slot, where padding candidates land."""
        return self.heads * int(self.glob.kv_indices.size)

    @property
    def candidate_shape(self) -> tuple:
        return (2, self.heads, self.glob.batch, self.k_pages + 1)


def make_plan(backend, kv: PagedKV, kv_local: PagedKV, shard: Shard, heads: int,
              k_pages: int, mode: str) -> StepPlan:
    """The StepPlan of `shard`; kv (global) and kv_local (from local_kv) with host tables."""
    shards = [shard_bounds(kv.pages(), shard.world, r) for r in range(shard.world)]
    h = np.arange(heads)[:, None, None]
    nnz, local_nnz = int(np.asarray(kv.kv_indptr)[-1]), int(np.asarray(kv_local.kv_indptr)[-1])
    lo_all = np.stack([s.lo for s in shards])[:, None, :, None]
    base = h[None] * nnz + np.asarray(kv.kv_indptr)[:-1][None, None, :, None] + lo_all
    row_k = (h * kv.batch + np.arange(kv.batch)[None, :, None]) * k_pages
    arrays = dict(lo=shard.lo[None, :, None], hi=shard.hi[None, :, None],
                  row_off=h * local_nnz + np.asarray(kv_local.kv_indptr)[:-1][None, :, None],
                  base=base, row_k=row_k, arange=np.arange(k_pages))
    put = {k: backend.asarray(np.ascontiguousarray(v, dtype=np.int32)) for k, v in arrays.items()}
    return StepPlan(backend.put(tables_only(kv)), shard.world, heads, k_pages, mode, **put)


def candidates(backend, q, kv_local: PagedKV, plan: StepPlan, send) -> None:
    """Phase 1 into send [2, Hs, B, K+1] float32: the local top-(K+1) scores, then their local
    positions as int32 bits (-1 padded; a padding slot's score is never read)."""
    scores = backend.estimate(q, kv_local, plan.mode)
    sel, _ = backend.topk(scores, kv_local, plan.k_pages + 1)
    xp = _xp(sel)
    if scores.size:  # a shape, not a device value: no rank holds zero pages at real sizes
        xp.take(scores.reshape(-1), plan.row_off + sel, out=send[0])
    send[1].view(np.int32)[...] = sel


def select(backend, gathered, plan: StepPlan):
    """Phase 2 from gathered candidates [W, 2, Hs, B, K+1]: the exact global (sel, count)."""
    xp = _xp(gathered)
    pos = gathered.view(np.int32)[:, 1]
    flat = xp.where(pos >= 0, plan.base + pos, plan.dummy)
    glob = xp.full(plan.dummy + 1, -np.inf, dtype=np.float32)
    glob[flat] = gathered[:, 0]  # one scatter; only the spare slot is written twice
    return backend.topk(glob[:-1].reshape(plan.heads, -1), plan.glob, plan.k_pages)


def partial(backend, q, kv_local: PagedKV, plan: StepPlan, sel, count):
    """Phase 3: attention over the selected pages held here -> (out, lse) of this rank.

    sel rows ascend, so a rank's pages are one run of each row: it starts after the count[b]
    - (picks >= lo) picks below lo and holds (picks >= lo) - (picks >= hi) pages; no sort."""
    xp = _xp(sel)
    from_lo = (sel >= plan.lo).sum(axis=-1)
    held = (from_lo - (sel >= plan.hi).sum(axis=-1)).astype(np.int32)
    first = count[None, :] - from_lo
    at = xp.minimum(first[..., None] + plan.arange, plan.k_pages - 1) + plan.row_k
    local = xp.take(sel.reshape(-1), at) - plan.lo
    return backend.attention(q, kv_local, local, held)


def pack(comm, out, lse, dtype: str):
    """This rank's partial as one send buffer [B, Hq, d+1] float32: out, then lse."""
    send = comm.send((*out.shape[:2], out.shape[2] + 1), np.float32)
    send[..., :-1] = to_float32(out, dtype, _xp(lse)) if dtype == "bf16" else out
    send[..., -1] = lse
    return send


def merge(out, lse):
    """Phase 4 from gathered partials out [W, B, Hq, d], lse [W, B, Hq]: float32 (out, lse)."""
    xp = _xp(lse)
    top = lse.max(axis=0)
    safe = xp.where(xp.isfinite(top), top, 0)
    w = xp.exp(lse - safe[None])
    total = w.sum(axis=0)
    merged = (w[..., None] * out).sum(axis=0) / total[..., None]
    return merged.astype(np.float32, copy=False), (safe + xp.log(total)).astype(np.float32)


def to_float32(x, dtype: str, xp):
    if dtype == "bf16" and x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32, copy=False)


def exact_step(backend, comm, q, kv_local: PagedKV, plan: StepPlan):
    """One rank's exact decode step of a layer: float32 (out [B, Hq, d], lse [B, Hq]) over the
    whole cache, and the global (sel [Hs, B, K], count [B])."""
    send = comm.send(plan.candidate_shape, np.float32)
    candidates(backend, q, kv_local, plan, send)
    sel, count = select(backend, comm.all_gather(send), plan)
    out, lse = partial(backend, q, kv_local, plan, sel, count)
    parts = comm.all_gather(pack(comm, out, lse, kv_local.dtype))
    out, lse = merge(parts[..., :-1], parts[..., -1])
    return out, lse, sel, count


def cheap_step(backend, comm, q, kv_local: PagedKV, plan: StepPlan):
    """The variant without the candidate collective: K // N local pages, then the merge. The
    local Quest step is the backend's own pipeline where it has one (as Workload.quest)."""
    keep = max(plan.k_pages // plan.world, 1)
    if hasattr(backend, "quest"):
        out, lse = backend.quest(q, kv_local, keep, plan.mode)
    else:
        sel, count = backend.topk(backend.estimate(q, kv_local, plan.mode), kv_local, keep)
        out, lse = backend.attention(q, kv_local, sel, count)
    parts = comm.all_gather(pack(comm, out, lse, kv_local.dtype))
    return merge(parts[..., :-1], parts[..., -1])


def step_goal_ms(single_ms, gather_ms, world: int):
    """Issue 15's bound on the step per layer: 1.5 x (single-GPU step / N + one all-gather's
    device time), in ms; None when either time is missing."""
    if single_ms is None or gather_ms is None:
        return None
    return 1.5 * (single_ms / world + gather_ms)


class LocalComm:
    """A world of one in this process (xp: numpy or cupy): all_gather is a stack of one."""

    world, rank = 1, 0

    def __init__(self, xp=np):
        self.xp = xp

    def send(self, shape, dtype):
        return self.xp.empty(shape, dtype)

    def all_gather(self, x):
        return x[None]


def simulate(backend, q, kv: PagedKV, k_pages: int, world: int, mode: str = "per-head"):
    """All ranks of one decode step in one process, phase by phase, each all-gather a stack
    (host arrays): (out, lse, sel, count)."""
    heads = q.shape[1] if mode == "per-head" else kv.kv_heads
    shards = [shard_bounds(kv.pages(), world, r) for r in range(world)]
    hosts = [local_kv(kv, s) for s in shards]
    plans = [make_plan(backend, kv, h, s, heads, k_pages, mode) for h, s in zip(hosts, shards)]
    parts = [backend.put(h) for h in hosts]
    sends = [np.empty(plans[0].candidate_shape, np.float32) for _ in shards]
    for part, plan, send in zip(parts, plans, sends):
        candidates(backend, q, part, plan, send)
    sel, count = select(backend, np.stack(sends), plans[0])
    partials = np.stack([pack(LocalComm(), *partial(backend, q, part, plan, sel, count), kv.dtype)
                         for part, plan in zip(parts, plans)])
    out, lse = merge(partials[..., :-1], partials[..., -1])
    return out, lse, sel, count


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
