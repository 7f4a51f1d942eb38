"""One self-contained HTML report of a run: `write_report(df, meta, path)` (the package imports
this module, and with it plotly, only when a report is drawn).

df holds result rows as notes/CONTRACTS.md defines them (one per configuration x stage); the
report reads length, batch, page_size, budget, mode, stage, status, reason, median_ms,
read_bytes, unmodelled_bytes, write_bytes, flops, measured_read_bytes, bytes_source,
rho_formula, sm_clock_mhz, mem_clock_mhz, throttled, backend. Missing mode means 'per-head'.
Rows with stage 'e2e' carry end-to-end steps; their columns are listed in report/amdahl.py.
meta is meta.json; beyond the contract it may carry heatmap_length (tokens) for section 5.

Sections: at a glance, crossover, speedup, roofline, bytes, heatmap, end to end, several GPUs,
machine. Rows with stage 'context-parallel' (sweep --gpus N) carry phase, gpus, median_ms,
cheap_variant_miss_rate and (since commit e6e5504, 2026-11-29) gpu_read_bytes_max /
single_read_bytes.
Every figure is a function of df; plotly.js is inlined once, so the file opens offline.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from questprof.core import model
from questprof.core.fp8 import E4M3
from questprof.results import write_atomic
from questprof.report import amdahl, figures, frames, hardware, measured_bytes, parallel
from questprof.report import tier as tier_report
from questprof.report import fidelity as fidelity_report
from questprof.report import selectors as selectors_report
from questprof.report import serving as serving_report
from questprof.report import verdict
from questprof.report.frames import CPU_BANNER, PANEL, fmt_tokens, fmt_x
from questprof.report.html import clocks, esc, figure, meta_table, page, section, table

__all__ = ["glance_lines", "write_report"]


def _panels(pairs: pd.DataFrame):
    """(index, label, rows) per (batch, mode), labels naming only what varies."""
    names = frames.varying(pairs, PANEL) or ["batch"]
    for i, (key, rows) in enumerate(pairs.groupby(PANEL, sort=True)):
        yield i, frames.label(PANEL, key, names), rows


def _glance(pairs: pd.DataFrame, df: pd.DataFrame, meta: dict) -> str:
    """Crossover and speedup at the longest length per curve; highlighted: the setting the
    fidelity floor recommends, else the fastest per panel."""
    if pairs.dropna(subset=["speedup"]).empty:
        return "<p>No configuration has both a Quest and a dense time: nothing to compare.</p>"
    g = frames.glance(pairs).dropna(subset=["speedup"])
    pick = fidelity_report.recommended(df, meta)
    if pick is None:
        g["best"] = g["speedup"] == g.groupby(PANEL)["speedup"].transform("max")
        why = ("the fastest page size and budget at the longest length of each batch, by speed "
               "alone" + ("" if fidelity_report.has_rows(df) else
                          ": what each setting loses in attention was not measured"))
    else:
        g["best"] = ((g["page_size"] == pick["page_size"]) & (g["budget"] == pick["budget"])
                     & (g["mode"] == pick["mode"]))
        why = (f"page {int(pick['page_size'])}, budget {fmt_tokens(pick['budget'])}, the fastest "
               "setting that keeps the fidelity floor (the recommendation above), wherever it "
               "was timed")
    g["cross"] = g["text"]
    g["at"] = g["longest"].map(fmt_tokens)
    g["sp"], g["id"] = g["speedup"].map(fmt_x), g["ideal"].map(fmt_x)
    g["share"] = g["of_ideal"].map(lambda v: f"{v:.0%}")
    g["budget_t"] = g["budget"].map(fmt_tokens)
    columns = {"shape": "model", "batch": "batch", "mode": "mode", "page_size": "page size",
               "budget_t": "budget", "cross": "Quest beats dense from", "at": "longest length", "sp": "speedup there",
               "id": "ideal 1/rho there", "share": "share of ideal"}
    for key in ("shape", "mode"):
        if key not in frames.varying(g, [key]):
            columns.pop(key)
    return (table(g, columns, "glance-table", numeric={"sp", "id", "share"}, best=g["best"])
            + f"<p class=\"note\">Highlighted: {why}. Speedup = dense median / Quest median "
              "per layer.</p>")


def _skipped(df: pd.DataFrame) -> str:
    skipped = frames.skipped(df)
    if skipped.empty:
        return "<p class=\"note\">No skipped rows.</p>"
    columns = {c: c for c in skipped.columns}
    return "<h3>Skipped rows, by cause</h3>" + table(skipped, columns, "skipped-table",
                                                    numeric={"rows", "need GiB", "free GiB"})


def _crossover(pairs: pd.DataFrame) -> str:
    """A figure per panel, then one table of every curve's crossover."""
    parts = [figure(figures.crossover_figure(rows, name), f"crossover-{i}")
             for i, name, rows in _panels(pairs)]
    cross = frames.crossovers(pairs)
    cross["budget_t"] = cross["budget"].map(fmt_tokens)
    cross["about"] = cross["estimate"].map(frames.fmt_about)
    columns = {"shape": "model", "batch": "batch", "mode": "mode", "page_size": "page size",
               "budget_t": "budget", "text": "Quest beats dense from",
               "about": "interpolated crossover"}
    if "shape" not in frames.varying(cross, ["shape"]):
        columns.pop("shape")
    return "".join(parts) + table(cross, columns, "crossover-table")


