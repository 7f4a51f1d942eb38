"""The launch of CuPy-compiled kernels through NVIDIA's cuda.bindings, with programmatic dependent
launch (PDL) where asked and available.

Every kernel takes one params struct by value (kernels/params.cuh, backends/params.py): a launch
copies its bytes through `cuLaunchKernelEx`, on the current CuPy stream, also inside a CUDA-graph
capture. A kernel launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION may start
while the previous kernel of its stream still runs, once every CTA of that kernel has passed
`griddepcontrol.launch_dependents` (grid_release in kernels/common.cuh); it waits for that kernel's
completion in `griddepcontrol.wait` (grid_wait). Kernels stay compiled by CuPy (RawModule). Where
the GPU predates sm_90 or the driver refuses a PDL launch, `Launcher` launches without the
attribute and says why in `path`; where cuda.bindings is missing, launches go through CuPy, which
passes a NumPy structured array by value as the kernel's struct (CuPy's custom structures).
"""

from __future__ import annotations

import ctypes
import functools
import struct

import cupy
import numpy as np

PDL = "pdl"  # Launcher.path when launches carry the PDL attribute
PLAIN = "plain"


def _driver():
    """cuda.bindings.driver, or ImportError when the package is not installed."""
    from cuda.bindings import driver

    return driver


def unavailable_reason() -> str | None:
    """Why PDL launches cannot be made on the current device, or None when they can."""
    try:
        _driver()
    except ImportError as exc:  # not installed, or built for another Python
        return f"cuda.bindings is not importable ({type(exc).__name__}: {exc})"
    major = int(cupy.cuda.Device().compute_capability[:-1])
    if major < 9:
        return f"compute capability {cupy.cuda.Device().compute_capability} < 9.0 has no PDL"
    return None


def _arg(x):
    """A kernel argument as the ctypes value the driver copies."""
    if isinstance(x, np.ndarray) and x.dtype.names:  # a params struct (backends/params.py)
        return (ctypes.c_char * x.dtype.itemsize).from_buffer_copy(x.tobytes())
    if isinstance(x, cupy.ndarray):
        return ctypes.c_void_p(x.data.ptr)
    if isinstance(x, np.int32):
        return ctypes.c_int32(int(x))
    if isinstance(x, np.float32):
        return ctypes.c_float(float(x))
    if isinstance(x, np.float64):
        return ctypes.c_double(float(x))
    if isinstance(x, np.uint64):  # a pointer passed as an integer (the null pointer)
        return ctypes.c_uint64(int(x))
    raise TypeError(f"no PDL argument conversion for {type(x).__name__}")


def _dim3(x) -> tuple[int, int, int]:
    x = tuple(int(v) for v in x)
    return x + (1,) * (3 - len(x))


@functools.cache
def driver_or_none():
    """cuda.bindings.driver, or None where it is missing (asked once per process)."""
    try:
        return _driver()
    except ImportError:  # not installed, or built for another Python: CuPy launches
        return None


class PlainLaunch:
    """Launches without PDL on the current stream, of the default kernel builds."""

    path = PLAIN

    def defines(self, stage: str) -> tuple[str, ...]:
        return ()

    def uses_pdl(self, stage: str) -> bool:
        """Whether `stage`'s next launch carries the PDL attribute."""
        return False

    def __call__(self, kernel, grid, block, args, shared_mem: int = 0, stage: str = "") -> None:
        if driver_or_none() is None:
            kernel(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)
            return
        error = _launch(kernel, grid, block, args, shared_mem, pdl=False)
        if error is not None:
            raise RuntimeError(error)


STAGES = ("estimate", "topk", "attention")


class Launcher(PlainLaunch):
    """Launches on the current CuPy stream, `stages` with the PDL attribute while it is available.

    `early`: stages whose kernels release their dependents right after their own grid_wait
    (kernels/common.cuh, QP_EARLY_RELEASE); the others let the next grid launch as they end.
    """

    def __init__(self, enabled: bool = True, stages=STAGES, early=STAGES) -> None:
        self.reason = unavailable_reason() if enabled else "PDL not asked for"
        self.stages, self.early = tuple(stages), tuple(early)

    @property
    def path(self) -> str:
        """'pdl', or 'plain: <why not>'."""
        return PDL if self.reason is None else f"{PLAIN}: {self.reason}"

    def defines(self, stage: str) -> tuple[str, ...]:
        """Preprocessor definitions of the kernel build this launcher runs for `stage`."""
        return () if self.reason is not None or stage in self.early else ("QP_EARLY_RELEASE=0",)

    def uses_pdl(self, stage: str) -> bool:
        return self.reason is None and stage in self.stages

    def __call__(self, kernel, grid, block, args, shared_mem: int = 0, stage: str = "") -> None:
        if self.reason is None and stage in self.stages:
            version = getattr(kernel, "ptx_version", 90) or 90
            if version < 90:  # griddepcontrol would be compiled out: no wait, a race
                self.reason = f"kernels built for PTX {version} < 9.0 have no griddepcontrol"
            else:
                error = _launch(kernel, grid, block, args, shared_mem, pdl=True)
                if error is None:
                    return
                self.reason = error
        super().__call__(kernel, grid, block, args, shared_mem, stage)


def _launch(kernel, grid, block, args, shared_mem: int, pdl: bool) -> str | None:
    """Launch through cuLaunchKernelEx, with the PDL attribute when `pdl`; the driver's refusal as
    text, None on success."""
    return Prepared(kernel, grid, block, args, shared_mem, pdl)()


class Prepared:
    """One launch built for the driver once (its config, function and argument buffers), made by
    calling it, again and again; `move` rewrites a pointer in an argument in between (a replay,
    backends/replay.py: a launch costs the driver call, not the objects built for it)."""

    def __init__(self, kernel, grid, block, args, shared_mem: int, pdl: bool) -> None:
        driver = self.driver = _driver()
        self.values = [_arg(a) for a in args]
        self.pointers = (ctypes.c_void_p * max(1, len(self.values)))(
            *[ctypes.addressof(v) for v in self.values])
        config = self.config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = _dim3(grid)
        config.blockDimX, config.blockDimY, config.blockDimZ = _dim3(block)
        config.sharedMemBytes = int(shared_mem)
        if pdl:
            attr = driver.CUlaunchAttribute()
            attr.id = (driver.CUlaunchAttributeID
                       .CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            attr.value.programmaticStreamSerializationAllowed = 1
            config.attrs = [attr]
        config.numAttrs = 1 if pdl else 0
        self.pdl, self.stream = pdl, None
        self.function = driver.CUfunction(kernel.kernel.ptr)

    def move(self, arg: int, offset: int, address: int) -> None:
        """The pointer at byte `offset` of argument `arg` becomes `address`."""
        struct.pack_into("<Q", self.values[arg], offset, address)

    def __call__(self) -> str | None:
        """Launch on the current CuPy stream: the driver's refusal as text, None on success."""
        driver, stream = self.driver, cupy.cuda.get_current_stream().ptr
        if stream != self.stream:
            self.config.hStream, self.stream = driver.CUstream(stream), stream
        result = driver.cuLaunchKernelEx(self.config, self.function,
                                         ctypes.addressof(self.pointers), 0)
        err = result[0] if isinstance(result, tuple) else result
        if err == driver.CUresult.CUDA_SUCCESS:
            return None
        _, text = driver.cuGetErrorString(err)
        text = text.decode() if isinstance(text, bytes) else str(text)
        return f"the driver refused a {'PDL ' if self.pdl else ''}launch ({err.name}: {text})"
