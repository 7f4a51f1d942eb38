"""A CPU stand-in for the few CuPy names backends/cupy.py touches, for a dry run of the launchers
without a GPU: arrays are NumPy's, kernels record their launches instead of running."""

from __future__ import annotations

import contextlib
import types

import numpy as np


def make() -> types.ModuleType:
    """A fresh module named cupy; its LAUNCHES list holds (expression, grid, block, args,
    shared_mem) of every launch, and a launch over 48 KiB of dynamic shared memory must have
    raised the kernel's attribute first (as a GPU refuses it otherwise)."""
    cupy = types.ModuleType("cupy")
    cupy.ndarray, cupy.asarray, cupy.asnumpy = np.ndarray, np.asarray, np.asarray
    cupy.empty, cupy.zeros, cupy.ascontiguousarray = np.empty, np.zeros, np.ascontiguousarray
    cupy.float32, cupy.int32 = np.float32, np.int32
    cupy.full, cupy.where = np.full, np.where
    cupy.float16, cupy.float64, cupy.uint16, cupy.uint32 = (np.float16, np.float64, np.uint16,
                                                            np.uint32)
    cupy.LAUNCHES = []

    class RawKernel:
        ptx_version, num_regs = 90, 128

        def __init__(self, expression):
            self.expression, self.max_dynamic_shared_size_bytes = expression, 0

        def __call__(self, grid, block, args, shared_mem=0):
            assert shared_mem <= max(self.max_dynamic_shared_size_bytes, 48 * 1024), (
                f"{self.expression}: {shared_mem} bytes over the kernel's attribute")
            cupy.LAUNCHES.append((self.expression, tuple(grid), tuple(block), args, shared_mem))

    class RawModule:
        def __init__(self, code, options, name_expressions):
            self.names = name_expressions

        def get_function(self, expression):
            assert expression in self.names
            return RawKernel(expression)

    class Device:
        id, compute_capability = 0, "90"
        attributes = {"MultiProcessorCount": 132}

        def __init__(self, *_):
            pass

    class Stream:
        ptr = 0

        def synchronize(self):
            pass

    class MemoryPool:
        def malloc(self, size):
            raise AssertionError("the stub's arrays are NumPy's")

    cupy.RawModule = RawModule
    cupy.get_default_memory_pool = MemoryPool
    cupy.cuda = types.SimpleNamespace(Device=Device, get_current_stream=Stream,
                                      MemoryPool=MemoryPool,
                                      using_allocator=lambda _: contextlib.nullcontext())
    return cupy


@contextlib.contextmanager
def installed(monkeypatch, names: tuple[str, ...]):
    """Within the block the stub is `cupy` and the modules `names` (which import it) are
    imported afresh over it: yields (stub, those modules). Afterwards the modules are as they
    were, in sys.modules and as their package's attributes (where a GPU machine imported the
    real ones first, `from questprof.backends import pdl` would otherwise find the stub's)."""
    import importlib
    import sys

    def parent(name):
        package, _, leaf = name.rpartition(".")
        return sys.modules[package], leaf

    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    attrs = {}
    for n in names:
        package, leaf = parent(n)
        attrs[n] = package.__dict__.pop(leaf, None)
    stub = make()
    monkeypatch.setitem(sys.modules, "cupy", stub)
    try:
        modules = [importlib.import_module(n) for n in names]
        pdl = sys.modules.get("questprof.backends.pdl")
        if pdl is not None:  # the stub's kernels launch by their own call, never the driver's
            monkeypatch.setattr(pdl, "driver_or_none", lambda: None)
        yield stub, modules
    finally:
        for n in names:
            sys.modules.pop(n, None)
            package, leaf = parent(n)
            package.__dict__.pop(leaf, None)
            if attrs[n] is not None:
                setattr(package, leaf, attrs[n])
        sys.modules.update(saved)
