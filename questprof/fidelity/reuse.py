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
`layer_trace` keeps one layer's selections of a shared mode as a reuse trace
(core/reuse_trace.py), which `sweep --reuse-trace` replays through the timed page cache.
Random pools have no reuse: these figures come from a real model only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from questprof.core import model
from questprof.core.layout import pages_for
from questprof.core.page_cache import LRUPages
from questprof.core.reuse_trace import Trace
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


def layer_selections(caps: list[Capture], layer: int, page_size: int, k_pages: int, mode: str,
                     backend, dtype: str = "fp32") -> list[tuple[np.ndarray, int]]:
    """Each step's selection of one layer (captures of one length): (sel [Hs, B, K] ascending
    page positions, -1 padded, count), the index grown a token a step."""
    keys = np.stack([c.keys[layer] for c in caps])                     # [B, Hkv, L, d]
    queries = np.stack([c.queries[layer] for c in caps])               # [B, T, Hq, d]
    first = caps[0].step_length(0) - 1
    index = page_index(backend, keys[:, :, :first], page_size, dtype, keys.shape[2])
    out = []
    for t in range(caps[0].steps):
        index.append(keys[:, :, first + t:first + t + 1])
        out.append(index.select(index.scores(queries[:, t], mode), k_pages))
    return out


def layer_sets(caps: list[Capture], layer: int, page_size: int, k_pages: int, mode: str,
               backend, dtype: str = "fp32") -> list[list[set]]:
    """Each step's page sets per (request, KV head) of one layer (captures of one length)."""
    kv_heads = caps[0].kv_heads
    return [kv_head_sets(sel, count, kv_heads) for sel, count in
            layer_selections(caps, layer, page_size, k_pages, mode, backend, dtype)]


def summed(per_step: list[list[set]], capacities) -> Reuse:
    """Counts of `replay` summed over the (request, KV head) page sets of each step."""
    pages = kept = 0
    misses = dict.fromkeys(capacities, 0)
    for head in range(len(per_step[0])):
        p, k, m = replay([step[head] for step in per_step], capacities)
        pages, kept = pages + p, kept + k
        for c in capacities:
            misses[c] += m[c]
    return Reuse(pages, kept, misses)


def layer_reuse(caps: list[Capture], layer: int, page_size: int, budget: int, mode: str,
                capacities, backend) -> Reuse:
    """Reuse of one layer (module text): counts summed over requests and KV heads."""
    return summed(layer_sets(caps, layer, page_size, model.k_pages(budget, page_size), mode,
                             backend), capacities)


def layer_trace(caps: list[Capture], layer: int, page_size: int, k_pages: int, mode: str,
                backend) -> tuple[Trace, int]:
    """(the trace of one layer's shared-mode selections, its first step): the steps from the
    first whose request has as many pages as at the last step, at the last step's length (a
    trace holds one length; where the tail page moved during decode, the steps before it read
    a different tail and are left out). ValueError for per-head selection (rows per q head)."""
    cap = caps[0]
    if mode == "per-head" and cap.q_heads != cap.kv_heads:
        raise ValueError("a reuse trace holds one page set per KV head: per-head selection "
                         "chooses one per q head (take a shared mode)")
    steps = layer_selections(caps, layer, page_size, k_pages, mode, backend)
    pages = [pages_for(cap.step_length(t), page_size) for t in range(cap.steps)]
    first = pages.index(pages[-1])
    sel = np.stack([s for s, _ in steps[first:]]).astype(np.int32)    # [T, Hkv, B, K]
    return Trace(sel, (cap.length,) * len(caps), page_size), first


def trace_reuse(trace: Trace, capacities) -> Reuse:
    """Reuse of a trace's steps as `replay` counts it: warm with its step 0, steps 1..T-1."""
    per_step = [[set(row[row >= 0].tolist()) for row in step.transpose(1, 0, 2)
                 .reshape(-1, step.shape[-1])] for step in trace.sel]
    return summed(per_step, capacities)
