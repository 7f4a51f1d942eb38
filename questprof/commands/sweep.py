"""`questprof sweep`: grid -> configurations -> result rows, on disk as they finish.

Each configuration gets a cold-cache Workload (workload.pools): on a GPU enough simulated layers
that a pass of its smallest timed stage reads >= 8x the L2, within half the free memory; on the
NumPy backend one. Each stage is timed over a pass of all layers (measure.timing), the Quest step
(estimate -> top-K -> sparse attention) as one pass of its own; on a GPU with torch, torch SDPA
dense beside ours, and with `--peers` FlashInfer's dense, top-K, sparse attention and Quest step
(workload.flashinfer; skipped rows with the reason where it cannot run); then, when a byte
source runs, the DRAM bytes of each of our stages (measure.dram), and over the host tier their
link bytes too (commands/link_bytes.py: calibrated on a zero-copy read in the same run).
On a CPU the NumPy backend's float32 path is timed (backends.timing_backend), and the
configurations that share pools run in a row, so each pool is built once (PoolCache).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from questprof.backends import timing_backend
from questprof.commands import link_bytes, sweep_table
from questprof.commands.sweep_meta import resumed_meta, sweep_meta
from questprof.commands.sweep_table import launcher, pass_layers
from questprof.core import model, tier
from questprof.core.stages import ROW_STAGES
from questprof.measure import cupti, dram
from questprof.measure.timing import time_layers
from questprof.results import OURS, ResultsWriter, done_keys, make_row, tier_fields
from questprof.workload.flashinfer import FlashInferPeer, STAGES as FLASHINFER_STAGES, refusal
from questprof.workload.pools import (PoolCache, Workload, fit_need, is_out_of_memory,
                                      l2_bytes, release, sim_layers)
from questprof.workload.replay import REPLAYED, CacheReplay, Replay

DENSE_REASON = "budget >= length: Quest selects every page, so it runs dense attention"
SDPA = "torch-sdpa"
FLASHINFER = "flashinfer"  # workload.flashinfer.IMPL
# Stages whose work does not depend on these fields: timed once per run and shared by the
# configurations that differ only there (a 4-budget grid times dense once, not 4 times).
SHARED_OVER = {"summary": ("budget", "mode"), "dense": ("budget", "mode"), "estimate": ("budget",)}
Progress = Callable[[dict, int, int], None]


@dataclass(frozen=True)
class Options:
    """How a sweep times and measures, settled before it starts: passes, graphs, the byte
    source, the peers and the budget table."""

    repeats: int = 20
    warmup: int = 3
    graph: bool = True
    layers: int | None = None
    bytes_source: str | None = None  # "cupti", "ncu" or None
    peers: bool = False  # torch SDPA dense beside ours (GPU with torch)
    flashinfer: bool = False  # FlashInfer's rows beside ours (workload.flashinfer.STAGES)
    peers_skipped: str | None = None  # why every peer row is a skipped row (a CPU, no torch)
    ncu: Callable | None = None  # ncu(cfg, stages) -> {stage: (read, write)} for --bytes ncu
    budget_table: object = None  # core.budgets.BudgetTable: the Quest step per layer's budget
    budgets_file: str = ""  # where budget_table came from (the rows name it)
    replay: Replay | None = None  # attention and the Quest step through an HBM page cache


@dataclass
class RunState:
    """What one run of run_sweep gathers as it goes, beside its frozen Options."""

    shared: dict = field(default_factory=dict)  # shared_key -> (timing, bytes) of this run
    bytes_seconds: float = 0.0  # wall time spent measuring bytes (meta.json: its share of a run)
    idle: object = None  # the idle device's DRAM rates (measure.cupti.IdleRate), taken once
    pools: PoolCache | None = None  # CPU: the last pools, for the next configuration
    link: link_bytes.LinkRun | None = None  # the host tier's link counting (None: no host tier)


def row_keys(cfg, peers: bool, flashinfer: bool = False) -> list[tuple[str, str]]:
    """(stage, impl) of every row of one configuration, in order: each peer after ours."""
    keys = []
    for stage in ROW_STAGES:
        keys.append((stage, OURS))
        if peers and stage == "dense":
            keys.append((stage, SDPA))
        if flashinfer and stage in FLASHINFER_STAGES:
            keys.append((stage, FLASHINFER))
    return keys


def remaining(configs, opts: Options, done: set) -> list:
    """The configurations with a row not in `done` ((config_key, stage, impl) on disk)."""
    return [c for c in configs
            if any((c.key(), *k) not in done for k in row_keys(c, opts.peers, opts.flashinfer))]


def shared_key(cfg, stage: str, impl: str = OURS) -> tuple | None:
    """Key under which `stage` of cfg shares its timing with other configurations, or None."""
    if stage not in SHARED_OVER:
        return None
    fields = cfg.as_dict()
    return (stage, impl, *((k, v) for k, v in sorted(fields.items())
                           if k not in SHARED_OVER[stage] and k != "k_pages"))


def _bytes(work: Workload, stage: str, state: RunState, pass_ms: float) -> dict:
    """measured_read_bytes, measured_write_bytes, bytes_source of one stage, or a note why not."""
    start = time.perf_counter()  # the score copies below are the measurement's cost too
    if stage == "topk":  # top-K reads only scores: copies of them make its own cold rotation
        need = model.COLD_FACTOR * l2_bytes()
        work.rotate_topk(min(-(-need // max(int(work.work("topk").read), 1)), 1024))
    try:
        if state.idle is None:
            state.idle = cupti.idle_rate()
        read, write = dram.stage_bytes("cupti", work.launcher(stage), work.calls(stage),
                                       pass_ms=pass_ms * work.calls(stage), seconds=0.01,
                                       idle=state.idle)
    except Exception as exc:  # a failed measurement is a note on the row, never a lost row
        return {"note": f"bytes not measured: {type(exc).__name__}: {exc}"}
    finally:
        work.topk_scores = work.scores
        state.bytes_seconds += time.perf_counter() - start
    return {"measured_read_bytes": read, "measured_write_bytes": write, "bytes_source": "cupti"}


def _launcher(work: Workload, stage: str, impl: str, flashinfer: dict, table=None):
    """launch(layer) of (stage, impl); FlashInfer's peer is built at the first of its rows of a
    workload and kept in `flashinfer` (cleared before the pools are released); our Quest step
    walks `table` (per-layer budgets) when one is given."""
    if table is not None and stage == "quest" and impl == OURS:
        return launcher(work, table)
    if impl != FLASHINFER:
        return work.launcher(impl if impl != OURS else stage)
    if "peer" not in flashinfer:
        flashinfer["peer"] = FlashInferPeer(work)
    return flashinfer["peer"].launcher(stage)


def _skip_reason(stage: str, impl: str, exc: Exception) -> str | None:
    """Why a (stage, impl) that raised becomes a skipped row, or None to let it raise: out of
    memory, or anything FlashInfer raised (not installed, a shape it refuses: its words)."""
    if impl == FLASHINFER:
        return refusal(exc)
    if is_out_of_memory(exc):
        return f"out of memory timing {stage}: {type(exc).__name__}"
    return None


def _measure(work: Workload, stage: str, impl: str, opts: Options, flashinfer: dict,
             state: RunState) -> tuple[dict, dict]:
    """(timing summary, measured-bytes fields) of one (stage, impl) on a prepared workload."""
    launch = _launcher(work, stage, impl, flashinfer, opts.budget_table)
    replay = work.replay if impl == OURS and stage in REPLAYED else None
    # a replay counts the timed passes' steps only (begin after the untimed ones)
    t = time_layers(work.backend, launch, work.layers, opts.warmup, opts.repeats, opts.graph,
                    uses_torch=impl != OURS, timed=replay.begin if replay is not None else None)
    timing = {**t.summary(), "note": t.note}
    got = {"pipeline": flashinfer["peer"].pipeline(stage)} if impl == FLASHINFER else {}
    # the timed steps' counts, before a byte pass runs more steps, and their mean time: the
    # time of exactly the steps counted (a median leaves out a trace's slow steps, its wrap).
    # The first timed pass starts on a drained stream (begin synchronises): its launch latency,
    # a few us for a graph, is in the mean, once over the repeats
    cache = ({**_replayed(work, stage, replay), "mean_ms": float(np.mean(t.samples_ms))}
             if replay is not None else {})
    if opts.bytes_source == "cupti" and impl == OURS and stage != "quest":
        got = {**_bytes(work, stage, state, t.median), **_link(work, stage, state, t.median)}
    elif impl == OURS:  # why the host tier's link is not counted ({} over HBM, or summed)
        got = {**got, **link_bytes.fields(state.link, work.cfg)}
    return timing, {**got, **cache}


def _replayed(work: Workload, stage: str, replay: CacheReplay) -> dict:
    """A replayed stage's cache counts and, at the replayed miss rate, its tier bytes (the
    misses written to the cache's slots in HBM and read there: core/tier.py's gather)."""
    got = replay.fields()
    miss = got["replayed_miss_rate"]
    return {**got, **tier_fields(work.cfg, stage, work.union, miss, fetch="gather")}


def _link(work: Workload, stage: str, state: RunState, median_ms: float) -> dict:
    """The host tier's link fields of one stage (commands/link_bytes.py), timed as bytes."""
    start = time.perf_counter()
    try:
        return link_bytes.fields(state.link, work.cfg, work.launcher(stage), work.calls(stage),
                                 median_ms * work.calls(stage))
    finally:
        state.bytes_seconds += time.perf_counter() - start