def _speedup(pairs: pd.DataFrame) -> str:
    return "".join(figure(figures.speedup_figure(rows, name), f"speedup-{i}")
                   for i, name, rows in _panels(pairs))


def _heatmaps(pairs: pd.DataFrame, meta: dict) -> str:
    parts = []
    for i, name, rows in _panels(pairs):
        length = frames.heatmap_length(rows, meta)
        if length is None:
            parts.append(f"<p>{esc(name)}: no speedup measured.</p>")
            continue
        parts.append(figure(figures.heatmap_figure(rows, length, name), f"heatmap-{i}"))
    return "".join(parts)


def _roofline(df: pd.DataFrame, meta: dict) -> str:
    if hardware.roofline_points(df).empty:
        return "<p>No kernel row with FLOPs and a time: nothing to place on the roofline.</p>"
    ceilings = meta.get("ceilings") or {}
    why = f" ({esc(ceilings['reason'])})" if ceilings.get("reason") else ""
    note = "" if ceilings.get("read_gbs") and ceilings.get("fp16_tflops") else (
        f"<p class=\"note\">This run recorded no measured ceilings{why}: the measured roof "
        "(meta.json ceilings.read_gbs, ceilings.fp16_tflops) is not drawn.</p>")
    return note + figure(hardware.roofline_figure(df, ceilings), "roofline")


def _amdahl(df: pd.DataFrame, pairs: pd.DataFrame) -> str:
    rows = amdahl.e2e_rows(df, pairs)
    if not rows.empty:
        return figure(amdahl.measured_figure(rows), "amdahl")
    g = frames.glance(pairs).dropna(subset=["speedup"])
    if g.empty:
        return "<p>No attention speedup was measured, so there is nothing to project.</p>"
    return ("<p class=\"banner\">Modelled, not measured: this run has no end-to-end rows "
            "(stage 'e2e'). The curves are Amdahl's law applied to the attention speedups "
            "measured in section 2.</p>" + figure(amdahl.modelled_figure(g), "amdahl"))


def _context_parallel(df: pd.DataFrame) -> str:
    """Context-parallel Quest against one GPU (sweep --gpus N), when the run measured it."""
    return parallel.section(df)


def _header(df: pd.DataFrame, meta: dict, parts, timed: bool) -> tuple[str, str]:
    """Title, command, banners and the navigation of the sections `parts` on the page. The CPU
    banner stands only over times: a fidelity-only run on a CPU has none."""
    backends = set(df["backend"].dropna()) if "backend" in df else set()
    cpu = str(meta.get("backend")).startswith("numpy") or meta.get("device") == "cpu" or (
        bool(backends) and all(str(b).startswith("numpy") for b in backends))  # numpy(-fp32)
    gpu = (meta.get("machine") or {}).get("gpu") or ("the CPU" if cpu else "an unknown GPU")
    title = f"questprof: {meta.get('scenario', 'run')} on {gpu}"
    banner = f"<p class=\"banner\">{CPU_BANNER}.</p>" if cpu and timed else ""
    if meta.get("fallback_reason"):
        banner += f"<p class=\"banner\">Fell back: {esc(meta['fallback_reason'])}</p>"
    banner += _cache_note(df)
    nav = " ".join(f"<a href=\"#{a}\">{esc(t)}</a>" for a, t, *_ in parts)
    command = f"<p class=\"note\"><code>{esc(meta['command'])}</code></p>" if meta.get("command") else ""
    shape = meta.get("shape") if isinstance(meta.get("shape"), dict) else {}
    if shape.get("text"):  # one GPU's shape under tensor parallelism, as the sweep timed it
        command += f"<p class=\"note\">Shape timed: {esc(shape['text'])}</p>"
    return f"<h1>{esc(title)}</h1>{command}{banner}<nav>{nav}</nav>", title


