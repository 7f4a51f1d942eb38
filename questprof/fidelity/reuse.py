"""Step-to-step reuse of Quest's selection on real attention, and the miss rate of an HBM page
cache replaying it.

From captures of a model's decode steps (capture.py: each step's queries, the keys of every
step), Quest selects at every step exactly as fidelity does (page_index.py: summaries grown a
token at a time, the bound, top-K with the tail page in). The pages that cross the host link
for one (request, KV head) at a step are the union of its rows' selections (its q heads' in
per-head mode, its own in the shared modes). Per layer:
- overlap: |A_t and A_(t-1)| / |A_t|, the share of step t's pages that step t-1 also read;
- miss rate of a cache of C pages per (request, KV head), least recently selected out
  (core/page_cache.LRUPages, the rule the page cache's kernel and NumPy path run): step
  t's pages missing from the cache, over the pages of step t. The cache starts holding the
  first step's pages (warm), so steps 1..T-1 are counted; a page opened during decode (the
  tail page moves every S tokens) counts as a miss when first read, as a fresh page would.
Random pools have no reuse: these figures come from a real model only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from questprof.core import model
from questprof.core.page_cache import LRUPages
from questprof.fidelity.capture import Capture
from questprof.fidelity.page_index import page_index


@dataclass(frozen=True)
class Reuse:
    """Counts of one layer over steps 1..T-1 and every (request, KV head)."""

    pages: int  # pages read (sum of |A_t|)
    kept: int  # of which the previous step read too
    misses: dict  # {C: pages missing from a C-page cache}

    @property
    def overlap(self) -> float:
        return self.kept / self.pages if self.pages else float("nan")

    def miss_rate(self, capacity: int) -> float:
        return self.misses[capacity] / self.pages if self.pages else float("nan")


def replay(steps: list[set], capacities) -> tuple[int, int, dict]:
    """(pages, kept, {C: misses}) of one (request, KV head)'s page sets over the steps."""
    caches = {c: LRUPages(c, steps[0]) for c in capacities}
    pages = kept = 0
    misses = dict.fromkeys(capacities, 0)
    for before, now in itertools.pairwise(steps):
        pages += len(now)
        kept += len(now & before)
        for c, cache in caches.items():
            misses[c] += cache.read(now)
    return pages, kept, misses


def kv_head_sets(sel: np.ndarray, count: int, kv_heads: int) -> list[set]:
    """Page sets per (request, KV head), request-major, from selections [Hs, B, K]: the union
    of the rows of each KV head (Hs / kv_heads rows each)."""
    rows, batch = sel.shape[:2]
    group = rows // kv_heads
    return [set(sel[h * group:(h + 1) * group, b, :count].ravel().tolist())
            for b in range(batch) for h in range(kv_heads)]


def layer_sets(caps: list[Capture], layer: int, page_size: int, k_pages: int, mode: str,
               backend, dtype: str = "fp32") -> list[list[set]]:
    """Each step's page sets per (request, KV head) of one layer (captures of one length)."""
    keys = np.stack([c.keys[layer] for c in caps])                     # [B, Hkv, L, d]
    queries = np.stack([c.queries[layer] for c in caps])               # [B, T, Hq, d]
    first = caps[0].step_length(0) - 1
    index = page_index(backend, keys[:, :, :first], page_size, dtype, keys.shape[2])
    out = []
    for t in range(caps[0].steps):
        index.append(keys[:, :, first + t:first + t + 1])
        sel, count = index.select(index.scores(queries[:, t], mode), k_pages)
        out.append(kv_head_sets(sel, count, keys.shape[1]))
    return out


def layer_reuse(caps: list[Capture], layer: int, page_size: int, budget: int, mode: str,
                capacities, backend) -> Reuse:
    """Reuse of one layer (module text): counts summed over requests and KV heads."""
    per_step = layer_sets(caps, layer, page_size, model.k_pages(budget, page_size), mode,
                          backend)
    pages = kept = 0
    misses = dict.fromkeys(capacities, 0)
    for head in range(len(per_step[0])):
        p, k, m = replay([step[head] for step in per_step], capacities)
        pages, kept = pages + p, kept + k
        for c in capacities:
            misses[c] += m[c]
    return Reuse(pages, kept, misses)
