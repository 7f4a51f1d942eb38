"""Float32 working copies of a paged cache for the NumPy backend's fast path (numpy_fp32.py).

Copies lays one cache out as fp32_stages.Working (head-major, request order), reads positions
from the storage arrays when a stage first needs them, and again when `summary` says they were
written or the tail page grew; new page tables lay the copies out anew. Pools that
workload.pools tiles from one random block (layout.tiled) are first read from that block,
decoded once, instead of decoding every value of the pool: the same values (every storage value
is a float32), and NumPy's fp16 -> fp32 cast ran at 2-7 ns per value on the 2-core machine
(2026-12-01), most of the time of a CPU sweep. An FP8 pool's block is decoded once too, and
each page scaled as it is read (fp32_fp8.py). Their memory comes from the backend's Arena.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numpy.lib.stride_tricks import as_strided

from questprof.backends import fp32_fp8
from questprof.backends.arena import Arena
from questprof.backends.fp32_stages import Working
from questprof.core.fp8 import E4M3
from questprof.core.layout import PagedKV

CHUNK_BYTES = 16 << 20  # pages are read and summarised this many float32 bytes at a time
# threads that read a pool into its copies (building, not timed): the scheduler shares a core
# per thread, so on the 2-core machine shared with other work two got more of it than one
READERS = max(1, min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                     else os.cpu_count() or 1))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(READERS, thread_name_prefix="questprof-read")


def f32(x, dtype: str) -> np.ndarray:
    """Storage-form values of `dtype` as float32 (exact: every storage value is a float32)."""
    x = np.asarray(x)
    if dtype == "bf16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def kv_f32(x, kv: PagedKV, which: str) -> np.ndarray:
    """Pages x [n, H, S, d] of kv's K or V storage (which: 'k' or 'v') as float32 values: a
    cast, or FP8 codes decoded and scaled (fp32_fp8.decode)."""
    if kv.is_fp8:
        return fp32_fp8.decode(x, getattr(kv, f"{which}_scale"))
    return f32(x, kv.dtype)


def summary_f32(x, kv: PagedKV) -> np.ndarray:
    """Summaries x [n, H, 2, d] of kv's summary storage as the float32 min/max they stand for
    (FP8 codes times k_scale)."""
    if kv.summary_dtype == E4M3:
        return fp32_fp8.decode(x, kv.k_scale)
    return f32(x, kv.summary_dtype)


def span(pos: np.ndarray):
    """pos as a slice when it is one ascending run (assignment then writes in place), else pos."""
    if len(pos) and pos[-1] - pos[0] == len(pos) - 1 and (np.diff(pos) == 1).all():
        return slice(int(pos[0]), int(pos[-1]) + 1)
    return pos


def chunks(idx: np.ndarray, kv: PagedKV):
    """idx in runs of CHUNK_BYTES of float32 pages."""
    size = max(1, CHUNK_BYTES // (4 * kv.kv_heads * kv.page_size * kv.head_dim))
    for i in range(0, len(idx), size):
        yield idx[i:i + size]


class Tiles:
    """The block a pool was tiled from, decoded: page (p, h) of k (which=0) or v (1) holds the
    block's values from offsets[which] + (p * H + h) * S * d on, wrapping (layout.tiled)."""

    def __init__(self, tile, offsets: tuple[int, int], kv: PagedKV):
        run = kv.page_size * kv.head_dim
        block = fp32_fp8.decode(tile) if kv.is_fp8 else f32(tile, kv.dtype)
        wrapped = np.concatenate([block, block[:run]])
        self.rows = as_strided(wrapped, (len(block), run), (4, 4), writeable=False)
        self.offsets, self.heads = offsets, kv.kv_heads
        # an FP8 pool's values are its codes' times the head's scale of k (0) or v (1)
        self.scale = np.stack([np.asarray(kv.k_scale, np.float32),
                               np.asarray(kv.v_scale, np.float32)]) if kv.is_fp8 else None

    def read(self, dst: np.ndarray, ids: np.ndarray, which: int, each=None) -> None:
        """dst [H, n, S, d] (a view: positions in a run) <- pages ids of k or v; each(h, block)
        after head h's block is written, while it is in cache. Heads split over READERS
        threads (NumPy copies and reductions release the GIL)."""
        heads, run = self.heads, self.rows.shape[1]

        def part(first: int) -> None:
            for h in range(first, heads, READERS):  # (np.take would copy the strided rows)
                starts = (self.offsets[which] + (ids * heads + h) * run) % self.rows.shape[0]
                if self.scale is None:
                    dst[h] = self.rows[starts].reshape(dst[h].shape)
                else:
                    np.multiply(self.rows[starts].reshape(dst[h].shape), self.scale[which, h],
                                out=dst[h])
                if each is not None:
                    each(h, dst[h])
        list(_pool().map(part, range(READERS)))