def _summed_bytes(parts: dict) -> dict:
    """The Quest step's measured bytes as the sum of its three stages' (bytes add up; measuring
    the step again was 168 of the longchat-7b grid's ~600 byte measurements), or {} when one
    is missing."""
    got = [parts.get(s) or {} for s in model.QUEST_STAGES]
    if any(g.get("measured_read_bytes") is None for g in got):
        return {}
    write = [g.get("measured_write_bytes") for g in got]
    return {"measured_read_bytes": sum(g["measured_read_bytes"] for g in got),
            "measured_write_bytes": None if None in write else sum(write),
            "bytes_source": f"{got[0]['bytes_source']}-sum"}


def _ncu_bytes(cfg, keys, opts: Options, dense_budget: bool) -> dict:
    """{(stage, impl): measured-bytes fields} from one ncu replay of the configuration."""
    stages = sorted({("dense" if dense_budget and s == "quest" else s) for s, i in keys
                     if i == OURS and not (dense_budget and s in model.QUEST_STAGES)})
    if opts.ncu is None or not stages:
        return {}
    try:
        got = opts.ncu(cfg, stages)
    except Exception as exc:  # the rows still land, saying why they carry no bytes
        return {(s, OURS): {"note": f"ncu: {type(exc).__name__}: {exc}"[:300]} for s in stages}
    return {(s, OURS): {"measured_read_bytes": r, "measured_write_bytes": w,
                        "bytes_source": "ncu"} for s, (r, w) in got.items()}


