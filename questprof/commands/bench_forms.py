"""The other forms of our Quest step that `bench` times beside the backend's default one
(commands/bench.py): the step's forms of backends/cupy.py (STEP_FORMS: `ours-2-kernels`, the
estimate and attention whose CTAs select their pages; `ours-3-kernels`, with a top-K kernel
between; `ours-fused`, estimate and top-K as one kernel) and the whole step as one persistent
kernel (`ours-persistent`, kernels/quest_step.cu), with what each gains over three kernels."""

from __future__ import annotations

from questprof.core import model
from questprof.results import OURS

# impl of each step form's row (the keys of backends/cupy.py's STEP_FORMS, whose labels end
# quest_path: '2 kernels', '3 kernels', 'fused')
FORM_IMPLS = {"select": "ours-2-kernels", "topk": "ours-3-kernels", "fused": "ours-fused"}
FORM_LABELS = {"2 kernels": "select", "3 kernels": "topk", "fused": "fused"}
SELECT, THREE_KERNELS, FUSED = (FORM_IMPLS[f] for f in ("select", "topk", "fused"))
PERSISTENT = "ours-persistent"
FORMS = (OURS, *FORM_IMPLS.values(), PERSISTENT)  # our Quest step's rows
DEFAULT_FORM = "select"  # the form of a row that names none (backends/cupy.py's default)


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
    timing) and skipped(impl, reason) build a row. They run on the CuPy backend only; a shape a
    form is not built for is a skipped row with the reason."""
    if backend.name != "cupy":
        return []
    rows, path = [], work.quest_path.rsplit(", ", 1)[0]
    labels = {form: label for label, form in FORM_LABELS.items()}
    for form, impl in FORM_IMPLS.items():
        if form == backend.form:
            continue
        if form == "fused" and not fused_built(cfg):
            rows.append(skipped(impl, "estimate_topk is built for 16-bit caches of head dims "
                                      "64 and 128"))
            continue
        rows.append(row(impl, time(lambda l, f=form: backend.quest(
            work.q, work.kvs[l], cfg.k_pages, cfg.mode, form=f))))
        rows[-1]["pipeline"] = f"{path}, {labels[form]}"
    if (reason := persistent_reason(cfg)) is not None:
        return rows + [skipped(PERSISTENT, reason)]
    from questprof.backends.quest_step import quest_step, step_launcher

    launch = step_launcher()
    rows.append(row(PERSISTENT, time(lambda l: quest_step(work.q, work.kvs[l], cfg.k_pages,
                                                           cfg.mode, launch=launch))))
    rows[-1]["pipeline"] = f"{launch.path}, persistent"
    return rows


def ours_form(ours: dict) -> str:
    """The step form of our quest row: the label its pipeline ends with, else the default."""
    label = str(ours.get("pipeline") or "").rsplit(", ", 1)[-1]
    return FORM_LABELS.get(label, DEFAULT_FORM)


def form_gains(ours: dict, rows: list[dict]) -> None:
    """Beside our quest row `ours`: the 3-kernel time (ours, or the ours-3-kernels row) over each
    other form's time: `select_gain` (2 kernels), `fusion_gain` (fused) and `persistent_gain`
    (> 1: that form is faster than three kernels)."""
    timed = {r["impl"]: r["median_ms"] for r in rows if r["stage"] == "quest"
             and r.get("impl") in FORMS and r.get("median_ms")}
    timed[FORM_IMPLS[ours_form(ours)]] = ours["median_ms"]
    three = timed.get(THREE_KERNELS)
    if three is None:
        return
    for impl, column in ((SELECT, "select_gain"), (FUSED, "fusion_gain"),
                         (PERSISTENT, "persistent_gain")):
        if impl in timed:
            ours[column] = three / timed[impl]
