"""Every metric of a batch of captured prompts, on the device the model ran on (torch, float64).

The same figures as evaluate.evaluate_batch (whose NumPy float64 code on the host is the
reference this is tested against), for captures that stay on the model's device: the
prompts' heads stacked as rows, dense attention and its page statistics once per (layer,
step, page size), the selection by the backend's index (page_index.page_index: the CUDA kernels
on a GPU, crossing to torch through DLPack), and the metrics of every budget of a page size
and mode at once, [budgets, rows, pages]. Nothing returns to the host until the last layer.

On the H200 (2026-12-01), the host path spent most of a 20-prompt 8K run in NumPy on one
core: per (layer, step) it read each layer's float64 keys and values (250 MB each) for
dense attention and again per page size for the page sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from questprof.core.layout import pages_for
from questprof.fidelity.device import as_tensor, selection_masks, stored
from questprof.fidelity.metrics import METRICS, TOP_TOKENS
from questprof.fidelity.page_index import page_index


@dataclass
class PageStats:
    """One step's dense attention by pages of one size: true mass [H, P], largest q.k [H, P],
    sum_t p_t v_t [H, P, d], the page of each top token [H, T], dense output [H, d]
    (H = B * Hq rows, request-major)."""

    mass: torch.Tensor
    max_qk: torch.Tensor
    weighted_v: torch.Tensor
    top_pages: torch.Tensor
    out: torch.Tensor


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int,
                    scaling: float):
    """(q.k [H, n] unscaled, weights [H, n], out [H, d]) of q [B, Hq, d] over the first n
    tokens of keys, values [B * Hkv, L', d] float64 (metrics.dense_attention per request)."""
    rows, _, d = keys.shape
    grouped = q.double().reshape(rows, -1, d)                            # [B * Hkv, g, d]
    qk = grouped @ keys[:, :n].transpose(1, 2)                           # [B * Hkv, g, n]
    logits = qk * scaling
    weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    weights /= weights.sum(dim=-1, keepdim=True)
    out = (weights @ values[:, :n]).reshape(-1, d)
    return qk.reshape(-1, n), weights.reshape(-1, n), out


def page_stats(qk, weights, out, values: torch.Tensor, page_size: int, n: int,
               top: torch.Tensor) -> PageStats:
    """The page statistics of n tokens' attention at `page_size` (metrics.page_stats):
    values [B * Hkv, L', d] are zero after the capture, L' >= the pages' tokens; top [H, T]:
    the top tokens."""
    heads, rows, d = weights.shape[0], values.shape[0], values.shape[2]
    pages = pages_for(n, page_size)
    span, group = pages * page_size, heads // rows
    w = F.pad(weights, (0, span - n)).reshape(heads, pages, page_size)
    max_qk = F.pad(qk, (0, span - n), value=-torch.inf).reshape(heads, pages, page_size)
    paged_v = values[:, :span].reshape(rows, pages, page_size, d)
    # an einsum: 1.5x faster than the batched matmul of [rows, P, g, S] @ [rows, P, S, d]
    # on one CPU core (2026-12-01, 12 rows of 256 pages)
    pv = torch.einsum("rgps,rpsd->rgpd", w.reshape(rows, group, pages, page_size), paged_v)
    return PageStats(w.sum(dim=2), max_qk.amax(dim=2), pv.reshape(heads, pages, d),
                     top // page_size, out)


def _coarser(fine: PageStats, ratio: int, page_size: int, n: int, top) -> PageStats:
    """The statistics at `page_size` from those of pages `ratio` times smaller (sums and
    maxima of whole fine pages: no second pass over the values)."""
    pages = pages_for(n, page_size)
    pad = pages * ratio - fine.mass.shape[1]
    heads, d = fine.mass.shape[0], fine.weighted_v.shape[2]
    mass = F.pad(fine.mass, (0, pad)).reshape(heads, pages, ratio).sum(dim=2)
    max_qk = F.pad(fine.max_qk, (0, pad), value=-torch.inf).reshape(heads, pages, ratio)
    pv = F.pad(fine.weighted_v, (0, 0, 0, pad)).reshape(heads, pages, ratio, d).sum(dim=2)
    return PageStats(mass, max_qk.amax(dim=2), pv, top // page_size, fine.out)


def step_stats(qk, weights, out, values, page_sizes, n: int) -> dict:
    """{S: page_stats} of one step for every page size: a size that a smaller one divides
    sums that one's pages (8 -> 16 -> 32 reads the values once, not three times)."""
    top = torch.topk(weights, min(TOP_TOKENS, n), dim=1).indices
    stats: dict = {}
    for s in sorted(page_sizes):
        finer = [f for f in stats if s % f == 0]
        stats[s] = (_coarser(stats[max(finer)], s // max(finer), s, n, top) if finer
                    else page_stats(qk, weights, out, values, s, n, top))
    return stats


def _oracles(mass: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[budgets, H, P] bool: the counts[i] pages of most true mass per row."""
    order = torch.topk(mass, max(counts), dim=1).indices                 # [H, kmax]
    rank = torch.full(mass.shape, mass.shape[1], dtype=torch.long, device=mass.device)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=mass.device).expand_as(order))
    return rank < torch.tensor(counts, device=mass.device)[:, None, None]


def head_metrics(stats: PageStats, masks: torch.Tensor, counts: list[int], bound, stale):
    """metrics.head_metrics of every budget at once: masks, stale [budgets, H, P] bool (the
    selection and the first step's), counts [budgets] pages selected, bound [H, P] float64
    (per-head scores). Returns [budgets, len(METRICS), H] float64."""
    m = masks.double()
    picked = m.sum(dim=2)
    mass = (stats.mass * m).sum(dim=2)                                   # [budgets, H]
    oracle = _oracles(stats.mass, counts)
    # heads as the batch ([H, budgets, P] @ [H, P, d]): broadcasting the budgets over the
    # weighted values instead copied them per budget, 24x slower on one CPU core
    out = (m.transpose(0, 1) @ stats.weighted_v).transpose(0, 1) / mass.unsqueeze(2)
    top = masks.gather(2, stats.top_pages.expand(len(counts), -1, -1))
    values = {
        "mass_recall": mass,
        "oracle_mass": (stats.mass * oracle).sum(dim=2),
        "top10_recall": top.double().mean(dim=2),
        "page_recall": (masks & oracle).sum(dim=2).double() / oracle.sum(dim=2).double(),
        "output_rel_error": (torch.linalg.vector_norm(out - stats.out, dim=2)
                             / torch.linalg.vector_norm(stats.out, dim=1)),
        "bound_slack": ((bound - stats.max_qk) * m).sum(dim=2) / picked,
        "stale_mass_recall": (stats.mass * stale).sum(dim=2),
        "pages_read": picked,
        "mass_bound": torch.full_like(mass, torch.nan),
    }
    return torch.stack([values[name] for name in METRICS], dim=1)


def stale_masks(first: torch.Tensor, pages: int) -> torch.Tensor:
    """The first step's selections [budgets, H, P0] grown to P pages with the tail page."""
    mask = torch.zeros((*first.shape[:2], pages), dtype=torch.bool, device=first.device)
    mask[..., : first.shape[2]] = first
    mask[..., -1] = True
    return mask


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
