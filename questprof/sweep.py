"""Grid -> configurations -> result rows (one per configuration x stage), on disk as they finish.

Each configuration gets a cold-cache set of KV pools, one per simulated layer: on a GPU enough
layers that a pass of its smallest timed stage reads >= 8x the L2 (measure.timing.cold_layers),
within half the free memory; on the NumPy backend one. Summaries are built by the `summary`
stage over a prefill plan, then each stage is timed over a pass of all layers
(measure.timing.time_layers).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

from questprof import model
from questprof.config import ConfigError
from questprof.layout import (TILE, AppendPlan, PagedKV, append_plan, page_tables,
                              random_queries, tiled, to_storage)
from questprof.measure.timing import cold_layers, time_layers
from questprof.results import STAGE_ORDER, ResultsWriter, done_keys, now, read_rows

STAGES = STAGE_ORDER  # summary, estimate, topk, attention, dense, then quest from their times
POOL_FRACTION = 0.5  # simulated layers' pools take at most half the free device memory
L2_DEFAULT = 60 * 1024 * 1024  # H200, when the device's own figure is unknown
ALIGN = 256  # layer offsets into the tile, in elements: keeps every pool 512-byte aligned
FREE_FRACTION = 0.9  # use at most this share of free memory
HOST_COPIES = 6  # NumPy backend: the pool, and float64 copies of K and V in reference.attention
DENSE_REASON = "budget >= length: Quest selects every page, so it runs dense attention"
# Stages whose work does not depend on these fields: timed once per run and shared by the
# configurations that differ only there (a 4-budget grid times dense once, not 4 times).
SHARED_OVER = {"summary": ("budget", "mode"), "dense": ("budget", "mode"), "estimate": ("budget",)}
Progress = Callable[[dict, int, int], None]


@dataclass
class Prepared:
    """Pools of every simulated layer, decode queries, and what each stage reads."""

    kvs: list[PagedKV]
    q: object
    decode_plan: AppendPlan
    scores: list
    selections: list
    union_pages: float | None


def _xp(backend):
    """The array module of the backend (cupy on a GPU, numpy otherwise)."""
    if backend.is_gpu:
        import cupy

        return cupy
    return np


def is_out_of_memory(exc: BaseException) -> bool:
    """MemoryError, CuPy's OutOfMemoryError, or a CUDA allocation failure."""
    return (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            or "cudaErrorMemoryAllocation" in str(exc))


def _release(backend) -> None:
    """Give cached device blocks back so the next configuration sees the free memory."""
    if backend.is_gpu:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()


def _l2_bytes() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"])
    except Exception:  # no CuPy here: the H200's figure
        return L2_DEFAULT


def sim_layers(cfg, backend, layers: int | None = None) -> int:
    """Layers of the timed pass: `layers` if given, 1 on a CPU backend, else a cold pass
    (measure.timing.cold_layers) within the free device memory."""
    if layers is not None:
        if layers < 1:
            raise ConfigError(f"layers {layers} must be at least 1")
        return layers
    if not backend.is_gpu:
        return 1
    free = free_bytes(backend)
    budget = POOL_FRACTION * free if free is not None else model.kv_pool_bytes(cfg)
    return cold_layers(cfg, _l2_bytes(), budget)


def _host_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def free_bytes(backend) -> int | None:
    """Free memory in bytes where the pools live: the GPU's (CuPy's cached blocks included),
    or the host's available memory for a CPU backend; None when unknown."""
    if not backend.is_gpu:
        return _host_available()
    import cupy

    pool = cupy.get_default_memory_pool()
    return int(cupy.cuda.runtime.memGetInfo()[0]) + int(pool.free_bytes())


def fit_reason(cfg, backend, layers: int) -> str | None:
    """Why `layers` pools of cfg do not fit in free memory, or None when they do."""
    free = free_bytes(backend)
    if free is None:
        return None
    copies = 1 if backend.is_gpu else HOST_COPIES
    need = copies * layers * model.kv_pool_bytes(cfg) + 4 * TILE * 4
    if need <= FREE_FRACTION * free:
        return None
    gib, where = 1 << 30, "GPU" if backend.is_gpu else "host"
    return (f"needs {need / gib:.1f} GiB of {where} memory for {layers} layer(s), "
            f"{free / gib:.1f} GiB free")


def _device_plan(backend, plan: AppendPlan) -> AppendPlan:
    return AppendPlan(*(backend.asarray(a) for a in (plan.page_ids, plan.first, plan.end)))


