"""tools/page_cache_probe.py: where the time of attention through the HBM page cache goes.

python3 tools/page_cache_probe.py [--length N] [--batch B] [--budget T] [--capacity C]
                                  [--overlap R] [--steps T] [--layers L] [--repeats N]
The sweep's row "attention through the cache" (workload/replay.py) is one launch of each of
page_cache_step, page_cache_fill (kernels/page_cache.cu) and sparse attention over the HBM
slots. This times them apart and together, in CUDA graphs over L layers' pools, on the host
tier's example shape (Llama-3.1-8B: 8 KV heads of 128 dims, fp16, page 16; by default 32K tokens,
batch 1, budget 2048, C 256, shared selection) replaying a synthetic trace that keeps R of each
step's pages:
  step + fill + attention   the sweep's row
  step alone                 the lookup, eviction and tail swap (graph replays advance it)
  step + fill                the misses read in place from host memory into their slots
  attention over the slots   the step's remapped selection, HBM only
and beside them the misses' bytes at the zero-copy ceiling measured in the run (the byte
model's link time). Us per layer: the median and the mean of the timed passes (the mean is of
the steps counted, as the sweep's mean_ms); the misses are counted over the timed passes only
(before 2026-12-03 the untimed passes too, and only the median was printed). Prints a short
table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

S = 16


def pools(layers: int, length: int, batch: int, budget: int, capacity: int, overlap: float,
          steps: int):
    """[(cache, q)] per layer: a host-tier pool with its page cache over the synthetic trace,
    warmed by one pass."""
    import cupy

    from questprof.backends.host_tier import host_tier
    from questprof.backends.page_cache_cupy import CupyPageCache
    from questprof.core.reuse_trace import synthetic
    from tools.host_tier_check import KV_HEADS, _pool

    rng, out = np.random.default_rng(3), []
    trace = synthetic([length] * batch, S, budget // S, KV_HEADS, steps, overlap, seed=0)
    sel, count = cupy.asarray(trace.sel), cupy.asarray(trace.count)
    for _ in range(layers):
        kv, q = _pool(rng, [length] * batch, spare=0)
        cache = CupyPageCache(host_tier(kv), sel, count, capacity)
        del kv
        for _ in range(steps):
            cache.step()
        out.append((cache, q))
    return out


def launches(cache, q, parts: str):
    """Launch `parts` of one step: s (step), f (fill), a (attention over the slots)."""
    from questprof.backends import cupy as ops

    if "s" in parts:
        cache.launch_step()
    if "f" in parts:
        cache.launch_fill()
    if "a" in parts:
        return ops.attention(q, cache.view, cache.tables["slot_sel"], cache.count)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(prog="tools/page_cache_probe.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=int, default=2048, help="tokens (K = budget / 16)")
    parser.add_argument("--overlap", type=float, default=0.82)
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=32)
    args = parser.parse_args()

    from questprof.backends import get_backend
    from questprof.measure.ceilings import measure_link_ceilings
    from questprof.measure.timing import time_layers

    backend = get_backend("cupy")
    layers = pools(args.layers, args.length, args.batch, args.budget, args.capacity,
                   args.overlap, args.steps)
    rows = {}
    for name, parts in (("step + fill + attention", "sfa"), ("step alone", "s"),
                        ("step + fill", "sf"), ("attention over the slots", "a")):
        timing = time_layers(backend, lambda i, p=parts: launches(*layers[i], p), args.layers,
                             repeats=args.repeats, graph=True,
                             timed=lambda: [cache.reset_counts() for cache, _ in layers])
        hits, misses, _ = (sum(x) for x in zip(*(cache.totals() for cache, _ in layers)))
        rows[name] = (timing.median * 1e3, float(np.mean(timing.samples_ms)) * 1e3,
                      misses / max(hits + misses, 1) if "s" in parts else float("nan"))
    cache = layers[0][0]
    page = 2 * S * cache.kv.head_dim * cache.kv.k.dtype.itemsize  # K and V, one KV head
    ceil = measure_link_ceilings()
    miss = rows["step + fill + attention"][2]
    link = miss * (args.budget // S) * cache.kv.kv_heads * args.batch * page
    link_us = link / (ceil["zero_copy_gbs"] * 1e3)
    print(f"link ceilings: copy {ceil['copy_gbs']:.1f} GB/s, zero-copy "
          f"{ceil['zero_copy_gbs']:.1f} GB/s; misses' bytes per layer {link / 1e6:.2f} MB")
    print("| launches | us per layer (median) | mean | miss rate |")
    print("|---|---:|---:|---:|")
    for name, (us, mean, rate) in rows.items():
        print(f"| {name} | {us:.1f} | {mean:.1f} | {rate:.3f} |")
    print(f"| misses' bytes at the zero-copy ceiling | {link_us:.1f} | - | {miss:.3f} |")


if __name__ == "__main__":
    main()
