"""Quest's page selection for one layer, computed by the backend under test.

A `PageIndex` holds one layer's keys of one request as a paged cache on the backend (pages in
order, one spare page's room to grow), builds the min/max summaries with the backend's
`summary` stage over a prefill plan, appends decode tokens through the same stage, and scores
and selects pages with the backend's `estimate` and `topk`.
"""

from __future__ import annotations

import numpy as np

from questprof.core.layout import PagedKV, append_plan, from_storage, pages_for, to_storage


def stored(x, dtype: str) -> np.ndarray:
    """Values as the cache stores them (rounded to `dtype`), as float32."""
    rounded = to_storage(np.asarray(x, dtype=np.float32), dtype)
    return from_storage(rounded, dtype).astype(np.float32)


class PageIndex:
    """One layer's paged keys [Hkv, L, d] on `backend`, with summaries, growable to `capacity`."""

    def __init__(self, backend, keys, page_size: int, dtype: str, capacity: int) -> None:
        keys = np.asarray(keys, dtype=np.float32)
        kv_heads, length, d = keys.shape
        self.backend, self.page_size, self.dtype = backend, page_size, dtype
        pool = np.zeros((pages_for(capacity, page_size) * page_size, kv_heads, d), np.float32)
        pool[:length] = keys.transpose(1, 0, 2)
        pool = pool.reshape(-1, page_size, kv_heads, d).transpose(0, 2, 1, 3)
        summary = np.full((pool.shape[0], kv_heads, 2, d), np.nan, np.float32)
        k = to_storage(np.ascontiguousarray(pool), dtype)
        host = PagedKV(k, k, to_storage(summary, dtype), np.zeros(2, np.int32),
                       np.arange(pool.shape[0], dtype=np.int32), np.ones(1, np.int32),
                       (length,), page_size, dtype)
        self.kv = backend.put(host)
        self.length = 0
        self._grow(length)

    def _grow(self, n_new: int) -> None:
        """Extend the page tables by n_new tokens and update their summaries (backend stage)."""
        self.length += n_new
        pages = pages_for(self.length, self.page_size)
        indptr = np.array([0, pages], np.int32)
        last = np.array([self.length - (pages - 1) * self.page_size], np.int32)
        self.kv.kv_indptr = self.backend.asarray(indptr)
        self.kv.last_page_len = self.backend.asarray(last)
        self.kv.lengths = (self.length,)
        indices = np.arange(pages, dtype=np.int32)  # pages in order; nnz = pages
        self.kv.kv_indices = self.backend.asarray(indices)
        plan = append_plan(indptr, indices, last, [n_new], self.page_size)
        self.backend.summary(self.kv, plan)

    def append(self, keys) -> None:
        """Write new keys [Hkv, n, d] after the current length and update their summaries."""
        keys = to_storage(np.asarray(keys, dtype=np.float32), self.dtype)
        for i in range(keys.shape[1]):
            pos = self.length + i
            page, slot = divmod(pos, self.page_size)
            self.kv.k[page, :, slot, :] = self.backend.asarray(keys[:, i, :])
        self._grow(keys.shape[1])

    @property
    def pages(self) -> int:
        return pages_for(self.length, self.page_size)

    def scores(self, q, mode: str):
        """U_p(q) [Hs, P] float32 on the backend for q [Hq, d] (Hs = Hq per-head, else Hkv)."""
        q = self.backend.asarray(to_storage(np.asarray(q, np.float32)[None], self.dtype))
        return self.backend.estimate(q, self.kv, mode)

    def select(self, scores, k_pages: int) -> tuple[np.ndarray, int]:
        """(page positions [Hs, K] ascending, count): the backend's top-K, tail page included."""
        sel, count = self.backend.topk(scores, self.kv, k_pages)
        return self.backend.to_host(sel)[:, 0, :], int(self.backend.to_host(count)[0])

