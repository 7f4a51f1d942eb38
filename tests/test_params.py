"""The params structs on the host (backends/params.py) are laid out as nvcc lays out
kernels/params.cuh: every field's offset and size, every struct's size and alignment, printed by a
host program nvcc builds (CPU, no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from kernel_objects import host_program
from questprof.backends import params


def test_host_structs_are_the_kernels(tmp_path):
    lines = []
    for name, dtype in params.STRUCTS.items():
        lines.append(f'std::printf("{name} - %zu %zu\\n", sizeof({name}), alignof({name}));')
        for field in dtype.names:
            lines.append(f'std::printf("{name} {field} %zu %zu\\n", offsetof({name}, {field}), '
                         f'sizeof((({name}*)nullptr)->{field}));')
    printed = host_program(tmp_path, ("params.cuh",), lines)
    want = []
    for name, dtype in params.STRUCTS.items():
        want.append(f"{name} - {dtype.itemsize} {dtype.alignment}")
        want += [f"{name} {f} {dtype.fields[f][1]} {dtype.fields[f][0].itemsize}"
                 for f in dtype.names]
    assert printed.splitlines() == want


def test_pack_takes_every_field_and_addresses():
    cache = params.pack(params.PAGED_CACHE, k=None, v=None, indptr=None, indices=None,
                        last_page_len=None, k_scale=None, v_scale=None, batch=3, kv_heads=2,
                        page_size=16, page_shift=4)
    x = np.arange(4, dtype=np.float32)
    p = params.pack(params.TOPK, cache=cache, scores=x, sel=None, count=None, nnz=4, k_pages=2,
                    sinks=0, window=0, cached=1, rule=2, param=0.9, scaling=0.125)
    assert p.shape == (1,) and p["cache"]["batch"][0] == 3 and p["cache"]["page_shift"][0] == 4
    assert p["scores"][0] == x.ctypes.data and p["sel"][0] == 0 and p["param"][0] == 0.9
    with pytest.raises(TypeError, match="window"):
        params.pack(params.TOPK, cache=cache, scores=x, sel=None, count=None, nnz=4, k_pages=2,
                    sinks=0, cached=1, rule=2, param=0.9, scaling=0.125)


def test_the_driver_launch_copies_a_struct_as_its_bytes(monkeypatch):
    """backends/pdl.py hands cuLaunchKernelEx a params struct as its own bytes."""
    import importlib
    import sys

    import cupy_stub

    monkeypatch.setitem(sys.modules, "cupy", cupy_stub.make())
    saved = sys.modules.pop("questprof.backends.pdl", None)
    try:
        pdl = importlib.import_module("questprof.backends.pdl")
        p = params.pack(params.PAGED_CACHE, k=None, v=None, indptr=None, indices=None,
                        last_page_len=None, k_scale=None, v_scale=None, batch=3, kv_heads=2,
                        page_size=16, page_shift=4)
        assert bytes(pdl._arg(p)) == p.tobytes() and len(p.tobytes()) == 72
    finally:
        sys.modules.pop("questprof.backends.pdl", None)
        if saved is not None:
            sys.modules["questprof.backends.pdl"] = saved


def test_top_k_alone_runs_on_page_tables_without_k_and_v():
    """top-K reads the page tables and the scores only: a cache of tables (k, v None, as
    tests/test_topk.py builds) packs null K / V and 0 KV heads, and its checks skip the cache's
    storage (they read k's shape: an AttributeError on the H200, 2026-12-02)."""
    from questprof.backends.launch_args import check_call
    from questprof.core.layout import PagedKV

    kv = PagedKV(None, None, None, np.array([0, 2, 3], np.int32), np.array([0, 1, 2], np.int32),
                 np.array([16, 5], np.int32), (32, 5), 16, "fp16")
    cache = params.paged_cache(kv)
    assert (cache["k"][0], cache["v"][0], cache["kv_heads"][0], cache["batch"][0]) == (0, 0, 0, 2)
    scores = np.zeros((4, 3), np.float32)
    assert check_call(kv, scores=scores, budget=(2, 0, 0), cache=False).tags == ()
    with pytest.raises(AttributeError):
        check_call(kv, scores=scores, budget=(2, 0, 0))


def test_pointer_offsets_are_every_pointer_field_nested_included():
    """A replay moves pointers at these offsets: the PagedCache's K and V inside every struct
    that holds one, each field of type uint64 and nothing else."""
    for name, dtype in params.STRUCTS.items():
        found = params.pointer_offsets(dtype)
        marks = np.zeros(1, dtype)
        raw = marks.view(np.uint8)
        for offset in found:
            raw[offset:offset + 8] = 0xFF
        pointers = [f for f in dtype.names if dtype.fields[f][0] == np.uint64]
        assert all(marks[f][0] == np.iinfo(np.uint64).max for f in pointers), name
        if "cache" in dtype.names:
            assert marks["cache"]["k"][0] == marks["cache"]["v"][0] == np.iinfo(np.uint64).max
        assert len(found) == len(pointers) + (7 if "cache" in dtype.names else 0), name
