"""`questprof serve`: a request mix through transformers' continuous batching, once per policy
and concurrency, with questprof's decode attention; per-token latency, time to first token,
tokens per second and the ragged decode steps, rows kept as each run ends (results.py's
writer), then the report."""

from __future__ import annotations

import importlib.util
from datetime import datetime
from pathlib import Path

import numpy as np

from questprof import results
from questprof.commands.fidelity import PACKAGES, SMOLLM2_NEEDS, install_line
from questprof.commands.serve_args import ServeArgs
from questprof.commands.serve_run import run_all
from questprof.core.config import ConfigError, parse_sizes, validate_budget, validate_page_size
from questprof.report.frames import crossovers, paired
from questprof.serving.mixes import named_mix, read_trace
from questprof.serving.paged_attention import POLICIES, Policy


def crossover_from(sweep: Path | None, page_size: int, budget: int) -> int | None:
    """The context length from which the sweep's Quest beat dense at this page size and
    budget (None: it never did); ConfigError when there is no sweep or no such pair in it."""
    if sweep is None:
        raise ConfigError("policy hybrid needs a sweep's crossover: give --sweep DIR")
    df = results.load(sweep)[0]
    for column, value in (("kv_tier", "hbm"), ("mode", "per-head")):  # what serve decodes:
        if column in df:                                                # HBM, per-head
            df = df[df[column].fillna(value) == value]
    cross = crossovers(paired(df))
    mine = cross[(cross["page_size"] == page_size) & (cross["budget"] == budget)]
    if mine.empty or set(mine["kind"]) == {"none"}:
        raise ConfigError(f"sweep {sweep} has no Quest/dense pair at page {page_size}, "
                          f"budget {budget}: hybrid has no crossover")
    found = mine.dropna(subset=["length"])
    return int(found["length"].max()) if len(found) else None


def check_counts(args: ServeArgs) -> None:
    """ConfigError in one line for a count that cannot run (each was a traceback before)."""
    for flag, value, low in (("--page-size", args.page_size, 1), ("--requests", args.requests, 1),
                             ("--output", args.output, 1), ("--seed", args.seed, 0),
                             ("--dense-layers", args.dense_layers, 0),
                             ("--rounds", args.rounds, 1),
                             ("--num-blocks", args.num_blocks, 1),
                             ("--max-batch-tokens", args.max_batch_tokens, 1)):
        if value is not None and value < low:
            raise ConfigError(f"{flag} {value}: expected a whole number >= {low}")


def policies(args: ServeArgs) -> list[Policy]:
    """The policies asked for, each checked; hybrid with the sweep's crossover."""
    check_counts(args)
    validate_page_size(args.page_size)  # the kernels' sizes, and transformers' blocks need >= 4
    validate_budget(args.budget, args.page_size)
    names = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not names or set(names) - set(POLICIES):
        raise ConfigError(f"bad --policy {args.policy!r}: expected some of {', '.join(POLICIES)}")
    if args.cuda_graph and args.engine != "transformers":
        raise ConfigError(f"--cuda-graph: transformers' graphs hold its own attention only; "
                          f"--engine {args.engine} plans each forward on the host")
    if args.engine == "transformers" and set(names) != {"dense"}:
        raise ConfigError("--engine transformers runs transformers' own attention, which is "
                          "dense: use --policy dense (Quest needs host, kernels or inplace)")
    out = []
    for name in dict.fromkeys(names):
        cross = crossover_from(args.sweep, args.page_size, args.budget) if name == "hybrid" \
            else None
        if name == "hybrid" and cross is None:  # Quest never won: hybrid is dense throughout
            cross = np.iinfo(np.int64).max
        out.append(Policy(name, args.page_size, args.budget, args.dense_layers, cross))
    return out


def mix_specs(args: ServeArgs):
    """The requests' lengths: the trace, else the named mix."""
    if args.trace is not None:
        if args.mix is not None:  # the trace was used and --mix (its --requests) ignored
            raise ConfigError(f"--trace and --mix {args.mix}: give one source of requests")
        return read_trace(args.trace)
    if args.mix is None:
        raise ConfigError("no requests: give --trace FILE or --mix uniform|log-uniform|longbench")
    lengths = parse_sizes(args.lengths) if args.lengths else None
    return named_mix(args.mix, lengths, args.requests, args.output, args.seed)


def check_installed(model: str) -> None:
    """ConfigError naming what serve needs that is not installed (torch and transformers run the
    loop; --model smollm2 also reads its GGUF) and the commands that install it."""
    names = ("torch", "transformers") + (SMOLLM2_NEEDS if model == "smollm2" else ())
    missing = [PACKAGES.get(n, n) for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise ConfigError(f"serve needs {', '.join(missing)} (transformers' continuous batching "
                          f"runs the model): {install_line('passkey', model)}")


def serve_command(args: ServeArgs, out_dir, argv, log=print) -> Path:
    """The whole `questprof serve`: returns the results directory."""
    chosen, specs = policies(args), mix_specs(args)  # the input's own errors first
    concurrency = parse_sizes(args.concurrency, "concurrency")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    target = Path(out_dir or Path("reports") / f"serve-{stamp}")
    results.check_new_run(target)  # a second run there would be drawn as one
    check_installed(args.model)
    return run_all(args, chosen, specs, concurrency, target, " ".join(["questprof", *argv]), log)
