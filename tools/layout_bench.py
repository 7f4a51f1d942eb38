"""Token-major pages (NHD) beside head-major ones (HND) on one GPU: for each case of a bench file,
the Workload's per-layer pools as they are (HND) and as token-major copies (PagedKV.token_major),
dense attention and the Quest step of each checked equal bit for bit on layer 0, then both timed
as CUDA-graph replays over the cold per-layer pools (bench's protocol), us per layer, with the
read ceiling measured first in the same process. Half the cold layers bench would take (the
token-major copies take the other half); host-tier cases are left out. The head-major launches
keep their own builds (a page size as a template argument where measured), the token-major
ones take the page size at launch: the ratio holds both differences.

    python tools/layout_bench.py [--cases FILE] [--repeats 20]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from questprof.commands.bench import load_bench  # noqa: E402  (after the path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=ROOT / "tests/fixtures/bench-gqa.toml")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    from questprof.backends import get_backend
    from questprof.backends.variants import layout_problem
    from questprof.core import model, tier
    from questprof.measure.ceilings import measure_ceilings
    from questprof.workload.pools import release

    backend = get_backend("cupy")
    ceiling = measure_ceilings(backend)["read_gbs"]
    cases, _ = load_bench(args.cases)
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    print(f"{'case':<40}{'stage':>7}{'HND us':>9}{'NHD us':>9}{'NHD/HND':>9}  bits", flush=True)
    for cfg in cases:
        m = cfg.model
        if layout_problem("NHD", m.dtype, model.kv_dtype(m), model.summary_dtype(m),
                          m.head_dim) or tier.kv_tier(cfg) == "host":
            continue  # not built for token-major pages, or pools in host memory
        for line in _case(backend, cfg, args.repeats):
            print(line, flush=True)
        release(backend)


def _case(backend, cfg, repeats: int) -> list[str]:
    """Table lines of one case: dense and the Quest step over both layouts."""
    import numpy as np

    from questprof.commands.bench import _layers
    from questprof.measure.timing import time_layers
    from questprof.workload.pools import Workload

    layers = max(1, _layers(cfg, backend) // 2)  # the copies take the other half
    work = Workload(cfg, backend, layers)
    q, hnd = work.q, work.kvs
    nhd = [replace(kv.token_major(), summary=kv.summary) for kv in hnd]
    steps = {"dense": lambda kvs, layer: backend.attention(q, kvs[layer]),
             "quest": lambda kvs, layer: backend.quest(q, kvs[layer], cfg.k_pages, cfg.mode)}
    name = f"{cfg.model.name[:18]} {cfg.length // 1024}K B{cfg.batch} {cfg.mode}"
    lines = []
    for stage, run in steps.items():
        same = all(np.array_equal(backend.to_host(a), backend.to_host(b))
                   for a, b in zip(run(hnd, 0), run(nhd, 0)))
        t = [time_layers(backend, _bound(run, kvs), layers, 3, repeats, True).median
             for kvs in (hnd, nhd)]
        lines.append(f"{name:<40}{stage:>7}{t[0] * 1e3:9.1f}{t[1] * 1e3:9.1f}{t[1] / t[0]:9.3f}"
                     f"  {'equal' if same else 'DIFFER'}")
    return lines


def _bound(run, kvs):
    """launch(layer) of `run` over the pools kvs."""
    return lambda layer: run(kvs, layer)


if __name__ == "__main__":
    main()
