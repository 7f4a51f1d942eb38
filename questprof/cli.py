"""The questprof command line: each command is a few lines over a function of its own module.

Bad input (ConfigError, BackendUnavailable, a missing file) is one red line on stderr and exit
status 2; Ctrl-C during a sweep keeps every finished row and exits 130. Rich lives only here.
"""

from __future__ import annotations

import functools
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from questprof.backends import BackendUnavailable
from questprof.config import ConfigError

app = typer.Typer(help="Profile Quest (query-aware sparse attention) stage by stage on a GPU.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

USER_ERRORS = (ConfigError, BackendUnavailable, FileNotFoundError, NotADirectoryError)
DEFAULT_SCENARIO = "longchat-7b"
# Defaults of the sweep options; None in the signature so --resume can take the first run's.
SWEEP_DEFAULTS = {"scenario": DEFAULT_SCENARIO, "backend": "auto", "graph": True, "e2e": False,
                  "e2e_budget": 2048, "e2e_page_size": 16, "gpus": 1}
HEADERS = {"length": "L", "batch": "B", "page_size": "S", "dense_ms": "dense",
           "quest_ms": "quest", "rho_formula": "rho", "median_ms_a": "A ms", "median_ms_b": "B ms"}
# is_gpu -> (repeats, warmup); CPU times of the reference are context, not the product, and
# three passes keep the longchat-7b 2k..128k grid within minutes on a laptop.
TIMING_DEFAULTS = {True: (20, 3), False: (3, 0)}


def user_errors(fn):
    """Turn user-input errors into one red line on stderr and exit status 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
            err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
            raise typer.Exit(2) from None
    return wrapper


def _banner(backend) -> None:
    """The yellow warning that times are CPU times when the NumPy backend runs."""
    if backend.is_gpu:
        return
    reason = backend.fallback_reason or "--backend numpy"
    err.print(f"[yellow]No usable GPU ({escape(reason)}): running the NumPy reference backend; "
              "times are CPU times, not GPU kernel times[/yellow]", highlight=False)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    console=err, transient=False)


def _fmt(value, digits: int = 3) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _fold(df, columns):
    """(df without the `columns` that hold one value, 'name=value, ...' of those), short headers."""
    fixed = [c for c in columns if c in df and len(df) and df[c].nunique(dropna=False) == 1]
    text = ", ".join(f"{HEADERS.get(c, c)}={df[c].iloc[0]}" for c in fixed)
    return df.drop(columns=fixed).rename(columns=HEADERS), text


def _table(df, title: str, styles: dict | None = None) -> Table:
    """A Rich table of a DataFrame; styles maps a cell value to a style (e.g. verdicts)."""
    table = Table(title=title, title_justify="left")
    for col in df.columns:
        table.add_column(str(col), justify="right" if df[col].dtype.kind in "if" else "left")
    for _, row in df.iterrows():
        cells = [_fmt(v) for v in row]
        style = next((s for v, s in (styles or {}).items() if v in cells), None)
        table.add_row(*cells, style=style)
    return table


def _write_report(out_dir: Path) -> None:
    """report.html from the results in out_dir, through questprof.report when it is available."""
    from questprof import results

    try:
        from questprof.report import write_report
    except ImportError as exc:
        err.print("[yellow]report.html not written: questprof.report is not available "
                  f"({escape(str(exc))})[/yellow]", highlight=False)
        return
    df, meta = results.load(out_dir)
    path = write_report(df, meta, out_dir / "report.html")
    out.print(f"report: {path or out_dir / 'report.html'}", highlight=False)


def _resume_args(resume: Optional[Path], given: dict) -> dict:
    """The sweep's arguments: those given, else the first run's (from meta.json), else defaults."""
    first = {}
    if resume is not None:
        from questprof import results

        first = results.load(resume)[1].get("args", {})
    merged = {k: v if v is not None else first.get(k) for k, v in given.items()}
    return {k: v if v is not None else SWEEP_DEFAULTS.get(k) for k, v in merged.items()}


def _configs(args: dict):
    """(scenario, configurations) for the sweep's arguments."""
    from questprof.config import expand, load_scenario

    for name in ("layers", "repeats", "warmup"):
        least = 0 if name == "warmup" else 1
        if args[name] is not None and args[name] < least:
            raise ConfigError(f"--{name} {args[name]} must be at least {least}")
    scenario = load_scenario(args["scenario"])
    modes = args["mode"].split(",") if args["mode"] else None
    configs = expand(scenario, lengths=args["lengths"], batches=args["batch"],
                     page_sizes=args["page_size"], budgets=args["budget"], modes=modes)
    return scenario, configs


def _run(scenario, configs, backend, out_dir: Path, args: dict, resume: bool) -> None:
    """run_sweep with a progress bar; the summary table at the end."""
    from questprof import results, sweep

    repeats, warmup = TIMING_DEFAULTS[backend.is_gpu]
    with _progress() as bar:
        task = bar.add_task(scenario.name, total=len(configs) * len(sweep.STAGES))

        def step(row: dict, done: int, total: int) -> None:
            what = f"{row['stage']:9} L={row['length']} B={row['batch']} S={row['page_size']}"
            bar.update(task, completed=done, total=total, description=what)

        sweep.run_sweep(scenario, configs, backend, out_dir, layers=args["layers"],
                        repeats=args["repeats"] or repeats,
                        warmup=warmup if args["warmup"] is None else args["warmup"],
                        resume=resume, progress=step, graph=bool(args["graph"]),
                        command=" ".join(["questprof", *sys.argv[1:]]),
                        meta_extra={"args": {k: str(v) if isinstance(v, Path) else v
                                             for k, v in args.items()}})
    df, _ = results.load(out_dir)
    table, fixed = _fold(results.summary_table(df), ("batch", "page_size", "budget", "mode"))
    out.print(_table(table, f"{scenario.name} ({fixed}): median ms per layer, "
                            "speedup = dense / quest"))


def _interrupted(out_dir: Path) -> None:
    """One line on what Ctrl-C left on disk, then exit 130."""
    from questprof import results

    kept = len(results.read_rows(out_dir))
    err.print(f"interrupted: {kept} finished rows kept in {out_dir}; "
              f"continue with: questprof sweep --resume {out_dir}", highlight=False)
    raise typer.Exit(130)


def _check_extras(args: dict, backend) -> None:
    """--e2e and --gpus before any work: a clear error instead of a failure an hour in."""
    from questprof.config import validate_budget, validate_page_size

    if args["e2e"]:
        validate_page_size(args["e2e_page_size"])
        validate_budget(args["e2e_budget"], args["e2e_page_size"])
    if args["gpus"] < 1:
        raise ConfigError(f"--gpus {args['gpus']} must be at least 1")
    if args["gpus"] > 1:
        if not backend.is_gpu:
            raise ConfigError(f"--gpus {args['gpus']} needs the cupy backend and GPUs")
        import cupy

        have = cupy.cuda.runtime.getDeviceCount()
        if args["gpus"] > have:
            raise ConfigError(f"--gpus {args['gpus']}: this host has {have} GPU(s)")


def _run_extras(scenario, configs, backend, out_dir: Path, args: dict) -> None:
    """The context-parallel and end-to-end measurements asked for, each with a short table."""
    from questprof import extras

    if args["gpus"] > 1:
        rows = extras.run_context_parallel(scenario, configs, out_dir, args["gpus"])
        import pandas as pd

        df = pd.DataFrame(rows)[["length", "batch", "page_size", "budget", "phase", "median_ms"]]
        out.print(_table(df, f"context-parallel Quest on {args['gpus']} GPUs (ms per layer)"))
    if args["e2e"]:
        rows = extras.run_e2e(scenario, configs, backend, out_dir, args["e2e_page_size"],
                              args["e2e_budget"])
        import pandas as pd

        cols = ["length", "step_ms_dense", "step_ms_quest", "attention_fraction",
                "amdahl_predicted", "measured_speedup", "predicted_4bit", "status"]
        df = pd.DataFrame(rows)[[c for c in cols if c in rows[0]]] if rows else pd.DataFrame()
        names = {"step_ms_dense": "dense ms", "step_ms_quest": "quest ms",
                 "attention_fraction": "attn share", "amdahl_predicted": "Amdahl",
                 "measured_speedup": "measured", "predicted_4bit": "4-bit pred."}
        out.print(_table(df.rename(columns=names), "end-to-end decode step (all layers)"))


@app.command()
@user_errors
def sweep(
    scenario: Annotated[Optional[str], typer.Option(
        help=f"Scenario name (scenarios/<name>.toml) or path to a .toml file "
             f"[default: {DEFAULT_SCENARIO}]")] = None,
    lengths: Annotated[Optional[str], typer.Option(
        help="Context lengths in tokens: '2k..128k' (doubling), '1k..8k+1k', '4k,100000'")] = None,
    batch: Annotated[Optional[str], typer.Option(help="Batch sizes, e.g. '1,8' or '1..16'")] = None,
    page_size: Annotated[Optional[str], typer.Option(
        help="Page sizes in tokens: 8, 16, 32, 64")] = None,
    budget: Annotated[Optional[str], typer.Option(
        help="Token budgets, whole pages, e.g. '512..4096'")] = None,
    mode: Annotated[Optional[str], typer.Option(
        help="GQA selection modes, comma-separated: per-head, shared-max, shared-mean")] = None,
    backend: Annotated[Optional[str], typer.Option(
        help="auto, cupy or numpy [default: auto]")] = None,
    layers: Annotated[Optional[int], typer.Option(
        help="Simulated layers per timed pass [default: >= 4x L2 on a GPU, 1 on the CPU]")] = None,
    repeats: Annotated[Optional[int], typer.Option(
        help="Timed passes per stage [default: 20 on a GPU, 3 on the CPU]")] = None,
    warmup: Annotated[Optional[int], typer.Option(
        help="Untimed passes first [default: 3 on a GPU, 0 on the CPU]")] = None,
    out_dir: Annotated[Optional[Path], typer.Option(
        "--out", help="Results directory [default: reports/<scenario>-<timestamp>/]")] = None,
    resume: Annotated[Optional[Path], typer.Option(
        help="Continue the sweep in this results directory (its arguments unless given "
             "again)")] = None,
    graph: Annotated[Optional[bool], typer.Option(
        "--graph/--no-graph", help="Time a CUDA-graph replay of each pass, as serving engines "
        "run decode; --no-graph times Python launches too [default: --graph]")] = None,
    e2e: Annotated[Optional[bool], typer.Option(
        "--e2e/--no-e2e", help="Also time whole decode steps of a random-weight decoder shaped "
        "like the scenario's model, dense vs Quest (Amdahl end to end) [default: --no-e2e]")] = None,
    e2e_budget: Annotated[Optional[int], typer.Option(
        help="Token budget of the end-to-end steps [default: 2048]")] = None,
    e2e_page_size: Annotated[Optional[int], typer.Option(
        help="Page size of the end-to-end steps [default: 16]")] = None,
    gpus: Annotated[Optional[int], typer.Option(
        help="Also run context-parallel Quest over this many GPUs of this host (NCCL), "
             "beside the single-GPU grid [default: 1]")] = None,
) -> None:
    """Time every Quest stage over a grid; write results.parquet, meta.json and report.html."""
    given = {k: v for k, v in locals().items() if k not in ("out_dir", "resume")}
    args = _resume_args(resume, given)
    scenario_obj, configs = _configs(args)
    from questprof.backends import get_backend

    chosen = get_backend(args["backend"])
    _check_extras(args, chosen)
    _banner(chosen)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    target = resume or out_dir or Path("reports") / f"{scenario_obj.name}-{stamp}"
    try:
        _run(scenario_obj, configs, chosen, target, args, resume is not None)
        _run_extras(scenario_obj, configs, chosen, target, args)
    except KeyboardInterrupt:
        _interrupted(target)
    _write_report(target)
    out.print(f"results: {target}", highlight=False)


@app.command()
def doctor() -> None:
    """What this machine can measure: GPU, driver, CuPy, CUPTI, ncu, NVML, torch."""
    from questprof.machine import doctor_rows

    table = Table(title="questprof doctor", title_justify="left")
    for col in ("item", "status", "version or reason"):
        table.add_column(col)
    for item, status, detail in doctor_rows():
        table.add_row(item, f"[{'green' if status == 'ok' else 'red'}]{status}", detail)
    out.print(table)


@app.command()
@user_errors
def report(results_dir: Annotated[Path, typer.Argument(help="A results directory")]) -> None:
    """Rebuild report.html from the results in a directory."""
    from questprof import results

    results.load(results_dir)  # a clear error when it is not a results directory
    _write_report(results_dir)


@app.command()
@user_errors
def compare(
    dir_a: Annotated[Path, typer.Argument(help="Baseline results directory")],
    dir_b: Annotated[Path, typer.Argument(help="Results directory to judge against A")],
    threshold: Annotated[float, typer.Option(
        help="Smallest change of the median that counts, as a fraction (0.05 = 5%)")] = 0.05,
    as_json: Annotated[bool, typer.Option("--json", help="Print rows as JSON lines")] = False,
) -> None:
    """Per configuration and stage: SAME / FASTER / SLOWER; exit 1 when anything is slower."""
    from questprof import results

    table = results.compare(dir_a, dir_b, threshold)
    if as_json:
        for row in table.to_dict(orient="records"):
            out.print(json.dumps(row, default=str), highlight=False)
    else:
        styles = {"SLOWER": "red", "FASTER": "green", "MISSING": "yellow"}
        shown, fixed = _fold(table, results.COMPARE_KEYS)
        out.print(_table(shown, f"B={dir_b} against A={dir_a} ({fixed}), median ms per layer",
                         styles))
    if (table["verdict"] == "SLOWER").any():
        raise typer.Exit(1)


@app.command()
@user_errors
def bench(
    quick: Annotated[bool, typer.Option(help="Only the MHA batch-1 32K and 128K cases")] = False,
    peers: Annotated[bool, typer.Option(help="Time the torch peers beside ours")] = True,
    graph: Annotated[bool, typer.Option(help="Time CUDA-graph replays of each pass")] = True,
    repeats: Annotated[int, typer.Option(help="Timed passes per stage")] = 20,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the rows here")] = None,
) -> None:
    """Every kernel against the read bandwidth measured in the same run, and the torch peers."""
    from questprof import bench as bench_mod
    from questprof.backends import get_backend

    get_backend("cupy")  # one clear line and exit 2 without a GPU
    rows = bench_mod.run_bench(bench_mod.default_cases(quick), repeats, graph, peers)
    if json_out is not None:
        json_out.write_text(json.dumps(rows, indent=1, default=str), encoding="utf-8")
    out.print(bench_mod.format_table(rows), highlight=False)
    out.print(bench_mod.format_goals(rows), highlight=False)
    out.print(bench_mod.format_bounds(rows), highlight=False)


@app.command("bytes")
@user_errors
def bytes_check(
    check_formula: Annotated[bool, typer.Option(
        "--check-formula/--no-check-formula",
        help="Judge measured bytes against the model (exit 1 beyond --tolerance)")] = True,
    scenario: Annotated[str, typer.Option(help="Scenario name or .toml path")] = "llama3-8b",
    lengths: Annotated[str, typer.Option(help="Context lengths, range syntax")] = "16k,64k",
    batch: Annotated[str, typer.Option(help="Batch sizes")] = "1",
    page_size: Annotated[str, typer.Option(help="Page sizes")] = "16",
    budget: Annotated[str, typer.Option(help="Token budgets, whole pages")] = "1024,4096",
    mode: Annotated[Optional[str], typer.Option(help="GQA selection modes")] = None,
    source: Annotated[str, typer.Option(help="cupti, ncu, nvml or all")] = "cupti",
    tolerance: Annotated[float, typer.Option(help="Allowed relative difference")] = 0.05,
    protocol: Annotated[str, typer.Option(
        help="CUPTI cold-cache protocol: rotate (layers with their own pools) or flush "
             "(an L2-evicting read after each call, subtracted)")] = "rotate",
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the table here")] = None,
) -> None:
    """DRAM bytes each stage really reads (CUPTI, ncu, NVML) against the formula, stage by stage.

    Exit 0 when every judged stage is within tolerance, 1 when one is not, 3 when no
    measurement source is available here (no GPU, no CUPTI).
    """
    from questprof import bytecheck, byterows

    if source not in ("cupti", "ncu", "nvml", "all"):
        raise ConfigError(f"--source {source!r}: expected cupti, ncu, nvml or all")
    if protocol not in bytecheck.PROTOCOLS:
        raise ConfigError(f"--protocol {protocol!r}: expected rotate or flush")
    args = {"scenario": scenario, "lengths": lengths, "batch": batch, "page_size": page_size,
            "budget": budget, "mode": mode, "layers": None, "repeats": None, "warmup": None}
    _, configs = _configs(args)
    result = bytecheck.run_check(configs, source, tolerance,
                                 log=lambda line: err.print(line, highlight=False),
                                 protocol=protocol)
    if json_out is not None:
        json_out.write_text(result.to_json(), encoding="utf-8")
    if result.rows:
        out.print(byterows.table(result), highlight=False)
    else:
        err.print(" ".join(result.lines), highlight=False)
    if check_formula or result.status == byterows.EXIT_NO_SOURCE:
        raise typer.Exit(result.status)
