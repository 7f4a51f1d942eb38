"""Every metric of a capture for every page size, budget and mode, selection by the backend."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from questprof.fidelity.capture import Capture
from questprof.fidelity.metrics import (METRICS, dense_attention, head_metrics, page_stats,
                                        selection_mask, stale_mask)
from questprof.fidelity.select import PageIndex, stored
from questprof.fidelity.threads import one_thread


@dataclass(frozen=True)
class FidelityGrid:
    """What to measure: page sizes and budgets in tokens (budgets whole pages), GQA modes, and
    the selectors (questprof.core.selectors names; `quest` runs on the backend)."""

    page_sizes: tuple[int, ...]
    budgets: tuple[int, ...]
    modes: tuple[str, ...] = ("per-head",)
    dtype: str = "fp32"
    selectors: tuple[str, ...] = ("quest",)

    def settings(self):
        """(page_size, budget, mode) of every combination whose budget is whole pages."""
        return [(s, b, m) for s in self.page_sizes for b in self.budgets for m in self.modes
                if b % s == 0]


class _LayerState:
    """One layer's page indexes (one per page size) and the first step's selections."""

    def __init__(self, cap: Capture, keys, backend, grid: FidelityGrid) -> None:
        first = cap.step_length(0)
        self.indexes = {s: PageIndex(backend, keys[:, :first], s, grid.dtype, cap.length)
                        for s in grid.page_sizes}
        self.first_masks: dict = {}


def _step_metrics(state: _LayerState, s: int, q, stats, grid: FidelityGrid, out, at) -> None:
    """Metrics of one query at page size s for every mode and budget, into out[...][at]."""
    index = state.indexes[s]
    bound = index.backend.to_host(index.scores(q, "per-head"))
    for mode in grid.modes:
        scores = index.scores(q, mode) if mode != "per-head" else index.backend.asarray(bound)
        for budget in (b for b in grid.budgets if b % s == 0):
            sel, count = index.select(scores, budget // s)
            mask = selection_mask(sel, count, q.shape[0], index.pages)
            first = state.first_masks.setdefault((s, budget, mode), mask)
            values = head_metrics(stats, mask, bound, stale_mask(first, index.pages))
            out[(s, budget, mode)][at] = np.stack([values[m] for m in METRICS])


def evaluate_layer(cap: Capture, layer: int, backend, grid: FidelityGrid, out) -> None:
    """Fill out[(S, B, mode)][layer, step] = metrics [len(METRICS), Hq] for one layer."""
    keys, values = stored(cap.keys[layer], grid.dtype), stored(cap.values[layer], grid.dtype)
    queries = stored(cap.queries[layer], grid.dtype)
    state = _LayerState(cap, keys, backend, grid)
    # float64 once per layer, not per step: at 4K tokens, 8 KV heads of 128, converting took
    # ~35 ms of a ~50 ms dense_attention (2-core CPU, one BLAS thread, 2026-12-01)
    keys64, values64 = keys.astype(np.float64), values.astype(np.float64)
    for step in range(cap.steps):
        n = cap.step_length(step)
        dense = dense_attention(queries[step], keys64[:, :n], values64[:, :n], cap.scaling)
        for s, index in state.indexes.items():
            if step:
                index.append(keys[:, n - 1:n])
            _step_metrics(state, s, queries[step], page_stats(dense, s), grid, out, (layer, step))


def evaluate(cap: Capture, backend, grid: FidelityGrid, progress=None) -> dict:
    """{(page_size, budget, mode): metrics [layers, steps, len(METRICS), Hq] float64}."""
    shape = (cap.layers, cap.steps, len(METRICS), cap.q_heads)
    out = {key: np.full(shape, np.nan) for key in grid.settings()}
    with one_thread():
        for layer in range(cap.layers):
            evaluate_layer(cap, layer, backend, grid, out)
            if progress is not None:
                progress(layer + 1, cap.layers)
    return out
