"""A sequence of decode steps' selections with step-to-step reuse, for timing an HBM page cache
(core/page_cache.py): random pools have none (each timed pass repeats one selection).

A trace holds sel [T, Hkv, B, K] (page positions of each step, ascending, -1 padded; the tail
page always in, as Quest's top-K keeps it) and the lengths it was made for. `synthetic` makes
one from a measured overlap r (the share of a step's pages the step before also chose: `questprof
reuse` measures it on a real model): each step keeps round(r x (K - 1)) of the previous step's
non-tail pages, drawn at random, and draws the rest from the pages the previous step left out.
A trace saved with `save` is read back by `load` and checked against the configuration it times.
Replays wrap around: step T follows step T - 1 (the miss rate of a replay counts the steps run).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from questprof.core.layout import pages_for


@dataclass(frozen=True)
class Trace:
    """Selections of T steps, sel [T, Hkv, B, K] int32, and the request lengths in tokens."""

    sel: np.ndarray
    lengths: tuple[int, ...]
    page_size: int

    @property
    def steps(self) -> int:
        return int(self.sel.shape[0])

    @property
    def count(self) -> np.ndarray:
        """[B] chosen pages per request (the attention kernel's count)."""
        return (self.sel[0, 0] >= 0).sum(axis=-1).astype(np.int32)


def _step(rng, before: np.ndarray, pages: int, k: int, keep: int) -> np.ndarray:
    """The next step's K positions (ascending): the tail, `keep` of `before`'s other pages and
    fresh ones from those `before` left out (fewer where a short request has none)."""
    tail = pages - 1
    old = before[(before >= 0) & (before != tail)]
    kept = rng.choice(old, size=min(keep, len(old)), replace=False)
    fresh_from = np.setdiff1d(np.arange(tail), old)
    need = min(k, pages) - 1 - len(kept)
    fresh = rng.choice(fresh_from, size=min(need, len(fresh_from)), replace=False)
    more = np.setdiff1d(old, kept)[:need - len(fresh)]  # a short request: reuse makes up the rest
    chosen = np.sort(np.concatenate([kept, fresh, more, [tail]])).astype(np.int32)
    return np.pad(chosen, (0, k - len(chosen)), constant_values=-1)


def synthetic(lengths, page_size: int, k_pages: int, kv_heads: int, steps: int, overlap: float,
              seed: int = 0) -> Trace:
    """A trace of `steps` steps whose selections keep `overlap` of the step before (module
    text); the first step's pages are drawn at random, the tail in."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"reuse overlap {overlap} is outside 0..1")
    if steps < 2:
        raise ValueError(f"a reuse trace needs at least 2 steps, got {steps}")
    rng = np.random.default_rng(seed)
    sel = np.full((steps, kv_heads, len(lengths), k_pages), -1, dtype=np.int32)
    keep = round(overlap * (k_pages - 1))
    for b, n in enumerate(lengths):
        pages = pages_for(n, page_size)
        for h in range(kv_heads):
            first = rng.choice(pages - 1, size=min(k_pages, pages) - 1, replace=False)
            sel[0, h, b, :min(k_pages, pages)] = np.sort(np.append(first, pages - 1))
            for t in range(1, steps):
                sel[t, h, b] = _step(rng, sel[t - 1, h, b], pages, k_pages, keep)
    return Trace(sel, tuple(int(n) for n in lengths), page_size)


def overlap(trace: Trace) -> float:
    """The measured share of each step's pages that the step before chose too (steps 1..T-1)."""
    kept = chosen = 0
    for t in range(1, trace.steps):
        for h, b in np.ndindex(trace.sel.shape[1:3]):
            now, before = trace.sel[t, h, b], trace.sel[t - 1, h, b]
            now = now[now >= 0]
            kept += len(np.intersect1d(now, before[before >= 0]))
            chosen += len(now)
    return kept / chosen if chosen else float("nan")


def save(trace: Trace, path) -> Path:
    """The trace as an .npz file (sel, lengths, page_size)."""
    path = Path(path)
    np.savez_compressed(path, sel=trace.sel, lengths=np.asarray(trace.lengths),
                        page_size=trace.page_size)
    return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")


def load(path) -> Trace:
    """A trace saved by `save`; ValueError in one line for a file that is not one."""
    try:
        with np.load(path) as f:
            sel = f["sel"]
            if sel.dtype.kind == "f" and not np.isfinite(sel).all():
                raise ValueError("sel holds NaN or infinity")
            return Trace(sel.astype(np.int32), tuple(int(n) for n in f["lengths"]),
                         int(f["page_size"]))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # EOFError:
        # an empty file, which click turned into a bare "Aborted."
        raise ValueError(f"{path} is not a reuse trace (.npz of sel, lengths, page_size): "
                         f"{exc}") from None


def check(trace: Trace, lengths, page_size: int, k_pages: int, kv_heads: int) -> None:
    """ValueError in one line unless the trace was made for this shape and every step of it is
    a selection: ascending positions inside the request, -1 only as trailing padding, the tail
    page in, the same count at every step (the page cache's kernel and its rule assume each)."""
    want = (tuple(int(n) for n in lengths), page_size, kv_heads, k_pages)
    if trace.sel.ndim != 4:
        raise ValueError(f"the reuse trace's sel has {trace.sel.ndim} dimensions; a trace "
                         f"holds [steps, KV heads, requests, K]")
    got = (trace.lengths, trace.page_size, int(trace.sel.shape[1]), int(trace.sel.shape[3]))
    if got != want or trace.sel.shape[2] != len(want[0]):
        raise ValueError(f"the reuse trace is for lengths {got[0][:4]}, page size {got[1]}, "
                         f"{got[2]} KV heads, K {got[3]}; this configuration has "
                         f"{want[0][:4]}, {want[1]}, {want[2]}, {want[3]}")
    if why := _not_a_selection(trace.sel, [pages_for(n, page_size) for n in want[0]]):
        raise ValueError(f"the reuse trace is not a sequence of selections: {why}")


def _not_a_selection(sel: np.ndarray, pages: list[int]) -> str:
    """Why sel [T, Hkv, B, K] is not one selection per (step, KV head, request), '' if it is."""
    valid = sel >= 0
    n = valid.sum(axis=-1)
    if (valid[..., 1:] & ~valid[..., :-1]).any():
        return "a -1 before a chosen page (padding is trailing only)"
    if (n != n[:1]).any():
        return "a request's count of chosen pages changes between steps"
    for b, p in enumerate(pages):
        row = sel[:, :, b]
        chosen = np.where(valid[:, :, b], row, -1)
        if (chosen >= p).any():
            return f"request {b} names a page past its {p}"
        d = np.diff(row, axis=-1)
        if ((d <= 0) & valid[:, :, b, 1:]).any():
            return f"request {b}'s pages are not strictly ascending (a page twice, or out of order)"
        if not ((row == p - 1).any(axis=-1)).all():
            return f"request {b} leaves out its tail page {p - 1} at some step"
    return ""
