"""Section 4 of the report: measured DRAM bytes against the byte model, and measured rho.

Judges our kernels only (impl 'ours'); peers' measured bytes are drawn grey, not judged.
"""

from __future__ import annotations

import pandas as pd

from questprof.report import hardware
from questprof.report.frames import fmt_tokens
from questprof.report.html import esc, figure, table

SOURCES = {"cupti": "CUPTI PM sampling of dram__bytes_read.sum in the sweep's own process",
           "ncu": "an Nsight Compute replay of each configuration",
           "nvml": "NVML GPM (whole-device bandwidth utilisation, calibrated)"}
MAX_LISTED = 50  # rows of the off-the-model table; the rest are counted


def _why_not(meta: dict) -> str:
    """meta.json's reason for measuring no bytes: sweep's bytes.reason, bytes' sources."""
    info = meta.get("bytes") or {}
    if info.get("reason"):
        return str(info["reason"])
    whys = [f"{s}: {w}" for s, w in (info.get("sources") or {}).items() if w]
    return "; ".join(whys)


def _sources(df: pd.DataFrame) -> str:
    counts = hardware.sources(df)
    parts = [f"<code>{esc(s)}</code> ({SOURCES.get(s, 'source not described')}, {n} rows)"
             for s, n in counts.items()]
    return "Measured by " + ", ".join(parts) + "."


def _off_table(df: pd.DataFrame) -> str:
    off = hardware.off_rows(df)
    rows = hardware.byte_rows(df)
    judged = int((~rows["peer"] & ~rows["small"]).sum())
    tol = f"{hardware.TOLERANCE:.0%}"
    if off.empty:
        return f"<p>All {judged} kernel rows are within {tol} of the model.</p>"
    shown = off.head(MAX_LISTED).assign(
        length_t=lambda r: r["length"].map(fmt_tokens),
        budget_t=lambda r: r["budget"].map(fmt_tokens),
        model_mb=lambda r: (r["modelled_read"] / 1e6).map(lambda v: f"{v:,.4g}"),
        measured_mb=lambda r: (r["measured_read_bytes"] / 1e6).map(lambda v: f"{v:,.4g}"),
        ratio_t=lambda r: r["ratio"].map(lambda v: f"{v:.3f}"))
    columns = {"stage": "kernel", "length_t": "length", "batch": "batch", "page_size": "page size",
               "budget_t": "budget", "mode": "mode", "model_mb": "modelled read (MB)",
               "measured_mb": "measured read (MB)", "ratio_t": "measured / modelled",
               "bytes_source": "source"}
    more = (f" The {len(off) - MAX_LISTED} less far off are not listed." if len(off) > MAX_LISTED
            else "")
    return (f"<h3>Off the model by more than {tol}: {len(off)} of {judged} kernel rows</h3>"
            + table(shown, columns, "bytes-off-table",
                    numeric={"model_mb", "measured_mb", "ratio_t"},
                    best=pd.Series(True, index=shown.index), mark="off")
            + f"<p class=\"note\">Worst first.{more}</p>")


def _peers(df: pd.DataFrame) -> str:
    peers = hardware.byte_rows(df)
    peers = peers[peers["peer"]]
    if peers.empty:
        return ""
    names = ", ".join(sorted(peers["impl"].astype(str).unique()))
    return (f"<p class=\"note\">{len(peers)} rows of peers ({esc(names)}) carry measured bytes: "
            "drawn grey, not judged against our byte model.</p>")


def _rho(df: pd.DataFrame) -> str:
    if hardware.measured_rho(df).empty:
        return ("<p>No configuration has measured reads of estimate, topk, attention and dense "
                "together: no measured rho.</p>")
    return (figure(hardware.rho_figure(df), "rho")
            + "<p class=\"note\">Measured rho = (estimate + topk + attention measured reads) / "
              "dense measured read, as <code>questprof bytes</code> computes it; hollow circles: "
              "the byte model's rho (rho_model). It sits above "
              "the diagonal by the bytes the formula leaves out (queries, scores, page tables) "
              "and, with per-head selection under GQA, by the pages only some heads of a KV "
              "head select (up to q heads / KV heads times K/P).</p>")


def section(df: pd.DataFrame, meta: dict) -> str:
    """The bytes section's HTML: sources, tolerance, figures, the per-kernel and off tables."""
    if not hardware.has_measured_bytes(df):
        why = _why_not(meta)
        because = f" ({esc(why)})" if why else ""
        return (f"<p>This run did not measure DRAM bytes{because}. Measure them with "
                "<code>questprof sweep --bytes cupti</code> on a GPU, or "
                "<code>questprof bytes --check-formula</code>.</p>")
    tol = f"{hardware.TOLERANCE:.0%}"
    ratios = hardware.bytes_table(df)
    for c in ("median", "min", "max"):
        ratios[c] = ratios[c].map(lambda v: f"{v:.3f}")
    ratios["off"] = ratios["off"].astype(int)
    columns = {"stage": "kernel", "rows": "rows", "median": "measured / modelled (median)",
               "min": "min", "max": "max", "off": f"off by > {tol}", "source": "byte source"}
    lede = (f"<p>{_sources(df)} The modelled read is the formula's bytes plus the bytes it "
            f"leaves out (unmodelled: queries, scores, selections, page tables). A kernel row "
            f"whose measured read is off the modelled read by more than {tol} (the tolerance of "
            f"<code>questprof bytes --check-formula</code>) is ringed in red and listed below. "
            f"Rows under {hardware.MIN_JUDGED_BYTES >> 20} MiB per layer (the summary append, "
            f"small top-K score arrays) are drawn but not judged: at that size sector "
            f"granularity and the L2's state decide what reaches DRAM.</p>")
    return (lede + figure(hardware.bytes_figure(df), "bytes") + _peers(df)
            + table(ratios, columns, "bytes-table", numeric={"rows", "median", "min", "max", "off"})
            + _off_table(df) + _rho(df))
