"""Dense attention with the CTAs per SM it runs at, against the same launch held to fewer: for each
case of a bench file, the kernel's registers and the driver's occupancy at the planned dynamic
shared memory, then dense timed as CUDA-graph replays over cold per-layer pools (bench's
protocol) at that occupancy and with the dynamic shared memory padded until only `--hold` CTAs
fit an SM (the grid and the splits unchanged), us per layer.

    python tools/residency_probe.py [--cases FILE] [--hold 2] [--match 405b]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from questprof.commands.bench import load_bench  # noqa: E402  (after the path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=ROOT / "tests/fixtures/bench-gqa.toml")
    parser.add_argument("--hold", type=int, default=2, help="CTAs per SM to hold the launch at")
    parser.add_argument("--match", default="", help="only models whose name holds this")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    from questprof.backends import get_backend
    from questprof.workload.pools import release

    backend = get_backend("cupy")
    cases, _ = load_bench(args.cases)
    seen: set = set()
    print(f"{'case':<34}{'regs':>5}{'grid':>10}{'ring':>8}{'occ':>4}{'us':>9}"
          f"{'held':>5}{'us':>9}{'ratio':>7}", flush=True)
    for cfg in cases:
        key = (cfg.model.name, cfg.length, cfg.batch)
        if args.match not in cfg.model.name or key in seen:
            continue
        seen.add(key)
        print(_probe(cfg, backend, args.hold, args.repeats), flush=True)
        release(backend)


def _probe(cfg, backend, hold: int, repeats: int) -> str:
    """One case's table line: dense at its own occupancy, then held to `hold` CTAs per SM."""
    from questprof.backends import cupy as cb
    from questprof.backends import variants
    from questprof.commands.bench import _layers
    from questprof.measure.timing import time_layers
    from questprof.workload.pools import Workload

    plain, plain_load = variants.attention_launch, cb.load_kernel
    layers = _layers(cfg, backend)
    work = Workload(cfg, backend, layers)
    launch = work.launcher("dense")
    launch(0)  # builds the kernel; the launch below is the one it ran
    shown: dict = {}

    def spy(*a, **k):
        run = plain(*a, **k)
        shown["run"], shown["args"] = run, (a, k)
        return run

    def loaded(stage, *a, **k):
        kernel = plain_load(stage, *a, **k)
        shown.setdefault(stage, kernel)
        return kernel

    cb.variants.attention_launch, cb.load_kernel = spy, loaded
    try:
        launch(0)
    finally:
        cb.variants.attention_launch, cb.load_kernel = plain, plain_load
    run, (a, _), kernel = shown["run"], shown["args"], shown["attention"]
    d, tile, kv_dtype = a[2], a[3], a[5]
    regs = kernel.num_regs
    occ = _occupancy(kernel, run.ring)
    natural = time_layers(backend, launch, layers, 3, repeats, True).median
    fixed = variants.static_bytes(d, tile, kv_dtype) + variants.SMEM_RESERVED
    held_ring = cb._smem_per_sm() // hold - fixed
    cb.variants.attention_launch = lambda *a, **k: dataclasses.replace(plain(*a, **k),
                                                                      ring=held_ring)
    try:
        launch(0)
        held_occ = _occupancy(kernel, held_ring)
        held = time_layers(backend, launch, layers, 3, repeats, True).median
    finally:
        cb.variants.attention_launch = plain
    grid = f"{run.splits}x{a[0]}"
    name = f"{cfg.model.name[:18]} {cfg.length // 1024}K B{cfg.batch}"
    return (f"{name:<34}{regs:>5}{grid:>10}{run.ring:>8}{occ:>4}{natural * 1e3:9.1f}"
          f"{held_occ:>5}{held * 1e3:9.1f}{held / natural:7.3f}")


def _occupancy(kernel, shared: int) -> int:
    """CTAs of 128 threads the driver fits on an SM at `shared` bytes of dynamic shared memory."""
    from questprof.backends.pdl import _driver

    driver = _driver()
    err, n = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        driver.CUfunction(kernel.kernel.ptr), 128, int(shared))
    return int(n) if err == driver.CUresult.CUDA_SUCCESS else -1


if __name__ == "__main__":
    main()
