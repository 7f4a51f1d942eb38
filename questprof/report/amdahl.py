"""End to end: measured decode-step speedup vs Amdahl's prediction, or a modelled Amdahl curve.

'e2e' rows (stage == 'e2e', status 'ok'), one per (batch, mode, page_size, budget, length):
  attention_fraction     share of the dense decode step spent in the attention Quest replaces, 0..1
  step_ms_dense          measured decode step, all layers, dense attention (ms)
  step_ms_quest          the same step with Quest attention (ms)
  measured_speedup       step_ms_dense / step_ms_quest (computed from the two when missing)
  attention_speedup      optional: attention speedup to predict from; default dense / Quest
                         per layer at the same point from the per-layer rows
  predicted_4bit         optional: Amdahl prediction with 4-bit weights (drawn when present)
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from questprof.core import model
from questprof.report.figures import PALETTE, finish, length_axis
from questprof.report.frames import CURVE, POINT, shape_names, DEFAULT_MODE, fmt_tokens

MAX_MODELLED_CURVES = 8  # more lines than this is a tangle; they are spread over the speedups


def e2e_rows(df: pd.DataFrame, pairs: pd.DataFrame) -> pd.DataFrame:
    """ok 'e2e' rows with measured_speedup, attention_speedup and the Amdahl prediction."""
    if df.empty or "stage" not in df:
        return pd.DataFrame()
    rows = df[(df["stage"] == "e2e") & (df["status"] == "ok")].copy()
    if rows.empty or "attention_fraction" not in rows:
        return pd.DataFrame()
    rows["mode"] = rows["mode"].fillna(DEFAULT_MODE) if "mode" in rows else DEFAULT_MODE
    rows["shape"] = shape_names(rows)
    if "measured_speedup" not in rows:
        rows["measured_speedup"] = np.nan
    rows["measured_speedup"] = rows["measured_speedup"].fillna(
        rows["step_ms_dense"] / rows["step_ms_quest"])
    per_layer = pairs.set_index(POINT)["speedup"].rename("layer_speedup")
    rows = rows.join(per_layer, on=POINT)
    given = rows["attention_speedup"] if "attention_speedup" in rows else np.nan
    rows["attention_speedup"] = pd.Series(given, index=rows.index).fillna(rows["layer_speedup"])
    rows["predicted"] = [model.amdahl_speedup(f, s) if s > 0 and 0 <= f <= 1 else np.nan
                         for f, s in zip(rows["attention_fraction"], rows["attention_speedup"])]
    return rows.sort_values(POINT)


def _name(key) -> str:
    shape, batch, mode, size, budget = key
    return f"{shape}: page {size}, budget {fmt_tokens(budget)}, batch {batch}, {mode}"


def measured_figure(rows: pd.DataFrame) -> go.Figure:
    """Measured end-to-end speedup (markers) vs Amdahl from the measured fraction (dashed)."""
    fig = go.Figure()
    for i, (key, curve) in enumerate(rows.groupby(CURVE, sort=True)):
        colour, name = PALETTE[i % len(PALETTE)], _name(key)
        lines = [("measured", "measured_speedup", "solid", "lines+markers"),
                 ("Amdahl", "predicted", "dash", "lines")]
        if "predicted_4bit" in curve and curve["predicted_4bit"].notna().any():
            lines.append(("Amdahl, 4-bit weights", "predicted_4bit", "dot", "lines"))
        for what, column, dash, mode in lines:
            fig.add_trace(go.Scatter(
                x=curve["length"], y=curve[column], mode=mode, name=f"{name}: {what}",
                legendgroup=name, line={"color": colour, "dash": dash},
                hovertemplate=f"{name}<br>{what}: %{{y:.3f}}x<extra></extra>"))
    length_axis(fig, rows["length"])
    fig.update_xaxes(title_text="context length (tokens)")
    fig.update_yaxes(title_text="decode step speedup (x)")
    fig.add_hline(y=1.0, line={"color": "#888", "width": 1})
    return finish(fig, "End to end: measured step speedup vs Amdahl's prediction", 480,
                  hovermode="closest")


def _spread(glance: pd.DataFrame, n: int) -> pd.DataFrame:
    """At most n rows of glance, evenly spread over their speedups."""
    rows = glance.dropna(subset=["speedup"]).sort_values("speedup")
    if len(rows) <= n:
        return rows
    return rows.iloc[np.linspace(0, len(rows) - 1, n).round().astype(int)]


def modelled_figure(glance: pd.DataFrame) -> go.Figure:
    """End-to-end speedup vs attention fraction, for the attention speedups measured at the
    longest length of each curve (at most MAX_MODELLED_CURVES of them)."""
    fraction = np.linspace(0.0, 1.0, 101)
    fig = go.Figure()
    for i, row in enumerate(_spread(glance, MAX_MODELLED_CURVES).itertuples()):
        name = (f"{row.speedup:.2f}x attention: page {row.page_size}, budget "
                f"{fmt_tokens(row.budget)}, batch {row.batch} at {fmt_tokens(row.longest)}")
        y = [model.amdahl_speedup(f, row.speedup) for f in fraction]
        fig.add_trace(go.Scatter(x=fraction, y=y, mode="lines", name=name,
                                 line={"color": PALETTE[i % len(PALETTE)]},
                                 hovertemplate="attention %{x:.0%} of the step: %{y:.2f}x"
                                               "<extra></extra>"))
    fig.update_xaxes(title_text="attention's share of the dense decode step", tickformat=".0%")
    fig.update_yaxes(title_text="modelled step speedup (x)")
    return finish(fig, "End to end, modelled: Amdahl's law for the measured attention speedups",
                  480, hovermode="closest")
