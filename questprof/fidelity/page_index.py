"""The page index Quest's selection runs on, for one layer of a batch of requests of equal
length.

`page_index(backend, keys, ...)` returns it:
- on a GPU backend, `PageIndex`: the requests' keys as one paged cache on the backend (pages in
  order, room to grow to `capacity`), min/max summaries by the backend's `summary` stage over a
  prefill plan, decode tokens appended through the same stage, pages scored and chosen by the
  backend's `estimate` and `topk` kernels;
- on the NumPy backend, `host_index.HostIndex`: the same summaries, bound and top-K as the
  float64 reference (core/reference.py) computes them, vectorised over the batch, heads and
  pages (the reference loops over pages, heads and requests in Python: a 2K-token batch of 20
  prompts took 130 us per (head, request) in its top-K on the 2-core CPU). Tests check both
  against the reference on random inputs.

Both hold keys [B, Hkv, L, d]; scores(q [B, Hq, d], mode) -> [Hs, B * P] in the backend's
array type (request-major, as `estimate` returns them); select(scores, K) -> (sel [Hs, B, K]
ascending page positions, -1 padded, count).
"""

from __future__ import annotations

import copy

import numpy as np

from questprof.core.layout import PagedKV, append_plan, pages_for, to_storage
from questprof.fidelity.host_index import HostIndex, on_host


def page_index(backend, keys, page_size: int, dtype: str, capacity: int):
    """The index of keys [B, Hkv, L, d] for `backend` (see the module docstring)."""
    if not backend.is_gpu:
        return HostIndex(keys, page_size, dtype, capacity)
    return PageIndex(backend, keys, page_size, dtype, capacity)


