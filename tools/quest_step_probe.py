"""Where the persistent Quest step's time goes: `python3 tools/quest_step_probe.py` on a GPU
(about 1-2 minutes on an H200, most of it NVRTC builds).

On bench's two batch-1 cases (scenarios/bench.toml, quick: MHA 32 heads, d 128, fp16, page 16;
32K budget 2048 and 128K budget 4096), with bench's timing protocol (CUDA graphs over a cold pass
of per-layer pools: commands/bench.py's layers, workload/pools.py, measure/timing.py), it times
  - the three-kernel step and its stages alone (estimate, topk, attention), from the same pools;
  - each build of launch_args.TUNINGS (threads per CTA, CTAs per SM,
    and CTAs that start on the queue, a launch argument) three ways: its estimate alone, estimate
    and select tickets, the whole step.
Every (build, phase) is first checked on layer 0 against the three-kernel step (scores, or
selection and count, bit for bit; out within 2e-3): one that fails prints why and is not timed.
Prints one table last: us per layer, medians.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from questprof.backends.launch_args import STOPS, TUNINGS  # noqa: E402

REPEATS = 10
PHASES = ("estimate", "select", "all")  # STOPS: est tickets only, + select tickets, the step
STAGE_ROWS = {"estimate alone": ("estimate", "estimate"), "topk alone": ("select", "topk"),
              "attention alone": ("all", "attention"), "three-kernel step": ("all", "quest")}
assert set(PHASES) == set(STOPS)


def bench_cases() -> list:
    """bench --quick's batch-1 cases of the MHA model."""
    from questprof.commands.bench import load_bench

    cases, _ = load_bench(quick=True)
    return [c for c in cases if c.batch == 1 and c.model.name == "mha-32h-d128"]


def mismatch(backend, work, tuning, phase: str) -> str | None:
    """Why the build's `phase` differs from the three-kernel step on layer 0 (None: it agrees)."""
    from questprof.backends.quest_step import step_outputs

    cfg, kv = work.cfg, work.kvs[0]
    try:
        out, _, sel, count, scores = step_outputs(work.q, kv, cfg.k_pages, cfg.mode,
                                                  tuning=tuning, stop=phase)
        backend.synchronize()
    except Exception as exc:  # a build error or a launch failure: reported, not timed
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"
    host = backend.to_host
    if phase == "estimate":
        return None if np.array_equal(host(scores), host(work.scores[0])) else "scores differ"
    want_sel, want_count = (host(x) for x in work.selections[0])
    if not (np.array_equal(host(sel), want_sel) and np.array_equal(host(count), want_count)):
        return "selection differs"
    if phase == "all":
        want = host(backend.attention(work.q, kv, *work.selections[0])[0]).astype(np.float64)
        err = np.abs(host(out).astype(np.float64) - want).max() / max(np.abs(want).max(), 1e-30)
        return None if err < 2e-3 else f"out differs ({err:.1e})"
    return None


def case_times(backend, cfg) -> dict:
    """{(row, phase): us or 'reason'} of one case."""
    from questprof.backends.quest_step import step_launcher, step_outputs
    from questprof.commands.bench import _layers
    from questprof.measure.timing import time_layers
    from questprof.workload.pools import Workload, release

    layers = _layers(cfg, backend)
    work = Workload(cfg, backend, layers)
    us = lambda launch: time_layers(backend, launch, layers, 3, REPEATS,  # noqa: E731
                                    True).summary()["median_ms"] * 1e3
    got = {(row, phase): us(work.launcher(stage)) for row, (phase, stage) in STAGE_ROWS.items()}
    launch = step_launcher()
    for name, tuning in TUNINGS.items():
        for phase in PHASES:
            why = mismatch(backend, work, tuning, phase)
            got[name, phase] = why or us(lambda l, t=tuning, p=phase: step_outputs(
                work.q, work.kvs[l], cfg.k_pages, cfg.mode, launch=launch, tuning=t, stop=p))
            if why:
                print(f"{cfg.length // 1024}K {name} {phase}: {why}", flush=True)
    for name in TRACED:
        print(timeline(backend, work, cfg, name), flush=True)
    del work
    release(backend)
    return got


