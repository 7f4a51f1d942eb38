"""Paged KV cache, CSR page tables and summary buffers for one layer (docs/QUEST.md, Layout).

Shapes (N physical pages, H kv heads, S page size, d head dim, B requests, nnz = sum of pages):
  k, v      [N, H, S, d]  kv_dtype storage (fp16, bf16 as uint16 bits, fp32, fp8_e4m3 as uint8)
  summary   [N, H, 2, d]  summary_dtype storage; [..., 0, :] = min, [..., 1, :] = max
  k_scale, v_scale [H] float32 (FP8 caches only): key = e4m3(k) * k_scale[h], value likewise
  kv_indptr [B + 1] int32, kv_indices [nnz] int32, last_page_len [B] int32 in 1..S
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from questprof.core.fp8 import E4M3, from_e4m3, kv_scale, quantize, to_e4m3, to_fp16

LAYOUTS = ("HND", "NHD")  # K and V pages head-major (ours) or token-major (PagedKV.layout)

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, E4M3: 1}
_STORAGE = {"fp16": np.float16, "bf16": np.uint16, "fp32": np.float32, E4M3: np.uint8}
FP8_SUMMARY_DTYPES = ("fp16", E4M3)  # summaries an FP8 cache can keep
KV_SCALES = ("tensor", "head")  # one scale per tensor (all heads equal) or per KV head


def storage_dtype(dtype: str) -> np.dtype:
    """NumPy dtype that holds `dtype` values (bf16 travels as its uint16 bit pattern)."""
    if dtype not in _STORAGE:
        raise ValueError(f"unsupported dtype {dtype!r}: expected one of {sorted(_STORAGE)}")
    return np.dtype(_STORAGE[dtype])


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float values to `dtype` (round to nearest even) and return them in storage form
    (fp8_e4m3: codes of the values as given, unscaled, saturating at +-448)."""
    if dtype == E4M3:
        return to_e4m3(x)
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
    if dtype == E4M3:
        return from_e4m3(x)
    return x.astype(np.float64)


def pages_for(length: int, page_size: int) -> int:
    """Pages that hold `length` tokens."""
    return -(-int(length) // int(page_size))


@dataclass
class PagedKV:
    """One layer's paged cache and the page tables of one batch, in one backend's array type.

    dtype: queries and outputs (fp16, bf16, fp32); kv_dtype: K and V storage, dtype or
    fp8_e4m3 (default dtype); summary_dtype: the min/max summaries, kv_dtype (the default) or,
    over an FP8 cache, fp16. k_scale, v_scale: float32 [H] for an FP8 cache, else None.
    layout: K and V pages head-major ("HND": [N, Hkv, S, d], ours) or token-major ("NHD":
    [N, S, Hkv, d], the blocks of transformers' and vLLM's paged caches, which the attention
    and summary kernels read in place); summaries are [N, Hkv, 2, d] in both.
    """

    k: object
    v: object
    summary: object
    kv_indptr: object
    kv_indices: object
    last_page_len: object
    lengths: tuple[int, ...]
    page_size: int
    dtype: str
    kv_dtype: str | None = None
    summary_dtype: str | None = None
    k_scale: object = None
    v_scale: object = None
    layout: str = "HND"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: expected one of {LAYOUTS}")
        self.kv_dtype = self.kv_dtype or self.dtype
        self.summary_dtype = self.summary_dtype or self.kv_dtype
        check_cache_dtypes(self.dtype, self.kv_dtype, self.summary_dtype)
        if self.is_fp8 and (self.k_scale is None or self.v_scale is None):
            raise ValueError("an FP8 cache needs k_scale and v_scale (float32 [kv_heads])")

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype == E4M3

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def num_pages(self) -> int:
        return int(self.k.shape[0])

    @property
    def kv_heads(self) -> int:
        return int(self.k.shape[2 if self.layout == "NHD" else 1])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[3])

    def pages(self) -> list[int]:
        """Pages of each request."""
        return [pages_for(n, self.page_size) for n in self.lengths]

    def head_major(self) -> "PagedKV":
        """The same cache with head-major pages (itself when they are): K and V as [N, Hkv, S, d]
        views of token-major ones."""
        if self.layout == "HND":
            return self
        return replace(self, k=self.k.transpose(0, 2, 1, 3), v=self.v.transpose(0, 2, 1, 3),
                       layout="HND")

    def token_major(self) -> "PagedKV":
        """The same cache with token-major pages (NHD), as contiguous copies of K and V."""
        if self.layout == "NHD":
            return self
        return replace(self, k=self.k.transpose(0, 2, 1, 3).copy(),  # C order: NumPy and CuPy
                       v=self.v.transpose(0, 2, 1, 3).copy(), layout="NHD")

    def with_arrays(self, convert) -> "PagedKV":
        """The same cache with every array passed through `convert` (host <-> device)."""
        names = ("k", "v", "summary", "kv_indptr", "kv_indices", "last_page_len", "k_scale",
                 "v_scale")
        return replace(self, **{n: convert(getattr(self, n)) for n in names
                                if getattr(self, n) is not None})


def head_major_only(kv: PagedKV, what: str) -> None:
    """ValueError in one line where `what` (a kernel that reads whole pages of one head) is
    given token-major (NHD) pages."""
    if kv.layout != "HND":
        raise ValueError(f"{what} reads head-major (HND) pages only, not token-major (NHD) ones")


