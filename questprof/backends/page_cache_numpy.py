"""The HBM page cache on the CPU (core/page_cache.py; the host is the host): the same tables and
rule as the GPU kernel, its slots a NumPy pool, so the CLI, the byte model and the report run it
in CI. Also the one place the slots' view for attention is made (`slot_view`), which the GPU
cache (backends/page_cache_cupy.py) shares: a cache of C pages per request, slot s of request b
at page b * C + s, the tail page in slot C - 1 (so attention's last-page mask falls on it).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from questprof.core.layout import PagedKV, head_major_only
from questprof.core.page_cache import SlotTable, check_capacity, step_tables

NAN_CODES = {2: 0x7FC0, 1: 0x7F}  # a NaN of 16-bit (fp16 and bf16) and 8-bit (e4m3) storage codes


def nan_slots(xp, kv: PagedKV, capacity: int):
    """[B * C, Hkv, S, d] of kv's storage dtype, NaN in every slot until a fetch fills it (so a
    slot read before it is written shows)."""
    shape = (kv.batch * capacity, int(kv.k.shape[1]), kv.page_size, int(kv.k.shape[3]))
    if kv.k.dtype.kind == "f":
        return xp.full(shape, np.nan, dtype=kv.k.dtype)
    return xp.full(shape, NAN_CODES[kv.k.dtype.itemsize], dtype=kv.k.dtype)


def slot_view(xp, kv: PagedKV, k_slots, v_slots, capacity: int) -> PagedKV:
    """kv's batch over the cache's slots: C pages per request, the tail page last."""
    b, s = kv.batch, kv.page_size
    last = np.asarray(xp.asnumpy(kv.last_page_len) if hasattr(xp, "asnumpy")
                      else kv.last_page_len).astype(np.int32)
    unused = xp.empty((1, int(kv.k.shape[1]), 2, int(kv.k.shape[3])), dtype=kv.summary.dtype)
    return replace(kv, k=k_slots, v=v_slots, summary=unused,  # attention reads no summary
                   kv_indptr=xp.asarray((np.arange(b + 1) * capacity).astype(np.int32)),
                   kv_indices=xp.arange(b * capacity, dtype=np.int32),
                   last_page_len=xp.asarray(last),
                   lengths=tuple(int((capacity - 1) * s + n) for n in last))


class NumpyPageCache:
    """One layer's page cache on the CPU, replaying sel [T, Hkv, B, K] (step t reads sel[t % T])."""

    def __init__(self, kv: PagedKV, sel, count, capacity: int) -> None:
        head_major_only(kv, "the HBM page cache")
        check_capacity(capacity, int(sel.shape[-1]))
        self.kv, self.sel, self.count, self.capacity = kv, np.asarray(sel), np.asarray(count), capacity
        heads, batch = int(sel.shape[1]), int(sel.shape[2])
        self.tables = [[SlotTable(capacity) for _ in range(batch)] for _ in range(heads)]
        self.k_slots, self.v_slots = nan_slots(np, kv, capacity), nan_slots(np, kv, capacity)
        self.view = slot_view(np, kv, self.k_slots, self.v_slots, capacity)
        indptr = np.asarray(kv.kv_indptr)
        self.req_pages = np.diff(indptr)
        self.clock = 0
        self.step_counts = np.zeros((heads, batch, 2), dtype=np.int64)
        self.total_counts = np.zeros((heads, batch, 2), dtype=np.int64)

    def step(self):
        """One decode step: (the slots' view, slot_sel [Hkv, B, K], count [B]) for attention."""
        sel = self.sel[self.clock % len(self.sel)]
        slot_sel, hits, misses, steps = step_tables(self.tables, sel, self.req_pages)
        for h, row in enumerate(steps):
            for b, got in enumerate(row):
                self._move(h, b, got)
        self.clock += 1
        self.step_counts[..., 0], self.step_counts[..., 1] = hits, misses
        self.total_counts += self.step_counts
        return self.view, slot_sel, self.count

    def _move(self, h: int, b: int, got) -> None:
        """The step's swap of the tail into slot C - 1, then its misses from the host pool."""
        base, ids = b * self.capacity, np.asarray(self.kv.kv_indices)
        first = int(np.asarray(self.kv.kv_indptr)[b])
        if got.swap is not None:
            at, tail_moves, other_moves = got.swap
            a, z = base + at, base + self.capacity - 1
            for pool in (self.k_slots, self.v_slots):
                old_a, old_z = pool[a, h].copy(), pool[z, h].copy()
                if tail_moves:
                    pool[z, h] = old_a
                if other_moves:
                    pool[a, h] = old_z
        for pos, slot in got.fetch:
            page = ids[first + pos]
            self.k_slots[base + slot, h] = self.kv.k[page, h]
            self.v_slots[base + slot, h] = self.kv.v[page, h]

    def reset_counts(self) -> None:
        self.total_counts[...] = 0

    def totals(self) -> tuple[int, int, int]:
        """(hits, misses) since the last reset_counts, and the steps run since creation."""
        hits, misses = self.total_counts.sum(axis=(0, 1))
        return int(hits), int(misses), self.clock
