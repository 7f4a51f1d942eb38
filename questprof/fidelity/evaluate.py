"""Every metric of a batch of captures of one length, for every page size, budget and mode.

The prompts of a batch run together: their q heads are stacked as B * Hq heads (KV heads as
B * Hkv) for the metrics, and one index per layer and page size holds all B requests for the
selection (page_index.page_index: the backend's kernels on a GPU, the vectorised reference on the
CPU). Budgets of one page size share the scores of a query; only top-K runs per budget.
The reference of evaluate_device.py, which computes the same where a real model ran.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from questprof.core.selectors import QUEST
from questprof.fidelity.capture import Capture
from questprof.fidelity.host_index import stored
from questprof.fidelity.metrics import (METRICS, dense_attention, head_metrics, page_stats,
                                        selection_mask, stale_mask)
from questprof.fidelity.page_index import page_index
from questprof.fidelity.threads import one_thread


@dataclass(frozen=True)
class FidelityGrid:
    """What to measure: page sizes and budgets in tokens (budgets whole pages), GQA modes, and
    the selectors (questprof.core.selectors names; `quest` runs on the backend)."""

    page_sizes: tuple[int, ...]
    budgets: tuple[int, ...]
    modes: tuple[str, ...] = ("per-head",)
    dtype: str = "fp32"
    selectors: tuple[str, ...] = (QUEST,)

    def settings(self):
        """(page_size, budget, mode) of every combination whose budget is whole pages."""
        return [(s, b, m) for s in self.page_sizes for b in self.budgets for m in self.modes
                if b % s == 0]


def flat_selection(sel: np.ndarray) -> np.ndarray:
    """Selections [Hs, B, K] as [B * Hs, K] (request-major, like the stacked heads)."""
    return np.ascontiguousarray(sel.transpose(1, 0, 2)).reshape(-1, sel.shape[2])


class _Layer:
    """One layer of a batch: stored keys [B, Hkv, L, d], keys and values in float64 as
    [B * Hkv, L', d] (L' = L up to a whole page of the largest size, zeros after L), queries
    [B, steps, Hq, d], and one index per page size grown step by step."""

    def __init__(self, caps: list[Capture], layer: int, backend, grid: FidelityGrid,
                 bases: dict | None) -> None:
        keys = stored(np.stack([c.keys[layer] for c in caps]), grid.dtype)   # [B, Hkv, L, d]
        self.batch, kv_heads, length, d = keys.shape
        self.keys = keys
        self.flat_keys = _float64(keys, max(grid.page_sizes))
        self.flat_values = _float64(stored(np.stack([c.values[layer] for c in caps]),
                                           grid.dtype), max(grid.page_sizes))
        self.queries = stored(np.stack([c.queries[layer] for c in caps]), grid.dtype)
        first = caps[0].step_length(0)
        if bases is None:
            self.indexes = {s: page_index(backend, keys[:, :, :first], s, grid.dtype, length)
                            for s in grid.page_sizes}
        else:  # the prefilled keys' summaries, shared with the task: add the fed token
            self.indexes = {s: bases[s][layer].copy() for s in grid.page_sizes}
            for index in self.indexes.values():
                index.append(keys[:, :, index.length:first])
        self.first_masks: dict = {}


def _float64(x: np.ndarray, page: int) -> np.ndarray:
    """[B, H, L, d] as float64 [B * H, L', d], zeros after L up to a whole page: dense attention
    reads slices of it in place, and page sums of a partial tail page need no copy to pad."""
    batch, heads, length, d = x.shape
    out = np.zeros((batch * heads, -(-length // page) * page, d))
    out[:, :length] = x.reshape(batch * heads, length, d)
    return out


def _padded(x: np.ndarray, width: int, fill: float) -> np.ndarray:
    """[H, n] -> [H, width], `fill` after n."""
    out = np.full((x.shape[0], width), fill, dtype=x.dtype)
    out[:, : x.shape[1]] = x
    return out


def _page_stats(state: _Layer, dense, n: int) -> dict:
    """{S: page_stats of the n tokens' dense attention at page size S}. Weights and logits are
    padded (0, -inf) to the layer's whole buffer, whose values are contiguous and zero after the
    capture: paging needs no copy of the values and the weighted-value matmul runs on
    contiguous batches (a strided view of them ran 2x slower than copying), and the few pages
    after n (at most the decode steps and one page) are cut off again."""
    width = state.flat_values.shape[1]
    padded = replace(dense, qk=_padded(dense.qk, width, -np.inf),
                     weights=_padded(dense.weights, width, 0.0),
                     values=state.flat_values)
    out = {}
    for s in state.indexes:
        stats, pages = page_stats(padded, s), -(-n // s)
        out[s] = replace(stats, mass=stats.mass[:, :pages], max_qk=stats.max_qk[:, :pages],
                         weighted_v=stats.weighted_v[:, :pages])
    return out


def _step(state: _Layer, s: int, q, stats, grid: FidelityGrid, out, at) -> None:
    """Metrics of one step's queries q [B, Hq, d] at page size s, every mode and budget."""
    index = state.indexes[s]
    heads = q.shape[0] * q.shape[1]
    per_head = index.scores(q, "per-head")
    bound = index.to_host(per_head).transpose(1, 0, 2).reshape(heads, -1)   # [B * Hq, P]
    budgets = [b for b in grid.budgets if b % s == 0]
    for mode in grid.modes:
        scores = per_head if mode == "per-head" else index.scores(q, mode)
        chosen = index.select_many(scores, [b // s for b in budgets])
        for budget in budgets:
            sel, count = chosen[budget // s]
            mask = selection_mask(flat_selection(sel), count, heads, index.pages)
            first = state.first_masks.setdefault((s, budget, mode), mask)
            values = head_metrics(stats, mask, bound, stale_mask(first, index.pages))
            got = np.stack([np.asarray(values[m]) for m in METRICS])             # [M, B * Hq]
            out[(s, budget, mode)][:, at[0], at[1]] = got.reshape(
                len(METRICS), state.batch, -1).transpose(1, 0, 2)


def evaluate_layer(caps: list[Capture], layer: int, backend, grid: FidelityGrid, out,
                   bases: dict | None = None) -> None:
    """Fill out[(S, B, mode)][:, layer, step] = metrics [batch, len(METRICS), Hq]."""
    state = _Layer(caps, layer, backend, grid, bases)
    for step in range(caps[0].steps):
        n = caps[0].step_length(step)
        q = state.queries[:, step]                                            # [B, Hq, d]
        dense = dense_attention(q.reshape(-1, q.shape[-1]), state.flat_keys[:, :n],
                                state.flat_values[:, :n], caps[0].scaling)
        stats = _page_stats(state, dense, n)
        for s, index in state.indexes.items():
            if step:
                index.append(state.keys[:, :, n - 1:n])
            _step(state, s, q, stats[s], grid, out, (layer, step))


def evaluate_batch(caps: list[Capture], backend, grid: FidelityGrid, progress=None,
                   bases: dict | None = None) -> dict:
    """{(page_size, budget, mode): metrics [batch, layers, steps, len(METRICS), Hq] float64}
    for captures of one length and shape. bases: {page size: {layer: index of the first
    step_length(0) - 1 keys}} to start from (model_run.base_indexes, shared with the task)."""
    first = caps[0]
    shape = (len(caps), first.layers, first.steps, len(METRICS), first.q_heads)
    out = {key: np.full(shape, np.nan) for key in grid.settings()}
    with one_thread():
        for layer in range(first.layers):
            evaluate_layer(caps, layer, backend, grid, out, bases)
            if progress is not None:
                progress(layer + 1, first.layers)
    return out


def evaluate(cap: Capture, backend, grid: FidelityGrid, progress=None) -> dict:
    """{(page_size, budget, mode): metrics [layers, steps, len(METRICS), Hq] float64} of one
    capture."""
    return {k: v[0] for k, v in evaluate_batch([cap], backend, grid, progress).items()}
