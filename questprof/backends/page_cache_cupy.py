"""The HBM page cache over the host tier on a GPU (kernels/page_cache.cu; its rule and the
reference it is tested against: core/page_cache.py): C slots per (request, KV head) in HBM over
K and V pages in mapped pinned host memory (backends/host_tier.py). A step is two launches on
the current stream, no synchronisation and no host copy, so a CUDA graph of it replays a whole
selection sequence: the step kernel reads sel[clock % T] and advances its own clock.
"""

from __future__ import annotations

import cupy
import numpy as np

from questprof.backends import constants, params
from questprof.backends.cupy import load_kernel
from questprof.backends.page_cache_numpy import nan_slots, slot_view
from questprof.backends.pdl import PlainLaunch
from questprof.core.layout import PagedKV, head_major_only
from questprof.core.page_cache import check_capacity

WORD = 16


def _check(kv: PagedKV, sel, capacity: int) -> int:
    """The page's 16-byte words; ValueError in one line for what the kernels do not take."""
    head_major_only(kv, "the HBM page cache")
    check_capacity(capacity, int(sel.shape[-1]))
    most = constants.load()["PC_MAX_SLOTS"]
    if capacity > most:
        raise ValueError(f"an HBM page cache of {capacity} pages per (request, KV head): the "
                         f"step kernel holds at most {most} (PC_MAX_SLOTS)")
    if sel.ndim != 4 or tuple(sel.shape[1:3]) != (kv.kv_heads, kv.batch):
        raise ValueError(f"selections {tuple(sel.shape)} are not [steps, {kv.kv_heads} KV heads, "
                         f"{kv.batch} requests, K] (shared modes: one page set per KV head)")
    page_bytes = kv.page_size * kv.head_dim * kv.k.dtype.itemsize
    if page_bytes % WORD:
        raise ValueError(f"a page of {page_bytes} bytes is not a whole number of 16-byte words")
    return page_bytes // WORD


class CupyPageCache:
    """One layer's page cache on the GPU, replaying sel [T, Hkv, B, K] (device, int32)."""

    def __init__(self, kv: PagedKV, sel, count, capacity: int) -> None:
        words = _check(kv, sel, capacity)
        heads, batch, k = kv.kv_heads, kv.batch, int(sel.shape[-1])
        self.kv, self.capacity, self.k_pages = kv, capacity, k
        self.sel = cupy.ascontiguousarray(sel, dtype=cupy.int32)
        self.count = cupy.asarray(count, dtype=cupy.int32)
        self.k_slots, self.v_slots = nan_slots(cupy, kv, capacity), nan_slots(cupy, kv, capacity)
        self.view = slot_view(cupy, kv, self.k_slots, self.v_slots, capacity)
        t = {"slot_sel": (heads, batch, k), "slot_page": (heads, batch, capacity),
             "resident": (heads, int(kv.kv_indices.shape[0])), "fetch": (heads, batch, k),
             "fetch_slot": (heads, batch, k)}
        self.tables = {n: cupy.full(shape, -1, dtype=cupy.int32) for n, shape in t.items()}
        self.tables.update(slot_stamp=cupy.zeros((heads, batch, capacity), dtype=cupy.int32),
                           clock=cupy.zeros((heads, batch), dtype=cupy.int32),
                           step_counts=cupy.zeros((heads, batch, 2), dtype=cupy.int32),
                           total_counts=cupy.zeros((heads, batch, 2), dtype=cupy.int64))
        self.params = params.pack(params.PAGE_CACHE, cache=params.paged_cache(kv),
                                  k_slots=self.k_slots, v_slots=self.v_slots, sel=self.sel,
                                  **self.tables, steps=int(sel.shape[0]), k_pages=k,
                                  capacity=capacity, nnz=int(kv.kv_indices.shape[0]),
                                  page_words=words)
        sort = 1 << (int(capacity) - 1).bit_length()  # C rounded up to a power of two
        self.shared = 8 * sort + 12 * k  # page_cache.cu: keys [sort], three [K] int arrays

    def launch_step(self) -> None:
        """page_cache_step: hits, misses and their slots (tools/page_cache_probe.py times it)."""
        PlainLaunch()(load_kernel("page_cache", "page_cache_step"), (self.kv.batch,
                      self.kv.kv_heads), (constants.load()["PC_THREADS"],), (self.params,),
                      shared_mem=self.shared)

    def launch_fill(self) -> None:
        """page_cache_fill: the step's misses from host memory into their slots."""
        PlainLaunch()(load_kernel("page_cache", "page_cache_fill"),
                      (self.kv.batch * self.k_pages, self.kv.kv_heads),
                      (constants.load()["PC_FILL_THREADS"],), (self.params,))

    def step(self):
        """One decode step (two launches): (the slots' view, slot_sel [Hkv, B, K], count [B])."""
        self.launch_step()
        self.launch_fill()
        return self.view, self.tables["slot_sel"], self.count

    def reset_counts(self) -> None:
        self.tables["total_counts"][...] = 0

    def totals(self) -> tuple[int, int, int]:
        """(hits, misses) since the last reset_counts, and the steps run (synchronises)."""
        hits, misses = (int(x) for x in cupy.asnumpy(self.tables["total_counts"].sum(axis=(0, 1))))
        return hits, misses, int(cupy.asnumpy(self.tables["clock"]).max())

    def host_tables(self) -> dict[str, np.ndarray]:
        """Every table as a NumPy array (tests hold them to core/page_cache.py's)."""
        return {n: cupy.asnumpy(a) for n, a in self.tables.items()}
