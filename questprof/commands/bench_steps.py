"""The other implementation of our Quest step that `bench` times beside the default three
kernels (commands/bench.py): the whole step as one persistent kernel (`ours-persistent`,
kernels/quest_step.cu), with what it gains over three kernels. Two implementations measured
slower everywhere left the code (notes/KERNELS.md): estimate and top-K as one kernel, and
attention whose CTAs selected their own pages."""

from __future__ import annotations

from questprof.core import model
from questprof.results import OURS

PERSISTENT = "ours-persistent"
STEP_IMPLS = (OURS, PERSISTENT)  # the impl of each of our Quest step's rows


def persistent_reason(cfg) -> str | None:
    """Why the persistent step does not run this configuration (None: it does)."""
    from questprof.backends.launch_args import persistent_problem

    m = cfg.model
    return persistent_problem(m.q_heads, m.kv_heads, m.head_dim, model.kv_dtype(m),
                              model.summary_dtype(m), cfg.mode, m.dtype)


def step_rows(cfg, backend, work, time, row, skipped) -> list[dict]:
    """Rows of our step's other implementation on `work`: time(launch) times launch(layer),
    row(impl, timing) and skipped(impl, reason) build a row. The persistent step runs on the
    CuPy backend only; a shape it is not built for is a skipped row with the reason."""
    if backend.name != "cupy":
        return []
    if (reason := persistent_reason(cfg)) is not None:
        return [skipped(PERSISTENT, reason)]
    from questprof.backends.quest_step import quest_step, step_launcher

    launch = step_launcher()
    rows = [row(PERSISTENT, time(lambda l: quest_step(work.q, work.kvs[l], cfg.k_pages,
                                                       cfg.mode, launch=launch)))]
    rows[-1]["pipeline"] = f"{launch.path}, persistent"
    return rows


def step_gains(ours: dict, rows: list[dict]) -> None:
    """Beside our quest row `ours` (three kernels): `persistent_gain` = 3-kernel time /
    persistent time when a persistent row is there (> 1: the persistent step is faster)."""
    timed = [r["median_ms"] for r in rows if r["stage"] == "quest"
             and r.get("impl") == PERSISTENT and r.get("median_ms")]
    if timed:
        ours["persistent_gain"] = ours["median_ms"] / timed[0]
