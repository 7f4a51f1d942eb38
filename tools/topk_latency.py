"""Where a top-K row's time goes at small batch, on one GPU.

Three measurements per case (rows x pages, K): the cost per launch of an empty kernel of the
same grid in a CUDA graph of back-to-back launches (plain and PDL), the same for the row select
of topk.cuh (`select_row`, keys in shared memory) and for its register form (`select_small`), and
the phases of each inside a CTA: clock64 stamps of thread 0 in a -DTK_TRACE build (kernels/
topk.cuh, TK_STAMP). Selections of the two forms are checked equal first (random, tied and
NaN scores, sinks and a window).

    python tools/topk_latency.py [--cases 8x2048,32x2048,64x8192,256x8192] [--k 128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SOURCE = r"""
#include "topk.cuh"
template <int NT>
__global__ void __launch_bounds__(NT) row_kernel(const float* scores, int pages, int nnz,
    int k_pages, int sinks, int window, int* sel) {
  extern __shared__ uint4 dyn[];
  __shared__ TopkShared sh;
  TK_STAMP(0);
  grid_wait();
  grid_release();
  select_row<NT>(scores + (size_t)blockIdx.y * nnz, reinterpret_cast<uint32_t*>(dyn), pages,
                 k_pages, sinks, window, sel + (size_t)blockIdx.y * k_pages, sh);
  __syncthreads();
  TK_STAMP(8);
}
template <int NT, int R>
__global__ void __launch_bounds__(NT) small_kernel(const float* scores, int pages, int nnz,
    int k_pages, int sinks, int window, int* sel) {
  __shared__ SmallShared sh;
  TK_STAMP(0);
  grid_wait();
  grid_release();
  select_small<NT, R>(scores + (size_t)blockIdx.y * nnz, pages, k_pages, sinks, window,
                      sel + (size_t)blockIdx.y * k_pages, sh);
  __syncthreads();
  TK_STAMP(8);
}
__global__ void empty_kernel(int* p) {
  grid_wait();
  grid_release();
  if (p && threadIdx.x == 0) p[blockIdx.y] = 0;
}
"""
SLOTS = {1: "keys", 2: "range", 3: "pass 1", 4: "pass 2", 5: "pass 3", 6: "pass 4",
         7: "compact", 8: "end"}


def forms(pages: int) -> list[tuple[str, str, int]]:
    """(label, name expression, threads) of the forms timed for rows of `pages` pages."""
    out = [(f"row {n}", f"row_kernel<{n}>", n) for n in (256, 512, 1024)]
    for n in (256, 512, 1024):
        r = -(-pages // n)
        if r <= 16:
            out.append((f"small {n}x{r}", f"small_kernel<{n}, {r}>", n))
    return out


def build(trace: bool, names: list[str]):
    import cupy

    from questprof.backends.cupy import KERNELS_DIR
    opts = ("-std=c++17", f"-I{KERNELS_DIR}") + (("-DTK_TRACE",) if trace else ())
    return cupy.RawModule(code=SOURCE, options=opts,
                          name_expressions=(*names, "empty_kernel"))


def per_launch_us(launch, n: int = 100, reps: int = 20) -> float:
    """us per launch of `launch()` in a graph of n back-to-back launches."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(3):
            launch()
        stream.begin_capture()
        for _ in range(n):
            launch()
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(reps):
            graph.launch()
        end.record()
        end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / (n * reps)


def launcher(kernel, grid, block, args, smem, pdl: bool):
    from questprof.backends import pdl as pdl_mod

    def go():
        error = pdl_mod._launch(kernel, grid, block, args, smem, pdl)
        if error:
            raise RuntimeError(error)
    return go


