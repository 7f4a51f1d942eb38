"""The kernels' params structs on the host (kernels/params.cuh): NumPy structured dtypes of the same
layout, one per struct, and their builders. No CuPy here: CI checks every offset and size against
what nvcc lays out (tests/test_params.py), and the launchers' dry run runs on a CPU.

A launch passes one struct by value: `PagedCache` (the cache as every kernel reads it, built once
per call from core.layout.PagedKV) inside the kernel's own params. Pointers are device addresses
(uint64), 0 where the launch has none.
"""

from __future__ import annotations

import math

import numpy as np

from questprof.core.layout import PagedKV

_P, _I, _F, _D = np.uint64, np.int32, np.float32, np.float64


def _struct(fields) -> np.dtype:
    """A C struct's layout: fields in order, each at its natural alignment (align=True)."""
    return np.dtype(list(fields), align=True)


PAGED_CACHE = _struct([("k", _P), ("v", _P), ("indptr", _P), ("indices", _P),
                       ("last_page_len", _P), ("k_scale", _P), ("v_scale", _P), ("batch", _I),
                       ("kv_heads", _I), ("page_size", _I), ("page_shift", _I)])
SUMMARY = _struct([("cache", PAGED_CACHE), ("summ", _P), ("summ_scale", _P), ("page_ids", _P),
                   ("first", _P), ("end", _P)])
ESTIMATE = _struct([("cache", PAGED_CACHE), ("summ", _P), ("summ_scale", _P),
                    ("scores", _P), ("nnz", _I), ("group", _I), ("mode", _I),
                    ("box_tokens", _I)])
TOPK = _struct([("cache", PAGED_CACHE), ("scores", _P), ("sel", _P), ("count", _P), ("nnz", _I),
                ("k_pages", _I), ("sinks", _I), ("window", _I), ("cached", _I), ("rule", _I),
                ("param", _D), ("scaling", _D)])
ATTENTION = _struct([("cache", PAGED_CACHE), ("q", _P), ("sel", _P), ("count", _P), ("out", _P),
                     ("lse", _P), ("ws_o", _P), ("ws_lse", _P), ("row_done", _P),
                     ("q_heads", _I), ("chunks", _I), ("chunk_size", _I), ("sel_per_q", _I),
                     ("k_sel", _I), ("count_per_head", _I), ("pages_per_split", _I),
                     ("merge", _I), ("scale_log2", _F)])
GATHER = _struct([("cache", PAGED_CACHE), ("k_out", _P), ("v_out", _P), ("sel", _P),
                  ("k_pages", _I), ("page_words", _I)])
PAGE_CACHE = _struct([("cache", PAGED_CACHE), ("k_slots", _P), ("v_slots", _P), ("sel", _P),
                      ("slot_sel", _P), ("slot_page", _P), ("slot_stamp", _P), ("resident", _P),
                      ("clock", _P), ("fetch", _P), ("fetch_slot", _P), ("step_counts", _P),
                      ("total_counts", _P), ("steps", _I), ("k_pages", _I), ("capacity", _I),
                      ("nnz", _I), ("page_words", _I)])
# The C name of each struct (tests/test_params.py prints their layouts under these names).
STRUCTS = {"PagedCache": PAGED_CACHE, "SummaryParams": SUMMARY, "EstimateParams": ESTIMATE,
           "TopkParams": TOPK, "GatherParams": GATHER, "PageCacheParams": PAGE_CACHE,
           "AttentionParams": ATTENTION}


def address(array) -> int:
    """The device address of a CuPy array (data.ptr), 0 for None; a NumPy array's own address,
    for the launchers' dry run on a CPU."""
    if array is None:
        return 0
    ptr = getattr(array.data, "ptr", None)
    return int(ptr) if ptr is not None else int(array.ctypes.data)


def pack(dtype: np.dtype, **fields) -> np.ndarray:
    """One struct of `dtype` as a one-element array (what a launch passes by value): arrays become
    their addresses, None a null pointer; every field must be given."""
    missing = set(dtype.names) - set(fields)
    if missing:
        raise TypeError(f"{sorted(missing)} not given")
    out = np.zeros(1, dtype=dtype)
    for name, value in fields.items():
        is_pointer = dtype.fields[name][0] == _P
        out[name] = address(value) if is_pointer and not isinstance(value, int) else value
    return out


def paged_cache(kv: PagedKV) -> np.ndarray:
    """PagedCache of kv (the launchers check kv first: backends/launch_args.check_kv); page
    tables without K and V (top-K alone reads no more) give null K / V and 0 KV heads."""
    fp8 = kv.is_fp8 and kv.k is not None
    return pack(PAGED_CACHE, k=kv.k, v=kv.v, indptr=kv.kv_indptr, indices=kv.kv_indices,
                last_page_len=kv.last_page_len, k_scale=kv.k_scale if fp8 else None,
                v_scale=kv.v_scale if fp8 else None, batch=kv.batch,
                kv_heads=kv.kv_heads if kv.k is not None else 0,
                page_size=kv.page_size, page_shift=kv.page_size.bit_length() - 1)


def scale_log2(head_dim: int) -> float:
    """Attention's scores in log2 units: log2(e) / sqrt(d)."""
    return math.log2(math.e) / math.sqrt(head_dim)


def pointer_offsets(dtype: np.dtype, base: int = 0) -> list[int]:
    """The byte offset of every pointer field of a struct of `dtype`, nested structs' included;
    a replay moves pointers at these offsets (backends/replay.py)."""
    found = []
    for name in dtype.names:
        field, offset = dtype.fields[name][:2]
        if field.names:
            found += pointer_offsets(field, base + offset)
        elif field == _P:
            found.append(base + offset)
    return found
