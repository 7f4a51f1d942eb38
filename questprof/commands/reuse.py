"""`questprof reuse`: how many pages Quest's selection shares from one decode step to the next
on a real model, and the miss rate of a C-page HBM cache replaying it (fidelity/reuse.py), as
result rows; with the byte model's link bytes of sparse attention at that miss rate.

One row per (page size, budget, mode, layer, C); layer None sums the layers >= dense_layers
(its link bytes: every such layer's, one decode step). With --trace-out, one layer's selections
of one setting are also written as a reuse trace (core/reuse_trace.py) for `sweep --reuse-trace`,
and meta.json records its layer, steps and the miss rates of LRUPages replaying it.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from questprof.backends import get_backend
from questprof.commands.reuse_args import ReuseArgs
from questprof.core import reuse_trace
from questprof.core.config import (Config, ConfigError, ModelShape, check_modes, parse_sizes,
                                   validate_page_size, validate_seed)
from questprof.core.machine import git_fields, machine_info
from questprof.core.model import k_pages
from questprof.core.tier import tier_bytes
from questprof.fidelity import prompts
from questprof.fidelity.model_run import capture
from questprof.fidelity.models import load_model
from questprof.fidelity.reuse import Reuse, layer_reuse, layer_trace, trace_reuse
from questprof.fidelity.threads import one_thread
from questprof.results import ResultsWriter, check_joinable, check_out_file, now

CAPACITY_FACTORS = (1, 2, 4)  # C = K, 2K, 4K pages when --hbm-pages is not given


def settings(args: ReuseArgs) -> list[tuple[int, int, str, tuple[int, ...]]]:
    """(S, budget, mode, capacities) to measure; ConfigError for bad input, in one line."""
    validate_seed(args.seed, "--seed")
    if args.dense_layers is not None and args.dense_layers < 0:
        raise ConfigError(f"--dense-layers {args.dense_layers}: expected 0 or more")
    if args.steps < 2:
        raise ConfigError(f"--steps {args.steps}: reuse needs at least 2 decode steps")
    if args.prompts < 1:
        raise ConfigError(f"--prompts {args.prompts} must be at least 1")
    lengths = parse_sizes(args.length, "length")  # before the model loads (23 s for SmolLM2)
    if len(lengths) != 1:
        raise ConfigError(f"--length {args.length}: reuse takes one length, got {len(lengths)}")
    modes = check_modes(args.mode.split(","))
    out = []
    for s, b, m in itertools.product(parse_sizes(args.page_size, "page sizes"),
                                     parse_sizes(args.budget, "budgets"), modes):
        validate_page_size(s)  # before the model loads, and before the budget is judged by it
        if b % s:
            raise ConfigError(f"budget {b} tokens is not a whole number of {s}-token pages")
        if b >= lengths[0]:
            raise ConfigError(f"budget {b} tokens covers the whole {lengths[0]}-token prompt: "
                              "every page is chosen at every step, no reuse to measure")
        k = k_pages(b, s)
        caps = (tuple(parse_sizes(args.hbm_pages, "hbm pages")) if args.hbm_pages else
                tuple(f * k for f in CAPACITY_FACTORS))
        if min(caps) < k:
            raise ConfigError(f"--hbm-pages {min(caps)}: a page cache holds at least one "
                              f"step's {k} chosen pages (budget {b}, page size {s})")
        out.append((s, b, m, caps))
    return out


def trace_setting(args: ReuseArgs) -> tuple[int, int, str, tuple[int, ...]] | None:
    """(S, budget, mode, capacities) of the trace --trace-out writes, None without it;
    ConfigError in one line for a choice the run does not make (before the model loads)."""
    if args.trace_out is None:
        if args.trace_layer is not None or args.trace_mode is not None:
            raise ConfigError("--trace-layer and --trace-mode choose what --trace-out writes: "
                              "add --trace-out FILE.npz")
        return None
    runs = settings(args)
    pairs = sorted({(s, b) for s, b, _, _ in runs})
    if len(pairs) > 1:
        raise ConfigError(f"--trace-out writes the selections of one page size and budget; this "
                          f"run has {len(pairs)} {pairs}: give one --page-size and one --budget")
    modes = [m for _, _, m, _ in runs]
    shared = [m for m in modes if m != "per-head"]
    mode = args.trace_mode or ("shared-mean" if "shared-mean" in shared else
                               shared[0] if len(shared) == 1 else None)
    if mode is None or mode == "per-head":
        raise ConfigError(f"--trace-out: the page cache holds one page set per KV head, so a "
                          f"trace is of a shared mode; give --trace-mode among {', '.join(modes)} "
                          f"but per-head")
    if mode not in modes:
        raise ConfigError(f"--trace-mode {mode}: this run selects with {', '.join(modes)}")
    return next(r for r in runs if r[2] == mode)


def trace_layer(args: ReuseArgs, rows: list[dict], setting) -> tuple[int, str]:
    """The trace's layer and why: --trace-layer, else the measured layer whose overlap is the
    median (the lower middle one of an even count): a typical layer, not an extreme one."""
    if args.trace_layer is not None:
        return args.trace_layer, "--trace-layer"
    s, b, mode, capacities = setting
    measured = sorted((r["overlap"], r["layer"]) for r in rows
                      if r["layer"] is not None and r["hbm_pages"] == capacities[0]
                      and (r["page_size"], r["budget"], r["mode"]) == (s, b, mode))
    got, layer = measured[(len(measured) - 1) // 2]
    return layer, f"median overlap {got:.3f} of {len(measured)} layers"


def write_trace(caps: list, args: ReuseArgs, rows: list[dict], backend, log) -> dict:
    """Write --trace-out (module text), checked as `sweep --reuse-trace` checks it; returns
    what meta.json records of it."""
    setting = trace_setting(args)
    s, b, mode, capacities = setting
    layer, why = trace_layer(args, rows, setting)
    trace, first = layer_trace(caps, layer, s, k_pages(b, s), mode, backend)
    reuse_trace.check(trace, trace.lengths, s, k_pages(b, s), caps[0].kv_heads)
    path = reuse_trace.save(trace, args.trace_out)
    got = trace_reuse(trace, capacities)
    miss = {str(c): got.miss_rate(c) for c in capacities}
    left_out = (f"; the steps before {first} left out: the tail page moved at step {first}"
                if first else "")
    log(f"reuse trace {path}: layer {layer} ({why}), {mode}, page size {s}, budget {b}, "
        f"decode steps {first}..{caps[0].steps - 1} at {caps[0].length} tokens{left_out}; "
        f"overlap {got.overlap:.3f}, miss rate " +
        ", ".join(f"{rate:.3f} at C {c}" for c, rate in miss.items()))
    return {"path": str(path), "layer": layer, "layer_chosen": why, "page_size": s,
            "budget": b, "mode": mode, "first_step": first, "steps": trace.steps,
            "lengths": list(trace.lengths), "overlap": got.overlap, "miss_rate": miss}


def captures(args: ReuseArgs, log):
    """Captures of `prompts` passkey prompts of `length` tokens, `steps` decode steps each."""
    loaded = load_model(args.model, args.seed)
    if loaded.tokenizer is None:
        raise ConfigError(f"--model {args.model}: reuse needs a real model's passkey answers")
    length = parse_sizes(args.length, "length")[0]
    batch = prompts.passkeys(loaded.tokenizer, length, prompts.spread_depths(args.prompts),
                             args.seed)
    log(f"{loaded.name}: {args.prompts} passkey prompt(s) of {length} tokens, "
        f"{args.steps} decode steps")
    with one_thread():
        captured = capture(loaded, batch, args.steps, "passkey")
    return loaded.name, captured.captures


def _shape(name: str, cap) -> ModelShape:
    return ModelShape(name, cap.layers, cap.q_heads, cap.kv_heads, cap.head_dim, "fp16",
                      dense_layers=0)


def _row(meta: dict, cfg: Config, layer, got, capacity: int, heads: int) -> dict:
    """One row: the counts, and sparse attention's link bytes per layer (the batch at its
    length) by the byte model at the miss rate measured, beside those without a cache."""
    miss = got.miss_rate(capacity)
    union = got.pages / heads if cfg.mode == "per-head" and cfg.model.group > 1 else None
    link = tier_bytes(cfg, miss, union_pages=union)["attention"].link
    bare = tier_bytes(replace(cfg, hbm_pages=0), union_pages=union)["attention"].link
    return {**meta, "page_size": cfg.page_size, "budget": cfg.budget, "k_pages": cfg.k_pages,
            "mode": cfg.mode, "layer": layer, "hbm_pages": capacity, "pages_read": got.pages,
            "overlap": got.overlap, "misses": got.misses[capacity], "miss_rate": miss,
            "link_bytes_model": link, "link_bytes_no_cache": bare}


def reuse_rows(name: str, caps: list, args: ReuseArgs, backend) -> list[dict]:
    """Every row of the captures (one length), layers >= dense_layers and their sum."""
    cap = caps[0]
    shape = _shape(name, cap)
    heads = (cap.steps - 1) * len(caps) * cap.kv_heads  # (request, KV head) x counted steps
    meta = {"kind": "reuse", "model": name, "source": "passkey", "length": cap.length,
            "prompts": len(caps), "steps": cap.steps, "dense_layers": args.dense_layers,
            "q_heads": cap.q_heads, "kv_heads": cap.kv_heads, "head_dim": cap.head_dim}
    rows = []
    for s, b, m, caps_c in settings(args):
        cfg = Config(shape, cap.length, len(caps), s, b, m, kv_tier="host", hbm_pages=max(caps_c))
        per_layer = {layer: layer_reuse(caps, layer, s, b, m, caps_c, backend)
                     for layer in range(args.dense_layers, cap.layers)}
        every = Reuse(sum(r.pages for r in per_layer.values()),
                      sum(r.kept for r in per_layer.values()),
                      {c: sum(r.misses[c] for r in per_layer.values()) for c in caps_c})
        for c in caps_c:
            cfg_c = replace(cfg, hbm_pages=c)
            rows += [_row(meta, cfg_c, layer, got, c, heads) for layer, got in per_layer.items()]
            row = _row(meta, cfg_c, None, every, c, heads * len(per_layer))
            row["link_bytes_model"] *= len(per_layer)  # every layer's, the step's sum
            row["link_bytes_no_cache"] *= len(per_layer)
            rows.append(row)
    return rows


def reuse_command(args: ReuseArgs, out_dir, argv, log=print) -> tuple[Path, list[dict]]:
    """The whole `questprof reuse`: rows to a results directory; returns it and the rows."""
    settings(args)  # bad input: one line before the model loads
    if out_dir is not None:
        check_joinable(out_dir, "kind", "reuse", "reuse")
    trace_setting(args)
    if args.trace_out is not None:
        check_out_file(args.trace_out, "--trace-out")
    backend = get_backend(args.backend)
    name, caps = captures(args, log)
    layers = caps[0].layers
    if args.dense_layers >= layers:
        raise ConfigError(f"--dense-layers {args.dense_layers}: {name} has {layers} layers")
    if args.trace_layer is not None and not args.dense_layers <= args.trace_layer < layers:
        raise ConfigError(f"--trace-layer {args.trace_layer}: {name}'s layers measured are "
                          f"{args.dense_layers}..{layers - 1} (--dense-layers {args.dense_layers})")
    rows = reuse_rows(name, caps, args, backend)
    target = Path(out_dir or Path("reports") / f"reuse-{datetime.now():%Y%m%d-%H%M%S}")
    meta = {"command": " ".join(["questprof", *argv]), "kind": "reuse", "started": now(),
            "backend": backend.name, "args": args.__dict__, "machine": machine_info(),
            **git_fields(),
            "answers": [c.info.get("generated", "") for c in caps]}
    if args.trace_out is not None:
        meta["trace"] = write_trace(caps, args, rows, backend, log)
    if (target / "meta.json").is_file():  # a sweep's directory: its meta stays, ours joins it
        meta = {**json.loads((target / "meta.json").read_text(encoding="utf-8")), "reuse": meta}
    with ResultsWriter(target, meta) as writer:
        writer.extend(rows)
    return target, rows


def table_rows(rows: list[dict]) -> list[dict]:
    """The rows over all layers, as the command line prints them."""
    return [{"S": r["page_size"], "budget": r["budget"], "K": r["k_pages"], "mode": r["mode"],
             "C": r["hbm_pages"], "overlap": f"{r['overlap']:.3f}",
             "miss rate": f"{r['miss_rate']:.3f}",
             "link MB/step": f"{r['link_bytes_model'] / 1e6:.3f}",
             "no cache MB": f"{r['link_bytes_no_cache'] / 1e6:.3f}"}
            for r in rows if r["layer"] is None]
