"""bench's selector rows: each selector a case names (`selectors` in scenarios/bench.toml) run
by its kernel form (core.selectors.KernelForm, backends/cupy_selectors.py) over the case's own
pools and queries: estimate, topk, attention and the Quest step timed, the pages each row read
(mean, p95, max over score heads, requests and layers), the modelled bytes of the form
(core.selectors.form_work, attention at the mean pages read per KV head), the DRAM bytes CUPTI
measures where a PM-sampling session configures (else none, the reason in `note`), and the
step's speedup against the fastest dense of the case (bench.add_speedups). `impl` is the
selector's name; "quest" there is plain Quest on the same path, for a like-for-like row.
"""

from __future__ import annotations

import functools
import tomllib

import numpy as np

from questprof.core import selectors
from questprof.core.config import Config, ConfigError, ModelShape
from questprof.core.layout import append_plan
from questprof.measure import cupti, dram

STAGES = ("estimate", "topk", "attention", "quest")


def selectors_of(path) -> dict[str, tuple[str, ...]]:
    """Config key -> the selectors a case of the bench file names (cases without: absent), each
    name checked (`check`); a case runs each of its modes (bench.load_bench)."""
    data = tomllib.loads(open(path, encoding="utf-8").read())
    models = {name: ModelShape(name=name, **m) for name, m in data.get("models", {}).items()}
    out = {}
    for case in data.get("case", []):
        names = tuple(case.get("selectors", ()))
        check(names)
        for mode in case.get("modes", ["per-head"]) if names else ():
            cfg = Config(models[case["model"]], case["length"], case["batch"],
                         case["page_size"], case["budget"], mode)
            out[cfg.key()] = names
    return out


def check(names) -> None:
    """ConfigError unless every name is a selector with a kernel form."""
    for name in names:
        if selectors.parse(name).kernel_form is None:
            raise ConfigError(f"bench: selector {name!r} has no kernel form (the NumPy reference "
                              f"only): kernels run {selectors.name_list(kernel=True)}")


def pages_read(picks, group: int) -> dict:
    """pages_read (mean distinct pages per (request, KV head), what attention reads), and over
    score rows its mean, p95 and max, from per-layer (sel [Hs, B, K], count)."""
    per_row, union = [], []
    for sel, count in picks:
        count = np.broadcast_to(count if count.ndim == 2 else count[None], sel.shape[:2])
        per_row.append(count.ravel())
        rows = group if sel.shape[0] % group == 0 and group > 1 else 1
        for h in range(0, sel.shape[0], rows):
            for b in range(sel.shape[1]):
                chosen = [sel[x, b, : count[x, b]] for x in range(h, h + rows)]
                union.append(len(np.unique(np.concatenate(chosen))))
    rows = np.concatenate(per_row)
    return {"pages_read": float(np.mean(union)), "pages_read_row_mean": float(rows.mean()),
            "pages_read_p95": float(np.percentile(rows, 95)), "pages_read_max": int(rows.max())}


@functools.cache
def _cupti_reason() -> str | None:
    ok, why = cupti.available()
    return None if ok else why


def _measured(launch, calls: int, median_ms: float | None) -> dict:
    """CUPTI's read / write bytes per call of launch(layer) over a cold rotation, or why none."""
    why = _cupti_reason()
    if why is None:
        try:
            read, write = dram.stage_bytes("cupti", launch, calls,
                                           pass_ms=(median_ms or 0) * calls or None)
            return {"measured_read_bytes": read, "measured_write_bytes": write,
                    "bytes_source": "cupti"}
        except Exception as exc:  # a session that fails here: the row keeps its time
            why = f"CUPTI: {type(exc).__name__}: {exc}"[:200]
    return {"bytes_reason": why}


def _launchers(cfg, work, form):
    """(launch(layer) per stage, pages read): the form's summaries, scores and selections of
    every layer prepared first, as Workload prepares plain Quest's."""
    from questprof.backends import cupy_selectors as forms

    b, q, kvs = work.backend, work.q, work.kvs
    host = [b.to_host(x) for x in (kvs[0].kv_indptr, kvs[0].kv_indices, kvs[0].last_page_len)]
    plan = append_plan(*host, list(kvs[0].lengths), cfg.page_size)
    fss = [forms.summaries(kv, form, plan) for kv in kvs]
    scores = [forms.estimate(q, kv, fs, cfg.mode) for kv, fs in zip(kvs, fss)]
    picks = [forms.topk(s, kv, cfg.k_pages, form) for s, kv in zip(scores, kvs)]
    stats = pages_read([tuple(b.to_host(x) for x in p) for p in picks], cfg.model.group
                       if cfg.mode == "per-head" else 1)
    return {
        "estimate": lambda l: forms.estimate(q, kvs[l], fss[l], cfg.mode),
        "topk": lambda l: forms.topk(scores[l], kvs[l], cfg.k_pages, form),
        "attention": lambda l: b.attention(q, kvs[l], *picks[l]),
        "quest": lambda l: forms.quest(q, kvs[l], fss[l], cfg.k_pages, cfg.mode,
                                       launch=b.launch),
    }, stats


def selector_rows(cfg, names, work, time, row) -> list[dict]:
    """Rows of each selector of `names` on a case's Workload: time(launch) -> Timing,
    row(stage, impl, timing, work, **extra) -> a bench row."""
    out = []
    for name in names:
        form = selectors.parse(name).kernel_form
        launches, stats = _launchers(cfg, work, form)
        modelled = selectors.form_work(cfg, form, stats["pages_read"])
        for stage in STAGES:
            timing = time(launches[stage])
            median = timing.summary().get("median_ms")
            extra = _measured(launches[stage], work.layers, median)
            if extra.get("measured_read_bytes") and modelled[stage].total_read:
                extra["bytes_ratio"] = extra["measured_read_bytes"] / modelled[stage].total_read
            out.append(row(stage, name, timing, modelled[stage], selector=name, **stats, **extra))
        del launches
        work.backend.synchronize()
    return out
