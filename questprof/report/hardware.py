"""Figures of the hardware side: the roofline, measured vs modelled bytes, measured rho vs formula."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from questprof.core import model
from questprof.report.figures import STAGE_COLOURS, finish
from questprof.report.frames import OURS, fmt_tokens, measured

KERNELS = model.STAGES  # one roofline point per kernel: 'quest' is three kernels, not one
QUEST_STAGES = model.QUEST_STAGES


def _config_text(rows: pd.DataFrame) -> list[str]:
    """Hover text naming each row's configuration."""
    return [f"{r.stage}: L={fmt_tokens(r.length)}, batch {r.batch}, page {r.page_size}, "
            f"budget {fmt_tokens(r.budget)}, {r.mode}<br>{r.median_ms:.4f} ms"
            for r in rows.itertuples()]


def roofline_points(df: pd.DataFrame) -> pd.DataFrame:
    """Kernel rows with intensity (FLOP/byte, model.intensity) and achieved TFLOP/s."""
    ok = measured(df)
    ok = ok[ok["stage"].isin(KERNELS) & (ok["median_ms"] > 0) & (ok["flops"] > 0)].copy()
    works = [model.StageWork(r.stage, r.read_bytes, r.unmodelled_bytes, r.write_bytes, r.flops)
             for r in ok.fillna({"unmodelled_bytes": 0, "write_bytes": 0}).itertuples()]
    ok["intensity"] = [model.intensity(w) for w in works]
    ok["tflops"] = ok["flops"] / (ok["median_ms"] * 1e-3) / 1e12
    return ok[np.isfinite(ok["intensity"])]


def _roof(x: np.ndarray, gbs, tflops) -> np.ndarray | None:
    """min(bandwidth * intensity, peak) in TFLOP/s, or None when a ceiling is missing."""
    if not gbs or not tflops:
        return None
    return np.minimum(float(gbs) * 1e9 * x / 1e12, float(tflops))


def roofline_figure(df: pd.DataFrame, ceilings: dict) -> go.Figure:
    """Measured roof (solid), datasheet roof (dashed), a point per kernel per configuration."""
    points = roofline_points(df)
    fig = go.Figure()
    lo = max(points["intensity"].min() / 2, 1e-3) if len(points) else 0.01
    hi = max(points["intensity"].max() * 4 if len(points) else 10, 1e3)
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    roofs = (("measured", ceilings.get("read_gbs"), ceilings.get("fp16_tflops"), "solid"),
             ("datasheet", ceilings.get("datasheet_gbs"), ceilings.get("datasheet_tflops"), "dash"))
    for name, gbs, tflops, dash in roofs:
        y = _roof(x, gbs, tflops)
        if y is not None:
            fig.add_trace(go.Scatter(
                x=x, y=y, mode="lines", name=f"{name} roof: {float(gbs):.0f} GB/s, "
                f"{float(tflops):.0f} TFLOP/s", line={"color": "#555", "dash": dash},
                hoverinfo="skip"))
    for stage, rows in points.groupby("stage", sort=False):
        fig.add_trace(go.Scatter(
            x=rows["intensity"], y=rows["tflops"], mode="markers", name=stage,
            marker={"color": STAGE_COLOURS.get(stage, "#999"), "size": 7, "opacity": 0.8},
            text=_config_text(rows),
            hovertemplate="%{text}<br>%{x:.3g} FLOP/byte, %{y:.3g} TFLOP/s<extra></extra>"))
    fig.update_xaxes(type="log", title_text="arithmetic intensity (FLOP per DRAM byte, modelled)")
    fig.update_yaxes(type="log", title_text="achieved TFLOP/s (FLOPs / median time)")
    return finish(fig, "Roofline: every kernel of every configuration", 520, hovermode="closest")


from questprof.results import BYTES_TOLERANCE as TOLERANCE  # noqa: E402 (bytes --check-formula's)
from questprof.results import MIN_JUDGED_BYTES  # noqa: E402


def _ours(rows: pd.DataFrame) -> pd.Series:
    return rows["impl"] == OURS


def has_measured_bytes(df: pd.DataFrame) -> bool:
    """True when some ok row of our kernels carries a measured read byte count."""
    ok = measured(df)
    return "measured_read_bytes" in ok and bool(ok.loc[_ours(ok), "measured_read_bytes"]
                                                .notna().any())


