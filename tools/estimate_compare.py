"""The estimate of this tree beside the estimate of an earlier commit, side by side in one run on
the bench protocol (cold per-layer pools, CUDA-graph replays of a pass of layers), with the scores
of the two compared (relative error) and each time against the read ceiling measured first.

    python tools/estimate_compare.py --old DIR [--form cuda-core|args] [--cases FILE] [--out DIR]

DIR holds an earlier commit's kernels/estimate.cu and the headers it includes (`git archive`
of kernels/). --form says which estimate_kernel it is (FORMS): `cuda-core` (7d2f648's: CUDA
cores, 256 threads, a persistent wave, its launch rule written out below) or `args` (05797cf's:
today's tensor-core kernel and launch rule, every pointer and count a kernel argument where
today's take a params struct). Both are timed twice, alternating (new, old, new, old), so
a drift of the machine shows as a difference between the two timings of one. Cases: a bench
file (default: scenarios/bench.toml); each case and mode is one row. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from questprof.backends import variants  # noqa: E402
from questprof.commands.bench import load_bench  # noqa: E402
from questprof.core import model  # noqa: E402
from questprof.core.stages import MODES  # noqa: E402

OLD_BLOCKS_PER_SM = (4, 4, 3, 2, 2)  # EST_BLOCKS_PER_SM of 7d2f648, per tile 1, 2, 4, 8, 16
OLD_THREADS, OLD_UNROLL = 256, 2


def old_build(q: str, summ: str, d: int, g: int, mode: int) -> tuple[int, int, bool]:
    """(tile, MODE, EXACT) of the CUDA-core estimate_kernel (variants.estimate_build, 7d2f648)."""
    tile = variants.plan_group(g).tile
    if q == summ and d in (64, 128) and tile in (1, 2, 4, 8) and g == tile:
        return tile, mode, True
    if tile <= 2:
        return tile, 0 if tile == 1 else -1, True
    return tile, -1, g == tile == 16


def old_estimate(old_dir: Path, q, kv, mode: str):
    """Scores of the earlier commit's estimate_kernel over kv (its own launch rule)."""
    import cupy
    import numpy as np

    from questprof.backends import cupy as ops
    from questprof.backends.launch_args import check_kv, check_q

    q_tag, _, s_tag = check_kv(kv)
    q_heads, g = check_q(q, kv)
    nnz, d, m = int(kv.kv_indices.size), kv.head_dim, MODES.index(mode)
    tile, mode_arg, exact = old_build(kv.dtype, kv.summary_dtype, d, g, m)
    expr = f"estimate_kernel<{q_tag}, {s_tag}, {d}, {tile}, {mode_arg}, {str(exact).lower()}, 1>"
    kernel = _old_kernel(str(old_dir), expr)
    tiles = -(-nnz * kv.kv_heads // (OLD_UNROLL * (OLD_THREADS // variants.row_lanes(d))))
    blocks = max(1, min(tiles, OLD_BLOCKS_PER_SM[variants.GROUPS.index(tile)] * ops._sm_count()))
    scores = cupy.empty((q_heads if m == 0 else kv.kv_heads, nnz), dtype=cupy.float32)
    scale = kv.k_scale if kv.is_fp8 else np.uint64(0)
    kernel((blocks,), (OLD_THREADS,), (q, kv.summary, kv.kv_indptr, kv.kv_indices, scores,
                                       np.int32(kv.batch), np.int32(kv.kv_heads), np.int32(nnz),
                                       np.int32(g), np.int32(m), scale, np.uint64(0),
                                       np.int32(0)))
    return scores


def args_estimate(old_dir: Path, q, kv, mode: str):
    """Scores of 05797cf's estimate_kernel (every argument apart) under today's launch rule."""
    import cupy
    import numpy as np

    from questprof.backends import cupy as ops
    from questprof.backends.launch_args import check_kv, check_q

    q_tag, _, s_tag = check_kv(kv)
    q_heads, g = check_q(q, kv)
    nnz, d, m = int(kv.kv_indices.size), kv.head_dim, MODES.index(mode)
    kernel = _old_kernel(str(old_dir), f"estimate_kernel<{q_tag}, {s_tag}, {d}, "
                                       f"{variants.estimate_ntiles(g)}, 1>")
    blocks = variants.estimate_blocks(nnz, kv.kv_heads, 1, g, ops._sm_count())
    smem = variants.estimate_shared_bytes(d, g, kv.summary_dtype)
    scores = cupy.empty((q_heads if m == 0 else kv.kv_heads, nnz), dtype=cupy.float32)
    scale = kv.k_scale if kv.is_fp8 else np.uint64(0)
    kernel.max_dynamic_shared_size_bytes = max(kernel.max_dynamic_shared_size_bytes, smem)
    kernel((blocks,), (variants.EST_WARPS * 32,), (
        q, kv.summary, kv.kv_indptr, kv.kv_indices, scores, np.int32(kv.batch),
        np.int32(kv.kv_heads), np.int32(nnz), np.int32(g), np.int32(m), scale, kv.last_page_len,
        np.int32(kv.page_size)), shared_mem=smem)
    return scores


FORMS = {"cuda-core": old_estimate, "args": args_estimate}
_OLD: dict = {}


def _old_kernel(old_dir: str, expr: str):
    import cupy

    if (old_dir, expr) not in _OLD:
        code = f'#line 1 "old/estimate.cu"\n{(Path(old_dir) / "estimate.cu").read_text()}'
        module = cupy.RawModule(code=code, options=("-std=c++17", f"-I{old_dir}"),
                                name_expressions=(expr,))
        _OLD[(old_dir, expr)] = module.get_function(expr)
    return _OLD[(old_dir, expr)]


def _launcher(estimate, old_dir: Path, q, kvs, mode: str):
    """launch(layer) of an earlier estimate over the workload's pools."""
    return lambda layer: estimate(old_dir, q, kvs[layer], mode)


def compare_case(backend, cfg, old_dir: Path, ceiling: float, repeats: int,
                 form: str = "cuda-core") -> dict:
    """One row: both estimates timed on the same pools, their scores compared."""
    import cupy
    import numpy as np

    from questprof.commands.bench import _layers
    from questprof.measure.timing import time_layers
    from questprof.workload.pools import Workload, release

    layers = _layers(cfg, backend)
    work = Workload(cfg, backend, layers)
    new = work.launcher("estimate")
    old = _launcher(FORMS[form], old_dir, work.q, work.kvs, cfg.mode)
    a, b = (cupy.asnumpy(f(0)).astype(np.float64) for f in (new, old))
    err = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    t_new, t_old, t_new2, t_old2 = (time_layers(backend, f, layers, 3, repeats, True).median
                                    for f in (new, old, new, old))
    mb = model.stage_work(cfg)["estimate"].read / 1e6
    del work
    release(backend)
    return {"model": cfg.model.name, "length": cfg.length, "batch": cfg.batch, "mode": cfg.mode,
            "group": cfg.model.group, "MB": mb, "old_us": t_old * 1e3, "new_us": t_new * 1e3,
            "old_us_2": t_old2 * 1e3, "new_us_2": t_new2 * 1e3,
            "speedup": t_old / t_new, "speedup_2": t_old2 / t_new2,
            "old_ratio": mb * 1e6 / (t_old * 1e-3) / 1e9 / ceiling,
            "new_ratio": mb * 1e6 / (t_new * 1e-3) / 1e9 / ceiling, "scores_rel_err": err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="an earlier commit's kernels/")
    parser.add_argument("--cases", type=Path, default=None, help="bench file of the cases")
    parser.add_argument("--form", choices=tuple(FORMS), default="cuda-core",
                        help="which earlier estimate_kernel --old holds")
    parser.add_argument("--out", type=Path, default=None, help="folder for rows.json")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from questprof.backends import get_backend
    from questprof.measure.ceilings import measure_ceilings

    backend = get_backend("cupy")
    ceiling = measure_ceilings(backend)["read_gbs"]
    cases, _ = load_bench(*(() if args.cases is None else (args.cases,)))
    rows = []
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    for cfg in cases:
        rows.append(compare_case(backend, cfg, args.old, ceiling, args.repeats, args.form))
        r = rows[-1]
        print(f"{r['model']:>18} {r['length'] // 1024:>4}K B{r['batch']} {r['mode']:<11} "
              f"{r['MB']:8.1f} MB  old {r['old_us']:7.1f} us ({r['old_ratio']:.2f})  new "
              f"{r['new_us']:7.1f} us ({r['new_ratio']:.2f})  x{r['speedup']:.3f}, again "
              f"{r['old_us_2']:.1f} / {r['new_us_2']:.1f} x{r['speedup_2']:.3f}  "
              f"err {r['scores_rel_err']:.1e}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "estimate_compare.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
