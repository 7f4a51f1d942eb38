"""The top-K kernel at every built CTA size (QP_TUNE tk_threads, kernels/constants.cuh's
TK_THREAD_OPTIONS) side by side on the bench protocol, for the rows of a bench file's cases,
with the selections checked equal across sizes.

    python tools/topk_threads.py [--cases FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from questprof.backends import variants  # noqa: E402
from questprof.commands.bench import load_bench  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=None, help="bench file of the cases")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    import cupy
    import numpy as np

    from questprof.backends import get_backend
    from questprof.commands.bench import _layers
    from questprof.measure.timing import time_layers
    from questprof.workload.pools import Workload, release

    backend = get_backend("cupy")
    cases, _ = load_bench(*(() if args.cases is None else (args.cases,)))
    print("case rows x pages: " + " ".join(f"{n:>6}" for n in variants.TK_THREAD_OPTIONS)
          + "  us per layer (same selections)", flush=True)
    for cfg in cases:
        layers = _layers(cfg, backend)
        work = Workload(cfg, backend, layers)
        times, picks = [], []
        for n in variants.TK_THREAD_OPTIONS:
            os.environ["QP_TUNE"] = f"tk_threads={n}"
            launch = work.launcher("topk")
            picks.append(cupy.asnumpy(launch(0)[0]))
            times.append(time_layers(backend, launch, layers, 3, args.repeats, True).median)
        os.environ.pop("QP_TUNE")
        same = all(np.array_equal(p, picks[0]) for p in picks)
        rows = work.topk_scores[0].shape[0] * cfg.batch
        print(f"{cfg.model.name[:16]:>16} {cfg.length // 1024}K B{cfg.batch} {cfg.mode[:11]:<11} "
              f"{rows} x {cfg.pages}: " + " ".join(f"{t * 1e3:6.1f}" for t in times)
              + f"  {'same' if same else 'DIFFER'}", flush=True)
        del work
        release(backend)


if __name__ == "__main__":
    main()
