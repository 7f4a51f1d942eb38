"""`questprof bench`: every kernel on the cold-cache protocol against ceilings and peers measured
in the same run. Cases and goals come from scenarios/bench.toml.

Per case: our stages and the Quest pipeline over the case's Workload (workload.pools), torch SDPA
dense, a naive torch Quest and FlashInfer's dense, top-K, sparse attention and Quest step
(workload.flashinfer; skipped rows with the reason where it is not installed or refuses the
shape) beside them, each row with its bytes, bandwidth, ratio to the read ceiling, and
(streaming stages) the time of a plain cold read of its own bytes (`same_read_ms`,
measure.ceilings.read_ladder, taken first): the ceiling at the stage's size. Speedups are against
the fastest dense of the case, ours, torch SDPA or FlashInfer (`dense_impl` names it). Over the
host tier our stages' rows carry their link bytes where CUPTI counts them (commands/link_bytes.py:
raw, calibrated on a zero-copy read in the same run, and the factor), else why not.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import tomllib

from questprof import SCENARIOS_DIR, console
from questprof.backends import get_backend, gpu_unavailable_reason
from questprof.commands import link_bytes
from questprof.commands.bench_args import BenchArgs
from questprof.commands.bench_selectors import selector_rows, selectors_of
from questprof.core import model, tier
from questprof.core.config import Config, ConfigError, ModelShape
from questprof.core.machine import git_fields, machine_info
from questprof.core.stages import ROW_STAGES
from questprof.measure.ceilings import ladder_ms, link_ceilings, measure_ceilings, read_ladder
from questprof.measure.timing import time_layers
from questprof.results import OURS, ResultsWriter, check_new_run, make_row, now
from questprof.workload import flashinfer as fi
from questprof.workload.flashinfer import IMPL as FLASHINFER, missing_reason
from questprof.workload.pools import (Workload, check_cache, free_bytes, is_out_of_memory, l2_bytes,
                                      release)

BENCH_FILE = SCENARIOS_DIR / "bench.toml"
POOL_FRACTION = 0.4  # our pools per case; the torch peers' contiguous caches take as much
STAGES = ROW_STAGES
PEERS = (("dense", "torch-sdpa"), ("quest", "torch-naive"))
SAME_BYTES_STAGES = ("estimate", "attention", "dense", "quest")  # they stream their bytes once


def load_bench(path=BENCH_FILE, quick: bool = False) -> tuple[list[Config], list[dict]]:
    """(cases, goals) of a bench file; quick keeps the cases marked quick. A file that is not
    valid TOML or misses a field is a ConfigError naming it (one line at the CLI)."""
    try:
        data = tomllib.loads(open(path, encoding="utf-8").read())
        models = {name: ModelShape(name=name, **m) for name, m in data.get("models", {}).items()}
        cases = [case for case in data.get("case", []) if case.get("quick") or not quick]
        goals = list(data.get("goal", []))
        for goal in goals:  # checked now: a goal is judged only after the whole run
            needed = ("metric", "case", "target") + (("over",) if goal.get("metric") ==
                                                     "dense_over" else ())
            if missing := [f for f in needed if f not in goal]:
                raise KeyError(missing[0])
            if goal["metric"] == "dense_over" and goal["over"] not in models:
                raise ConfigError(f"{path}: goal dense_over names unknown model "
                                  f"{goal['over']!r}")
        return [_case(models, case, mode, path) for case in cases
                for mode in case.get("modes", ["per-head"])], goals
    except (tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ConfigError(f"{path}: {what}") from None


def _case(models: dict, case: dict, mode: str, path) -> Config:
    if case["model"] not in models:
        raise ConfigError(f"{path}: case names unknown model {case['model']!r}")
    return Config(models[case["model"]], case["length"], case["batch"], case["page_size"],
                  case["budget"], mode)


def with_tiers(cfg, args: BenchArgs) -> Config:
    """A case with the command line's tiers (Config checks them: a ConfigError line)."""
    return replace(cfg, kv_tier=args.kv_tier, summary_tier=args.summary_tier,
                   hbm_pages=args.hbm_pages)


