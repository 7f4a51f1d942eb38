"""Fidelity of one decode query per head: what Quest's page set keeps of dense attention.

Shapes (Hq q heads, Hkv kv heads, L valid tokens, S page size, P = ceil(L / S) pages, d head dim).
Everything is float64 torch on the CPU: one query of 8K tokens is a few MB, and float64 keeps
the bound check U_p(q) >= max q.k exact up to the float32 rounding of the backend's scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METRICS = ("mass_recall", "oracle_mass", "top10_recall", "page_recall", "output_rel_error",
           "bound_slack", "stale_mass_recall")
TOP_TOKENS = 10  # Quest's recall figure counts the 10 highest-weight tokens


def device() -> torch.device:
    """Where the metrics run: the GPU when torch sees one (float64 is fast on an H200), else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _expand(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """[Hkv, ...] -> [Hq, ...]: each KV head repeated for its group of q heads."""
    return x.repeat_interleave(q_heads // x.shape[0], dim=0)


@dataclass
class DenseAttention:
    """Dense decode attention of one query: logits q.k [Hq, L] (unscaled), weights [Hq, L],
    out [Hq, d], and the values [Hkv, L, d] it read."""

    qk: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor
    values: torch.Tensor


def dense_attention(q, k, v, scaling: float) -> DenseAttention:
    """Exact attention of q [Hq, d] over k, v [Hkv, L, d]; weights = softmax(scaling * q.k)."""
    q, k, v = (torch.as_tensor(x, dtype=torch.float64, device=device()) for x in (q, k, v))
    kv_heads, length, d = k.shape
    grouped = q.reshape(kv_heads, -1, d)  # [Hkv, g, d]: no copy of K per q head
    qk = torch.bmm(grouped, k.transpose(1, 2))                    # [Hkv, g, L]
    weights = torch.softmax(qk * scaling, dim=-1)
    out = torch.bmm(weights, v).reshape(-1, d)
    return DenseAttention(qk.reshape(-1, length), weights.reshape(-1, length), out, v)


def _paged(x: torch.Tensor, page_size: int, fill: float) -> torch.Tensor:
    """[H, L, ...] -> [H, P, S, ...], the tail page padded with `fill`."""
    pad = -x.shape[1] % page_size
    if pad:
        shape = (x.shape[0], pad, *x.shape[2:])
        x = torch.cat([x, torch.full(shape, fill, dtype=x.dtype, device=x.device)], dim=1)
    return x.reshape(x.shape[0], -1, page_size, *x.shape[2:])


@dataclass
class PageStats:
    """Per page of one page size: true mass [Hq, P], largest q.k [Hq, P], sum_t p_t v_t
    [Hq, P, d], the page of each of the top tokens [Hq, T], dense output [Hq, d]."""

    mass: torch.Tensor
    max_qk: torch.Tensor
    weighted_v: torch.Tensor
    top_pages: torch.Tensor
    out: torch.Tensor


def _weighted_values(weights: torch.Tensor, values: torch.Tensor, page_size: int) -> torch.Tensor:
    """sum_{t in page} p_t v_t [Hq, P, d] from weights [Hq, L] and values [Hkv, L, d]."""
    kv_heads, _, d = values.shape
    w = _paged(weights, page_size, 0.0)                            # [Hq, P, S]
    q_heads, pages, _ = w.shape
    w = w.reshape(kv_heads, -1, pages, page_size).transpose(1, 2)  # [Hkv, P, g, S]
    v = _paged(values, page_size, 0.0)                             # [Hkv, P, S, d]
    pv = torch.matmul(w, v)                                        # [Hkv, P, g, d]
    return pv.transpose(1, 2).reshape(q_heads, pages, d)


def page_stats(dense: DenseAttention, page_size: int) -> PageStats:
    """Aggregate dense attention to pages of `page_size` tokens (padding weighs 0)."""
    mass = _paged(dense.weights, page_size, 0.0).sum(dim=2)
    max_qk = _paged(dense.qk, page_size, -torch.inf).amax(dim=2)
    pv = _weighted_values(dense.weights, dense.values, page_size)
    top = torch.topk(dense.weights, min(TOP_TOKENS, dense.weights.shape[1]), dim=1).indices
    return PageStats(mass, max_qk, pv, top // page_size, dense.out)


def selection_mask(sel, count: int, q_heads: int, pages: int) -> torch.Tensor:
    """Page positions sel [Hs, K] (first `count` valid) -> bool mask [Hq, P], Hs = Hq or Hkv."""
    sel = torch.as_tensor(sel[:, :count], dtype=torch.long, device=device())
    mask = torch.zeros(sel.shape[0], pages, dtype=torch.bool, device=sel.device)
    mask.scatter_(1, sel, True)
    return _expand(mask, q_heads)


def _oracle(mass: torch.Tensor, k: int) -> torch.Tensor:
    """Mask [Hq, P] of the k pages with the most true mass per head."""
    idx = torch.topk(mass, k, dim=1).indices
    return torch.zeros_like(mass, dtype=torch.bool).scatter_(1, idx, True)


def stale_mask(first: torch.Tensor, pages: int) -> torch.Tensor:
    """The pages chosen at the first decode step [Hq, P0], grown to [Hq, P] with the tail page."""
    mask = torch.zeros(first.shape[0], pages, dtype=torch.bool, device=first.device)
    mask[:, : first.shape[1]] = first
    mask[:, -1] = True
    return mask


def head_metrics(stats: PageStats, mask: torch.Tensor, bound, stale: torch.Tensor):
    """The fidelity metrics per q head [Hq] for selection `mask` [Hq, P] (dict of METRICS).

    bound [Hq, P]: the backend's U_p(q) of each head's own query (per-head scores), unscaled
    q.k units like bound_slack, which is the mean over the head's selected pages.
    stale [Hq, P]: the first decode step's selection (see stale_mask); its mass says what
    reusing an earlier query's pages would keep.
    """
    m = mask.to(torch.float64)
    k = int(mask.sum(dim=1).max())
    mass = (stats.mass * m).sum(dim=1)
    oracle = _oracle(stats.mass, k)
    out = torch.matmul(m[:, None, :], stats.weighted_v)[:, 0] / mass[:, None]
    slack = torch.as_tensor(bound, dtype=torch.float64, device=mass.device) - stats.max_qk
    return {
        "mass_recall": mass,
        "oracle_mass": (stats.mass * oracle).sum(dim=1),
        "top10_recall": torch.gather(mask, 1, stats.top_pages).to(torch.float64).mean(dim=1),
        "page_recall": (mask & oracle).sum(dim=1) / oracle.sum(dim=1),
        "output_rel_error": (out - stats.out).norm(dim=1) / stats.out.norm(dim=1),
        "bound_slack": (slack * m).sum(dim=1) / m.sum(dim=1),
        "stale_mass_recall": (stats.mass * stale).sum(dim=1),
    }