def score_sets(rows: int, pages: int):
    import cupy
    rng = cupy.random.default_rng(7)
    normal = rng.standard_normal((rows, pages), dtype=cupy.float32)
    tied = cupy.floor(rng.standard_normal((rows, pages), dtype=cupy.float32) * 3)
    tied[:, ::97] = cupy.nan
    return {"normal": normal, "tied+nan": tied, "equal": cupy.ones((rows, pages), cupy.float32)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="8x2048,32x2048,64x8192,256x8192")
    parser.add_argument("--k", type=int, default=128, help="pages chosen per row")
    args = parser.parse_args()
    import cupy
    import numpy as np

    from questprof.core import reference

    clock_khz = cupy.cuda.runtime.getDeviceProperties(0)["clockRate"]
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    for rows, pages in cases:
        names = forms(pages)
        timed, traced = build(False, [e for _, e, _ in names]), build(True, [e for _, e, _ in names])
        empty = timed.get_function("empty_kernel")
        sel = cupy.empty((rows, args.k), cupy.int32)
        sets = score_sets(rows, pages)
        results = {}
        for label, expr, nt in names:
            smem = pages * 4 if expr.startswith("row") else 0
            ok = True
            for sinks, window in ((0, 1), (2, 4)):
                for scores in sets.values():
                    k = timed.get_function(expr)
                    k.max_dynamic_shared_size_bytes = smem
                    a = (scores, np.int32(pages), np.int32(pages), np.int32(args.k),
                         np.int32(sinks), np.int32(window), sel)
                    sel.fill(-7)  # no form passes on the launch before's output
                    launcher(k, (1, rows), (nt,), a, smem, False)()
                    ref = reference.topk(cupy.asnumpy(scores), [0, pages], args.k, sinks,
                                         window)[0][:, 0, :]
                    ok &= bool(np.array_equal(cupy.asnumpy(sel), ref))
            k = timed.get_function(expr)
            a = (sets["normal"], np.int32(pages), np.int32(pages), np.int32(args.k), np.int32(0),
                 np.int32(1), sel)
            plain = per_launch_us(launcher(k, (1, rows), (nt,), a, smem, False))
            pdl = per_launch_us(launcher(k, (1, rows), (nt,), a, smem, True))
            kt = traced.get_function(expr)
            kt.max_dynamic_shared_size_bytes = smem
            launcher(kt, (1, rows), (nt,), a, smem, False)()
            cupy.cuda.runtime.deviceSynchronize()
            stamps = trace_of(traced, rows)
            e_plain = per_launch_us(launcher(empty, (1, rows), (nt,), (np.uint64(0),), 0, False))
            e_pdl = per_launch_us(launcher(empty, (1, rows), (nt,), (np.uint64(0),), 0, True))
            results[label] = (ok, plain, pdl, e_plain, e_pdl, stamps)
        print(f"\n{rows} rows x {pages} pages, K {args.k} (us per launch in a graph; phases: "
              f"median over CTAs of thread 0's clock since the kernel's start, us at "
              f"{clock_khz / 1e3:.0f} MHz)")
        print(f"{'form':<16}{'same':>6}{'plain':>8}{'PDL':>8}{'empty':>8}{'empty PDL':>10}  phases")
        for label, (ok, plain, pdl, e_plain, e_pdl, stamps) in results.items():
            phases = " ".join(f"{SLOTS[s]} {v / clock_khz * 1e3:.2f}" for s, v in stamps.items())
            print(f"{label:<16}{'yes' if ok else 'NO':>6}{plain:8.2f}{pdl:8.2f}{e_plain:8.2f}"
                  f"{e_pdl:10.2f}  {phases}", flush=True)


def trace_of(module, rows: int) -> dict[int, float]:
    """Median over CTAs of (stamp - stamp 0) per recorded slot, in clock cycles."""
    import cupy
    import numpy as np

    ptr = module.get_global("tk_trace")
    raw = cupy.ndarray((1024, 16), cupy.int64, ptr)
    stamps = cupy.asnumpy(raw[:rows]).astype(np.float64)
    raw[:] = 0
    out = {}
    for s in SLOTS:
        d = stamps[:, s] - stamps[:, 0]
        d = d[stamps[:, s] != 0]
        if d.size:
            out[s] = float(np.median(d))
    return out


if __name__ == "__main__":
    main()