TRACED = ("default", "threads-128x3")  # the builds whose timeline is printed


def timeline(backend, work, cfg, name: str) -> str:
    """One traced launch of a build (layer 1, after layer 0): when its phases start and end, us
    from the first CTA's start (StepTrace of backends/quest_step.py)."""
    from questprof.backends.quest_step import StepTrace, step_outputs

    tuning, tr = TUNINGS[name], StepTrace()
    step_outputs(work.q, work.kvs[0], cfg.k_pages, cfg.mode, tuning=tuning)
    step_outputs(work.q, work.kvs[1], cfg.k_pages, cfg.mode, tuning=tuning, trace=tr)
    backend.synchronize()
    w = backend.to_host(tr.words).astype(np.int64)
    cta, tk = w[:3 * tr.grid].reshape(-1, 3), w[3 * tr.grid:].reshape(-1, 3)
    t0 = cta[:, 0].min()
    us = lambda x: (x - t0) / 1e3  # noqa: E731
    q = min(tuning.queue_ctas, tr.grid - 1)
    est, sel, att = cta[q:, 1], tk[:tr.selects], tk[tr.selects:]
    pct = lambda x: "/".join(f"{us(v):.1f}" for v in np.percentile(x, [0, 50, 100]))  # noqa
    wait = (att[:, 1] - att[:, 0]).sum() / max(1, (att[:, 2] - att[:, 0]).sum())
    return (f"{cfg.length // 1024}K {name}: CTAs start by {us(cta[:, 0].max()):.1f}; estimate "
            f"shares end {pct(est)} (min/median/max); rows scored {pct(sel[:, 1])}, selected "
            f"{pct(sel[:, 2])}; attention tickets start {pct(att[:, 0])}, rows ready for them "
            f"{pct(att[:, 1])}, end {pct(att[:, 2])} ({wait:.0%} of their time waiting); "
            f"kernel ends {us(cta[:, 2].max()):.1f}")


def prebuild(cfg) -> None:
    """NVRTC builds of every tuning, several at once (each is seconds)."""
    from questprof.backends import cupy as ops
    from questprof.backends.quest_step import STAGE, step_launcher

    expression, early = f"quest_step_kernel<fp16, {cfg.model.head_dim}, 1>", step_launcher()
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda t: _try(ops.load_kernel, STAGE, expression,
                                     early.defines(STAGE) + t.defines()), TUNINGS.values()))


def _try(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # the check before timing reports it
        pass


def table(cases: list, results: list[dict]) -> list[str]:
    """Markdown: one row per stage alone and per build, columns (case, phase)."""
    cols = [f"{c.length // 1024}K {p}" for c in cases for p in ("est", "est+select", "step")]
    lines = ["| build | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for row in [*STAGE_ROWS, *TUNINGS]:
        cells = []
        for got in results:
            for phase in PHASES:
                x = got.get((row, phase))
                cells.append("" if x is None else f"{x:.1f}" if isinstance(x, float) else "fail")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options: --help
    from questprof.backends import get_backend

    start, backend, cases = time.perf_counter(), get_backend("cupy"), bench_cases()
    prebuild(cases[0])
    print(f"builds ready in {time.perf_counter() - start:.0f} s", flush=True)
    results = [case_times(backend, cfg) for cfg in cases]
    print(f"probe done in {time.perf_counter() - start:.0f} s; us per layer, median of "
          f"{REPEATS} CUDA-graph replays of a cold pass; builds: " + "; ".join(
              f"{n} {' '.join(t.defines()) or '(PS_* defaults)'} queue CTAs {t.queue_ctas} "
              f"attention waves {t.att_waves}"
              for n, t in TUNINGS.items()))
    print("\n".join(table(cases, results)))


if __name__ == "__main__":
    main()
