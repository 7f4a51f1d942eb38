"""The NumPy backend's float32 path: what a sweep times on a machine without a GPU.

NumpyBackend runs the float64 reference (core/reference.py), the specification; a sweep of it
is CPU time nobody acts on (the longchat-7b main job took 1,019 s on 2 cores at 5aeb93e). This
backend computes the same stages in float32, the precision the kernels accumulate in, on float32
working copies of each cache (backends/fp32_copies.py: head-major, in request order), so each
stage is a few BLAS calls per request (backends/fp32_stages.py). The `summary` stage re-reads
the pages of its plan (the slots a caller wrote), so writing K/V and then calling `summary`, the
protocol's order, keeps the copies current. FP8 (e4m3) caches run too: their codes decoded into
the float32 copies once per pool, summaries taken on the codes (backends/fp32_fp8.py). Its rows
say `numpy-fp32`.
"""

from __future__ import annotations

import numpy as np

from questprof.backends import fp32_fp8, fp32_stages
from questprof.backends.arena import Arena
from questprof.backends.blas import one_thread
from questprof.backends.fp32_copies import Copies, Tiles, chunks, f32, span, summary_f32
from questprof.backends.fp32_stages import minmax
from questprof.backends.numpy import HostArrays
from questprof.core.fp8 import E4M3
from questprof.core.layout import DTYPE_BYTES, AppendPlan, PagedKV, head_major_only, to_storage

_ATTR = "_fp32_copies"  # where put() keeps a cache's working copies (dataclasses.replace drops it)


def _copies(kv: PagedKV, keep: bool = True) -> Copies | None:
    """put()'s working copies of kv, current with its tables; else (keep) copies read now."""
    copies = getattr(kv, _ATTR, None)
    if copies is None:
        return Copies(kv) if keep else None
    copies = copies.current(kv)
    setattr(kv, _ATTR, copies)
    return copies


def _read_summarised(kv: PagedKV, copies: Copies, pos, first, end):
    """(min, max) [H, n, d] of positions pos over slots [first, end), their K and V read into
    the copies on the way, each head's K summarised right after it is read (in cache)."""
    lo, hi = (np.empty((kv.kv_heads, len(pos), kv.head_dim), np.float32) for _ in range(2))

    def each(h, block):
        np.min(block, axis=1, out=lo[h])
        np.max(block, axis=1, out=hi[h])
    copies.write_kv(kv, pos, each)
    part = (first != 0) | (end != kv.page_size)  # a tail, an append: some slots only
    if part.any():
        lo[:, part], hi[:, part] = minmax(copies.w.k[:, pos[part]], first[part], end[part])
    return lo, hi


def _plain_summaries(kv: PagedKV, copies, ids, first, end, pos):
    """(min, max) [H, n, d] of a plain cache's pages `ids`, written to its summaries (exact:
    every storage value is a float32) and merged with the stored ones where first > 0."""
    mine = pos >= 0
    if mine.all():
        lo, hi = _read_summarised(kv, copies, pos, first, end)
    else:
        if mine.any():
            copies.write_kv(kv, pos[mine])
        keys = f32(kv.k[ids], kv.dtype).transpose(1, 0, 2, 3)      # [H, n, S, d]
        lo, hi = minmax(keys, first, end)
    old = first > 0
    if old.any():
        prev = f32(kv.summary[ids[old]], kv.dtype)                # [m, H, 2, d]
        lo[:, old] = np.minimum(lo[:, old], prev[:, :, 0].transpose(1, 0, 2))
        hi[:, old] = np.maximum(hi[:, old], prev[:, :, 1].transpose(1, 0, 2))
    kv.summary[ids, :, 0] = to_storage(lo.transpose(1, 0, 2), kv.dtype)
    kv.summary[ids, :, 1] = to_storage(hi.transpose(1, 0, 2), kv.dtype)
    return lo, hi