def union_pages(sel, count, group: int) -> float:
    """Mean distinct pages per (request, KV head) over the per-head selections sel [Hq, B, K]."""
    sel, count = np.asarray(sel), np.asarray(count)
    q_heads, batch, _ = sel.shape
    sizes = [len(np.unique(sel[h:h + group, b, :count[b]]))
             for h in range(0, q_heads, group) for b in range(batch)]
    return float(np.mean(sizes))


def _pools(cfg, backend, layers: int, rng) -> tuple[list[PagedKV], np.ndarray]:
    """Random K/V pools for each layer, sharing one page table; summaries built by prefill."""
    m, xp, lengths = cfg.model, _xp(backend), [cfg.length] * cfg.batch
    n = cfg.batch * cfg.pages
    tables = page_tables(lengths, cfg.page_size, n, rng)
    tile = backend.asarray(to_storage(rng.standard_normal(TILE, dtype=np.float32), m.dtype))
    nan = to_storage(np.array([np.nan]), m.dtype)[0]
    shape = (n, m.kv_heads, cfg.page_size, m.head_dim)
    prefill = _device_plan(backend, append_plan(*tables, lengths, cfg.page_size))
    kvs = []
    for layer in range(layers):
        k, v = (tiled(xp, tile, shape, ALIGN * (2 * layer + i)) for i in (0, 1))
        summ = xp.full((n, m.kv_heads, 2, m.head_dim), nan, dtype=tile.dtype)
        kv = backend.put(PagedKV(k, v, summ, *(backend.asarray(t) for t in tables),
                                 tuple(lengths), cfg.page_size, m.dtype))
        backend.summary(kv, prefill)
        kvs.append(kv)
    return kvs, tables


def prepare(cfg, backend, layers: int) -> Prepared:
    """Pools, queries, the one-token decode plan, and (unless the budget is dense) each layer's
    scores and selections, which topk and attention read."""
    rng = np.random.default_rng(cfg.seed)
    kvs, tables = _pools(cfg, backend, layers, rng)
    m = cfg.model
    q = backend.asarray(random_queries(rng, cfg.batch, m.q_heads, m.head_dim, m.dtype))
    decode = _device_plan(backend, append_plan(*tables, [1] * cfg.batch, cfg.page_size))
    scores, selections, union = [], [], None
    if not cfg.is_dense_budget:
        scores = [backend.estimate(q, kv, cfg.mode) for kv in kvs]
        selections = [backend.topk(s, kv, cfg.k_pages) for s, kv in zip(scores, kvs)]
        if cfg.mode == "per-head" and m.group > 1:
            sel, count = selections[0]
            union = union_pages(backend.to_host(sel), backend.to_host(count), m.group)
    backend.synchronize()
    return Prepared(kvs, q, decode, scores, selections, union)


def runner(stage: str, backend, cfg, prep: Prepared) -> Callable[[int], object]:
    """run_layer(l) that launches `stage` on layer l."""
    kvs, q = prep.kvs, prep.q
    return {
        "summary": lambda l: backend.summary(kvs[l], prep.decode_plan),
        "estimate": lambda l: backend.estimate(q, kvs[l], cfg.mode),
        "topk": lambda l: backend.topk(prep.scores[l], kvs[l], cfg.k_pages),
        "attention": lambda l: backend.attention(q, kvs[l], *prep.selections[l]),
        "dense": lambda l: backend.attention(q, kvs[l]),
    }[stage]


def _clocks(backend) -> dict:
    """sm_clock_mhz, mem_clock_mhz, throttled from NVML now (None each when unavailable)."""
    out = dict.fromkeys(("sm_clock_mhz", "mem_clock_mhz", "throttled"))
    if not backend.is_gpu:
        return out
    try:
        from questprof.measure import nvml

        snap = nvml.snapshot()
    except Exception:  # NVML absent or broken: rows carry None, the doctor says why
        return out
    return {k: snap.get(k) for k in out}