def _cache_note(df: pd.DataFrame) -> str:
    """Which rho formula the run's FP8 caches follow (none for plain caches: 1/S + K/P)."""
    if not {"kv_dtype", "summary_dtype"} <= set(df.columns):
        return ""
    caches = df[["kv_dtype", "summary_dtype"]].dropna().drop_duplicates()
    words = [model.rho_words(k, s) for k, s in caches.itertuples(index=False) if k == E4M3]
    return f"<p class=\"note\">FP8 KV cache: rho = {esc('; '.join(words))}</p>" if words else ""


SECTIONS = (("glance", "At a glance"), ("crossover", "1. Crossover"), ("speedup", "2. Speedup"),
            ("roofline", "3. Roofline"), ("bytes", "4. Bytes"), ("heatmap", "5. Page size x budget"),
            ("amdahl", "6. End to end"), ("cp", "7. Several GPUs"), ("machine", "8. The machine"))
LEDES = {
    "glance": "For each page size, budget and batch: from which context length Quest's decode "
              "attention is faster than dense, and how close it gets to the ideal 1/rho at the "
              "longest length measured.",
    "crossover": "Time per layer (median) against context length. Coloured bands: Quest's "
                 "stages stacked, each its share of the three timed apart, scaled to the Quest "
                 "step timed as one pass, so they stack to the Quest total (where the budget "
                 "covers the length, Quest is dense attention: one attention band); dotted "
                 "black: dense. The dashed line marks where Quest starts to win (the p20..p80 "
                 "spreads apart) and stays ahead; a speedup within them is a tie.",
    "speedup": "Dense median / Quest median per layer (solid) against the ideal 1/rho = "
               "1 / (1/S + K/P) (dashed): the gap is what the kernels leave on the table.",
    "roofline": "Each kernel of each configuration at its modelled arithmetic intensity and "
                "achieved throughput, under the roof of the measured read bandwidth and fp16 "
                "matmul rate (datasheet dashed). Points near the slanted roof are memory bound "
                "and fast; points far below it lose time to latency or launch overhead.",
    "bytes": "DRAM bytes the counters saw, against the byte model, and the measured rho against "
             "the formula 1/S + K/P.",
    "heatmap": "Speedup at one length for every page size and budget: green beats dense.",
    "amdahl": "What the attention speedup is worth for a whole decode step.",
    "cp": "Context-parallel Quest: pages split across GPUs by position. Each GPU replays the "
          "whole step of a layer as one CUDA graph (local top-(K+1) candidates, an all-gather of "
          "them, the exact global top-K, local sparse attention, an all-gather of (output, lse), "
          "the log-sum-exp merge), timed over cold layers like the single-GPU Quest step of the "
          "same run; each phase and each all-gather is also timed alone the same way. Bytes are "
          "the formula over the exact selection, busiest GPU against one GPU holding the whole "
          "cache.",
    "machine": "Where and how these numbers were measured.",
}


def _body(df: pd.DataFrame, meta: dict) -> tuple[str, str, bool]:
    """The HTML body, the title and whether any figure was drawn."""
    every, df = df, selectors_report.quest_only(df)  # other selectors: their own section
    pairs = frames.paired(df)
    have = not pairs.empty
    fidelity = fidelity_report.sections(df, meta)  # [] without fidelity rows
    pick = fidelity_report.recommended(df, meta)
    said = verdict.sentence(pairs, df, meta, pick)
    top = (f"<p class=\"verdict\">{esc(said)}</p>" if said else "") + fidelity_report.glance(
        df, meta, selectors_report.glance_lines(every, meta))
    serving = serving_report.sections(every, meta)  # [] without serve rows
    if not have and not fidelity and serving:  # a serve-only run: its section and the machine
        parts = serving + [_machine_part(meta)]
    elif not have and fidelity:  # a fidelity-only run: no timing section, nothing to pair
        parts = _fidelity_only(top, fidelity, selectors_report.sections(every, meta), meta)
    else:
        parts = _timing_parts(df, meta, pairs, top) + fidelity
        parts += selectors_report.sections(every, meta) + serving
    header, title = _header(df, meta, parts, have)
    body = header + "".join(section(*part) for part in parts)
    return body, title, "plotly-graph-div" in body