def _layers(cfg, backend) -> int:
    """Layers of a cold pass within POOL_FRACTION of free memory (peers need as much again)."""
    return model.cold_layers(cfg, l2_bytes(), POOL_FRACTION * (free_bytes(backend) or 0))


def _row(cfg, stage, impl, timing, work, ceiling, layers, backend) -> dict:
    row = make_row(cfg, stage, scenario="bench", backend=backend.name, impl=impl,
                   timing=timing.summary(), work=work, layers=layers, note=timing.note)
    gbs = row["bandwidth_gbs"]
    if tier.kv_tier(cfg) == "host":  # link-bound rows: the HBM read ceiling does not judge them
        return {**row, "ceiling_gbs": None, "ratio": None}
    return {**row, "ceiling_gbs": ceiling, "ratio": gbs / ceiling if gbs and ceiling else None}


def run_case(backend, cfg: Config, ceiling: float | None, repeats: int = 20, graph: bool = True,
             with_peers: bool = True, read_ms=None, selectors=(), link=None) -> list[dict]:
    """All rows of one case: ours per stage and the pipeline (over the host tier with their link
    bytes, `link` being the run's commands/link_bytes.LinkRun), the `selectors`' kernel forms
    (commands/bench_selectors.py), then the peers."""
    layers = _layers(cfg, backend)
    work = Workload(cfg, backend, layers)
    time = lambda launch, torch=False: time_layers(  # noqa: E731
        backend, launch, layers, 3, repeats, graph, uses_torch=torch)
    rows = [_row(cfg, s, OURS, time(work.launcher(s)), work.work(s), ceiling, layers, backend)
            for s in STAGES]
    rows[STAGES.index("quest")]["pipeline"] = work.quest_path
    for r in rows:  # after every timing (a link window's calibration and passes take seconds)
        pass_ms = r["median_ms"] * layers if r.get("median_ms") else None
        r.update(link_bytes.fields(link, cfg, work.launcher(r["stage"]), layers, pass_ms))
    if selectors and not cfg.is_dense_budget:
        rows += selector_rows(cfg, selectors, work, time, lambda s, impl, t, w, **extra: {
            **_row(cfg, s, impl, t, w, ceiling, layers, backend), **extra})
    if with_peers and tier.kv_tier(cfg) == "host":
        rows += [make_row(cfg, s, scenario="bench", backend=backend.name, impl=impl,
                          layers=layers, status="skipped", reason=tier.PEERS_REASON)
                 for s, impl in PEERS]
    elif with_peers:
        rows += [_row(cfg, s, impl, time(work.launcher(impl), True), work.work(s), ceiling,
                      layers, backend) for s, impl in PEERS]
        rows += _flashinfer_rows(cfg, work, time, ceiling, layers, backend)
    del work
    release(backend)
    if read_ms is not None and tier.kv_tier(cfg) == "hbm":  # an HBM read ladder: HBM rows only
        for r in rows:
            if r["impl"] == OURS and r["stage"] in SAME_BYTES_STAGES and r.get("median_ms"):
                ms = read_ms(int(r["read_bytes"] + r["unmodelled_bytes"]))
                if ms is not None:
                    r["same_read_ms"], r["same_ratio"] = ms, ms / r["median_ms"]
    add_speedups(rows)
    return rows


