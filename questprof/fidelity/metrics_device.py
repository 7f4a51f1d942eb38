"""The device path of the fidelity metrics (torch, float64, where the model ran): metrics.py,
the NumPy reference, computed for a whole batch of requests at once, every budget of a page size
together. tests/test_fidelity_device.py holds each function here to its reference on random
inputs; evaluate_device.py runs them over a batch of captures.

Rows are the batch's q heads, request-major (H = B * Hq); selections and masks cover every
budget of a page size at once ([budgets, H, P]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from questprof.core.layout import pages_for
from questprof.fidelity.metrics import METRICS, TOP_TOKENS


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


def selection_masks(sel: torch.Tensor, count: int, heads: int, pages: int) -> torch.Tensor:
    """Selections sel [Hs, B, K] (first `count` valid, ascending) -> bool [B * Hq, P], rows
    request-major, `heads` = B * Hq; a shared mode's KV head mask repeats for its q heads
    (metrics.selection_mask of evaluate.flat_selection, for a whole batch)."""
    flat = sel.transpose(0, 1).reshape(-1, sel.shape[2])[:, :count].long()
    mask = torch.zeros((flat.shape[0], pages), dtype=torch.bool, device=sel.device)
    mask.scatter_(1, flat, True)
    return mask.repeat_interleave(heads // flat.shape[0], dim=0)