class PageIndex:
    """B requests' paged keys [B, Hkv, L, d] on `backend`, with summaries, growable to
    `capacity` tokens each."""

    def __init__(self, backend, keys, page_size: int, dtype: str, capacity: int) -> None:
        batch, kv_heads, length, d = keys.shape
        self.backend, self.page_size, self.dtype = backend, page_size, dtype
        self.batch, self.room = batch, pages_for(capacity, page_size)
        xp = _xp(backend)  # the pool is laid out where it lives: 126 MB of keys for 20 prompts
        stored_keys = on_backend(backend, keys, dtype)                # of 8K tokens per layer
        pool = xp.zeros((batch, self.room * page_size, kv_heads, d), stored_keys.dtype)
        pool[:, :length] = stored_keys.transpose(0, 2, 1, 3)
        pool = xp.ascontiguousarray(pool.reshape(batch * self.room, page_size, kv_heads, d)
                                    .transpose(0, 2, 1, 3))
        nan = to_storage(np.full(1, np.nan, np.float32), dtype)  # filled where it lives: 31 MB
        summary = xp.full((pool.shape[0], kv_heads, 2, d), nan[0], dtype=nan.dtype)  # at S = 8
        self.kv = backend.put(PagedKV(pool, pool, summary, np.zeros(batch + 1, np.int32),
                                      np.arange(pool.shape[0], dtype=np.int32),
                                      np.ones(batch, np.int32), (length,) * batch, page_size,
                                      dtype))
        self.length = 0
        self._grow(length)

    def _tables(self):
        pages = self.pages
        indptr = np.arange(self.batch + 1, dtype=np.int32) * pages
        indices = (np.arange(self.batch, dtype=np.int32)[:, None] * self.room
                   + np.arange(pages, dtype=np.int32)).ravel()  # pages in order, nnz = B * P
        last = np.full(self.batch, self.length - (pages - 1) * self.page_size, np.int32)
        return indptr, indices, last

    def _grow(self, n_new: int) -> None:
        """Extend the page tables by n_new tokens and update their summaries (backend stage)."""
        self.length += n_new
        indptr, indices, last = self._tables()
        self.kv.kv_indptr = self.backend.asarray(indptr)
        self.kv.kv_indices = self.backend.asarray(indices)
        self.kv.last_page_len = self.backend.asarray(last)
        self.kv.lengths = (self.length,) * self.batch
        plan = append_plan(indptr, indices, last, [n_new] * self.batch, self.page_size)
        self.backend.summary(self.kv, plan)

    def append(self, keys) -> None:
        """Write new keys [B, Hkv, n, d] after the current length and update their summaries."""
        keys = on_backend(self.backend, keys, self.dtype)
        base = np.arange(self.batch, dtype=np.int32) * self.room
        for i in range(keys.shape[2]):
            page, slot = divmod(self.length + i, self.page_size)
            rows = self.backend.asarray(base + page)
            self.kv.k[rows, :, slot, :] = keys[:, :, i, :]
        self._grow(keys.shape[2])

    def copy(self) -> "PageIndex":
        """An independent index with the same keys and summaries (grows apart from this one)."""
        twin = copy.copy(self)
        twin.kv = copy.copy(self.kv)
        twin.kv.k = twin.kv.v = self.kv.k.copy()
        twin.kv.summary = self.kv.summary.copy()
        return twin

    def tiled(self, copies: int) -> "PageIndex":
        """An index of `copies` x the requests (request = copy * B + b), each growing apart:
        the pool and its summaries repeated where they live, the tables rebuilt."""
        xp = _xp(self.backend)
        twin = copy.copy(self)
        twin.kv = copy.copy(self.kv)
        twin.kv.k = twin.kv.v = xp.concatenate([self.kv.k] * copies)
        twin.kv.summary = xp.concatenate([self.kv.summary] * copies)
        twin.batch = copies * self.batch
        indptr, indices, last = twin._tables()
        twin.kv.kv_indptr = self.backend.asarray(indptr)
        twin.kv.kv_indices = self.backend.asarray(indices)
        twin.kv.last_page_len = self.backend.asarray(last)
        twin.kv.lengths = (self.length,) * twin.batch
        return twin

    @property
    def pages(self) -> int:
        return pages_for(self.length, self.page_size)

    def scores(self, q, mode: str):
        """U_p(q) [Hs, B * P] float32 on the backend for q [B, Hq, d] (the kernels take any group)."""
        return self.backend.estimate(on_backend(self.backend, q, self.dtype), self.kv, mode)

    def to_host(self, scores) -> np.ndarray:
        """Scores [Hs, B * P] as a host array [Hs, B, P]."""
        return self.backend.to_host(scores).reshape(scores.shape[0], self.batch, -1)

    def select(self, scores, k_pages: int) -> tuple[np.ndarray, int]:
        """(page positions [Hs, B, K] ascending, count): the backend's top-K, tail page in."""
        sel, count = self.backend.topk(scores, self.kv, k_pages)
        return self.backend.to_host(sel), int(self.backend.to_host(count)[0])

    def select_many(self, scores, ks, host: bool = True) -> dict:
        """{K: select(scores, K)} for several budgets of the same scores; host False: the
        selections stay on the backend (no wait), count min(K, pages) as top-K gives it."""
        if host:
            return {k: self.select(scores, k) for k in ks}
        return {k: (self.backend.topk(scores, self.kv, k)[0], min(k, self.pages)) for k in ks}


def on_backend(backend, x, dtype: str):
    """x in `dtype` storage as the backend's array: a torch tensor on the GPU through DLPack,
    rounded where it lives (no host copy), anything else through the host."""
    if backend.is_gpu and getattr(x, "is_cuda", False):
        import cupy

        from questprof.fidelity.device import storage
        tensor = storage(x.detach(), dtype).contiguous()
        try:
            got = cupy.from_dlpack(tensor)
        except (TypeError, BufferError):  # an older protocol: the CUDA array interface
            got = cupy.asarray(tensor)
        return got.view(cupy.uint16) if dtype == "bf16" else got
    return backend.asarray(to_storage(np.asarray(on_host(x), dtype=np.float32), dtype))


def _xp(backend):
    """The array module of the backend's arrays (NumPy or CuPy)."""
    return __import__("cupy") if backend.is_gpu else np

