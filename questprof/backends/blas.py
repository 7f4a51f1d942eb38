"""One BLAS thread for the CPU path's matmuls, without a dependency: the loaded OpenBLAS's own
thread-count call, through ctypes; a no-op where there is none (another BLAS, another OS).

Why: on the 2-core machine shared with other work (load 2.8, 2026-12-01), dense attention of a
32k-token request (1 GB of float32 K and V) took 450-630 ms with OpenBLAS's default 2 threads and
85-115 ms with 1: a BLAS thread that waits for a descheduled partner spins.
"""

from __future__ import annotations

import ctypes
import functools
from contextlib import contextmanager

# per-thread first (OpenBLAS >= 0.3.27), then the process-wide calls of NumPy's scipy-openblas
# build and of a plain OpenBLAS: (set, get) symbol names
_CALLS = (("openblas_set_num_threads_local", None),
          ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
          ("openblas_set_num_threads", "openblas_get_num_threads"))


def _loaded_openblas() -> list[str]:
    """Paths of the OpenBLAS libraries this process has loaded (Linux), else []."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower()}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


@functools.cache
def _setter():
    """set(n) -> previous n for the loaded OpenBLAS, or None."""
    import numpy  # noqa: F401  (loads the BLAS that NumPy calls)

    for path in _loaded_openblas():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name, get_name in _CALLS:
            if not hasattr(lib, set_name):
                continue
            setter = getattr(lib, set_name)
            if get_name is None:  # the per-thread call returns the previous count itself
                setter.restype = ctypes.c_int
                return lambda n, f=setter: f(ctypes.c_int(n))
            getter = getattr(lib, get_name)
            getter.restype = ctypes.c_int

            def swap(n, f=setter, g=getter):
                old = g()
                f(ctypes.c_int(n))
                return old
            return swap
    return None


@contextmanager
def threads(n: int = 1):
    """BLAS calls inside run on `n` threads (where the thread count can be set)."""
    swap = _setter()
    old = swap(n) if swap is not None else None
    try:
        yield
    finally:
        if old is not None:  # 0: the per-thread count unset again (the global one applies)
            swap(old)


def one_thread(fn):
    """Decorator: `fn` runs its BLAS calls on one thread."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with threads(1):
            return fn(*args, **kwargs)
    return run
