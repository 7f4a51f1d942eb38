"""Figures of the hardware side: the roofline, measured vs modelled bytes, measured rho vs formula."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from questprof.core import model
from questprof.report.figures import STAGE_COLOURS, finish
from questprof.report.frames import fmt_tokens, measured

KERNELS = model.STAGES  # one roofline point per kernel: 'quest' is three kernels, not one


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


def has_measured_bytes(df: pd.DataFrame) -> bool:
    """True when some ok row carries a measured read byte count."""
    ok = measured(df)
    return "measured_read_bytes" in ok and bool(ok["measured_read_bytes"].notna().any())


def _byte_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Kernel rows with measured reads, modelled reads (formula + unmodelled) and their ratio."""
    ok = measured(df)
    rows = ok[ok["stage"].isin(KERNELS) & ok["measured_read_bytes"].notna()].copy()
    rows["modelled_read"] = rows["read_bytes"] + rows["unmodelled_bytes"].fillna(0)
    rows["ratio"] = rows["measured_read_bytes"] / rows["modelled_read"]
    return rows


def bytes_figure(df: pd.DataFrame) -> go.Figure:
    """Measured DRAM reads vs modelled reads per kernel, the diagonal being the model exact."""
    rows = _byte_rows(df)
    rows = rows[rows["modelled_read"] > 0]
    fig = go.Figure()
    if len(rows):
        span = [rows[["modelled_read", "measured_read_bytes"]].min().min() / 2,
                rows[["modelled_read", "measured_read_bytes"]].max().max() * 2]
        fig.add_trace(go.Scatter(x=span, y=span, mode="lines", name="measured = modelled",
                                 line={"color": "#888", "dash": "dash"}, hoverinfo="skip"))
    for stage, group in rows.groupby("stage", sort=False):
        fig.add_trace(go.Scatter(
            x=group["modelled_read"], y=group["measured_read_bytes"], mode="markers", name=stage,
            marker={"color": STAGE_COLOURS.get(stage, "#999"), "size": 7}, text=_config_text(group),
            customdata=group["ratio"],
            hovertemplate="%{text}<br>measured / modelled %{customdata:.3f}<extra></extra>"))
    fig.update_xaxes(type="log", title_text="modelled read bytes (formula + unmodelled)")
    fig.update_yaxes(type="log", title_text="measured DRAM read bytes")
    return finish(fig, "Bytes read per kernel: measured vs modelled", 480, hovermode="closest")


def measured_rho(df: pd.DataFrame) -> pd.DataFrame:
    """Per point: (estimate + attention measured reads) / dense measured reads, beside rho_formula.

    The same ratio as model.quest_rho, with measured bytes in place of modelled ones.
    """
    rows = _byte_rows(df)
    keys = ["batch", "mode", "page_size", "budget", "length"]
    wide = rows.pivot_table(index=keys, columns="stage", values="measured_read_bytes")
    need = {"estimate", "attention", "dense"}
    if not need <= set(wide.columns):
        return pd.DataFrame(columns=keys + ["measured_rho", "rho_formula"])
    wide["measured_rho"] = (wide["estimate"] + wide["attention"]) / wide["dense"]
    formula = rows.groupby(keys)["rho_formula"].median()
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
    for size, group in rho.groupby("page_size"):
        text = [f"L={fmt_tokens(r.length)}, batch {r.batch}, budget {fmt_tokens(r.budget)}, "
                f"{r.mode}" for r in group.itertuples()]
        fig.add_trace(go.Scatter(
            x=group["rho_formula"], y=group["measured_rho"], mode="markers",
            name=f"page {size}", text=text, marker={"size": 8},
            hovertemplate="%{text}<br>formula %{x:.4f}, measured %{y:.4f}<extra></extra>"))
    fig.update_xaxes(type="log", title_text="rho formula 1/S + K/P")
    fig.update_yaxes(type="log", title_text="measured rho (estimate + attention reads / dense reads)")
    return finish(fig, "rho: measured vs formula", 480, hovermode="closest")


def bytes_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per kernel: measured / modelled reads (median, min, max) and the byte sources used."""
    rows = _byte_rows(df)
    rows = rows[rows["modelled_read"] > 0]
    out = rows.groupby("stage").agg(
        rows=("ratio", "size"), median=("ratio", "median"), min=("ratio", "min"),
        max=("ratio", "max"),
        source=("bytes_source", lambda s: ", ".join(sorted(s.dropna().astype(str).unique()))))
    order = [s for s in KERNELS if s in out.index]
    return out.loc[order].reset_index()