def _skipped_rows(scenario, cfg, backend, keys, layers, reason, need=None):
    """Skipped rows of every (stage, impl), with the cause and, for memory, the figures."""
    extra = {}
    if need is not None:
        gib = 1 << 30
        extra = {"need_gib": need[0] / gib, "free_gib": None if need[1] is None else need[1] / gib}
    return [make_row(cfg, s, scenario=scenario, backend=backend.name, impl=i, layers=layers,
                     status="skipped", reason=reason, **extra) for s, i in keys]


def _prepare(cfg, backend, layers: int, pools: PoolCache | None = None):
    """(Workload, None), or (None, why) when the pools do not fit in memory."""
    try:
        return Workload(cfg, backend, layers, pools), None
    except (MemoryError, RuntimeError) as exc:  # CuPy's OOM is a MemoryError; DoesNotFit, torch's
        # and a CUDA allocation failure are RuntimeErrors; any other reaches the caller
        if not is_out_of_memory(exc):
            raise
        why = (str(exc) if type(exc).__name__ == "DoesNotFit"
               else f"out of memory building {layers} layer(s): {type(exc).__name__}")
    if pools is not None:
        pools.key = pools.value = None
    release(backend)  # here, not in the except block, whose traceback still holds the arrays
    return None, why


def config_rows(scenario: str, cfg, backend, keys, opts: Options, state: RunState):
    """Yield the rows of (stage, impl) `keys` of one configuration, each as soon as it is done
    (timings shared with other configurations in `state`, and its pools on a CPU)."""
    layers = pass_layers(sim_layers(cfg, backend, opts.layers), opts.budget_table)
    dense_budget = cfg.is_dense_budget
    # ncu's child builds its own one-layer workload: before ours, which may take most of the
    # memory (on an H200 the child of smoke's 2k and 4k points could not create its context).
    ncu = _ncu_bytes(cfg, keys, opts, dense_budget)
    work, reason = _prepare(cfg, backend, layers, state.pools)
    if work is None:
        yield from _skipped_rows(scenario, cfg, backend, keys, layers, reason,
                                 fit_need(cfg, backend, layers))
        return
    if opts.replay is not None and not dense_budget:
        work.replay = CacheReplay(work, opts.replay)
    row = lambda s, i, **kw: make_row(cfg, s, scenario=scenario, backend=backend.name,  # noqa: E731
                                      impl=i, layers=layers, union=work.union, **kw)
    parts, flashinfer = {}, {}
    for stage, impl in keys:
        if dense_budget and stage in model.QUEST_STAGES:
            yield row(stage, impl, status="skipped", reason=DENSE_REASON)
            continue
        if impl != OURS and (opts.peers_skipped or tier.kv_tier(cfg) == "host"):
            yield row(stage, impl, status="skipped", reason=opts.peers_skipped or tier.PEERS_REASON)
            continue
        table = opts.budget_table is not None and (stage, impl) == ("quest", OURS)
        runs = "dense" if dense_budget and stage == "quest" and not table else stage
        key = shared_key(cfg, runs, impl)
        try:
            timing, got = state.shared.get(key) or _measure(work, runs, impl, opts,
                                                            flashinfer, state)
        except Exception as exc:  # deliberately any: FlashInfer fails its own way (its words are
            # the skipped row's reason); of ours only out of memory is a row, the rest re-raised
            why = _skip_reason(stage, impl, exc)
            if why is None:
                raise
            release(backend)
            yield row(stage, impl, status="skipped", reason=why)
            continue
        if key is not None:
            state.shared[key] = (timing, got)
        reason = DENSE_REASON if runs != stage else None
        got = {**got, **ncu.get((runs, impl), {})}
        if impl == OURS:
            parts[runs] = got
            if runs == "quest":
                summed = link_bytes.summed([parts.get(s) or {} for s in model.QUEST_STAGES])
                got = {**_summed_bytes(parts), **summed, **got, "pipeline": work.quest_path}
        if table:  # the Quest step walked the table: each layer its own budget
            got = {**got, **sweep_table.fields(cfg, opts.budget_table, opts.budgets_file)}
            yield row(stage, impl, timing=timing, work=sweep_table.work(cfg, opts.budget_table),
                      reason=reason, **got)
            continue
        yield row(stage, impl, timing=timing, work=work.work(runs), reason=reason, **got)
    flashinfer.clear()  # its torch views hold the pools' memory
    del work
    release(backend)


