"""An HBM page cache over the host tier: C slots per (request, KV head), least recently selected
out. The one definition of its rule, which the NumPy path runs, `questprof reuse` replays and
the GPU kernel (kernels/page_cache.cu) is tested against.

The rule (`LRUPages`): a step reads a set of pages; those held are hits, the others misses; every
page read takes the step's stamp; then the least recent go, by (stamp, position), until C remain.
With C >= the pages of a step (what a slot cache needs, `check_capacity`) only pages not read
this step go.

Where pages sit (`SlotTable`, what the kernel does slot for slot): the step's misses, ascending,
take the free slots (ascending) and then the slots of the pages that go (in the rule's order).
Attention reads the slots as the positions of a request of C pages (indptr b * C), whose last
position masks the tail page's unwritten tokens (last_page_len), so the tail page always sits in
slot C - 1: where the rule put it elsewhere, it swaps with what C - 1 holds (the contents of both
move in HBM where they were resident; a miss is simply fetched into its final slot). Quest's
top-K always keeps the tail page, and a step whose selection lacks it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def check_capacity(capacity: int, k_pages: int) -> None:
    """ValueError in one line unless a cache of `capacity` slots holds a step's `k_pages`."""
    if capacity != int(capacity) or capacity < k_pages:
        raise ValueError(f"an HBM page cache of {capacity} pages cannot hold a step's {k_pages} "
                         f"chosen pages (C >= K)")


def lru_order(held: dict) -> list[int]:
    """Held pages {position: stamp}, least recently selected first: by (stamp, position)."""
    return sorted(held, key=lambda p: (held[p], p))


class LRUPages:
    """A cache of `capacity` page positions, least recently selected out (module text);
    `pages` are read as its first step (a warm start)."""

    def __init__(self, capacity: int, pages=()) -> None:
        self.capacity, self.held, self.clock = capacity, {}, 0
        if len(pages):
            self.read(pages)

    def read(self, pages) -> int:
        """Read one step's pages: returns how many were missing."""
        self.clock += 1
        pages = set(int(p) for p in pages)
        missing = len(pages - self.held.keys())
        for p in pages:
            self.held[p] = self.clock
        for p in lru_order(self.held)[:max(0, len(self.held) - self.capacity)]:
            del self.held[p]
        return missing


@dataclass(frozen=True)
class Step:
    """What one step did to one (request, KV head): `slots` of the chosen pages (in selection
    order), hits, misses, `fetch` [(position, slot)] of the misses and `swap` (slot, moves the
    tail's contents, moves the other's contents) or None."""

    slots: tuple[int, ...]
    hits: int
    misses: int
    fetch: tuple[tuple[int, int], ...]
    swap: tuple[int, bool, bool] | None


class SlotTable:
    """One (request, KV head)'s C slots: which page position each holds (-1: free), kept by
    LRUPages' rule (module text)."""

    def __init__(self, capacity: int) -> None:
        self.rule = LRUPages(capacity)
        self.page = [-1] * capacity

    def slot_of(self) -> dict[int, int]:
        return {p: s for s, p in enumerate(self.page) if p >= 0}

    def step(self, chosen, tail: int) -> Step:
        """Read `chosen` (positions, -1 padding ignored), `tail` the request's last position."""
        chosen = [int(p) for p in chosen if p >= 0]
        check_capacity(self.rule.capacity, len(chosen))
        if tail not in chosen:
            raise ValueError(f"a step chose pages {chosen[:4]}... without the tail page {tail}: "
                             f"the page cache keeps the tail in its last slot")
        before, where = dict(self.rule.held), self.slot_of()
        missed = sorted(set(chosen) - before.keys())
        self.rule.read(chosen)
        gone = [p for p in lru_order(before) if p not in self.rule.held]
        free = [s for s, p in enumerate(self.page) if p < 0]
        placed = dict(zip(missed, free + [where[p] for p in gone]))
        for p, s in placed.items():
            self.page[s] = p
        swap = self._tail_swap(tail, placed)
        where = self.slot_of()
        fetch = tuple(sorted((p, where[p]) for p in missed))
        return Step(tuple(where[p] for p in chosen), len(chosen) - len(missed), len(missed),
                    fetch, swap)

    def _tail_swap(self, tail: int, placed: dict) -> tuple[int, bool, bool] | None:
        """Put the tail page in the last slot; (its old slot, whether the tail's contents and
        the other page's move) where it was elsewhere."""
        last, at = len(self.page) - 1, self.page.index(tail)
        if at == last:
            return None
        other = self.page[last]
        self.page[last], self.page[at] = tail, other
        return at, tail not in placed, other >= 0 and other not in placed


def step_tables(tables: list[list[SlotTable]], sel: np.ndarray, req_pages) -> tuple:
    """One step of every table [Hkv][B] on sel [Hkv, B, K] (positions, -1 padded): (slot_sel
    [Hkv, B, K] int32, -1 where sel is, hits [Hkv, B], misses [Hkv, B], steps [Hkv][B])."""
    heads, batch, _ = sel.shape
    slot_sel = np.full(sel.shape, -1, dtype=np.int32)
    hits, misses = (np.zeros((heads, batch), dtype=np.int64) for _ in range(2))
    steps = [[None] * batch for _ in range(heads)]
    for h in range(heads):
        for b in range(batch):
            got = tables[h][b].step(sel[h, b], int(req_pages[b]) - 1)
            used = sel[h, b] >= 0
            slot_sel[h, b, used] = got.slots
            hits[h, b], misses[h, b], steps[h][b] = got.hits, got.misses, got
    return slot_sel, hits, misses, steps
