"""The report's "several GPUs" section: context-parallel Quest against one GPU.

Rows have stage 'context-parallel' and a `phase`: exact_step, cheap_step, the phases and
all-gathers of the exact step timed alone (local_candidates, gather_candidates, select,
local_attention, gather_partials, merge), and single_gpu_step (one GPU over the whole cache,
the same loop); median_ms is the slowest rank's, per layer. Runs before issue 15 carry other
phase names and no single_gpu_step: they get the phase table only.
"""

from __future__ import annotations

import pandas as pd

from questprof.core.sharding import step_goal_ms
from questprof.report.frames import fmt_tokens
from questprof.report.html import esc, table

KEY = ["gpus", "page_size", "budget", "batch", "length"]
METHOD = ("<p class=\"note\">Each GPU replays the whole step of a layer as one CUDA graph (local "
          "estimate, top-(K+1) candidates, all-gather, exact global top-K, local sparse "
          "attention, all-gather of (output, lse), merge) over a cold pass of layers, timed "
          "with CUDA events like the single-GPU Quest step beside it; each phase and each "
          "all-gather is also timed alone the same way. Goal: step &le; 1.5 &times; (single-GPU "
          "step / N + one all-gather of candidates).</p>")


def verdict(rows: pd.DataFrame) -> pd.DataFrame:
    """Per configuration: exact and cheap steps, single-GPU step, speedup, goal (ms), miss rate,
    bytes share, and whether the N GPUs beat one."""
    wide = rows.pivot_table(index=KEY, columns="phase", values="median_ms", aggfunc="max")
    if "single_gpu_step" not in wide or "exact_step" not in wide:
        return pd.DataFrame()
    out = wide.reset_index()
    first = rows.groupby(KEY, as_index=False).first()
    out = out.merge(first[KEY + [c for c in ("cheap_variant_miss_rate", "gpu_read_bytes_max",
                                            "single_read_bytes") if c in first]], on=KEY)
    out["speedup"] = out["single_gpu_step"] / out["exact_step"]
    out["goal_ms"] = [step_goal_ms(s, g, n) for s, g, n in
                      zip(out["single_gpu_step"], out.get("gather_candidates", pd.Series(
                          [None] * len(out))), out["gpus"])]
    out["beats"] = out["speedup"] > 1
    if "cheap_step" in out:
        out["cheap_beats"] = out["single_gpu_step"] > out["cheap_step"]
    return out.sort_values(KEY)


def beats_from(v: pd.DataFrame, column: str = "beats", step: str = "the exact step") -> list[str]:
    """For each (gpus, page size, budget, batch): the shortest length from which `step` on N GPUs
    (column: its verdict) beats one GPU at every longer length measured, in words."""
    lines = []
    for (gpus, size, budget, batch), g in v.groupby(KEY[:-1], sort=True):
        g = g.sort_values("length")
        losing = g.loc[~g[column].astype(bool), "length"]
        later = g[g["length"] > losing.max()] if len(losing) else g
        where = (f"from {fmt_tokens(later['length'].iloc[0])} tokens" if len(later)
                 else f"at no length measured (up to {fmt_tokens(g['length'].max())})")
        lines.append(f"{gpus} GPUs beat one with {step} {where}: batch {batch}, page size "
                     f"{size}, budget {fmt_tokens(budget)}.")
    return lines


def _us(v) -> str:
    return "" if v is None or pd.isna(v) else f"{v * 1e3:,.1f}"


def _verdict_table(v: pd.DataFrame) -> str:
    shown = v.assign(
        length_t=v["length"].map(fmt_tokens), budget_t=v["budget"].map(fmt_tokens),
        **{f"{c}_us": v[c].map(_us) for c in ("exact_step", "cheap_step", "single_gpu_step",
                                               "gather_candidates", "goal_ms") if c in v},
        x=v["speedup"].map(lambda s: f"{s:.2f}"),
        within=[("yes" if s <= g else "no") if g is not None and not pd.isna(g) else ""
                for s, g in zip(v["exact_step"], v["goal_ms"])])
    columns = {"gpus": "GPUs", "length_t": "length", "batch": "batch", "page_size": "page size",
               "budget_t": "budget", "exact_step_us": "step (us/layer)",
               "single_gpu_step_us": "one GPU (us/layer)", "x": "one GPU / step",
               "cheap_step_us": "K/N-per-GPU step", "gather_candidates_us": "all-gather (us)",
               "goal_ms_us": "goal (us)", "within": "within goal"}
    columns = {k: h for k, h in columns.items() if k in shown}
    numeric = {c for c in columns if c.endswith("_us") or c == "x"}
    return table(shown, columns, "cp-verdict", numeric=numeric, best=shown["beats"])


def _phase_table(rows: pd.DataFrame) -> str:
    rows = rows.assign(gpus=rows["gpus"].astype(int),  # float in a frame shared with NaN rows
                       us=(rows["median_ms"] * 1e3).map(lambda v: f"{v:,.1f}"),
                       miss=rows["cheap_variant_miss_rate"].map(lambda v: f"{v:.1%}"),
                       budget_t=rows["budget"].map(fmt_tokens),
                       length_t=rows["length"].map(fmt_tokens))
    columns = {"gpus": "GPUs", "length_t": "length", "batch": "batch", "page_size": "page size",
               "budget_t": "budget", "phase": "phase", "us": "us (slowest rank, median)",
               "miss": "K/N-per-GPU variant misses"}
    if "gpu_read_bytes_max" in rows:  # runs before the byte columns existed lack them
        rows = rows.assign(share=(rows["gpu_read_bytes_max"] / rows["single_read_bytes"]).map(
            lambda v: f"{v:.3f}"))
        columns["share"] = "formula bytes, busiest GPU / one GPU"
    return table(rows, columns, "cp-table", numeric={"us"})


def section(df: pd.DataFrame) -> str:
    """The section's HTML from all rows of a run (those of stage 'context-parallel')."""
    rows = df[df["stage"] == "context-parallel"] if "stage" in df else df.iloc[0:0]
    if rows.empty:
        return ("<p>This run did not measure context-parallel Quest "
                "(<code>questprof sweep --gpus N</code> on a host with N GPUs).</p>")
    rows = rows.assign(gpus=rows["gpus"].astype(int))
    v = verdict(rows)
    if v.empty:
        return _phase_table(rows)
    said = beats_from(v) + (beats_from(v, "cheap_beats", "the K/N-per-GPU step (no candidate "
                                                       "all-gather)") if "cheap_beats" in v else [])
    lines = "".join(f"<li>{esc(t)}</li>" for t in said)
    return METHOD + f"<ul>{lines}</ul>" + _verdict_table(v) + _phase_table(rows)
