"""The other forms of our Quest step that `bench` times beside the default one
(commands/bench.py): estimate and top-K fused into one kernel (`ours-fused`, or `ours-3-kernels`
when the fused form is the backend's default) and the whole step as one persistent kernel
(`ours-persistent`, kernels/quest_step.cu), with what each gains over three kernels."""

from __future__ import annotations

from questprof.core import model
from questprof.results import OURS

FUSED, THREE_KERNELS, PERSISTENT = "ours-fused", "ours-3-kernels", "ours-persistent"
FORMS = (OURS, FUSED, THREE_KERNELS, PERSISTENT)  # our Quest step's rows


def fused_built(cfg) -> bool:
    """estimate_topk (the fused form) is built for this cache (16-bit) and head dim."""
    from questprof.backends.variants import FUSED_HEAD_DIMS

    return cfg.model.head_dim in FUSED_HEAD_DIMS and not cfg.model.is_fp8


def persistent_reason(cfg) -> str | None:
    """Why the persistent step does not run this configuration (None: it does)."""
    from questprof.backends.launch_args import persistent_problem

    m = cfg.model
    return persistent_problem(m.q_heads, m.kv_heads, m.head_dim, model.kv_dtype(m),
                              model.summary_dtype(m), cfg.mode, m.dtype)


def form_rows(cfg, backend, work, time, row, skipped) -> list[dict]:
    """Rows of our step's other forms on `work`: time(launch) times launch(layer), row(impl,
    timing) and skipped(impl, reason) build a row. The persistent form runs on the CuPy backend
    only; a shape it is not built for is a skipped row with the reason."""
    rows = []
    if hasattr(backend, "fused") and fused_built(cfg):
        other = not backend.fused
        rows.append(row(FUSED if other else THREE_KERNELS, time(
            lambda l: backend.quest(work.q, work.kvs[l], cfg.k_pages, cfg.mode, fused=other))))
        rows[-1]["pipeline"] = work.quest_path.rsplit(", ", 1)[0] + (
            ", fused" if other else ", 3 kernels")
    if backend.name != "cupy":
        return rows
    if (reason := persistent_reason(cfg)) is not None:
        return rows + [skipped(PERSISTENT, reason)]
    from questprof.backends.quest_step import quest_step, step_launcher

    launch = step_launcher()
    rows.append(row(PERSISTENT, time(lambda l: quest_step(work.q, work.kvs[l], cfg.k_pages,
                                                           cfg.mode, launch=launch))))
    rows[-1]["pipeline"] = f"{launch.path}, persistent"
    return rows


def form_gains(ours: dict, rows: list[dict]) -> None:
    """Beside our quest row `ours` (the default form): `fusion_gain` = 3-kernel time / fused time
    when a fused or 3-kernel row is there, `persistent_gain` = 3-kernel time / persistent time when
    a persistent row is (> 1: the persistent step is faster)."""
    timed = {r["impl"]: r["median_ms"] for r in rows if r["stage"] == "quest"
             and r.get("impl") in FORMS and r.get("median_ms")}
    if FUSED in timed:
        ours["fusion_gain"] = ours["median_ms"] / timed[FUSED]
    elif THREE_KERNELS in timed:
        ours["fusion_gain"] = timed[THREE_KERNELS] / ours["median_ms"]
    three = timed.get(THREE_KERNELS, ours["median_ms"])
    if PERSISTENT in timed:
        ours["persistent_gain"] = three / timed[PERSISTENT]