def _flashinfer_rows(cfg, work, time, ceiling, layers, backend) -> list[dict]:
    """FlashInfer's rows of a case (workload.flashinfer.STAGES): timed, or skipped with the
    reason, one line: not installed, or a shape it refuses in its own words."""
    def skipped(stage: str, exc: BaseException) -> dict:
        return make_row(cfg, stage, scenario="bench", backend=backend.name, impl=fi.IMPL,
                        layers=layers, status="skipped", reason=fi.refusal(exc))
    try:
        peer = fi.FlashInferPeer(work)
    except Exception as exc:  # not installed, no torch device: every row says why
        return [skipped(s, exc) for s in fi.STAGES]
    rows = []
    for stage in fi.STAGES:
        try:
            timing = time(peer.launcher(stage), True)
        except Exception as exc:  # a shape FlashInfer refuses (group 7, head dim 96, ...)
            rows.append(skipped(stage, exc))
            continue
        rows.append({**_row(cfg, stage, fi.IMPL, timing, work.work(stage), ceiling, layers,
                            backend), "pipeline": peer.pipeline(stage)})
    return rows


def add_speedups(rows: list[dict]) -> None:
    """Give every quest row of a case `speedup` against the fastest dense and `dense_impl`;
    our quest row also `stages_sum_ms` (its three stages timed apart), `overlap_gain` (that sum
    over the pipeline's time: what running them as one step saves) and, beside FlashInfer's
    Quest step, `vs_flashinfer` (its time / ours: > 1 where ours is faster)."""
    dense = [r for r in rows if r["stage"] == "dense" and r.get("median_ms")]
    parts = {r["stage"]: r["median_ms"] for r in rows if r.get("impl") == OURS
             and r["stage"] in model.QUEST_STAGES and r.get("median_ms")}
    for r in rows:
        if r["stage"] != "quest" or not r.get("median_ms"):
            continue
        if dense:
            best = min(dense, key=lambda d: d["median_ms"])
            r["speedup"], r["dense_impl"] = best["median_ms"] / r["median_ms"], best["impl"]
        if r.get("impl") == OURS and len(parts) == len(model.QUEST_STAGES):
            r["stages_sum_ms"] = sum(parts.values())
            r["overlap_gain"] = r["stages_sum_ms"] / r["median_ms"]
        peer = [u for u in rows if u["stage"] == "quest" and u.get("impl") == FLASHINFER
                and u.get("median_ms")]
        if r.get("impl") == OURS and peer:
            r["vs_flashinfer"] = peer[0]["median_ms"] / r["median_ms"]


def _matches(row: dict, case: dict) -> bool:
    return all(row.get(k) == v for k, v in case.items())


def _metric(rows: list[dict], goal: dict) -> float | None:
    at = [r for r in rows if _matches(r, goal["case"])]
    get = lambda stage, impl=OURS: next((r for r in at if r["stage"] == stage  # noqa: E731
                                         and r["impl"] == impl and r.get("median_ms")), None)
    metric = goal["metric"]
    if metric == "speedup":  # of our default step, or of the implementation the goal names (impl)
        quest = get("quest", goal.get("impl", OURS))
        return quest.get("speedup") if quest else None
    if metric == "dense_sdpa":
        ours, sdpa = get("dense"), get("dense", "torch-sdpa")
        return ours["median_ms"] / sdpa["median_ms"] if ours and sdpa else None
    if metric == "dense_best":  # our dense / the fastest dense of the case (ours included)
        ours, best = get("dense"), [r["median_ms"] for r in at if r["stage"] == "dense"
                                    and r.get("median_ms")]
        return ours["median_ms"] / min(best) if ours else None
    if metric == "dense_over":  # our dense / our dense of the model `over` at the same case
        ours = get("dense")
        other = next((r for r in rows if _matches(r, {**goal["case"], "model": goal["over"]})
                      and r["stage"] == "dense" and r["impl"] == OURS and r.get("median_ms")),
                     None)
        return ours["median_ms"] / other["median_ms"] if ours and other else None
    if metric == "vs_flashinfer":
        quest = get("quest")
        return quest.get("vs_flashinfer") if quest else None
    row = get(goal["stage"], goal.get("impl", OURS))
    if row is None:
        return None
    if metric in ("ratio", "same_ratio"):  # same_ratio: a plain cold read of its bytes / its time
        return row.get(metric)
    return row["median_ms"] * 1e3


