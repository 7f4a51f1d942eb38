"""The `questprof sweep` command: arguments -> configurations -> the grid, then what joins it
(measured end-to-end steps, context parallel over several GPUs, fidelity), then the summary.

On a GPU the default is the whole answer: the grid with torch SDPA beside our dense, DRAM bytes
of every stage through CUPTI where a PM-sampling session configures, and end-to-end decode steps
at 8k, 32k and 128k (within the grid's lengths).
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import typer

from questprof import console
from questprof.backends import get_backend, timing_backend
from questprof.backends.variants import shape_problem
from questprof.commands.sweep_table import apply_table
from questprof.core import model
from questprof.core.config import ConfigError, validate_budget, validate_page_size
from questprof.commands.sweep_args import SweepArgs, check_backend, resolve_args
from questprof.commands.sweep_say import announce, settings, skipped_lines
from questprof.core.scenarios import configs_from_args
from questprof.fidelity.models import model_path
from questprof.measure import cupti, ncu
from questprof.workload.flashinfer import missing_reason
from questprof.workload.pools import check_cache
from questprof.workload.replay import Replay, check_replay, trace_for

BYTE_SOURCES = ("auto", "cupti", "ncu", "none")
# is_gpu -> (repeats, warmup); CPU times (the NumPy fp32 path) are context, not the product: 3
# passes keep the main job within minutes there (compare then says NOISY: too few passes)
TIMING_DEFAULTS = {True: (20, 3), False: (3, 0)}


def check_shape(shape, backend) -> None:
    """A model shape the GPU kernels are not built for is one clear line, before any work."""
    if not backend.is_gpu:
        return
    problem = shape_problem(shape.head_dim)  # any group: tiles and chunks
    if problem:
        raise ConfigError(f"model {shape.name}: {problem} (--backend numpy runs it)")


def check_extras(args: SweepArgs, backend) -> None:
    """--bytes, --e2e, --gpus and --fidelity-model before any work: a clear error instead of a
    failure later."""
    if args.bytes_source not in BYTE_SOURCES:
        raise ConfigError(f"--bytes {args.bytes_source!r}: expected auto, cupti, ncu or none")
    if args.bytes_source in ("cupti", "ncu") and not backend.is_gpu:
        raise ConfigError(f"--bytes {args.bytes_source} measures GPU kernels: this run uses "
                          f"the {backend.name} backend ({console.INSTALL_GPU} on a GPU machine)")
    validate_page_size(args.e2e_page_size)
    validate_budget(args.e2e_budget, args.e2e_page_size)
    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus} must be at least 1")
    if args.gpus > 1:
        if not backend.is_gpu:
            raise ConfigError(f"--gpus {args.gpus} needs the cupy backend and GPUs")
        import cupy

        have = cupy.cuda.runtime.getDeviceCount()
        if args.gpus > have:
            raise ConfigError(f"--gpus {args.gpus}: this host has {have} GPU(s)")
    if args.fidelity_model and args.fidelity is not False:  # asked for: said now, not at the end
        from questprof.commands.fidelity import check_needs

        check_needs("passkey", args.fidelity_model, "sweep --fidelity-model")
        model_path(args.fidelity_model)


def byte_source(asked: str, backend) -> tuple[str | None, dict]:
    """(source the sweep measures bytes with or None, meta.json's account of why)."""
    if asked == "none":
        return None, {"source": None, "reason": "--bytes none"}
    if not backend.is_gpu:
        return None, {"source": None, "reason": f"the {backend.name} backend runs on the CPU"}

    if asked == "ncu":
        ok, why = ncu.available()
        if not ok:
            raise ConfigError(f"--bytes ncu: {why}")
        return "ncu", {"source": "ncu", "reason": None}
    ok, why = cupti.available()  # a real PM-sampling session, before any timing (measure.cupti)
    if ok:
        return "cupti", {"source": "cupti", "reason": None}
    if asked == "cupti":
        raise ConfigError(f"--bytes cupti: {why}")
    return None, {"source": None, "reason": why}


def _torch_missing() -> str | None:
    """Why torch cannot time on a GPU here (one line), or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install -e '.[torch]')"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no GPU"
    return None


def _torch_gpu() -> bool:
    return _torch_missing() is None


def peers_skipped(backend) -> str | None:
    """Why the peers' rows (torch SDPA, FlashInfer) are skipped rows on this run, or None."""
    if not backend.is_gpu:
        return "torch SDPA and FlashInfer time GPU kernels: this run times the CPU"
    return _torch_missing()


def _options(args: SweepArgs, backend, source, table=None):
    from questprof.commands.sweep import Options

    repeats, warmup = TIMING_DEFAULTS[backend.is_gpu]
    peers = args.peers if args.peers is not None else (backend.is_gpu and _torch_gpu())
    flashinfer = args.peers is True  # asked for: --peers, not the default
    skipped = peers_skipped(backend) if peers else None
    if skipped:
        console.warn(f"the peers' rows are skipped: {skipped}")
    elif flashinfer:
        if (why := missing_reason()) is not None:
            console.warn(f"FlashInfer's rows are skipped: {why}")
    ncu = None
    if source == "ncu":
        from questprof.commands.bytes import ncu_bytes as ncu
    # a CPU times perf-counter passes, never a CUDA graph: meta.json's timing says what ran
    return Options(repeats=args.repeats or repeats,
                   warmup=warmup if args.warmup is None else args.warmup,
                   graph=bool(args.graph) and backend.is_gpu, layers=args.layers,
                   bytes_source=source if source == "cupti" else None, peers=peers,
                   flashinfer=flashinfer, peers_skipped=skipped, ncu=ncu, budget_table=table,
                   budgets_file=args.budgets_file or "", replay=replay_of(args))


def replay_of(args: SweepArgs) -> Replay | None:
    """The page cache's replayed selections the arguments ask for, or None."""
    if args.reuse_overlap is None and args.reuse_trace is None:
        return None
    return Replay(args.reuse_overlap, args.reuse_trace, args.reuse_steps)


def check_replay_configs(args: SweepArgs, configs) -> None:
    """One line (ConfigError) for a replay that a configuration cannot run, a trace file of
    another shape included, before anything is timed."""
    replay = replay_of(args)
    if replay is None:
        return
    if args.budgets_file:
        raise ConfigError("--budgets-file with a reuse replay: the Quest step walks one budget "
                          "table or one trace, not both")
    for cfg in configs:
        check_replay(replay, cfg)
        if replay.trace is not None:
            trace_for(replay, cfg)


def _grid(scenario, configs, backend, target: Path, args: SweepArgs, resume: bool, argv,
          opts, status) -> None:
    """run_sweep with progress, then the summary table and what was skipped."""
    from questprof import results
    from questprof.commands.sweep import row_keys, run_sweep
    from questprof.report.frames import summary_table

    total = sum(len(row_keys(c, opts.peers, opts.flashinfer)) for c in configs)
    with console.Ticker(scenario.name, total) as ticker:
        def step(row: dict, done: int, _total: int) -> None:
            ticker.update(done, f"{row['stage']:9} L={row['length']} B={row['batch']} "
                                f"S={row['page_size']}")
        run_sweep(scenario, configs, backend, target, opts, resume=resume, progress=step,
                  command=" ".join(["questprof", *argv]),
                  meta_extra={"args": args.as_dict(), "bytes": status})
    df, _ = results.load(target)
    table, fixed = console.fold(summary_table(df), ("batch", "page_size", "budget", "mode"))
    console.out.print(console.table(table, f"{scenario.name} ({fixed}): median ms per layer, "
                                           "speedup = fastest dense / quest, rho = "
                                           f"{model.rho_text(scenario.model)}"))
    for line in skipped_lines(df):
        console.warn(line)


def _done_extras(target: Path) -> set[str]:
    """Stages beside the grid ('context-parallel', 'e2e', 'fidelity') already in target: a
    resumed sweep does not add their rows twice."""
    from questprof import results

    return {r.get("stage") for r in results.read_rows(target)} & {"context-parallel", "e2e",
                                                                  "fidelity"}


def _extras(scenario, configs, backend, target: Path, args: SweepArgs) -> None:
    """The context-parallel, end-to-end and fidelity measurements asked for (and not done)."""
    import pandas as pd

    done = _done_extras(target)
    if args.gpus > 1 and "context-parallel" not in done:
        from questprof.commands.context_parallel import run_context_parallel

        rows = run_context_parallel(scenario, configs, target, args.gpus)
        df = pd.DataFrame(rows)[["length", "batch", "page_size", "budget", "phase", "median_ms"]]
        console.out.print(console.table(df, f"context-parallel Quest on {args.gpus} GPUs"))
    if args.e2e_on and "e2e" not in done:
        from questprof.commands.e2e import E2E_LENGTHS, run_e2e

        grid = sorted({c.length for c in configs})
        lengths = ([n for n in E2E_LENGTHS if grid[0] <= n <= grid[-1]] or grid) \
            if args.e2e is None else grid
        rows = run_e2e(scenario, configs, backend, target, args.e2e_page_size,
                       args.e2e_budget, lengths)
        cols = ["length", "step_ms_dense", "step_ms_quest", "attention_fraction",
                "amdahl_predicted", "measured_speedup", "predicted_4bit", "status"]
        df = pd.DataFrame(rows)
        df = df[[c for c in cols if c in df]]
        console.out.print(console.table(df, "end-to-end decode step (all layers)"))
    if "fidelity" not in done:
        _fidelity(scenario, configs, backend, target, args)


def _fidelity(scenario, configs, backend, target: Path, args: SweepArgs) -> None:
    """The fidelity rows the sweep adds (commands.fidelity.sweep_fidelity_plan); a model that
    cannot run here is one yellow line, and the grid's rows stay."""
    from questprof.commands.fidelity import fidelity_rows_for_sweep, sweep_fidelity_plan

    plan = sweep_fidelity_plan(args.fidelity, args.fidelity_model, backend, settings(configs))
    if plan is None:
        return
    log = lambda msg: console.err.print(f"fidelity: {msg}", highlight=False,  # noqa: E731
                                        markup=False)
    try:
        fidelity_rows_for_sweep(scenario, configs, backend, target, log=log, model=plan)
    except ConfigError as exc:
        console.warn(f"fidelity not added ({plan}): {exc}")


def sweep_command(given: SweepArgs, out_dir: Path | None, resume: Path | None, argv) -> Path:
    """The whole `questprof sweep`: returns the results directory (report not yet written)."""
    args = resolve_args(resume, given, out_dir)
    if resume is None and out_dir is not None:
        from questprof.results import check_new_run

        check_new_run(out_dir, resumable=True)
    scenario, configs = configs_from_args(args.as_dict())
    args, table = apply_table(args, scenario.model.layers)
    if table is not None:  # the table's page size, largest budget and mode
        scenario, configs = configs_from_args(args.as_dict())
    backend = get_backend(args.backend)
    if resume is not None:
        check_backend(resume, timing_backend(backend).name)
    # e2e as given (None: on a GPU with torch, at E2E_LENGTHS) stays in meta.json for --resume
    args = replace(args, e2e_on=(backend.is_gpu and _torch_gpu()) if args.e2e is None
                   else args.e2e)
    check_shape(scenario.model, backend)
    check_cache(scenario.model, backend)
    check_extras(args, backend)
    check_replay_configs(args, configs)
    source, status = byte_source(args.bytes_source, backend)
    console.banner(backend)
    if status["reason"] and args.bytes_source == "auto" and backend.is_gpu:
        console.warn(f"DRAM bytes not measured: {status['reason']}")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    target = resume or out_dir or Path("reports") / f"{scenario.name}-{stamp}"
    opts = _options(args, backend, source, table)
    announce(scenario, configs, backend, args, opts, resume)
    start = time.perf_counter()
    try:
        _grid(scenario, configs, backend, target, args, resume is not None, argv, opts, status)
        _extras(scenario, configs, backend, target, args)
    except KeyboardInterrupt:
        interrupted(target)
    from questprof.results import append_rows

    append_rows(target, [], job_seconds=time.perf_counter() - start)
    return target


def interrupted(out_dir: Path) -> None:
    """One line on what Ctrl-C left on disk, then exit 130."""
    from questprof import results

    kept = len(results.read_rows(out_dir))
    console.err.print(f"interrupted: {kept} finished rows kept in {out_dir}; "
                      f"continue with: questprof sweep --resume {out_dir}", highlight=False)
    raise typer.Exit(130)