def check_cache_dtypes(dtype: str, kv_dtype: str, summary_dtype: str) -> None:
    """ValueError unless kv_dtype is dtype or fp8_e4m3 (under fp16 / bf16 queries) and the
    summaries are kv_dtype or, over an FP8 cache, fp16."""
    storage_dtype(dtype), storage_dtype(kv_dtype), storage_dtype(summary_dtype)
    if kv_dtype not in (dtype, E4M3) or (kv_dtype == E4M3 and dtype == "fp32"):
        raise ValueError(f"a {kv_dtype} cache under {dtype} queries is not supported: the cache "
                         f"holds {dtype} or, under fp16 / bf16, {E4M3}")
    allowed = FP8_SUMMARY_DTYPES if kv_dtype == E4M3 else (kv_dtype,)
    if summary_dtype not in allowed:
        raise ValueError(f"{summary_dtype} summaries over a {kv_dtype} cache are not supported: "
                         f"expected {' or '.join(allowed)}")


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


class Dequantized:
    """Float64 values of an FP8 pool, decoded on indexing: view[i] = e4m3(codes[i]) * scale[h]
    (exact: 4 significant bits times 24). The reference reads K and V through it page by page."""

    def __init__(self, codes, scale) -> None:
        self.codes = np.asarray(codes)
        self._scale = np.broadcast_to(np.asarray(scale, dtype=np.float64)[:, None, None],
                                      self.codes.shape)

    @property
    def shape(self) -> tuple:
        return self.codes.shape

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    def __getitem__(self, index) -> np.ndarray:
        return from_e4m3(self.codes[index]) * self._scale[index]

    def __array__(self, dtype=None, copy=None):
        return self[...].astype(dtype or np.float64)


def kv_values(kv: PagedKV, which: str):
    """K or V ('k', 'v') of a host cache as the reference reads them: FP8 through Dequantized,
    bf16 decoded to float64, fp16 / fp32 as stored (widened page by page); head-major
    ([N, Hkv, S, d]) whatever kv.layout."""
    stored = getattr(kv.head_major(), which)
    if kv.is_fp8:
        return Dequantized(stored, getattr(kv, f"{which}_scale"))
    return from_storage(stored, kv.dtype) if kv.dtype == "bf16" else stored


def summary_values(kv: PagedKV) -> np.ndarray:
    """float64 [N, H, 2, d] min/max a host cache's summaries stand for (FP8: codes x k_scale)."""
    values = from_storage(kv.summary, kv.summary_dtype)
    if kv.summary_dtype == E4M3:
        values = values * np.asarray(kv.k_scale, dtype=np.float64)[:, None, None]
    return values


def encode_summary(values, kv: PagedKV) -> np.ndarray:
    """Summaries [N, H, 2, d] of float64 min/max `values` in kv's summary storage, rounded
    outward (min toward -inf, max toward +inf) so U_p(q) still bounds q.k: exact when they are
    the keys' own values (FP8 summaries of an FP8 cache, fp16 of fp16), one rounding when fp16
    summaries hold the dequantized keys of an FP8 cache."""
    values = np.asarray(values, dtype=np.float64)
    if not kv.is_fp8:
        return to_storage(values, kv.summary_dtype)
    if kv.summary_dtype == E4M3:
        values = values / np.asarray(kv.k_scale, dtype=np.float64)[:, None, None]
    rnd = to_e4m3 if kv.summary_dtype == E4M3 else to_fp16
    return np.stack([rnd(values[:, :, 0], "down"), rnd(values[:, :, 1], "up")], axis=2)


def quantized(kv: PagedKV, per: str = "tensor", summary_dtype: str = E4M3) -> PagedKV:
    """An FP8 copy of a host cache of fp16 / bf16 values: scales amax / 448 per tensor or per
    KV head (`per`), K and V rounded to nearest even; summaries poisoned (NaN), to be built by
    the `summary` stage."""
    k, v = kv_values(kv, "k"), kv_values(kv, "v")
    k_scale, v_scale = kv_scale(k, per), kv_scale(v, per)
    summary = to_storage(np.full(np.shape(kv.summary), np.nan), summary_dtype)
    return replace(kv, k=quantize(k, k_scale), v=quantize(v, v_scale), summary=summary,
                   kv_dtype=E4M3, summary_dtype=summary_dtype, k_scale=k_scale,
                   v_scale=v_scale)


def random_paged_kv(rng, lengths, page_size: int, kv_heads: int, head_dim: int, dtype: str,
                    spare_pages: int = 0, shuffle: bool = True, tail_fill=None,
                    kv_dtype: str | None = None, summary_dtype: str | None = None,
                    kv_scale: str = "tensor") -> PagedKV:
    """A random cache for `lengths`; unused tail slots hold `tail_fill` (default: random values).
    kv_dtype fp8_e4m3 quantizes it (`quantized`, scales per `kv_scale`; summaries fp8_e4m3
    unless summary_dtype says fp16).

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
    kv = PagedKV(to_storage(k, dtype), to_storage(v, dtype), to_storage(summary, dtype),
                 indptr, indices, last, tuple(int(n) for n in lengths), page_size, dtype)
    if kv_dtype in (None, dtype):
        return kv
    check_cache_dtypes(dtype, kv_dtype, summary_dtype or kv_dtype)
    return quantized(kv, kv_scale, summary_dtype or kv_dtype)


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


def full_plan(kv: PagedKV) -> AppendPlan:
    """Rebuild plan of every page of every request of a host cache (a prefill of every valid
    slot: whole pages, each request's tail page up to its last_page_len)."""
    indptr, indices = np.asarray(kv.kv_indptr), np.asarray(kv.kv_indices)
    valid = np.full(len(indices), kv.page_size, dtype=np.int32)
    valid[indptr[1:] - 1] = np.asarray(kv.last_page_len)
    return rebuild_plan(indices, valid)
