"""What a sweep says on the console around its grid: before it starts, the model shape it times
(one GPU's share under tensor parallelism), the grid a config.json falls back to, and the
configurations left with about how long they take; after it, what was skipped and why."""

from __future__ import annotations

from pathlib import Path

from questprof import console
from questprof.backends import timing_backend
from questprof.commands.sweep_time import sweep_seconds
from questprof.core.scenarios import grid_note
from questprof.core.stages import ROW_STAGES

REASONS_SHOWN = 2  # skipped-row causes printed; the report lists every one


def count(n: int, word: str) -> str:
    """'1 configuration', '4 configurations'."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def settings(configs) -> int:
    """Page size, budget and mode combinations of the grid: what a recommendation chooses from."""
    return len({(c.page_size, c.budget, c.mode) for c in configs})


def _say(text: str) -> None:
    console.err.print(text, highlight=False, markup=False)


def announce(scenario, configs, backend, args, opts, resumed: Path | None) -> None:
    """The shape, then the configurations left to time (a resume: those not yet on disk) on
    which backend and about how long they take (commands/sweep_time.py)."""
    from questprof.commands.fidelity import sweep_fidelity_plan
    from questprof.commands.sweep import remaining
    from questprof.results import done_keys

    if scenario.note:  # a config.json: where its shape comes from
        _say(scenario.note)
    if note := grid_note(scenario, args.as_dict()):
        _say(note)
    _say(f"model {scenario.name}: {scenario.model.text()}")
    if line := tier_line(configs[0], backend, args.reuse_overlap, args.reuse_trace):
        _say(line)
    left = remaining(configs, opts, done_keys(resumed) if resumed else set())
    fidelity = sweep_fidelity_plan(args.fidelity, args.fidelity_model, backend,
                                   settings(configs))
    extras = (f"(bytes: {args.bytes_source}, e2e: {args.e2e_on}, fidelity: "
              f"{fidelity or 'none'})")
    every = count(len(configs), "configuration")
    if resumed is not None and not left:
        held = (f"the one configuration of {resumed} is" if len(configs) == 1 else
                f"all {every} of {resumed} are")
        _say(f"sweep {scenario.name}: {held} on disk, none left to time {extras}")
        return
    what = every if resumed is None else f"{len(left)} of {every} left in {resumed}"
    minutes = sweep_seconds(left, backend) / 60
    _say(f"sweep {scenario.name}: {what} on the {timing_backend(backend).name} backend, about "
         f"{max(minutes, 0.1):.1f} min {extras}")


def tier_line(cfg, backend, overlap: float | None = None, trace: str | None = None) -> str:
    """What a host-tier run times and models, in one line ('' over HBM); `overlap` / `trace`:
    the selection sequence a page cache's rows replay (sweep --reuse-overlap / --reuse-trace)."""
    if cfg.kv_tier == "hbm":
        return ""
    cache = (f", an HBM cache of {cfg.hbm_pages} pages per (request, KV head)" if cfg.hbm_pages
             else "")
    where = ("in pinned host memory read over the link" if backend.is_gpu else
             "on the CPU, where the host is the host: the same work as over HBM, the link "
             "bytes modelled (core/tier.py)")
    replay = (f"the trace {trace}" if trace else
              f"a synthetic sequence of overlap {overlap:g} with the step before"
              if overlap is not None else "")
    if cfg.hbm_pages and replay:
        return (f"tier: K and V pages {where}; summaries in {cfg.summary_tier}{cache}. Attention "
                f"and the Quest step replay {replay} through the cache; the other stages' pools "
                f"are random")
    return (f"tier: K and V pages {where}; summaries in {cfg.summary_tier}{cache}. The pools "
            f"are random: no step-to-step reuse, every chosen page misses (questprof reuse "
            f"measures it on a real model)")


def skipped_lines(df) -> list[str]:
    """One line for each cause of skipped rows of the grid (out of memory, peers that cannot
    run here), with how many configurations and which; the Quest rows of a budget that covers
    the whole length, dense by design, are not counted."""
    from questprof.commands.sweep import DENSE_REASON

    if df.empty or "status" not in df:
        return []
    grid = df[df["stage"].isin(ROW_STAGES)]
    skipped = grid[(grid["status"] == "skipped") & (grid["reason"] != DENSE_REASON)]
    total = grid["config_key"].nunique()
    lines = []
    for reason, rows in sorted(skipped.groupby("reason"), key=lambda kv: -len(kv[1])):
        keys = rows["config_key"].unique()
        whole = len(rows) == len(grid[grid["config_key"].isin(keys)])
        what = "" if whole else f"the {', '.join(sorted(set(rows['impl'])))} rows of "
        where = _where(rows)
        lines.append(f"skipped: {what}{len(keys)} of {count(total, 'configuration')} "
                     f"({where}): {reason}")
    if len(lines) > REASONS_SHOWN:
        rest = len(lines) - REASONS_SHOWN + 1
        lines = lines[:REASONS_SHOWN - 1] + [f"skipped: and rows for {rest} more causes "
                                             "(report.html lists them)"]
    return lines


def _where(rows) -> str:
    """'batch 8, 64k..128k tokens': the batches and lengths of skipped rows."""
    from questprof.report.frames import fmt_tokens

    batches = ",".join(str(b) for b in sorted(set(rows["batch"])))
    lengths = sorted(set(rows["length"]))
    span = fmt_tokens(lengths[0]) + (f"..{fmt_tokens(lengths[-1])}" if len(lengths) > 1 else "")
    return f"batch {batches}, {span} tokens"
