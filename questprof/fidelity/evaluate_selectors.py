"""Every metric of the selectors beyond plain Quest, on the same captures, queries and steps.

Quest itself is measured by the backend under test (evaluate.py); every other selector of
questprof.core.selectors runs its NumPy float64 reference here, one decode sequence per
(layer, page size, budget) so that the stateful ones (h2o, tova) carry their evictions from
step to step. The key of a setting is (S, B, mode) for Quest and (S, B, 'per-head', name) for
the others: they select per q head. Their rows carry `selector`, `selector_rho` (bytes per
query against dense, summaries included, for an fp16 cache: the kernels' storage) and the
tail of the pages read (`pages_read_p95`, `pages_read_max` over heads, steps and prompts).
"""

from __future__ import annotations

import numpy as np

from questprof.core import selectors as registry
from questprof.core.selection import View
from questprof.fidelity.capture import Capture
from questprof.fidelity.metrics import (METRICS, dense_attention, head_metrics, page_stats,
                                        stale_mask)
from questprof.fidelity.host_index import stored
from questprof.fidelity.threads import one_thread

RHO_DTYPE = "fp16"
PAGES_READ = METRICS.index("pages_read")


def others(grid) -> tuple:
    """The grid's selectors other than Quest, parsed."""
    chosen = registry.parse_list(",".join(grid.selectors))
    return tuple(s for s in chosen if s.name != registry.QUEST)


def has_quest(grid) -> bool:
    """Whether the grid measures plain Quest (the backend's kernels)."""
    return registry.QUEST in grid.selectors


def setting_keys(grid) -> list[tuple]:
    """(S, B, 'per-head', name) of every selector other than Quest, budgets whole pages."""
    return [(s, b, "per-head", sel.name) for s in grid.page_sizes for b in grid.budgets
            if b % s == 0 for sel in others(grid)]


def _layer(cap: Capture, layer: int, grid, out: dict) -> None:
    """Fill out[key][layer, step] = metrics [len(METRICS), Hq] for one layer."""
    keys = stored(cap.keys[layer], grid.dtype).astype(np.float64)
    values = stored(cap.values[layer], grid.dtype).astype(np.float64)
    queries = stored(cap.queries[layer], grid.dtype)
    chosen = {sel.name: sel for sel in others(grid)}
    states = {key: chosen[key[3]].start() for key in out}
    first: dict = {}
    for step in range(cap.steps):
        n = cap.step_length(step)
        dense = dense_attention(queries[step], keys[:, :n], values[:, :n], cap.scaling)
        for s in grid.page_sizes:
            stats = page_stats(dense, s)
            view = View(queries[step], keys[:, :n], s, cap.scaling, seed=1000 * layer + step)
            for key in (k for k in out if k[0] == s):
                got = chosen[key[3]].select(view, key[1] // s, states[key])
                mask = first.setdefault(key, got.mask)
                bound = got.bound if got.bound is not None else np.full(got.mask.shape, np.nan)
                metrics = head_metrics(stats, got.mask, bound, stale_mask(mask, view.pages),
                                       got.pages_read, got.eps)
                out[key][layer, step] = np.stack([metrics[m] for m in METRICS])


def evaluate_selectors(cap: Capture, grid) -> dict:
    """{(S, B, 'per-head', name): metrics [layers, steps, len(METRICS), Hq]} of one capture."""
    shape = (cap.layers, cap.steps, len(METRICS), cap.q_heads)
    out = {key: np.full(shape, np.nan) for key in setting_keys(grid)}
    if out:
        with one_thread():
            for layer in range(cap.layers):
                _layer(cap, layer, grid, out)
    return out


def selector_fields(key: tuple, metrics: np.ndarray, pages: int, dense_layers: int) -> dict:
    """Row fields of a setting's selector from metrics [samples, layers, steps, M, Hq]."""
    name = key[3] if len(key) > 3 else registry.QUEST
    sparse = metrics[:, dense_layers:] if metrics.shape[1] > dense_layers else metrics
    read = sparse[:, :, :, PAGES_READ].ravel()
    read = read[np.isfinite(read)]
    if not read.size:
        return {"selector": name}
    rho = registry.parse(name).rho(key[0], float(read.mean()), pages, RHO_DTYPE)
    return {"selector": name, "selector_rho": round(rho, 5),
            "pages_read_p95": float(np.percentile(read, 95)), "pages_read_max": float(read.max())}