class NumpyFp32Backend(HostArrays):
    """The stages in float32 with BLAS, on the CPU; agrees with the reference within the fp32
    tolerance. Its times are CPU times of this path, not GPU kernel times."""

    name = "numpy-fp32"
    kv_dtypes = ("fp16", "bf16", "fp32", E4M3)  # caches it runs (FP8: decoded once per pool)

    def __init__(self) -> None:
        self.fallback_reason: str | None = None
        self.arena = Arena()  # the copies of caches put one after another share its memory
        self.pool_arena = Arena()  # and so do the pools themselves (workload.pools)

    def spare_bytes(self) -> int:
        """Host bytes held for the next pool and its copies (workload.pools.free_bytes)."""
        return self.arena.spare() + self.pool_arena.spare()

    @staticmethod
    def host_copies(dtype: str) -> float:
        """Host bytes per byte of a pool of `dtype` values (the KV cache's: fp8_e4m3 for an FP8
        pool): the storage, and float32 working copies of it."""
        return 1 + 4 / DTYPE_BYTES[dtype]

    def put(self, host_kv: PagedKV, tiles: Tiles | None = None) -> PagedKV:
        head_major_only(host_kv, "the float32 CPU path (its working copies)")
        kv = host_kv.with_arrays(np.asarray)
        ids = np.asarray(kv.kv_indices)
        if len(np.unique(ids)) == len(ids):  # shared pages: copies read anew on each call
            setattr(kv, _ATTR, Copies(kv, tiles, self.arena))
        return kv

    def put_tiled(self, host_kv: PagedKV, tile, offsets: tuple[int, int]) -> PagedKV:
        """put() of a pool whose k and v are layout.tiled(tile, offsets): its working copies
        are first read from the tile (fp32_copies.Tiles), the same values, without a cast of
        each."""
        return self.put(host_kv, Tiles(tile, offsets, host_kv))

    def summary(self, kv: PagedKV, plan: AppendPlan) -> None:
        ids, first, end = (np.asarray(a, dtype=np.int64) for a in (plan.page_ids, plan.first,
                                                                  plan.end))
        if len(np.unique(ids)) < len(ids):  # a page twice: in order, as the reference does
            for i in range(len(ids)):
                self.summary(kv, AppendPlan(ids[i:i + 1], first[i:i + 1], end[i:i + 1]))
            return
        copies = _copies(kv, keep=False)
        for rows in chunks(np.arange(len(ids)), kv):
            self._summary_rows(kv, copies, ids[rows], first[rows], end[rows])

    @staticmethod
    def _summary_rows(kv: PagedKV, copies, ids, first, end) -> None:
        """Summaries of pages `ids` (distinct); their working copies, if any, read anew."""
        pos = copies.pos[ids] if copies is not None else np.full(len(ids), -1)
        mine = pos >= 0
        if kv.is_fp8:  # the min and max of the codes themselves (fp32_fp8.py)
            if mine.any():
                copies.write_kv(kv, pos[mine])
            kv.summary[ids] = fp32_fp8.summaries(kv, ids, first, end)
            box = summary_f32(kv.summary[ids], kv).transpose(1, 0, 2, 3)    # [H, n, 2, d]
            lo, hi = box[:, :, 0], box[:, :, 1]
        else:
            lo, hi = _plain_summaries(kv, copies, ids, first, end, pos)
        if mine.any():
            p = pos[mine]
            copies.w.box[:, span(p)] = np.concatenate([lo[:, mine], hi[:, mine]], axis=-1)
            copies.box_stale[p] = False

    @one_thread  # BLAS on one thread: blas.py says why
    def estimate(self, q, kv: PagedKV, mode: str = "per-head"):
        return fp32_stages.estimate(f32(q, kv.dtype), _copies(kv).fresh(kv, box=True), mode)

    def topk(self, scores, kv: PagedKV, k_pages: int, sinks: int = 0, window: int = 0):
        return fp32_stages.topk(scores, kv.kv_indptr, k_pages, sinks, window)

    @one_thread
    def attention(self, q, kv: PagedKV, sel=None, count=None):
        out, lse = fp32_stages.attention(f32(q, kv.dtype), _copies(kv).fresh(kv, box=False),
                                         sel, count)
        return to_storage(out, kv.dtype), lse

    def quest(self, q, kv: PagedKV, k_pages: int, mode: str = "per-head", sinks: int = 0,
              window: int = 0):
        scores = self.estimate(q, kv, mode)
        sel, count = self.topk(scores, kv, k_pages, sinks, window)
        return self.attention(q, kv, sel, count)