class Copies:
    """A cache's Working copies, the page tables they were laid out for, and which positions
    have to be read (again) before a stage uses them."""

    def __init__(self, kv: PagedKV, tiles: Tiles | None = None, arena: Arena | None = None):
        nnz, heads = len(kv.kv_indices), kv.kv_heads
        shape = (heads, nnz, kv.page_size, kv.head_dim)
        self.indices = np.array(kv.kv_indices, dtype=np.int64)
        indptr = np.array(kv.kv_indptr, dtype=np.int64)
        self.last = np.array(kv.last_page_len, dtype=np.int64)
        n, box = int(np.prod(shape)), heads * nnz * 2 * kv.head_dim
        flat = arena.take(4 * (2 * n + box)).view(np.float32) if arena is not None \
            else np.empty(2 * n + box, np.float32)
        self.w = Working(flat[:n].reshape(shape), flat[n:2 * n].reshape(shape),
                         flat[2 * n:].reshape(heads, nnz, -1),
                         np.full(nnz, kv.page_size, dtype=np.int64), indptr)
        self.w.valid[self._tails()] = self.last[indptr[1:] > indptr[:-1]]
        self.pos = np.full(kv.num_pages, -1, dtype=np.int64)
        self.pos[self.indices] = np.arange(nnz)
        self.kv_stale = np.ones(nnz, dtype=bool)
        self.box_stale = np.ones(nnz, dtype=bool)
        self.tiles = tiles
        self.untouched = np.ones(nnz, dtype=bool)  # never read: storage still holds the tiles

    def _tails(self) -> np.ndarray:
        """Position of each non-empty request's last page."""
        indptr = self.w.indptr
        return indptr[1:][indptr[1:] > indptr[:-1]] - 1

    def current(self, kv: PagedKV) -> "Copies":
        """These copies, or new ones where kv's pages changed since; a new last_page_len (a
        token appended within the tail page) re-reads the tail pages from storage."""
        if not (np.array_equal(self.w.indptr, kv.kv_indptr)
                and np.array_equal(self.indices, kv.kv_indices)):
            return Copies(kv)
        if not np.array_equal(self.last, kv.last_page_len):
            self.last = np.array(kv.last_page_len, dtype=np.int64)
            tails = self._tails()
            self.w.valid[tails] = self.last[self.w.indptr[1:] > self.w.indptr[:-1]]
            self.kv_stale[tails], self.untouched[tails] = True, False
        return self

    def write_kv(self, kv: PagedKV, pos: np.ndarray, each=None) -> None:
        """Positions `pos` of k and v read (cast into place; slots past a tail's length 0);
        each(h, block [n, S, d]) on K head by head as it is written (then zeroed past tails)."""
        w, ids, at = self.w, self.indices[pos], span(pos)
        tiled = self.tiles is not None and isinstance(at, slice) and self.untouched[pos].all()
        for which, name in enumerate(("k", "v")):
            dst, hook = getattr(w, name), each if which == 0 else None
            if tiled:
                self.tiles.read(dst[:, at], ids, which, hook)
            else:
                src = getattr(kv, name)[ids]
                if kv.is_fp8 or kv.dtype == "bf16" or hook:  # (fp16, fp32: cast in place)
                    src = kv_f32(src, kv, name)
                dst[:, at] = src.transpose(1, 0, 2, 3)
                for h in range(kv.kv_heads if hook else 0):
                    hook(h, src[:, h])
            for p in pos[w.valid[pos] < kv.page_size]:
                dst[:, p, w.valid[p]:] = 0
        self.kv_stale[pos], self.untouched[pos] = False, False

    def fresh(self, kv: PagedKV, box: bool) -> Working:
        """The working copies with every stale position read (the box only when `box`)."""
        stale = np.flatnonzero(self.box_stale if box else self.kv_stale)
        for part in chunks(stale, kv):
            if not box:
                self.write_kv(kv, part)
                continue
            s = summary_f32(kv.summary[self.indices[part]], kv)              # [n, H, 2, d]
            self.w.box[:, part] = s.transpose(1, 0, 2, 3).reshape(kv.kv_heads, len(part), -1)
            self.box_stale[part] = False
        return self.w
