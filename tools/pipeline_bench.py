"""Time the Quest step as a pipeline against its stages, our dense and torch SDPA.

python3 tools/pipeline_bench.py [--repeats N]: MHA 32 heads, d 128, fp16, page 16; 32K budget 2048
and 128K budget 4096 at batch 1, 32K budget 2048 at batch 8. Each layer has its own pool, and a
pass walks enough layers that the Quest stages read >= 8x the L2 between visits of one pool; a
pass is captured as one CUDA graph and replayed; us per layer, median (p20-p80) of the replays.
Imports only questprof.core and questprof.backends (the rest of the package may be mid-change).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from questprof.core.layout import PagedKV, page_tables, rebuild_plan  # noqa: E402

HEADS, D, S, DTYPE = 32, 128, 16, "fp16"
CASES = ((32768, 1, 2048), (131072, 1, 4096), (32768, 8, 2048))  # (tokens, batch, budget)


def _layer(rng, lengths, num_pages) -> tuple[PagedKV, object]:
    """One layer's pool on the device (random K, V; summaries by the summary kernel) and its q
    (CuPy arrays)."""
    import cupy

    from questprof.backends import cupy as ops

    indptr, indices, last = page_tables(lengths, S, num_pages, rng)
    shape = (num_pages, HEADS, S, D)
    k = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    v = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    summ = cupy.empty((num_pages, HEADS, 2, D), dtype=cupy.float16)
    kv = PagedKV(k, v, summ, cupy.asarray(indptr), cupy.asarray(indices), cupy.asarray(last),
                 tuple(lengths), S, DTYPE)
    valid = np.full(len(indices), S, dtype=np.int32)
    valid[indptr[1:] - 1] = last
    ops.summary(kv, rebuild_plan(indices, valid))
    q = cupy.random.standard_normal((len(lengths), HEADS, D), dtype=cupy.float32)
    return kv, q.astype(cupy.float16)


def _time(run_layer, layers: int, repeats: int) -> tuple[float, float, float]:
    """(median, p20, p80) us per layer of a CUDA-graph replay of one pass over the layers."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for layer in range(layers):  # compile and fill the pool before the capture
            run_layer(layer)
        stream.synchronize()
        stream.begin_capture()
        for layer in range(layers):
            run_layer(layer)
        graph = stream.end_capture()
        for _ in range(3):
            graph.launch(stream)
        events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
        for start, end in events:
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
        stream.synchronize()
    us = [cupy.cuda.get_elapsed_time(s, e) * 1e3 / layers for s, e in events]
    return tuple(float(np.percentile(us, p)) for p in (50, 20, 80))


def _sdpa(tokens: int, batch: int, layers: int, repeats: int):
    """torch SDPA decode on contiguous [B, H, L, d] caches, one per layer; eager, CUDA events."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    caches = [(torch.randn(batch, HEADS, tokens, D, device="cuda", dtype=torch.float16),
               torch.randn(batch, HEADS, tokens, D, device="cuda", dtype=torch.float16))
              for _ in range(layers)]
    q = torch.randn(batch, HEADS, 1, D, device="cuda", dtype=torch.float16)

    def run():
        for k, v in caches:
            F.scaled_dot_product_attention(q, k, v)
    for _ in range(3):
        run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    us = [s.elapsed_time(e) * 1e3 / layers for s, e in events]
    del caches
    torch.cuda.empty_cache()
    return tuple(float(np.percentile(us, p)) for p in (50, 20, 80))


def read_ceiling_gbs(repeats: int = 10) -> float:
    """GB/s of the calibration read kernel (kernels/ceilings.cu) over 2 GiB, median."""
    import cupy

    from questprof.backends import cupy as ops

    n = (2 << 30) // 16
    x = cupy.random.standard_normal(n * 4, dtype=cupy.float32)
    sink = cupy.zeros(1, dtype=cupy.float32)
    kernel = ops.load_kernel("ceilings", "ceilings_read")
    grid = 8 * ops._sm_count()  # one full wave of 256-thread blocks
    run = lambda: kernel((grid,), (256,), (x, np.int64(n), sink))  # noqa: E731
    run()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    del x
    return n * 16 / (float(np.median(times)) * 1e-3) / 1e9


def launchers() -> dict:
    """'quest <variant>' -> the PDL Launcher of a launch variant of quest()'s default step."""
    from questprof.backends import cupy as ops
    from questprof.backends.pdl import STAGES, Launcher

    variants = {  # (stages launched with the attribute, stages releasing early)
        "pipeline": (STAGES, ops.QUEST_EARLY_RELEASE),  # what CupyBackend.quest runs
        "pdl all-early": (STAGES, STAGES),
        "pdl end-release": (STAGES, ()),
        "pdl no-estimate": (("topk", "attention"), ("topk",)),
    }
    return {f"quest {name}": Launcher(stages=stages, early=early)
            for name, (stages, early) in variants.items()}


