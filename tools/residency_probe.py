"""Dense attention at the CTAs per SM its launch holds it to (variants.held_ring) against the same
launch left free (its ring alone as dynamic shared memory, so registers may fit more CTAs): for
each case of a bench file, the kernel's registers, the grid, the driver's occupancy of both, and
dense timed as CUDA-graph replays over cold per-layer pools (bench's protocol), us per layer.
--hold N holds every launch at N CTAs per SM instead of the launcher's rule.

    python tools/residency_probe.py [--cases FILE] [--hold 0] [--match 405b]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from questprof.commands.bench import load_bench  # noqa: E402  (after the path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=ROOT / "tests/fixtures/bench-gqa.toml")
    parser.add_argument("--hold", type=int, default=0,
                        help="CTAs per SM to hold every launch at (0: the launcher's rule)")
    parser.add_argument("--match", default="", help="only models whose name holds this")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    from questprof.backends import get_backend
    from questprof.workload.pools import release

    backend = get_backend("cupy")
    cases, _ = load_bench(args.cases)
    seen: set = set()
    print(f"{'case':<32}{'regs':>5}{'grid':>9}{'ring':>8}{'free':>5}{'us':>9}{'held':>7}"
          f"{'occ':>4}{'us':>9}{'ratio':>7}", flush=True)
    for cfg in cases:
        key = (cfg.model.name, cfg.length, cfg.batch)
        if args.match not in cfg.model.name or key in seen:
            continue
        seen.add(key)
        print(_probe(cfg, backend, args.hold, args.repeats), flush=True)
        release(backend)


def _probe(cfg, backend, hold: int, repeats: int) -> str:
    """One case's table line: dense left free, then held (the rule's, or at `hold` per SM)."""
    from questprof.backends import cupy as cb
    from questprof.backends import variants
    from questprof.commands.bench import _layers
    from questprof.measure.timing import time_layers
    from questprof.workload.pools import Workload

    rule, plain_load = variants.held_ring, cb.load_kernel
    layers = _layers(cfg, backend)
    launch = Workload(cfg, backend, layers).launcher("dense")
    seen: dict = {}

    def spy(run, rows, sms, regs, d, tile, kv, smem):
        fixed = variants.static_bytes(d, tile, kv) + variants.SMEM_RESERVED
        held = smem // (hold + 1) + 1 - fixed if hold else rule(run, rows, sms, regs, d, tile,
                                                                  kv, smem)
        seen.update(run=run, rows=rows, regs=regs, held=max(run.ring, held))
        return seen["held"] if seen.get("hold", True) else run.ring

    def loaded(stage, *a, **k):
        kernel = plain_load(stage, *a, **k)
        seen.setdefault(stage, kernel)
        return kernel

    cb.variants.held_ring, cb.load_kernel = spy, loaded
    try:
        seen["hold"] = False
        free = time_layers(backend, launch, layers, 3, repeats, True).median
        seen["hold"] = True
        held = time_layers(backend, launch, layers, 3, repeats, True).median
    finally:
        cb.variants.held_ring, cb.load_kernel = rule, plain_load
    if "attention" not in seen:
        return f"{cfg.model.name}: no attention launch was seen (nothing timed)"
    run, kernel = seen["run"], seen["attention"]
    name = f"{cfg.model.name[:18]} {cfg.length // 1024}K B{cfg.batch}"
    return (f"{name:<32}{seen['regs']:>5}{str(run.splits) + 'x' + str(seen['rows']):>9}"
            f"{run.ring:>8}{_occupancy(kernel, run.ring):>5}{free * 1e3:9.1f}{seen['held']:>7}"
            f"{_occupancy(kernel, seen['held']):>4}{held * 1e3:9.1f}{held / free:7.3f}")


def _occupancy(kernel, shared: int) -> int:
    """CTAs of attention's size the driver fits on an SM at `shared` bytes of dynamic shared
    memory."""
    from questprof.backends import variants
    from questprof.backends.pdl import _driver

    driver = _driver()
    err, n = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        driver.CUfunction(kernel.kernel.ptr), variants.ATT_WARPS * 32, int(shared))
    return int(n) if err == driver.CUresult.CUDA_SUCCESS else -1


if __name__ == "__main__":
    main()
