"""NumPy float64 reference of every page selector (questprof.core.selectors names them).

One decode query of one request: q [Hq, d], keys [Hkv, L, d] in pages of S tokens in order
(P = ceil(L / S) pages, the tail page holds the newest token), a budget of K pages. A selection
is a mask [Hq, P] per q head (per-head selection; a KV head's pages are read for each of its q
heads), the pages each head read [Hq] (more than its mask for branch and bound, which reads to
decide), the selector's own bounds U_p [Hq, P] when it has some, and branch and bound's mass
bound eps [Hq]. Bounds and logits are unscaled q.k; softmax scales them by `scaling`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from questprof.core import reference
from questprof.core.fp8 import E4M3_MAX, from_e4m3, to_e4m3

SINK_PAGES = 1    # StreamingLLM's 4 sink tokens fit one page
WINDOW_PAGES = 2  # quest+sink+window: the tail page and the one before it


@dataclass
class Selection:
    """mask [Hq, P] bool, pages_read [Hq], bound [Hq, P] or None, eps [Hq] or None."""

    mask: np.ndarray
    pages_read: np.ndarray
    bound: np.ndarray | None = None
    eps: np.ndarray | None = None


class View:
    """One query q [Hq, d] over keys [Hkv, L, d] in pages of `page_size` tokens (float64)."""

    def __init__(self, q, keys, page_size: int, scaling: float, seed: int = 0,
                 box_bounds=None) -> None:
        """box_bounds(q, width, fp8) -> [Hq, n] bounds of the n boxes of `width` tokens, when
        the caller has a faster way (the task keeps its prompts' prefix summaries and sums by a
        matmul); default: reference.estimate over box_summary of the keys."""
        self.box_bounds = box_bounds or self._box_bounds
        self.q = np.asarray(q, dtype=np.float64)
        self.keys = np.asarray(keys, dtype=np.float64)
        kv_heads, self.length, self.d = self.keys.shape
        self.q_heads, self.page_size, self.scaling, self.seed = len(self.q), page_size, scaling, seed
        self.pages = -(-self.length // page_size)
        self.valid = np.full(self.pages, page_size)
        self.valid[-1] = self.length - (self.pages - 1) * page_size
        self._bounds: dict = {}

    @cached_property
    def qk(self) -> np.ndarray:
        """Unscaled logits q.k [Hq, L] (each q head against its KV head)."""
        kv_heads = self.keys.shape[0]
        grouped = self.q.reshape(kv_heads, -1, self.d) @ self.keys.transpose(0, 2, 1)
        return grouped.reshape(self.q_heads, self.length)

    def paged(self, x: np.ndarray, fill: float) -> np.ndarray:
        """[Hq, L] -> [Hq, P, S], the tail page padded with `fill`."""
        pad = self.pages * self.page_size - self.length
        x = np.concatenate([x, np.full((len(x), pad), fill)], axis=1)
        return x.reshape(len(x), self.pages, self.page_size)

    @cached_property
    def page_max(self) -> np.ndarray:
        """Exact largest q.k of each page [Hq, P]."""
        return self.paged(self.qk, -np.inf).max(axis=2)

    def mass(self, among: np.ndarray | None = None) -> np.ndarray:
        """Softmax mass of each page [Hq, P] over the tokens of the pages `among` [Hq, P] (all)."""
        logits = self.paged(self.qk * self.scaling, -np.inf)
        if among is not None:
            logits = np.where(among[:, :, None], logits, -np.inf)
        w = np.exp(logits - logits.max(axis=(1, 2), keepdims=True))
        w = w.sum(axis=2)
        return w / w.sum(axis=1, keepdims=True)

    def bound(self, boxes: int = 1, fp8: bool = False) -> np.ndarray:
        """U_p(q) [Hq, P]: the largest bound of the page's `boxes` sub-boxes (consecutive S/c
        tokens each), min/max exact or rounded outward to FP8 (`fp8`)."""
        if (boxes, fp8) not in self._bounds:
            u = self.box_bounds(self.q, self.page_size // boxes, fp8)
            n = u.shape[1]
            u = np.concatenate([u, np.full((self.q_heads, self.pages * boxes - n), -np.inf)], 1)
            self._bounds[boxes, fp8] = u.reshape(self.q_heads, self.pages, boxes).max(axis=2)
        return self._bounds[boxes, fp8]

    def _box_bounds(self, q: np.ndarray, width: int, fp8: bool) -> np.ndarray:
        summ = box_summary(self.keys, width, fp8)
        return reference.estimate(q[None], summ, np.array([0, len(summ)]), np.arange(len(summ)))


def fp8_box_scale(amax) -> np.ndarray:
    """Scale per KV head of FP8 summaries whose largest magnitude is `amax` [Hkv] (1 for 0):
    amax / 448 widened by 2^-20, so that the float64 quotient x / scale never exceeds 448, where
    to_e4m3 saturates and rounding up would stop being a bound (the kernels take it as float32,
    within the same margin)."""
    amax = np.asarray(amax, dtype=np.float64)
    return np.where(amax > 0, amax / E4M3_MAX * (1 + 2.0**-20), 1.0)


def box_summary(keys: np.ndarray, width: int, fp8: bool = False, scale=None) -> np.ndarray:
    """[n, Hkv, 2, d] min/max of consecutive boxes of `width` tokens (n = ceil(L / width)),
    rounded outward to E4M3 with one scale per KV head when `fp8` (`scale` [Hkv], default
    fp8_box_scale of the keys' largest magnitude)."""
    kv_heads, length, d = keys.shape
    n = -(-length // width)
    k = np.pad(keys, ((0, 0), (0, n * width - length), (0, 0)), mode="edge")
    k = k.reshape(kv_heads, n, width, d)
    summ = np.stack([k.min(axis=2), k.max(axis=2)], axis=2).transpose(1, 0, 2, 3)
    return fp8_outward(summ, scale=scale) if fp8 else summ


def fp8_outward(summ: np.ndarray, amax: np.ndarray | None = None, scale=None) -> np.ndarray:
    """Summaries [n, Hkv, 2, d] rounded outward to E4M3, one scale per KV head: `scale` [Hkv],
    default fp8_box_scale of amax [Hkv], the largest |value| of the whole cache's summaries
    (default: of summ's)."""
    if scale is None:
        scale = fp8_box_scale(np.abs(summ).max(axis=(0, 2, 3)) if amax is None else amax)
    scale = np.asarray(scale, dtype=np.float64)[None, :, None]
    lo = from_e4m3(to_e4m3(summ[:, :, 0] / scale, "down")) * scale
    hi = from_e4m3(to_e4m3(summ[:, :, 1] / scale, "up")) * scale
    return np.stack([lo, hi], axis=2)


def _done(mask: np.ndarray, bound=None, eps=None) -> Selection:
    return Selection(mask, mask.sum(axis=1), bound, eps)


def topk_bound(view: View, k: int, boxes: int = 1, fp8: bool = False, sinks: int = 0,
               window: int = 0) -> Selection:
    """Quest and its variants: the K pages of largest U_p (reference.topk, tail page in), for
    all heads at once: the reserved pages (tail, sinks, window) first, then the others by U_p
    descending, ties to the lower position (a test holds it to reference.topk)."""
    u = view.bound(boxes, fp8)
    keep = reference.reserved_positions(view.pages, k, sinks, window)
    score = u.copy()
    score[:, keep] = np.inf
    top = np.argsort(-score, axis=1, kind="stable")[:, :min(k, view.pages)]
    mask = np.zeros((view.q_heads, view.pages), dtype=bool)
    np.put_along_axis(mask, top, True, axis=1)
    return _done(mask, u)


def sink_window(view: View, k: int) -> Selection:
    """Quest with SINK_PAGES first and WINDOW_PAGES last pages reserved (fewer when K is)."""
    window = min(WINDOW_PAGES, k)
    return topk_bound(view, k, sinks=min(SINK_PAGES, k - window), window=window)


def _rest_order(score: np.ndarray) -> np.ndarray:
    """Positions [Hq, P-1] of the non-tail pages by score descending (ties: lower position)."""
    return np.argsort(-score[:, :-1], axis=1, kind="stable")


def _top_rest(view: View, order: np.ndarray, n) -> np.ndarray:
    """Mask [Hq, P]: the tail page and the first n[h] pages of order[h] (n scalar or [Hq])."""
    n = np.broadcast_to(np.asarray(n), (view.q_heads,))
    mask = np.zeros((view.q_heads, view.pages), dtype=bool)
    mask[:, -1] = True
    take = np.arange(order.shape[1])[None, :] < n[:, None]
    np.put_along_axis(mask, order, take, axis=1)
    return mask


def streaming(view: View, k: int) -> Selection:
    """Sinks and a recent window only: the first SINK_PAGES pages and the last K - sinks."""
    score = np.arange(view.pages, dtype=np.float64)[None].repeat(view.q_heads, 0)
    sinks = min(SINK_PAGES, k - 1)
    score[:, :sinks] = np.inf
    return _done(_top_rest(view, _rest_order(score), k - 1))


def order(view: View, k: int, how: str) -> Selection:
    """Ablation: K - 1 pages in a fixed order (first pages first, or a seeded random order)."""
    if how == "position":
        score = -np.arange(view.pages, dtype=np.float64)[None].repeat(view.q_heads, 0)
    else:
        score = np.random.default_rng(view.seed).random((view.q_heads, view.pages))
    return _done(_top_rest(view, _rest_order(score), k - 1))


def oracle(view: View, k: int) -> Selection:
    """The K pages of most true mass (tail page not forced: the same set as oracle_mass)."""
    top = np.argsort(-view.mass(), axis=1, kind="stable")[:, :k]
    mask = np.zeros((view.q_heads, view.pages), dtype=bool)
    np.put_along_axis(mask, top, True, axis=1)
    return _done(mask)


def gap_pages(u: np.ndarray, k: int, t: float, scaling: float) -> np.ndarray:
    """Non-tail pages [H] quest-gap:t keeps of bounds u [H, P] (tail page last), budget K:
    those by U_p down to the first gap U_(i) - U_(i+1) > t (scaled logits), at most K - 1."""
    order_ = _rest_order(u)
    v = np.take_along_axis(u[:, :-1], order_, axis=1) * scaling
    over = np.concatenate([(v[:, :-1] - v[:, 1:]) > t, np.ones((len(v), 1), bool)], axis=1)
    n = over.argmax(axis=1) + 1  # the last non-tail page ends the ranking: a gap to nothing
    return np.minimum(n, min(max(k - 1, 0), u.shape[1] - 1))


def top_p_pages(u: np.ndarray, k: int, p: float, scaling: float) -> np.ndarray:
    """Non-tail pages [H] quest-topp:p keeps of bounds u [H, P] (tail page last), budget K: with
    the tail page, those by U_p until the bounds' softmax reaches cumulative mass p, at most
    K - 1."""
    order_ = _rest_order(u)
    w = np.exp((u - u.max(axis=1, keepdims=True)) * scaling)
    w /= w.sum(axis=1, keepdims=True)
    cum = w[:, -1:] + np.concatenate([np.zeros((len(w), 1)),
                                      np.take_along_axis(w[:, :-1], order_, axis=1)], 1).cumsum(1)
    n = np.minimum((cum < p).sum(axis=1), u.shape[1] - 1)
    return np.minimum(n, max(k - 1, 0))


def gap(view: View, k: int, t: float) -> Selection:
    """Dynamic budget: the tail page and the non-tail pages of gap_pages."""
    u = view.bound()
    return _done(_top_rest(view, _rest_order(u), gap_pages(u, k, t, view.scaling)), u)


def top_p(view: View, k: int, p: float) -> Selection:
    """Dynamic budget: the tail page and the non-tail pages of top_p_pages."""
    u = view.bound()
    return _done(_top_rest(view, _rest_order(u), top_p_pages(u, k, p, view.scaling)), u)


def _tau(logits: np.ndarray, r: int) -> float:
    """The r-th largest of `logits` (-inf when fewer)."""
    return -np.inf if len(logits) < r else float(np.partition(logits, len(logits) - r)[-r])


def _read_pages(pages_qk: np.ndarray, u_sorted: np.ndarray, r: int) -> int:
    """Pages read in bound order until the next U_p < tau_r (binary search: tau_r grows with
    the pages read, U_p falls). pages_qk [P, S] in the same order, -inf padded."""
    lo, hi = 1, len(u_sorted)  # stopping after n pages: U_(n+1) < tau_r(first n)
    while lo < hi:
        mid = (lo + hi) // 2
        read = pages_qk[:mid].ravel()
        # a relative 1e-12 below tau_r: a bound equal to a read logit up to float64 sums reads on
        if u_sorted[mid] < _tau(read[np.isfinite(read)], r) - 1e-12 * (1 + abs(u_sorted[mid])):
            hi = mid
        else:
            lo = mid + 1
    return lo


def branch_and_bound(view: View, r: int) -> Selection:
    """Exact top-R tokens: pages in descending U_p until the next U_p < tau_R, the R-th largest
    true logit read; eps <= sum_unread S_p e^U_p / (Z_read + sum_unread S_p e^U_p)."""
    u = view.bound()
    order_ = np.argsort(-u, axis=1, kind="stable")
    qk = view.paged(view.qk, -np.inf)
    mask = np.zeros((view.q_heads, view.pages), dtype=bool)
    eps = np.zeros(view.q_heads)
    for h in range(view.q_heads):
        n = _read_pages(qk[h][order_[h]], u[h][order_[h]], r)
        mask[h, order_[h, :n]] = True
        read = qk[h][mask[h]].ravel() * view.scaling
        unread = u[h][~mask[h]] * view.scaling
        top = max(read.max(), unread.max(initial=-np.inf))
        z = np.exp(read - top).sum()
        rest = (view.valid[~mask[h]] * np.exp(unread - top)).sum()
        eps[h] = rest / (z + rest)
    return _done(mask, u, eps)


def _keep_top(view: View, cand: np.ndarray, score: np.ndarray, k: int) -> np.ndarray:
    """Of the candidate pages [Hq, P], the tail and the K - 1 others of largest score."""
    score = np.where(cand, score, -np.inf)
    order_ = _rest_order(score)
    n = np.minimum(cand[:, :-1].sum(axis=1), max(k - 1, 0))
    return _top_rest(view, order_, n)


def _candidates(view: View, state: dict, key: str, fill) -> tuple[np.ndarray, np.ndarray]:
    """state[key] [Hq, P0] grown to [Hq, P] with `fill` for the pages written since."""
    old = state.get(key)
    grown = np.full((view.q_heads, view.pages), fill)
    if old is not None:
        grown[:, : old.shape[1]] = old
    return grown, old is None


def h2o(view: View, k: int, state: dict) -> Selection:
    """Heavy hitters: keep the pages of most attention accumulated over the queries so far;
    evicted pages never come back. The first query's attention stands in for the prompt's."""
    cand, first = _candidates(view, state, "kept", True)
    acc, _ = _candidates(view, state, "acc", 0.0)
    if first:
        acc = view.mass()
    kept = _keep_top(view, cand, acc, k)
    if not first:
        acc = acc + np.where(kept, view.mass(kept), 0.0)
    state["kept"], state["acc"] = kept, acc
    return _done(kept)


def tova(view: View, k: int, state: dict) -> Selection:
    """Token omission via attention: once the budget is full, evict the pages of least
    attention under the current query; evicted pages never come back."""
    cand, _ = _candidates(view, state, "kept", True)
    kept = _keep_top(view, cand, view.mass(cand), k)
    state["kept"] = kept
    return _done(kept)


def union_pages(sel, count, group: int) -> float:
    """Mean distinct pages per (request, KV head) over the per-head selections sel [Hq, B, K]
    (the first count[b] of request b's): what a KV head reads when its `group` q heads choose
    apart (the sweep's pools, the serving loop's pages read)."""
    sel, count = np.asarray(sel), np.asarray(count)
    q_heads, batch, _ = sel.shape
    sizes = [len(np.unique(sel[h:h + group, b, :count[b]]))
             for h in range(0, q_heads, group) for b in range(batch)]
    return float(np.mean(sizes))
