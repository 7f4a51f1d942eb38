"""Every metric of a batch of captured prompts, on the device the model ran on (torch, float64):
the device path of evaluate.py.

The same figures as evaluate.evaluate_batch (whose NumPy float64 code on the host is the
reference this is tested against), for captures that stay on the model's device: the
prompts' heads stacked as rows, dense attention and its page statistics once per (layer,
step, page size), the selection by the backend's index (page_index.page_index: the CUDA kernels
on a GPU, crossing to torch through DLPack), and the metrics of every budget of a page size
and mode at once, [budgets, rows, pages] (metrics_device.py, the device path of metrics.py).
Nothing returns to the host until the last layer.

On the H200 (2026-12-01), the host path spent most of a 20-prompt 8K run in NumPy on one
core: per (layer, step) it read each layer's float64 keys and values (250 MB each) for
dense attention and again per page size for the page sums.
"""

from __future__ import annotations

import torch

from questprof.core.layout import pages_for
from questprof.fidelity.device import as_tensor, stored
from questprof.fidelity.metrics import METRICS
from questprof.fidelity.metrics_device import (PageStats, dense_attention, head_metrics,
                                               selection_masks, stale_masks, step_stats)
from questprof.fidelity.page_index import page_index


def _flat64(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, L, d] as float64 [B * H, width, d], zeros after L."""
    batch, heads, length, d = x.shape
    out = torch.zeros((batch * heads, width, d), dtype=torch.float64, device=x.device)
    out[:, :length] = x.reshape(batch * heads, length, d)
    return out


class _Layer:
    """One layer of the batch on the device: stored keys [B, Hkv, L, d], float64 keys and
    values as rows, stored queries [B, steps, Hq, d], an index per page size."""

    def __init__(self, captured, layer: int, backend, grid, bases: dict | None) -> None:
        self.keys = stored(captured.keys[layer], grid.dtype)
        length = self.keys.shape[2]
        width = max(pages_for(length, s) * s for s in grid.page_sizes)
        self.flat_keys = _flat64(self.keys, width)
        self.flat_values = _flat64(stored(captured.values[layer], grid.dtype), width)
        self.queries = stored(captured.queries[:, layer], grid.dtype)
        first = captured.step_length(0)
        if bases is None:
            self.indexes = {s: page_index(backend, self.keys[:, :, :first], s, grid.dtype,
                                          length) for s in grid.page_sizes}
        else:  # the task's summaries of the prefilled keys: add the fed token
            self.indexes = {s: bases[s][layer].copy() for s in grid.page_sizes}
            for index in self.indexes.values():
                index.append(self.keys[:, :, index.length:first])
        self.first: dict = {}


def _settings(state: _Layer, s: int, q, stats: PageStats, grid, out, at) -> None:
    """Metrics of one step's queries q [B, Hq, d] at page size s, every mode and budget, into
    out[setting, :, layer, step] (at: (settings' positions, layer, step))."""
    index, device = state.indexes[s], q.device
    batch, q_heads = q.shape[:2]
    heads, pages = batch * q_heads, index.pages
    per_head = index.scores(q, "per-head")
    bound = as_tensor(per_head, device).reshape(q_heads, batch, pages).transpose(0, 1)
    bound = bound.reshape(heads, pages).double()
    budgets = [b for b in grid.budgets if b % s == 0]
    for mode in grid.modes:
        scores = per_head if mode == "per-head" else index.scores(q, mode)
        chosen = index.select_many(scores, [b // s for b in budgets], host=False)
        picks = [chosen[b // s] for b in budgets]
        masks = torch.stack([selection_masks(as_tensor(sel, device), count, heads, pages)
                             for sel, count in picks])
        first = state.first.setdefault((s, mode), masks)
        got = head_metrics(stats, masks, [c for _, c in picks], bound, stale_masks(first, pages))
        got = got.reshape(len(budgets), len(METRICS), batch, q_heads).transpose(1, 2)
        for i, budget in enumerate(budgets):
            out[at[0][(s, budget, mode)], :, at[1], at[2]] = got[i]


def evaluate_layer(captured, layer: int, backend, grid, out, positions, bases=None) -> None:
    """Fill out[setting, :, layer, step] = metrics [B, len(METRICS), Hq] of one layer."""
    state = _Layer(captured, layer, backend, grid, bases)
    for step in range(captured.steps):
        n = captured.step_length(step)
        q = state.queries[:, step]                                        # [B, Hq, d]
        qk, weights, dense_out = dense_attention(q, state.flat_keys, state.flat_values, n,
                                                 captured.scaling)
        stats = step_stats(qk, weights, dense_out, state.flat_values, state.indexes, n)
        for s, index in state.indexes.items():
            if step:
                index.append(state.keys[:, :, n - 1:n])
            _settings(state, s, q, stats[s], grid, out, (positions, layer, step))


@torch.inference_mode()
def evaluate_captured(captured, backend, grid, bases: dict | None = None) -> dict:
    """{(page_size, budget, mode): metrics [B, layers, steps, len(METRICS), Hq] float64 NumPy}
    of a model_run.Captured batch (evaluate.evaluate_batch's result, computed where the
    captures are). bases: as evaluate_batch's."""
    keys = grid.settings()
    queries = captured.queries                                # [B, layers, steps, Hq, d]
    batch, layers, steps, q_heads = queries.shape[:4]
    out = torch.full((len(keys), batch, layers, steps, len(METRICS), q_heads), torch.nan,
                     dtype=torch.float64, device=queries.device)
    positions = {key: i for i, key in enumerate(keys)}
    for layer in range(layers):
        evaluate_layer(captured, layer, backend, grid, out, positions, bases)
    host = out.cpu().numpy()
    return {key: host[i] for i, key in enumerate(keys)}