def _timing_parts(df: pd.DataFrame, meta: dict, pairs: pd.DataFrame, top: str) -> list:
    """(anchor, title, lede, html) of the glance and the timing sections 1-8."""
    have = not pairs.empty
    empty = "<p>No measured rows: every row was skipped (see the list above).</p>"
    content = {
        "glance": top + _glance(pairs, df, meta) + _skipped(df),
        "crossover": _crossover(pairs) if have else empty,
        "speedup": _speedup(pairs) if have else empty,
        "roofline": _roofline(df, meta),
        "bytes": measured_bytes.section(df, meta),
        "heatmap": _heatmaps(pairs, meta) if have else empty,
        "amdahl": _amdahl(df, pairs),
        "cp": _context_parallel(df),
        "machine": meta_table(_as_timed(meta, df), clocks(df)),
    }
    parts = [(a, t, LEDES[a], content[a]) for a, t in SECTIONS]
    if tier_report.has_tier(df):  # before the machine, only where rows ran over the host
        parts.insert(-1, ("tier", tier_report.TITLE, tier_report.LEDE,
                          tier_report.section(df, meta)))
    return parts


FIDELITY_ONLY_LEDE = (
    "What each page size and budget keeps of dense attention, and the setting the fidelity "
    "floor recommends. This run timed nothing: to set speed against fidelity, point "
    "<code>questprof fidelity --out</code> at a sweep's results directory.")


def _fidelity_only(top: str, fidelity: list, selectors: list, meta: dict) -> list:
    """The sections of a run without timing rows: the glance, fidelity (no frontier: it needs
    speed), the selectors, the machine; unnumbered, as sections 1-7 are not there."""
    kept = [part for part in fidelity if part[0] != "frontier"] + selectors
    parts = [("glance", "At a glance", FIDELITY_ONLY_LEDE, top)]
    parts += [(a, t.split(". ", 1)[-1], *rest) for a, t, *rest in kept]
    return parts + [_machine_part(meta)]


def _machine_part(meta: dict) -> tuple:
    """The machine section, unnumbered (for a run without the timing sections 1-7)."""
    machine = SECTIONS[-1]
    return (machine[0], machine[1].split(". ", 1)[-1], LEDES["machine"], meta_table(meta, {}))


def _as_timed(meta: dict, df: pd.DataFrame) -> dict:
    """meta with timing.graph as the rows were timed: a CPU run asked for CUDA graphs (the
    default) and showed `graph True` over perf-counter passes."""
    timing = meta.get("timing")
    methods = set(df["method"].dropna()) if "method" in df else set()
    if not isinstance(timing, dict) or not timing.get("graph") or not methods:
        return meta
    if "cuda-graph" in methods:
        return meta
    return {**meta, "timing": {**timing, "graph": f"False (asked; timed by "
                                                   f"{', '.join(sorted(methods))})"}}


def write_report(df: pd.DataFrame, meta: dict, path) -> Path:
    """Write the HTML report of rows `df` and run metadata `meta` to `path`; returns the path.

    A directory path gets report.html inside it. The file needs no network to open.
    """
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path = path / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"results_dir": str(path.parent), **(meta or {})}
    body, title, with_plotly = _body(df, meta)
    write_atomic(path, page(title, body, with_plotly))  # Ctrl-C leaves the old page whole
    return path


def glance_lines(df: pd.DataFrame, meta: dict, out_dir=None) -> list[str]:
    """The verdict and the recommendation of "At a glance" as plain sentences, for the command
    line (a bench or a byte check has no setting to judge: none)."""
    where = {"results_dir": str(out_dir)} if out_dir is not None else {}
    meta = {**where, **(meta or {})}
    quest = selectors_report.quest_only(df)
    lines = (fidelity_report.glance_lines(quest, meta)
             + selectors_report.glance_lines(df, meta))
    if str(meta.get("command") or "").split()[1:2] in (["bench"], ["bytes"]):
        return lines
    said = verdict.sentence(frames.paired(quest), quest, meta,
                            fidelity_report.recommended(quest, meta))
    return [said] + lines if said else lines