def goals(rows: list[dict], goal_list: list[dict]) -> list[tuple[str, float | None, str, bool | None]]:
    """(goal, measured, target, met) of every goal of the bench file."""
    out = []
    for goal in goal_list:
        case = goal["case"]
        name = " ".join(f"{goal['metric']} {goal.get('stage', '')} {goal.get('impl', '')} "
                        f"{case.get('model')} {case.get('length', 0) // 1024}K "
                        f"B{case.get('batch')}".split())
        value = _metric(rows, goal)
        out.append((name, value, goal["target"], None if value is None else
                    _met(value, goal["target"])))
    return out


def _met(value: float, target: str) -> bool:
    op, bound = target.split()
    return {">=": value >= float(bound), "<=": value <= float(bound), "<": value < float(bound),
            ">": value > float(bound)}[op]


def run_bench(cases: list[Config], repeats: int = 20, graph: bool = True,
              with_peers: bool = True, log=print, on_case=None,
              selectors=None, link=None) -> tuple[list[dict], dict]:
    """(rows of every case, ceilings). Needs the CuPy backend (a CUDA GPU); peers need torch.
    on_case(ceilings, rows) gets each case's rows as soon as they are measured (to disk);
    selectors: config key -> the selectors of that case (bench_selectors.selectors_of); link:
    the run's link counting over the host tier (commands/link_bytes.LinkRun) or None."""
    backend = get_backend("cupy")
    ceilings = measure_ceilings(backend)
    ladder = read_ladder(backend, l2_bytes(), repeats=repeats)  # before any pool comes and goes
    ceilings["read_ladder"] = ladder
    log("plain cold reads: " + ", ".join(f"{n >> 20} MiB {ms * 1e3:.1f} us" for n, ms in ladder))
    read_ms = functools.partial(ladder_ms, ladder)
    log(f"ceilings: read {ceilings['read_gbs']:.0f} GB/s, copy {ceilings['copy_gbs']:.0f} GB/s, "
        f"fp16 {ceilings['fp16_tflops']:.0f} TFLOP/s ({ceilings.get('gpu')})")
    ceilings["link"] = link_ceilings(cases, backend)  # host-tier cases only (meta link_ceilings)
    if ceilings["link"] and "copy_gbs" in ceilings["link"]:
        log(f"link ceilings: pinned copy {ceilings['link']['copy_gbs']:.1f} GB/s, zero-copy read "
            f"{ceilings['link']['zero_copy_gbs']:.1f} GB/s")
    rows = []
    for cfg in cases:
        log(f"case {cfg.model.name} L={cfg.length} B={cfg.batch} S={cfg.page_size} "
            f"budget={cfg.budget} {cfg.mode}")
        try:
            case = run_case(backend, cfg, ceilings["read_gbs"], repeats, graph, with_peers,
                            read_ms, (selectors or {}).get(cfg.key(), ()), link)
        except (MemoryError, RuntimeError) as exc:  # a case that does not fit (CuPy's OOM is a
            # MemoryError, torch's and CUDA's a RuntimeError) is skipped rows, not a lost run
            if not is_out_of_memory(exc):
                raise
            release(backend)
            case = [make_row(cfg, s, scenario="bench", backend=backend.name, status="skipped",
                             reason=f"does not fit: {type(exc).__name__}: {exc}"[:200])
                    for s in STAGES]
        rows += case
        if on_case is not None:
            on_case(ceilings, case)
    return rows, ceilings


def _meta(command: str, ceilings: dict, goal_list: list[dict], link=None) -> dict:
    return {"scenario": "bench", "command": command, "started": now(), "finished": None,
            **git_fields(), "machine": machine_info(), "backend": "cupy",
            "ceilings": {k: v for k, v in ceilings.items() if k != "link"},
            "link_ceilings": ceilings.get("link"), "goals": goal_list,
            "link_bytes": link.as_meta() if link is not None else None}