def make_row(scenario: str, cfg, stage: str, backend, layers: int, timing: dict | None,
             union: float | None, status: str = "ok", reason: str | None = None) -> dict:
    """One result row (notes/CONTRACTS.md); timing holds median/p20/p80/p95_ms, method, clocks."""
    works = model.stage_work(cfg, union)
    dense = cfg.is_dense_budget and stage == "quest"
    work = works["dense"] if dense else (model.quest_work(cfg, union) if stage == "quest"
                                         else works[stage])
    timing = dict(timing or {})
    median = timing.get("median_ms")
    row = {"scenario": scenario, **cfg.as_dict(), "stage": stage, "backend": backend.name,
           "method": timing.get("method"),
           **{k: timing.get(k) for k in ("median_ms", "p20_ms", "p80_ms", "p95_ms")},
           "read_bytes": work.read, "unmodelled_bytes": work.unmodelled_read,
           "write_bytes": work.write, "flops": work.flops,
           "bandwidth_gbs": work.total_bytes / (median * 1e-3) / 1e9 if median else None,
           "measured_read_bytes": None, "measured_write_bytes": None, "bytes_source": None,
           "rho_formula": model.rho(cfg.page_size, cfg.k_pages, cfg.pages),
           "rho_model": model.quest_rho(cfg, union),
           **{k: timing.get(k) for k in ("sm_clock_mhz", "mem_clock_mhz", "throttled")},
           "status": status, "reason": reason,
           "config_key": cfg.key(), "sim_layers": layers, "read_is_bound": work.bound}
    return row


def _quest_timing(cfg, timings: dict) -> tuple[dict | None, str | None]:
    """The quest row's timing: estimate + topk + attention (each percentile summed), or dense;
    clocks are the lowest of the parts' and throttled if any part was."""
    parts = ("dense",) if cfg.is_dense_budget else model.QUEST_STAGES
    missing = [p for p in parts if timings.get(p) is None]
    if missing:
        return None, f"no timing of {', '.join(missing)}"
    out = {k: sum(timings[p][k] for p in parts)
           for k in ("median_ms", "p20_ms", "p80_ms", "p95_ms")}
    out["method"] = timings[parts[0]]["method"]
    for key, pick in (("sm_clock_mhz", min), ("mem_clock_mhz", min), ("throttled", any)):
        seen = [timings[p].get(key) for p in parts if timings[p].get(key) is not None]
        out[key] = pick(seen) if seen else None
    return out, None


def _time_stage(stage, backend, cfg, prep, layers, opts) -> tuple[dict | None, str | None]:
    """(timing dict, None) or (None, reason) when the stage ran out of memory."""
    try:
        t = time_layers(backend, runner(stage, backend, cfg, prep), layers, **opts)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        _release(backend)
        return None, f"out of memory timing {stage}: {type(exc).__name__}"
    return {**t.summary(), "method": t.method, **_clocks(backend)}, None


def _previous(key: str, rows: list[dict]) -> dict:
    """Timings of stages of `key` already on disk (for the quest row of a resumed config)."""
    cols = ("median_ms", "p20_ms", "p80_ms", "p95_ms", "method", "sm_clock_mhz",
            "mem_clock_mhz", "throttled")
    return {r["stage"]: {c: r.get(c) for c in cols} for r in rows
            if r.get("config_key") == key and r.get("status") == "ok"}


def _prepare_or_reason(cfg, backend, layers: int) -> tuple[Prepared | None, str | None]:
    """(Prepared, None), or (None, why) when the pools do not fit in memory."""
    reason = fit_reason(cfg, backend, layers)
    if reason is not None:
        return None, reason
    try:
        return prepare(cfg, backend, layers), None
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        _release(backend)
        return None, f"out of memory building {layers} layer(s): {type(exc).__name__}"


def shared_key(cfg, stage: str) -> tuple | None:
    """Key under which `stage` of cfg shares its timing with other configurations, or None."""
    if stage not in SHARED_OVER:
        return None
    fields = cfg.as_dict()
    return (stage, *((k, v) for k, v in sorted(fields.items()) if k not in SHARED_OVER[stage]
                     and k != "k_pages"))


def config_rows(scenario: str, cfg, backend, todo, layers=None, opts=None, previous=None,
                shared=None):
    """Yield the rows of stages `todo` of one configuration, each as soon as it is timed.

    previous: {stage: timing} already on disk, for the quest row of a resumed configuration.
    shared: {shared_key: timing} of this run, read and filled for the stages in SHARED_OVER.
    """
    shared = {} if shared is None else shared
    layers = sim_layers(cfg, backend, layers)
    prep, reason = _prepare_or_reason(cfg, backend, layers)
    union = prep.union_pages if prep else None
    timings = dict(previous or {})

    def row(stage, timing, why=None, status="ok"):
        return make_row(scenario, cfg, stage, backend, layers, timing, union, status, why)

    for stage in todo:
        if prep is None:
            yield row(stage, None, reason, "skipped")
        elif stage == "quest":
            timing, why = _quest_timing(cfg, timings)
            note = DENSE_REASON if cfg.is_dense_budget else None
            yield row(stage, timing, note) if timing else row(stage, None, why, "skipped")
        elif cfg.is_dense_budget and stage in model.QUEST_STAGES:
            yield row(stage, None, DENSE_REASON, "skipped")
        elif shared.get(shared_key(cfg, stage)) is not None:
            timings[stage] = shared[shared_key(cfg, stage)]
            yield row(stage, timings[stage])
        else:
            timings[stage], why = _time_stage(stage, backend, cfg, prep, layers, opts or {})
            if why is None and shared_key(cfg, stage) is not None:
                shared[shared_key(cfg, stage)] = timings[stage]
            yield row(stage, timings[stage], why, "ok" if why is None else "skipped")
    del prep
    _release(backend)


