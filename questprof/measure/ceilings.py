"""Ceilings measured on the machine at run time (read, copy bandwidth; fp16 matmul rate), with
the datasheet figures beside them. Bandwidths in GB/s (1e9 B/s), rates in TFLOP/s (1e12).

The read kernel (kernels/ceilings.cu) doubles as the calibration kernel of every byte counter:
it reads exactly `nbytes` and writes nothing, so CUPTI, ncu and NVML GPM can be checked on it.
"""

from __future__ import annotations

import functools

import numpy as np

GIB = 1 << 30
READ_BYTES = 2 * GIB  # 34x the 60 MiB L2 of an H200: the bytes come from HBM, not L2
MATMUL_N = 8192
THREADS = 256
BLOCKS_PER_SM = 8  # one full wave of 256-thread blocks (2048 threads per SM on Hopper)

# Dense (no sparsity) figures from the vendors' datasheets: HBM GB/s, fp16/bf16 tensor TFLOP/s.
# Matched by substring of the NVML / CUDA device name, most specific first.
DATASHEET = (
    ("H200", 4800.0, 989.4),
    ("H100 PCIe", 2000.0, 756.0),
    ("H100", 3350.0, 989.4),
    ("A100-SXM4-80GB", 2039.0, 312.0),
    ("A100", 1555.0, 312.0),
    ("L40S", 864.0, 362.1),
    ("L4", 300.0, 121.0),
)


def datasheet(gpu_name: str) -> tuple[float | None, float | None]:
    """(GB/s, dense fp16 TFLOP/s) of the datasheet for `gpu_name`, (None, None) if unknown."""
    for key, gbs, tflops in DATASHEET:
        if key.lower() in gpu_name.lower():
            return gbs, tflops
    return None, None


def unavailable(reason: str, gpu_name: str = "") -> dict:
    """The ceilings dict of a machine where they cannot be measured."""
    gbs, tflops = datasheet(gpu_name)
    return {"available": False, "reason": reason, "gpu": gpu_name, "read_gbs": None,
            "copy_gbs": None, "fp16_tflops": None, "datasheet_gbs": gbs, "datasheet_tflops": tflops}


def _kernel(name: str):
    """A kernel of kernels/ceilings.cu through the CuPy backend's cached loader."""
    from questprof.backends.cupy import _kernel as load

    return load("ceilings", name)


@functools.cache
def _grid() -> int:
    import cupy

    return int(cupy.cuda.Device().attributes["MultiProcessorCount"]) * BLOCKS_PER_SM


def random_buffer(nbytes: int = READ_BYTES):
    """A float32 device buffer of `nbytes` (a multiple of 16) filled with N(0, 1) values."""
    import cupy

    if nbytes % 16:
        raise ValueError(f"{nbytes} bytes is not a whole number of float4")
    return cupy.random.default_rng(0).standard_normal(nbytes // 4, dtype=cupy.float32)


def launch_read(x, sink) -> None:
    """Read every byte of float32 array `x` once on the current stream (no synchronisation)."""
    import numpy

    _kernel("ceilings_read")(
        (_grid(),), (THREADS,), (x, numpy.int64(x.size // 4), sink))


def launch_copy(x, y) -> None:
    """y[:] = x for float32 arrays of one size (a multiple of 4), on the current stream."""
    import numpy

    _kernel("ceilings_copy")(
        (_grid(),), (THREADS,), (x, y, numpy.int64(x.size // 4)))


def median_ms(launch, repeats: int = 20, warmup: int = 3) -> float:
    """Median time of `launch()` in ms, CUDA events around each call on the current stream."""
    import cupy

    for _ in range(warmup):
        launch()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
    for start, end in events:
        start.record()
        launch()
        end.record()
    events[-1][1].synchronize()
    return float(np.median([cupy.cuda.get_elapsed_time(s, e) for s, e in events]))


def _matmul_tflops(n: int, repeats: int) -> tuple[float, str]:
    """fp16 n x n x n matmul on random data; torch when importable (cuBLASLt), else CuPy."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.float16) for _ in range(2))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for i in range(repeats + 3):
            start.record()
            a @ b
            end.record()
            end.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end))
        return 2 * n**3 / (np.median(times) * 1e-3) / 1e12, "torch"
    import cupy

    a, b = (cupy.random.default_rng(i).standard_normal((n, n), dtype=cupy.float32)
            .astype(cupy.float16) for i in range(2))
    return 2 * n**3 / (median_ms(lambda: a @ b, repeats) * 1e-3) / 1e12, "cupy"


def measure_ceilings(backend, nbytes: int = READ_BYTES, repeats: int = 20) -> dict:
    """Measured read_gbs, copy_gbs (read + write counted), fp16_tflops with datasheet figures.

    On a CPU backend: the same keys with None values, available False and the reason.
    """
    if not getattr(backend, "is_gpu", False):
        return unavailable(f"the {getattr(backend, 'name', '?')} backend runs on the CPU: "
                           "no GPU ceilings to measure")
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    x = random_buffer(nbytes)
    sink = cupy.zeros(1, dtype=cupy.float32)
    read_ms = median_ms(lambda: launch_read(x, sink), repeats)
    y = cupy.empty_like(x)
    copy_ms = median_ms(lambda: launch_copy(x, y), repeats)
    if not bool(cupy.array_equal(x[-1024:], y[-1024:])):
        raise RuntimeError("ceilings_copy did not copy its input: the copy ceiling is void")
    del x, y
    tflops, matmul_by = _matmul_tflops(MATMUL_N, repeats)
    gbs, peak = datasheet(name)
    return {"available": True, "reason": None, "gpu": name,
            "read_gbs": nbytes / (read_ms * 1e-3) / 1e9,
            "copy_gbs": 2 * nbytes / (copy_ms * 1e-3) / 1e9,
            "fp16_tflops": float(tflops), "matmul_by": matmul_by,
            "datasheet_gbs": gbs, "datasheet_tflops": peak}


if __name__ == "__main__":
    import json

    from questprof.backends import get_backend

    print(json.dumps(measure_ceilings(get_backend("auto")), indent=1))