def _print(rows: list[dict], goal_list: list[dict]) -> None:
    import pandas as pd

    df = pd.DataFrame(rows)
    df["us"] = df["median_ms"] * 1e3
    df["MB"] = (df["read_bytes"] + df["unmodelled_bytes"]) / 1e6
    if "same_read_ms" in df:  # a plain cold read of the row's bytes
        df["same_us"] = df["same_read_ms"] * 1e3
    cols = ["model", "length", "batch", "budget", "mode", "stage", "impl", "us", "MB",
            "bandwidth_gbs", "ratio", "same_us", "same_ratio", "speedup", "dense_impl",
            "overlap_gain", "vs_flashinfer", "pipeline", "method"]
    shown, fixed = console.fold(df[[c for c in cols if c in df]], ("model", "mode"))
    console.out.print(console.table(shown, f"bench ({fixed}): us per layer; ratio = read "
                                           "bandwidth / read ceiling of this run"))
    skipped = df[df["status"] != "ok"] if "status" in df else df.iloc[0:0]
    for (impl, why), group in skipped.groupby(["impl", "reason"], sort=False):
        console.warn(f"{impl} {', '.join(group['stage'].unique())} skipped: {why}")
    g = pd.DataFrame(goals(rows, goal_list), columns=["goal", "measured", "target", "met"])
    console.out.print(console.table(g, "goals (scenarios/bench.toml)"))


def bench_command(args: BenchArgs, out_dir, argv) -> object:
    """The whole `questprof bench`: rows to a results directory (and rows.json); returns it."""
    if out_dir is not None:
        check_new_run(out_dir)
    cases_file = Path(args.cases or BENCH_FILE)
    if not cases_file.is_file():
        raise ConfigError(f"bench file {cases_file} " + ("is a directory: name the .toml file"
                                                          if cases_file.is_dir() else "not found"))
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats} must be at least 1")
    cases, goal_list = load_bench(cases_file, args.quick)
    cases = [with_tiers(cfg, args) for cfg in cases]  # one line for tiers that make no sense
    named = selectors_of(cases_file)  # one line for a name without a kernel form
    # the link counter's calibration, before the CuPy backend starts: CUPTI's collector wants
    # torch's CUDA context (measure/cupti.py); None without a host-tier case
    link = link_bytes.prepare(cases, None if gpu_unavailable_reason() is None else "no GPU")
    backend = get_backend("cupy")  # one clear line and exit 2 without a GPU
    for cfg in cases:  # a cache dtype the kernels do not run yet: one line before any work
        check_cache(cfg.model, backend)
    peers = _peers_here(args.peers)
    target = Path(out_dir or Path("reports") / f"bench-{datetime.now():%Y%m%d-%H%M%S}")
    writer = None

    def on_case(ceilings, rows):  # each case on disk as soon as it is measured
        nonlocal writer
        if writer is None:
            writer = ResultsWriter(target, _meta(" ".join(["questprof", *argv]), ceilings,
                                                 goal_list, link))
        for row in rows:
            writer.append(row)
    if not cases:
        quick = " (none marked quick)" if args.quick else ""
        raise ConfigError(f"{cases_file}: no case to run{quick}")
    try:
        rows, _ = run_bench(cases, args.repeats, args.graph, peers, on_case=on_case,
                            selectors=named, link=link)
    except BaseException:  # Ctrl-C or a failure: the finished cases stay on disk
        if writer is not None:
            writer.close(finished=False)
        raise
    writer.close(finished=True)
    (target / "rows.json").write_text(json.dumps(rows, indent=1, default=str), encoding="utf-8")
    _print(rows, goal_list)
    return target


def _peers_here(asked: bool) -> bool:
    """Whether the peers are timed: asked for, and torch sees a GPU (said when it does not);
    FlashInfer missing is said in one line (its rows are skipped rows)."""
    if asked and not _torch_gpu():
        console.warn("torch with CUDA is not importable here: the torch peers are not timed")
        return False
    if asked:
        if (why := missing_reason()) is not None:
            console.warn(f"FlashInfer's rows are skipped: {why}")
    return asked


def _torch_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
