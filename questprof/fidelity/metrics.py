"""Fidelity of one decode query per head: what Quest's page set keeps of dense attention. The
reference of every metric; metrics_device.py is its device path (torch, a batch at once), held
to it by tests/test_fidelity_device.py.

Shapes (Hq q heads, Hkv kv heads, L valid tokens, S page size, P = ceil(L / S) pages, d head dim).
Everything is float64 NumPy on the CPU (no torch: `questprof fidelity --source synthetic` runs
after `pip install -e .`): one query of 8K tokens is a few MB, and float64 keeps the bound check
U_p(q) >= max q.k exact up to the float32 rounding of the backend's scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METRICS = ("mass_recall", "oracle_mass", "top10_recall", "page_recall", "output_rel_error",
           "bound_slack", "stale_mass_recall", "pages_read", "mass_bound")
TOP_TOKENS = 10  # Quest's recall figure counts the 10 highest-weight tokens


def _expand(x: np.ndarray, q_heads: int) -> np.ndarray:
    """[Hkv, ...] -> [Hq, ...]: each KV head repeated for its group of q heads."""
    return np.repeat(x, q_heads // x.shape[0], axis=0)


def _top_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices [H, k] of the k largest values of each row of x [H, N] (in no order)."""
    return np.argpartition(-x, k - 1, axis=1)[:, :k]


@dataclass
class DenseAttention:
    """Dense decode attention of one query: logits q.k [Hq, L] (unscaled), weights [Hq, L],
    out [Hq, d], and the values [Hkv, L, d] it read."""

    qk: np.ndarray
    weights: np.ndarray
    out: np.ndarray
    values: np.ndarray


def dense_attention(q, k, v, scaling: float) -> DenseAttention:
    """Exact attention of q [Hq, d] over k, v [Hkv, L, d]; weights = softmax(scaling * q.k)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    kv_heads, length, d = k.shape
    grouped = q.reshape(kv_heads, -1, d)  # [Hkv, g, d]: no copy of K per q head
    qk = grouped @ k.transpose(0, 2, 1)                           # [Hkv, g, L]
    logits = qk * scaling
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    out = (weights @ v).reshape(-1, d)
    return DenseAttention(qk.reshape(-1, length), weights.reshape(-1, length), out, v)


def _paged(x: np.ndarray, page_size: int, fill: float) -> np.ndarray:
    """[H, L, ...] -> [H, P, S, ...], the tail page padded with `fill`."""
    pad = -x.shape[1] % page_size
    if pad:
        shape = (x.shape[0], pad, *x.shape[2:])
        x = np.concatenate([x, np.full(shape, fill, dtype=x.dtype)], axis=1)
    return x.reshape(x.shape[0], -1, page_size, *x.shape[2:])


@dataclass
class PageStats:
    """Per page of one page size: true mass [Hq, P], largest q.k [Hq, P], sum_t p_t v_t
    [Hq, P, d], the page of each of the top tokens [Hq, T], dense output [Hq, d]."""

    mass: np.ndarray
    max_qk: np.ndarray
    weighted_v: np.ndarray
    top_pages: np.ndarray
    out: np.ndarray


def _weighted_values(weights: np.ndarray, values: np.ndarray, page_size: int) -> np.ndarray:
    """sum_{t in page} p_t v_t [Hq, P, d] from weights [Hq, L] and values [Hkv, L, d]."""
    kv_heads, _, d = values.shape
    w = _paged(weights, page_size, 0.0)                                # [Hq, P, S]
    q_heads, pages, _ = w.shape
    w = w.reshape(kv_heads, -1, pages, page_size).transpose(0, 2, 1, 3)  # [Hkv, P, g, S]
    v = _paged(values, page_size, 0.0)                                 # [Hkv, P, S, d]
    pv = w @ v                                                         # [Hkv, P, g, d]
    return pv.transpose(0, 2, 1, 3).reshape(q_heads, pages, d)


def page_stats(dense: DenseAttention, page_size: int) -> PageStats:
    """Aggregate dense attention to pages of `page_size` tokens (padding weighs 0)."""
    mass = _paged(dense.weights, page_size, 0.0).sum(axis=2)
    max_qk = _paged(dense.qk, page_size, -np.inf).max(axis=2)
    pv = _weighted_values(dense.weights, dense.values, page_size)
    top = _top_indices(dense.weights, min(TOP_TOKENS, dense.weights.shape[1]))
    return PageStats(mass, max_qk, pv, top // page_size, dense.out)


def selection_mask(sel, count: int, q_heads: int, pages: int) -> np.ndarray:
    """Page positions sel [Hs, K] (first `count` valid) -> bool mask [Hq, P], Hs = Hq or Hkv."""
    sel = np.asarray(sel)[:, :count].astype(np.int64)
    mask = np.zeros((sel.shape[0], pages), dtype=bool)
    np.put_along_axis(mask, sel, True, axis=1)
    return _expand(mask, q_heads)


def _oracle(mass: np.ndarray, k: int) -> np.ndarray:
    """Mask [Hq, P] of the k pages with the most true mass per head."""
    mask = np.zeros(mass.shape, dtype=bool)
    if k > 0:
        np.put_along_axis(mask, _top_indices(mass, k), True, axis=1)
    return mask


def stale_mask(first: np.ndarray, pages: int) -> np.ndarray:
    """The pages chosen at the first decode step [Hq, P0], grown to [Hq, P] with the tail page."""
    mask = np.zeros((first.shape[0], pages), dtype=bool)
    mask[:, : first.shape[1]] = first
    mask[:, -1] = True
    return mask


def head_metrics(stats: PageStats, mask: np.ndarray, bound, stale: np.ndarray,
                 pages_read=None, mass_bound=None) -> dict:
    """The fidelity metrics per q head [Hq] for selection `mask` [Hq, P] (dict of METRICS).

    bound [Hq, P]: the backend's U_p(q) of each head's own query (per-head scores), unscaled
    q.k units like bound_slack, which is the mean over the head's selected pages.
    stale [Hq, P]: the first decode step's selection (see stale_mask); its mass says what
    reusing an earlier query's pages would keep.
    pages_read [Hq]: pages a head read (default: its selected pages; branch and bound reads
    to decide); mass_bound [Hq]: a certified bound on the unread mass (NaN when none).
    """
    m = mask.astype(np.float64)
    k = int(mask.sum(axis=1).max())
    mass = (stats.mass * m).sum(axis=1)
    oracle = _oracle(stats.mass, k)
    out = (m[:, None, :] @ stats.weighted_v)[:, 0] / mass[:, None]
    slack = np.asarray(bound, dtype=np.float64) - stats.max_qk
    return {
        "mass_recall": mass,
        "oracle_mass": (stats.mass * oracle).sum(axis=1),
        "top10_recall": np.take_along_axis(mask, stats.top_pages, axis=1).mean(axis=1),
        "page_recall": (mask & oracle).sum(axis=1) / oracle.sum(axis=1),
        "output_rel_error": (np.linalg.norm(out - stats.out, axis=1)
                             / np.linalg.norm(stats.out, axis=1)),
        "bound_slack": (slack * m).sum(axis=1) / m.sum(axis=1),
        "stale_mass_recall": (stats.mass * stale).sum(axis=1),
        "pages_read": mask.sum(axis=1) if pages_read is None else np.asarray(pages_read, float),
        "mass_bound": np.full(len(mask), np.nan) if mass_bound is None else mass_bound,
    }
