"""Paged KV cache, CSR page tables and summary buffers for one layer (docs/QUEST.md, Layout).

Shapes (N physical pages, H kv heads, S page size, d head dim, B requests, nnz = sum of pages):
  k, v      [N, H, S, d]  storage dtype (fp16, bf16 as uint16 bits, fp32)
  summary   [N, H, 2, d]  storage dtype; [..., 0, :] = min, [..., 1, :] = max
  kv_indptr [B + 1] int32, kv_indices [nnz] int32, last_page_len [B] int32 in 1..S
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
_STORAGE = {"fp16": np.float16, "bf16": np.uint16, "fp32": np.float32}


def storage_dtype(dtype: str) -> np.dtype:
    """NumPy dtype that holds `dtype` values (bf16 travels as its uint16 bit pattern)."""
    if dtype not in _STORAGE:
        raise ValueError(f"unsupported dtype {dtype!r}: expected one of {sorted(_STORAGE)}")
    return np.dtype(_STORAGE[dtype])


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float values to `dtype` (round to nearest even) and return them in storage form."""
    if dtype != "bf16":
        return np.asarray(x).astype(storage_dtype(dtype))
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(nan, 0x7FC0, rounded).astype(np.uint16)


def from_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """Storage-form values of `dtype` as float64."""
    x = np.asarray(x)
    if dtype == "bf16":
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def pages_for(length: int, page_size: int) -> int:
    """Pages that hold `length` tokens."""
    return -(-int(length) // int(page_size))


@dataclass
class PagedKV:
    """One layer's paged cache and the page tables of one batch, in one backend's array type."""

    k: object
    v: object
    summary: object
    kv_indptr: object
    kv_indices: object
    last_page_len: object
    lengths: tuple[int, ...]
    page_size: int
    dtype: str

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def num_pages(self) -> int:
        return int(self.k.shape[0])

    @property
    def kv_heads(self) -> int:
        return int(self.k.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[3])

    def pages(self) -> list[int]:
        """Pages of each request."""
        return [pages_for(n, self.page_size) for n in self.lengths]

    def with_arrays(self, convert) -> "PagedKV":
        """The same cache with every array passed through `convert` (host <-> device)."""
        names = ("k", "v", "summary", "kv_indptr", "kv_indices", "last_page_len")
        return replace(self, **{n: convert(getattr(self, n)) for n in names})


def page_tables(lengths, page_size: int, num_pages: int, rng=None):
    """CSR tables for `lengths`; pages are drawn from `num_pages` (shuffled when rng is given)."""
    counts = [pages_for(n, page_size) for n in lengths]
    if min(lengths, default=1) < 1:
        raise ValueError("every request needs at least one token")
    nnz = sum(counts)
    if nnz > num_pages:
        raise ValueError(f"{nnz} pages needed but the pool holds {num_pages}")
    ids = rng.permutation(num_pages)[:nnz] if rng is not None else np.arange(nnz)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    last = np.array([n - (c - 1) * page_size for n, c in zip(lengths, counts)], dtype=np.int32)
    return indptr, ids.astype(np.int32), last


def random_paged_kv(rng, lengths, page_size: int, kv_heads: int, head_dim: int, dtype: str,
                    spare_pages: int = 0, shuffle: bool = True, tail_fill=None) -> PagedKV:
    """A random cache for `lengths`; unused tail slots hold `tail_fill` (default: random values).

    The summary buffer is poisoned (NaN); build it with the `summary` stage over a prefill plan.
    """
    counts = [pages_for(n, page_size) for n in lengths]
    num_pages = sum(counts) + spare_pages
    indptr, indices, last = page_tables(lengths, page_size, num_pages, rng if shuffle else None)
    shape = (num_pages, kv_heads, page_size, head_dim)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    if tail_fill is not None:
        for b, n in enumerate(last):
            tail = indices[indptr[b + 1] - 1]
            k[tail, :, n:, :] = tail_fill
            v[tail, :, n:, :] = tail_fill
    summary = np.full((num_pages, kv_heads, 2, head_dim), np.nan, dtype=np.float32)
    return PagedKV(to_storage(k, dtype), to_storage(v, dtype), to_storage(summary, dtype),
                   indptr, indices, last, tuple(int(n) for n in lengths), page_size, dtype)


TILE = (1 << 22) + 40  # random values tiled into large pools; not a multiple of any page size


def tiled(xp, tile, shape, offset: int = 0):
    """An array of `shape` holding `tile` repeated from `offset` elements in (numpy or cupy):
    pools of many GiB without drawing that many random numbers."""
    total = math.prod(shape)
    rolled = xp.roll(tile, -(offset % tile.size))
    reps = -(-total // tile.size)
    out = xp.tile(rolled, reps)[:total]
    # A slice keeps its whole base alive: a pool smaller than the tile would hold 8 MiB (fp16),
    # and smoke's 7,680 layers of 1 MiB pools took all of an H200's 141 GiB. Copy such slices.
    return (out.copy() if reps * tile.size > 2 * total else out).reshape(shape)


def random_queries(rng, batch: int, q_heads: int, head_dim: int, dtype: str) -> np.ndarray:
    """Decode queries [B, q_heads, d] in storage form."""
    return to_storage(rng.standard_normal((batch, q_heads, head_dim), dtype=np.float32), dtype)


@dataclass(frozen=True)
class AppendPlan:
    """Pages touched by an append: slots [first, end) of page_ids[i] were written.

    A run that starts at slot 0 re-initialises its page (fresh or reused physical page);
    otherwise the new keys merge into the page's existing min/max.
    """

    page_ids: np.ndarray
    first: np.ndarray
    end: np.ndarray

    def __len__(self) -> int:
        return len(self.page_ids)


def append_plan(kv_indptr, kv_indices, last_page_len, n_new, page_size: int) -> AppendPlan:
    """Plan for the last `n_new[b]` tokens of each request (tables already include them)."""
    indptr, indices = np.asarray(kv_indptr), np.asarray(kv_indices)
    last = np.asarray(last_page_len)
    ids, first, end = [], [], []
    for b in range(len(last)):
        pages = indptr[b + 1] - indptr[b]
        length = int((pages - 1) * page_size + last[b])
        start = length - int(n_new[b])
        if not 0 <= start < length:
            raise ValueError(f"request {b}: cannot append {n_new[b]} of {length} tokens")
        for p in range(start // page_size, (length - 1) // page_size + 1):
            ids.append(indices[indptr[b] + p])
            first.append(max(start, p * page_size) - p * page_size)
            end.append(min(length, (p + 1) * page_size) - p * page_size)
    as32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
    return AppendPlan(as32(ids), as32(first), as32(end))


def rebuild_plan(page_ids, valid_len) -> AppendPlan:
    """Plan that recomputes the summaries of `page_ids` from their first `valid_len` keys."""
    ids = np.asarray(page_ids, dtype=np.int32)
    return AppendPlan(ids, np.zeros_like(ids), np.asarray(valid_len, dtype=np.int32))
