"""The host tier on a GPU (core/tier.py): K and V pages (and the summaries, when they live there)
in mapped pinned host memory, brought to attention two ways.

- zero-copy: the pool's arrays are CuPy arrays over the device address of mapped pinned host
  memory (cudaHostAlloc with the mapped flag), so the existing kernels take them unchanged and
  every byte they read crosses the host link;
- gather: `gather` (kernels/gather.cu) copies each KV head's chosen pages into a staging pool in
  HBM, slot (request, j) holding its j-th chosen page; attention then runs dense over the staging
  pool, whose K pages per request are exactly the selection (the tail page last, as top-K's
  ascending positions leave it). Shared modes only: one page set per KV head.

Every stage keeps its name and its kernel; the tier changes where the pool's memory lives.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import replace

import cupy
import numpy as np

from questprof.backends import params
from questprof.backends.cupy import load_kernel
from questprof.backends.pdl import PlainLaunch
from questprof.core.layout import PagedKV, head_major_only

HOST_ALLOC_PORTABLE = 1  # cudaHostAllocPortable: the mapping holds in every context
HOST_ALLOC_MAPPED = 2  # cudaHostAllocMapped: the pages get a device address
GATHER_THREADS = 256  # one 16-byte word of K and one of V per thread per 4 KiB page (S 16, d 128)
WORD = 16
NAN_CODES = {2: 0x7FC0, 1: 0x7F}  # a NaN of 16-bit (bf16) and 8-bit (e4m3) storage codes


class MappedHost:
    """`nbytes` of pinned host memory mapped into the device's address space; freed with it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(int(nbytes), 1)
        self.ptr = cupy.cuda.runtime.hostAlloc(self.nbytes, HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED)
        weakref.finalize(self, cupy.cuda.runtime.freeHost, self.ptr)
        self.device_ptr = cupy.cuda.runtime.pointerGetAttributes(self.ptr).devicePointer

    def host_view(self, shape, dtype) -> np.ndarray:
        """The memory as a NumPy array (the CPU's view of the same pages)."""
        import ctypes

        count = math.prod(shape) * np.dtype(dtype).itemsize
        buf = (ctypes.c_byte * count).from_address(self.ptr)
        return np.frombuffer(buf, dtype=dtype).reshape(shape)


def mapped_empty(shape, dtype) -> cupy.ndarray:
    """A CuPy array of `shape` whose memory is mapped pinned host memory: kernels that read it
    read over the host link, in place (zero-copy)."""
    host = MappedHost(math.prod(shape) * np.dtype(dtype).itemsize)
    memory = cupy.cuda.UnownedMemory(host.device_ptr, host.nbytes, host,
                                     device_id=cupy.cuda.Device().id)
    return cupy.ndarray(tuple(shape), dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))


def to_host_memory(array: cupy.ndarray) -> cupy.ndarray:
    """A copy of device array `array` in mapped pinned host memory."""
    out = mapped_empty(array.shape, array.dtype)
    out[...] = array
    return out


def host_tier(kv: PagedKV, summaries: bool = False) -> PagedKV:
    """kv with its K and V pools (and its summaries when `summaries`) in host memory; the page
    tables, scales and the rest stay in HBM. The device copies go when kv's do."""
    head_major_only(kv, "the host tier (its gather and page cache)")
    moved = {"k": to_host_memory(kv.k), "v": to_host_memory(kv.v)}
    if summaries:
        moved["summary"] = to_host_memory(kv.summary)
    return replace(kv, **moved)


def is_host_memory(array) -> bool:
    """Whether `array`'s memory is host memory (cudaPointerGetAttributes' type 1, host)."""
    return cupy.cuda.runtime.pointerGetAttributes(array.data.ptr).type == 1


def staging_pool(kv: PagedKV, k_pages: int) -> PagedKV:
    """An HBM staging pool of K pages per request for kv's batch: slots b * K .. b * K + K - 1
    of request b, its tail page last (lengths (K - 1) * S + last). NaN in every slot until a
    gather fills it, so a slot read before it is written shows."""
    head_major_only(kv, "the host tier's staging pool")
    b, heads = kv.batch, int(kv.k.shape[1])
    shape = (b * k_pages, heads, kv.page_size, int(kv.k.shape[3]))
    nan = cupy.full(shape, NAN_CODES.get(kv.k.dtype.itemsize, np.nan), dtype=kv.k.dtype)
    if kv.k.dtype.kind == "f":
        nan[...] = np.nan
    last = cupy.asnumpy(kv.last_page_len).astype(np.int32)
    indptr = (np.arange(b + 1) * k_pages).astype(np.int32)
    unused = cupy.empty((1, heads, 2, int(kv.k.shape[3])), dtype=kv.summary.dtype)
    return replace(kv, k=nan, v=nan.copy(), summary=unused,  # attention reads no summary
                   kv_indptr=cupy.asarray(indptr),
                   kv_indices=cupy.arange(b * k_pages, dtype=cupy.int32),
                   last_page_len=cupy.asarray(last),
                   lengths=tuple(int((k_pages - 1) * kv.page_size + n) for n in last))


def gather(kv: PagedKV, sel, staging: PagedKV) -> None:
    """Copy each KV head's chosen pages (sel [Hkv, B, K], shared modes) from kv's pool into the
    staging pool, on the current stream (no synchronisation)."""
    head_major_only(kv, "the host tier's gather")
    heads, batch, k_pages = (int(n) for n in sel.shape)
    if heads != int(kv.k.shape[1]):
        raise ValueError(f"gather takes one selection per KV head (shared modes): {heads} rows "
                         f"for {int(kv.k.shape[1])} KV heads")
    if batch != kv.batch:  # the kernel reads the batch from kv's PagedCache
        raise ValueError(f"a selection of {batch} requests for a cache of {kv.batch}")
    if staging.num_pages != batch * k_pages:
        raise ValueError(f"staging pool of {staging.num_pages} pages for {batch} x {k_pages}")
    page_bytes = kv.page_size * int(kv.k.shape[3]) * kv.k.dtype.itemsize
    if page_bytes % WORD:
        raise ValueError(f"a page of {page_bytes} bytes is not a whole number of 16-byte words")
    sel = cupy.ascontiguousarray(sel, dtype=cupy.int32)  # held until the launch is queued
    p = params.pack(params.GATHER, cache=params.paged_cache(kv), k_out=staging.k,
                    v_out=staging.v, sel=sel, k_pages=k_pages, page_words=page_bytes // WORD)
    PlainLaunch()(load_kernel("gather", "gather_pages"), (batch * k_pages, heads),
                  (GATHER_THREADS,), (p,))


def attention_gathered(backend, q, kv: PagedKV, sel, staging: PagedKV):
    """Sparse attention over the host tier by the gather path: the chosen pages to HBM, then
    dense attention over them. (out, lse) as backend.attention returns them."""
    gather(kv, sel, staging)
    return backend.attention(q, staging)