def _grid(configs) -> dict:
    """The values swept, from the configurations."""
    values = lambda name: sorted({getattr(c, name) for c in configs})  # noqa: E731
    return {"lengths": values("length"), "batches": values("batch"),
            "page_sizes": values("page_size"), "budgets": values("budget"),
            "modes": values("mode"), "seeds": values("seed")}


def _ceilings(backend) -> dict:
    """measure.ceilings.measure_ceilings(backend), or why it could not run."""
    try:
        from questprof.measure.ceilings import measure_ceilings

        return measure_ceilings(backend)
    except Exception as exc:  # ceilings are context for the report, never a reason to stop
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}


def sweep_meta(scenario, configs, backend, command: str | None = None, opts=None) -> dict:
    """meta.json of a run (notes/CONTRACTS.md)."""
    from questprof.machine import git_commit, machine_info

    return {"scenario": scenario.name, "scenario_path": str(scenario.path),
            "command": command or " ".join(sys.argv), "started": now(), "finished": None,
            "git_commit": git_commit(), "machine": machine_info(), "backend": backend.name,
            "fallback_reason": getattr(backend, "fallback_reason", None),
            "ceilings": _ceilings(backend), "grid": _grid(configs), "timing": dict(opts or {})}


def _resumed_meta(out_dir, meta: dict) -> dict:
    """meta.json of a resumed run: the first run's start and command, and each resumption's."""
    from questprof.results import load

    old = load(out_dir)[1]
    resumed = list(old.get("resumed", [])) + [meta["started"]]
    commands = list(old.get("resumed_commands", [])) + [meta["command"]]
    return {**meta, "started": old.get("started", meta["started"]),
            "command": old.get("command", meta["command"]), "resumed": resumed,
            "resumed_commands": commands}


def run_sweep(scenario, configs, backend, out_dir, layers: int | None = None,
              repeats: int = 20, warmup: int = 3, resume: bool = False,
              progress: Progress | None = None, graph: bool = True,
              command: str | None = None, meta_extra: dict | None = None) -> list[dict]:
    """Time every stage of every configuration; rows go to out_dir as they finish.

    progress(row, done, total) is called after each row (done counts rows on disk, resumed
    ones included). resume=True skips (configuration, stage) pairs already in out_dir.
    graph=True (GPU only) times a CUDA-graph replay of each pass, as serving engines run decode:
    without it the stages' Python launches dominate (H200, longchat-7b, 128k tokens, batch 1:
    attention 12 us with graphs, 45 us without), and Quest's speedup reads 5.9x instead of 8.9x.
    Returns the rows written by this call. results.parquet is rewritten on exit, also on error.
    meta_extra is merged into meta.json (the CLI keeps its arguments there for --resume).
    """
    opts = {"repeats": repeats, "warmup": warmup, "graph": graph}
    done = done_keys(out_dir) if resume else set()
    old_rows = read_rows(out_dir) if resume else []
    meta = sweep_meta(scenario, configs, backend, command, {**opts, "layers": layers})
    meta.update(meta_extra or {})
    if resume:
        meta = _resumed_meta(out_dir, meta)
    total = len(configs) * len(STAGES)
    count = sum((c.key(), s) in done for c in configs for s in STAGES)
    written, shared = [], {}
    with ResultsWriter(out_dir, meta) as writer:
        for cfg in configs:
            key = cfg.key()
            todo = [s for s in STAGES if (key, s) not in done]
            if not todo:
                continue
            previous = _previous(key, old_rows)
            for row in config_rows(scenario.name, cfg, backend, todo, layers, opts, previous,
                                   shared):
                writer.append(row)
                written.append(row)
                count += 1
                if progress is not None:
                    progress(row, count, total)
    return written