def byte_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Kernel rows with measured reads: modelled read (formula + unmodelled; over the host tier
    its HBM reads: results.dram_read), ratio measured / modelled, `off` (the ratio outside
    1 +- TOLERANCE) and `peer` (impl is not ours: shown, not judged). Rows whose modelled read
    is 0 are left out."""
    ok = measured(df)
    if "measured_read_bytes" not in ok:
        return ok.iloc[0:0].assign(modelled_read=[], ratio=[], off=[], peer=[], small=[])
    rows = ok[ok["stage"].isin(KERNELS) & ok["measured_read_bytes"].notna()].copy()
    rows["modelled_read"] = rows["read_bytes"].astype(float) + rows["unmodelled_bytes"].astype(
        float).fillna(0)
    if "tier_hbm_read_bytes" in rows:  # the host tier's pages cross the link, never DRAM
        hbm = pd.to_numeric(rows["tier_hbm_read_bytes"], errors="coerce")
        rows["modelled_read"] = hbm.where(hbm.notna(), rows["modelled_read"])
    rows = rows[rows["modelled_read"] > 0]
    rows["ratio"] = rows["measured_read_bytes"].astype(float) / rows["modelled_read"]
    rows["peer"] = ~_ours(rows)
    rows["small"] = rows["modelled_read"] < MIN_JUDGED_BYTES  # reported, not judged
    rows["off"] = ~rows["peer"] & ~rows["small"] & ((rows["ratio"] - 1).abs() > TOLERANCE)
    return rows


def off_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Our kernel rows whose measured read is off the model by more than TOLERANCE, worst first."""
    rows = byte_rows(df)
    rows = rows[rows["off"]]
    return rows.iloc[(rows["ratio"] - 1).abs().argsort()[::-1]]


def sources(df: pd.DataFrame) -> dict[str, int]:
    """{bytes_source: number of our kernel rows it measured}."""
    rows = byte_rows(df)
    rows = rows[~rows["peer"]]
    return rows["bytes_source"].fillna("(unnamed)").astype(str).value_counts().to_dict()


def _trace(fig, rows, name, marker, legend=True) -> None:
    """The rows twice: measured vs modelled (left), measured / modelled vs modelled (right)."""
    text = _config_text(rows)
    for col, y in ((1, rows["measured_read_bytes"]), (2, rows["ratio"])):
        fig.add_trace(go.Scatter(
            x=rows["modelled_read"], y=y, mode="markers", name=name, legendgroup=name,
            showlegend=legend and col == 1, marker=marker, text=text, customdata=rows["ratio"],
            hovertemplate="%{text}<br>measured / modelled %{customdata:.3f}<extra></extra>"),
            row=1, col=col)


def _guides(fig, lo: float, hi: float) -> None:
    """measured = modelled (dashed) and +-TOLERANCE (dotted) on both panels."""
    for factor, name, dash in ((1.0, "measured = modelled", "dash"),
                               (1 + TOLERANCE, f"+-{TOLERANCE:.0%}", "dot"),
                               (1 - TOLERANCE, f"+-{TOLERANCE:.0%}", "dot")):
        line = {"color": "#888", "dash": dash, "width": 1}
        for col, y in ((1, [lo * factor, hi * factor]), (2, [factor, factor])):
            fig.add_trace(go.Scatter(x=[lo, hi], y=y, mode="lines", name=name, legendgroup=name,
                                     showlegend=col == 1 and factor <= 1, line=line,
                                     hoverinfo="skip"), row=1, col=col)


def bytes_figure(df: pd.DataFrame) -> go.Figure:
    """Measured DRAM reads vs modelled reads per kernel (left) and their ratio (right): the
    model exact dashed, +-TOLERANCE dotted; rows outside ringed in red; peers (not judged) grey."""
    rows = byte_rows(df)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45], horizontal_spacing=0.08,
                        subplot_titles=["measured vs modelled", "measured / modelled"])
    if len(rows):
        _guides(fig, rows["modelled_read"].min() / 2, rows["modelled_read"].max() * 2)
    ours = rows[~rows["peer"]]
    for stage, group in ours.groupby("stage", sort=False):
        _trace(fig, group, stage, {"color": STAGE_COLOURS.get(stage, "#999"), "size": 7})
    off = ours[ours["off"]]
    if len(off):
        _trace(fig, off, f"off the model by > {TOLERANCE:.0%}",
               {"color": "rgba(0,0,0,0)", "size": 14, "line": {"color": "#d62728", "width": 2}})
    peers = rows[rows["peer"]]
    if len(peers):
        _trace(fig, peers.assign(stage=peers["impl"] + " " + peers["stage"]),
               "peers (not judged)", {"color": "#bbb", "size": 7, "symbol": "diamond"})
    fig.update_xaxes(type="log", title_text="modelled read bytes (formula + unmodelled)")
    fig.update_yaxes(type="log", title_text="measured DRAM read bytes", col=1)
    fig.update_yaxes(title_text="measured / modelled read", col=2)
    return finish(fig, "Bytes read per kernel: measured vs modelled", 480, hovermode="closest")


