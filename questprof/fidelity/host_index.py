"""Quest's selection on the host, vectorised: what the NumPy backend's stages compute, at once
for a batch of requests of equal length, every head and every page.

Summaries are the exact min and max of each page's stored keys (as the reference's `summary`
stage keeps them); the bound U_p(q) = sum_j max(q_j m_pj, q_j M_pj) is written as
q+ . M + q- . m (q+ = max(q, 0), q- = min(q, 0); the same terms, summed by a float64 matmul
instead of numpy's sum); top-K keeps the tail page and the K - 1 best other pages, ties to the
lower position, ascending, -1 padded: core.reference.topk with no sinks and no window.
"""

from __future__ import annotations

import numpy as np

from questprof.core.layout import from_storage, pages_for, to_storage
from questprof.core.stages import check_mode


def on_host(x):
    """x as the host holds it: a torch tensor (on any device) copied to a NumPy array."""
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x


def stored(x, dtype: str) -> np.ndarray:
    """Values as the cache stores them (rounded to `dtype`), as float32 (x: an array, or a
    torch tensor anywhere)."""
    x = on_host(x)
    if dtype == "fp32":
        return np.asarray(x, dtype=np.float32)
    return from_storage(to_storage(np.asarray(x, dtype=np.float32), dtype), dtype).astype(
        np.float32)


class HostIndex:
    """B requests' page summaries of keys [B, Hkv, L, d], growable to `capacity` tokens each."""

    def __init__(self, keys, page_size: int, dtype: str, capacity: int) -> None:
        keys = stored(keys, dtype)
        self.batch, kv_heads, length, d = keys.shape
        self.page_size, self.dtype = page_size, dtype
        room = pages_for(capacity, page_size)
        # float64 min and max per page, [B, Hkv, d, pages]: the bound's matmul reads a slice
        # of pages in place
        self.lo = np.full((self.batch, kv_heads, d, room), np.nan)
        self.hi = np.full((self.batch, kv_heads, d, room), np.nan)
        full = length // page_size
        paged = keys[:, :, :full * page_size].reshape(self.batch, kv_heads, full, page_size, d)
        self.lo[..., :full] = paged.min(axis=3).transpose(0, 1, 3, 2)
        self.hi[..., :full] = paged.max(axis=3).transpose(0, 1, 3, 2)
        self.length = full * page_size
        if length > self.length:
            self.append(keys[:, :, self.length:])

    def append(self, keys) -> None:
        """New keys [B, Hkv, n, d] after the current length: their pages' min and max."""
        keys = stored(keys, self.dtype).astype(np.float64)
        for i in range(keys.shape[2]):
            page, slot = divmod(self.length, self.page_size)
            new = keys[:, :, i]
            if slot == 0:
                self.lo[..., page], self.hi[..., page] = new, new
            else:
                self.lo[..., page] = np.minimum(self.lo[..., page], new)
                self.hi[..., page] = np.maximum(self.hi[..., page], new)
            self.length += 1

    def copy(self) -> "HostIndex":
        """An independent index with the same summaries (grows apart from this one)."""
        twin = object.__new__(HostIndex)
        twin.__dict__.update(self.__dict__)
        twin.lo, twin.hi = self.lo.copy(), self.hi.copy()
        return twin

    def tiled(self, copies: int) -> "HostIndex":
        """An index of `copies` x the requests (request = copy * B + b), each growing apart."""
        twin = self.copy()
        twin.lo, twin.hi = np.tile(self.lo, (copies, 1, 1, 1)), np.tile(self.hi, (copies, 1, 1, 1))
        twin.batch = copies * self.batch
        return twin

    @property
    def pages(self) -> int:
        return pages_for(self.length, self.page_size)

    def scores(self, q, mode: str) -> np.ndarray:
        """U_p(q) [Hs, B * P] float32 for q [B, Hq, d] (Hs = Hq per-head, else Hkv)."""
        check_mode(mode)
        q = stored(q, self.dtype).astype(np.float64)
        batch, q_heads, d = q.shape
        kv_heads, pages = self.lo.shape[1], self.pages
        q = q.reshape(batch, kv_heads, q_heads // kv_heads, d)
        u = (np.matmul(np.maximum(q, 0.0), self.hi[..., :pages])
             + np.matmul(np.minimum(q, 0.0), self.lo[..., :pages]))  # [B, Hkv, g, P]
        if mode == "shared-max":
            u = u.max(axis=2, keepdims=True)
        elif mode == "shared-mean":
            u = u.mean(axis=2, keepdims=True)
        heads = u.shape[1] * u.shape[2]
        return u.reshape(batch, heads, pages).transpose(1, 0, 2).reshape(heads, -1).astype(
            np.float32)

    def to_host(self, scores) -> np.ndarray:
        """Scores [Hs, B * P] as [Hs, B, P]."""
        return np.asarray(scores).reshape(scores.shape[0], self.batch, -1)

    def select(self, scores, k_pages: int) -> tuple[np.ndarray, int]:
        """(page positions [Hs, B, K] ascending, -1 padded; count): top-K, tail page in."""
        return topk(self.to_host(scores), k_pages)

    def select_many(self, scores, ks, host: bool = True) -> dict:
        """{K: select(scores, K)} for several budgets, from one ordering of the pages (host
        arrays either way)."""
        order = _order(self.to_host(scores))
        return {k: _take(order, k) for k in ks}


def _order(scores: np.ndarray) -> np.ndarray:
    """Pages but the tail [Hs, B, P - 1] from the highest score down, ties to the lower page."""
    return np.argsort(-scores[:, :, :-1].astype(np.float64), axis=2, kind="stable")


def _take(order: np.ndarray, k_pages: int) -> tuple[np.ndarray, int]:
    """The tail page and the first K - 1 of `order`, ascending, -1 padded to K."""
    heads, batch, rest = order.shape
    count = min(k_pages, rest + 1)
    sel = np.full((heads, batch, k_pages), -1, np.int32)
    tail = np.full((heads, batch, 1), rest)
    sel[:, :, :count] = np.sort(np.concatenate([order[:, :, : count - 1], tail], axis=2), axis=2)
    return sel, count


def topk(scores: np.ndarray, k_pages: int) -> tuple[np.ndarray, int]:
    """core.reference.topk (no sinks, no window) for scores [Hs, B, P] of equal-length requests:
    the tail page, then the K - 1 highest of the others (ties: lower position), ascending."""
    return _take(_order(scores), k_pages)
