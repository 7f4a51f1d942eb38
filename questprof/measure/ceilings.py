"""Ceilings measured on the machine at run time (read, copy bandwidth; fp16 matmul rate), with
the datasheet figures beside them. Bandwidths in GB/s (1e9 B/s), rates in TFLOP/s (1e12).

The read kernel (kernels/ceilings.cu) doubles as the calibration kernel of every byte counter:
it reads exactly `nbytes` and writes nothing, so CUPTI, ncu and NVML GPM can be checked on it.
"""

from __future__ import annotations

import bisect
import functools

import numpy as np

from questprof.backends import get_backend
from questprof.core.model import cold_read_layers
from questprof.measure.timing import time_call, time_layers

GIB = 1 << 30
READ_BYTES = 2 * GIB  # 34x the 60 MiB L2 of an H200: the bytes come from HBM, not L2
MATMUL_N = 8192
LADDER = tuple((16 << 20) << k for k in range(10))  # plain-read sizes: 16 MiB .. 8 GiB, doubling
# Fresh allocations timed per ladder size; the fastest counts. On an H200, after 24 GiB had been
# allocated and freed, the same 537 MB read took 118.3-137.0 us on different allocations (67 MB:
# 16.9-19.2 us), while a fresh process gave 118.3-119.1 us every time.
LADDER_TRIES = 3
FLUSH_BYTES = 256 << 20  # the flush protocol's L2-evicting read
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
    from questprof.backends.cupy import load_kernel

    return load_kernel("ceilings", name)


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
    _kernel("ceilings_read")(
        (_grid(),), (THREADS,), (x, np.int64(x.size // 4), sink))


def launch_copy(x, y) -> None:
    """y[:] = x for float32 arrays of one size (a multiple of 4), on the current stream."""
    _kernel("ceilings_copy")(
        (_grid(),), (THREADS,), (x, y, np.int64(x.size // 4)))


def same_bytes_read_ms(backend, nbytes: int, l2_bytes: int, repeats: int = 20) -> float:
    """ms of one read of `nbytes` by the read kernel, timed like our stages: a CUDA-graph pass
    over one buffer per simulated layer, >= COLD_FACTOR x L2 per pass (cold, as each decode
    layer is). The ceiling a kernel that must read `nbytes` meets at that size: launch, ramp
    and tail included (a 2 GiB read hides them, a 33.6 MB one does not).
    """
    import cupy

    n = -(-nbytes // 16) * 16
    layers = cold_read_layers(n, l2_bytes)
    stride = -(-n // 4096) * 4096  # 4 KiB-aligned buffers, like the pools' pages
    pool = random_buffer(layers * stride)
    sink = cupy.zeros(1, dtype=cupy.float32)
    bufs = [pool[l * stride // 4:(l * stride + n) // 4] for l in range(layers)]
    timing = time_layers(backend, lambda l: launch_read(bufs[l], sink), layers,
                         repeats=repeats, graph=True)
    del pool, bufs
    cupy.get_default_memory_pool().free_all_blocks()
    return timing.median


def read_ladder(backend, l2_bytes: int, sizes=LADDER, repeats: int = 20,
                tries: int = LADDER_TRIES) -> list[tuple[int, float]]:
    """[(bytes, ms)]: a plain cold read (same_bytes_read_ms) at each size whose buffers fit in
    half the free memory, the fastest of `tries` fresh allocations: the read ceiling as a
    function of size. Take it before large pools come and go (see LADDER_TRIES)."""
    import cupy

    free = cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()
    out = []
    for n in sorted(sizes):
        if cold_read_layers(n, l2_bytes) * n > free // 2:
            break
        out.append((n, min(same_bytes_read_ms(backend, n, l2_bytes, repeats)
                           for _ in range(tries))))
    return out


def ladder_ms(ladder: list[tuple[int, float]], nbytes: int) -> float | None:
    """Plain-read ms for `nbytes` from a ladder: linear between its rungs (a read's time is close
    to affine in its bytes), the last segment extended above it; None below the first rung."""
    if not ladder or nbytes < ladder[0][0]:
        return None
    if len(ladder) == 1:
        return ladder[0][1] * nbytes / ladder[0][0]
    i = min(max(bisect.bisect_left([n for n, _ in ladder], nbytes), 1), len(ladder) - 1)
    (n0, t0), (n1, t1) = ladder[i - 1], ladder[i]
    return t0 + (t1 - t0) * (nbytes - n0) / (n1 - n0)


def median_ms(launch, repeats: int = 20, warmup: int = 3, uses_torch: bool = False) -> float:
    """Median time of single calls of `launch()` in ms (measure.timing's one loop, events)."""
    return time_call(get_backend("cupy"), launch, warmup, repeats, uses_torch=uses_torch).median


def _matmul_tflops(n: int, repeats: int) -> tuple[float, str]:
    """fp16 n x n x n matmul on random data; torch when importable (cuBLASLt), else CuPy."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.float16) for _ in range(2))
        return 2 * n**3 / (median_ms(lambda: a @ b, repeats, uses_torch=True) * 1e-3) / 1e12, "torch"
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


class Flush:
    """A plain read of FLUSH_BYTES after each stage call evicts L2 (4x an H200's 60 MiB)."""

    def __init__(self, nbytes: int = FLUSH_BYTES):
        import cupy

        self.buf, self.sink = random_buffer(nbytes), cupy.zeros(1, dtype=cupy.float32)

    def __call__(self) -> None:
        launch_read(self.buf, self.sink)


LINK_BYTES = GIB  # 1 GiB: the H200 box's pinned copy ran at 54.9 GB/s over it (2026-12-01)


def measure_link_ceilings(nbytes: int = LINK_BYTES, repeats: int = 10) -> dict:
    """The host link's ceilings in GB/s (1e9 B/s), for the host tier (core/tier.py):
    `copy_gbs`, a pinned host-to-device copy of `nbytes` by the copy engine; `zero_copy_gbs`,
    the read kernel over `nbytes` of mapped pinned host memory, read in place."""
    import cupy

    from questprof.backends.host_tier import MappedHost, mapped_empty

    host = MappedHost(nbytes)
    src = host.host_view((nbytes // 4,), np.float32)
    src[:] = np.random.default_rng(0).standard_normal(src.size, dtype=np.float32)
    dst = cupy.empty(nbytes // 4, dtype=cupy.float32)
    # the stream is looked up at each call: the timing loop makes its own stream current, and a
    # copy queued elsewhere would fall outside its events (146 TB/s on the H200, 2026-12-02)
    copy_ms = median_ms(lambda: cupy.cuda.runtime.memcpyAsync(
        dst.data.ptr, host.ptr, nbytes, cupy.cuda.runtime.memcpyHostToDevice,
        cupy.cuda.get_current_stream().ptr), repeats)
    if not np.array_equal(cupy.asnumpy(dst[-1024:]), src[-1024:]):
        raise RuntimeError("the pinned copy did not copy its input: the copy ceiling is void")
    mapped = mapped_empty((nbytes // 4,), np.float32)
    mapped[...] = dst  # the same values, now in host memory, read in place below
    sink = cupy.zeros(1, dtype=cupy.float32)
    read_ms = median_ms(lambda: launch_read(mapped, sink), repeats)
    del dst, mapped
    return {"link_bytes": nbytes, "copy_gbs": nbytes / (copy_ms * 1e-3) / 1e9,
            "zero_copy_gbs": nbytes / (read_ms * 1e-3) / 1e9}


def link_ceilings(configs, backend) -> dict | None:
    """The host link's ceilings (measure_link_ceilings) when a configuration keeps its pages on
    the host of a GPU, for a run's meta.json (sweep, bench); None otherwise (on the CPU the host
    is the host: no link to measure); a failure is its reason, never a stop."""
    if not backend.is_gpu or all(c.kv_tier == "hbm" for c in configs):
        return None
    try:
        return measure_link_ceilings()
    except Exception as exc:  # context for the report, as the other ceilings: never a stop
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