def measured_rho(df: pd.DataFrame) -> pd.DataFrame:
    """Per point: measured rho = (estimate + topk + attention measured reads) / dense measured
    read, as `questprof bytes` computes it, beside rho_formula 1/S + K/P (our kernels only)."""
    rows = byte_rows(df)
    rows = rows[~rows["peer"]]
    if "kv_tier" in rows:  # over the host tier dense reads almost nothing from DRAM: no rho
        rows = rows[rows["kv_tier"].fillna("hbm") != "host"]
    keys = ["batch", "mode", "page_size", "budget", "length"]
    need = {*QUEST_STAGES, "dense"}
    if rows.empty or not need <= set(rows["stage"]):
        return pd.DataFrame(columns=keys + ["measured_rho", "rho_formula", "rho_model"])
    wide = rows.pivot_table(index=keys, columns="stage", values="measured_read_bytes")
    wide["measured_rho"] = wide[list(QUEST_STAGES)].sum(axis=1, min_count=3) / wide["dense"]
    if "rho_model" not in rows:
        rows = rows.assign(rho_model=np.nan)
    formula = rows.groupby(keys)[["rho_formula", "rho_model"]].median()
    out = wide[["measured_rho"]].join(formula).reset_index()
    return out.dropna(subset=["measured_rho"])


def rho_figure(df: pd.DataFrame) -> go.Figure:
    """Measured rho against 1/S + K/P, one colour per page size; the diagonal is the formula."""
    rho = measured_rho(df)
    fig = go.Figure()
    if len(rho):
        span = [min(rho["rho_formula"].min(), rho["measured_rho"].min()) / 1.5,
                max(rho["rho_formula"].max(), rho["measured_rho"].max()) * 1.5]
        fig.add_trace(go.Scatter(x=span, y=span, mode="lines", name="measured = 1/S + K/P",
                                 line={"color": "#888", "dash": "dash"}, hoverinfo="skip"))
    if len(rho) and rho["rho_model"].notna().any():
        fig.add_trace(go.Scatter(
            x=rho["rho_formula"], y=rho["rho_model"], mode="markers", name="byte model (rho_model)",
            marker={"size": 11, "color": "rgba(0,0,0,0)", "line": {"color": "#888", "width": 1}},
            hovertemplate="formula %{x:.4f}, byte model %{y:.4f}<extra></extra>"))
    for size, group in rho.groupby("page_size"):
        text = [f"L={fmt_tokens(r.length)}, batch {r.batch}, budget {fmt_tokens(r.budget)}, "
                f"{r.mode}" for r in group.itertuples()]
        fig.add_trace(go.Scatter(
            x=group["rho_formula"], y=group["measured_rho"], mode="markers",
            name=f"page {size}", text=text, marker={"size": 8},
            hovertemplate="%{text}<br>formula %{x:.4f}, measured %{y:.4f}<extra></extra>"))
    fig.update_xaxes(type="log", title_text="rho formula 1/S + K/P")
    fig.update_yaxes(type="log", title_text="measured rho (Quest stages' reads / dense reads)")
    return finish(fig, "rho: measured vs formula", 480, hovermode="closest")


def bytes_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per kernel of ours: measured / modelled reads (median, min, max), rows off the model by
    more than TOLERANCE, and the byte sources used."""
    rows = byte_rows(df)
    rows = rows[~rows["peer"]]
    out = rows.groupby("stage").agg(
        rows=("ratio", "size"), median=("ratio", "median"), min=("ratio", "min"),
        max=("ratio", "max"), off=("off", "sum"),
        source=("bytes_source", lambda s: ", ".join(sorted(s.dropna().astype(str).unique()))))
    order = [s for s in KERNELS if s in out.index]
    return out.loc[order].reset_index()
