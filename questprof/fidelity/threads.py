"""One thread for the small array ops of fidelity: NumPy's OpenBLAS and, where loaded, torch.

The metric arrays are small ([8, 4, 128] @ [8, 128, 4096] at 4K tokens), and threads cost more
than they give: on a busy 2-core CPU (2026-12-01) the metrics of 6 layers x 8 steps of a
SmolLM2-shaped 8K cache took 3.6-3.9 s with OpenBLAS on one thread and 7.4-13.8 s on its
default two; a torch [9,1,256] @ [9,256,64] float64 matmul took 0.13 ms on one thread and
9.9 ms on two. OpenBLAS is reached through the library NumPy loaded (no extra package); where
it cannot be found, the block runs with NumPy's threads as they are.
"""

from __future__ import annotations

import ctypes
import sys
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import numpy  # noqa: F401  (loads its BLAS, so _openblas finds the library mapped)

# (get, set) of the OpenBLAS builds NumPy wheels ship: scipy-openblas (64-bit ints), plain
_OPENBLAS_CALLS = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                   ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
                   ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
                   ("openblas_get_num_threads", "openblas_set_num_threads"))


@cache
def _openblas() -> tuple | None:
    """(get, set) thread-count functions of the OpenBLAS in this process, or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return None
    paths = sorted({line.split()[-1] for line in maps.splitlines()
                    if "openblas" in line.rsplit("/", 1)[-1].lower()})
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get, put in _OPENBLAS_CALLS:
            if hasattr(lib, get) and hasattr(lib, put):
                return getattr(lib, get), getattr(lib, put)
    return None


@contextmanager
def one_thread():
    """OpenBLAS (NumPy) and torch, when loaded, on one thread inside the block."""
    blas, torch = _openblas(), sys.modules.get("torch")
    before_blas = blas[0]() if blas else None
    before_torch = torch.get_num_threads() if torch is not None else None
    if blas:
        blas[1](1)
    if torch is not None:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if blas:
            blas[1](before_blas)
        if torch is not None:
            torch.set_num_threads(before_torch)