def names() -> tuple[str, ...]:
    """The timed rows of a case, in the table's order."""
    return ("estimate", "topk", "attention", "quest composed", *launchers(), "dense", "torch SDPA")


def bench_case(tokens: int, batch: int, budget: int, repeats: int, l2: int) -> dict:
    """One case's row: names() -> (median, p20, p80) us per layer, the launch paths, layers, PTX."""
    import cupy

    from questprof.backends import cupy as ops

    rng = np.random.default_rng(tokens + batch)
    k_pages = budget // S
    pages = tokens // S
    quest_bytes = batch * HEADS * (pages * 2 * D * 2 + k_pages * S * D * 2 * 2)
    layers = max(4, math.ceil(8 * l2 / quest_bytes))
    pool = [_layer(rng, [tokens] * batch, batch * pages + 7) for _ in range(layers)]
    scores = [ops.estimate(q, kv) for kv, q in pool]
    picks = [ops.topk(s, kv, k_pages) for s, (kv, _) in zip(scores, pool)]
    cupy.cuda.Device().synchronize()  # the timing streams do not wait for the null stream
    launches = launchers()
    runs = {
        "estimate": lambda l: ops.estimate(pool[l][1], pool[l][0]),
        "topk": lambda l: ops.topk(scores[l], pool[l][0], k_pages),
        "attention": lambda l: ops.attention(pool[l][1], pool[l][0], *picks[l]),
        "quest composed": lambda l: ops.quest(pool[l][1], pool[l][0], k_pages),
        **{name: (lambda l, la=la: ops.quest(pool[l][1], pool[l][0], k_pages, launch=la))
           for name, la in launches.items()},
        "dense": lambda l: ops.attention(pool[l][1], pool[l][0]),
    }
    row = {name: _time(run, layers, repeats) for name, run in runs.items()}
    row["path"] = {name: la.path for name, la in launches.items()}
    row["layers"] = layers
    kernel = ops.load_kernel("topk", "topk_kernel<1024, 0>")
    row["ptx"] = (kernel.ptx_version, kernel.binary_version)
    del pool, scores, picks
    cupy.get_default_memory_pool().free_all_blocks()
    row["torch SDPA"] = _sdpa(tokens, batch, max(2, min(layers, 4)), repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--case", type=int, help="run CASES[i] alone, print its row as JSON")
    args = parser.parse_args()
    import cupy

    from questprof.backends.cupy import CupyBackend

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    l2 = int(props["l2CacheSize"])
    if args.case is not None:
        print(json.dumps(bench_case(*CASES[args.case], args.repeats, l2)))
        return
    ceiling = read_ceiling_gbs()
    print(f"{props['name'].decode()}, L2 {l2 >> 20} MiB, read ceiling {ceiling:.0f} GB/s, "
          f"backend quest_path {CupyBackend().quest_path}", flush=True)
    rows, columns = [], names()
    for i, (tokens, batch, budget) in enumerate(CASES):  # a process per case: one fault, one case
        done = subprocess.run([sys.executable, __file__, "--case", str(i), "--repeats",
                               str(args.repeats)], capture_output=True, text=True)
        if done.returncode:
            print(f"case {i} failed:\n{done.stderr[-3000:]}", flush=True)
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(((tokens, batch, budget), row))
        detail = ", ".join(f"{n} {row[n][0]:.1f} ({row[n][1]:.1f}-{row[n][2]:.1f})"
                           for n in columns if row.get(n))
        print(f"{tokens // 1024}K B{batch} budget {budget}, {row['layers']} layers, ptx/sass "
              f"{row['ptx']}, paths {set(row['path'].values())}: {detail}", flush=True)
    print("\nus per layer, median of CUDA-graph replays (SDPA: eager, events)")
    print("| case | " + " | ".join(columns) + " | stage sum | faster dense / pipeline |")
    print("|---|" + "---:|" * (len(columns) + 2))
    for (tokens, batch, budget), row in rows:
        cells = [f"{row[n][0]:.1f}" if row.get(n) else "-" for n in columns]
        stage_sum = sum(row[n][0] for n in ("estimate", "topk", "attention"))
        dense = min(row["dense"][0], row["torch SDPA"][0] if row.get("torch SDPA") else math.inf)
        print(f"| {tokens // 1024}K B{batch} b{budget} | " + " | ".join(cells)
              + f" | {stage_sum:.1f} | {dense / row['quest pipeline'][0]:.2f}x |")


if __name__ == "__main__":
    main()