def run_order(configs, backend) -> list:
    """Configurations in the order a sweep runs them: as given on a GPU; on the CPU those that
    share pools (all but budget and mode) in a row, largest pools first, so each pool is built
    once (PoolCache) into the memory of the one before (the fp32 path's arenas)."""
    if backend.is_gpu:
        return list(configs)
    groups: dict[tuple, list] = {}
    for c in configs:
        groups.setdefault((c.model, c.length, c.batch, c.page_size, c.seed), []).append(c)
    order = sorted(groups.values(), key=lambda g: -model.kv_pool_bytes(g[0]))  # stable
    return [c for group in order for c in group]


def link_why_not(backend, opts: Options, byte_status: dict | None) -> str | None:
    """Why this run counts no link bytes over the host tier (None: CUPTI on a GPU counts them)."""
    if not backend.is_gpu:
        return link_bytes.cpu_reason(backend)
    if opts.bytes_source != "cupti":
        why = (byte_status or {}).get("reason") or f"this run's byte source is {opts.bytes_source}"
        return f"link bytes are counted through CUPTI ({why})"
    return None


def run_sweep(scenario, configs, backend, out_dir, opts: Options | None = None,
              resume: bool = False, progress: Progress | None = None,
              command: str | None = None, meta_extra: dict | None = None) -> list[dict]:
    """Time (and measure) every stage of every configuration; rows go to out_dir as they finish.

    progress(row, done, total) is called after each row (done counts rows on disk, resumed
    ones included). resume=True skips (configuration, stage, impl) already in out_dir.
    Returns the rows written by this call; results.parquet is rewritten on exit, also on error.
    On a CPU it times the NumPy backend's float32 path (backends.timing_backend).
    """
    opts, backend = opts or Options(), timing_backend(backend)
    done = done_keys(out_dir) if resume else set()
    byte_status = (meta_extra or {}).get("bytes")
    meta = sweep_meta(scenario, configs, backend, command, opts, byte_status)
    meta.update(meta_extra or {})
    state = RunState(pools=None if backend.is_gpu else PoolCache())
    state.link = link_bytes.prepare(configs, link_why_not(backend, opts, byte_status))
    meta["link_bytes"] = state.link.as_meta() if state.link is not None else None
    if resume:
        meta = resumed_meta(out_dir, meta)
    plan = [(cfg, [k for k in row_keys(cfg, opts.peers, opts.flashinfer)
                   if (cfg.key(), *k) not in done]) for cfg in run_order(configs, backend)]
    total = sum(len(row_keys(c, opts.peers, opts.flashinfer)) for c in configs)
    count = total - sum(len(keys) for _, keys in plan)
    written, start = [], time.perf_counter()
    with ResultsWriter(out_dir, meta) as writer:
        try:
            for cfg, keys in plan:
                for row in (config_rows(scenario.name, cfg, backend, keys, opts, state)
                            if keys else ()):
                    writer.append(row)
                    written.append(row)
                    count += 1
                    if progress is not None:
                        progress(row, count, total)
        finally:
            state.pools = None  # the last pools go before what runs next (e2e, fidelity)
            writer.write_meta(grid_seconds=time.perf_counter() - start,
                              bytes_seconds=state.bytes_seconds)
    return written
