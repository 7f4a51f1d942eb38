"""Fidelity figures, each a function of a fidelity_frames table: budget curves, layer x head
heatmap, passkey accuracy, speed-fidelity frontier."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from questprof.report.figures import PALETTE, finish
from questprof.report.frames import fmt_tokens


def _budget_axis(fig, budgets) -> None:
    ticks = sorted(set(int(b) for b in budgets))
    fig.update_xaxes(type="log", tickvals=ticks, ticktext=[fmt_tokens(b) for b in ticks])


def _curves(fig, rows, row: int, colour: str, name: str, legend: bool) -> None:
    """Mass recall mean (solid), p10 (dashed), oracle (dotted); output error in column 2."""
    x = rows["budget"]
    lines = (("mass_recall", "mean", "solid", 1), ("mass_recall_p10", "p10", "dash", 1),
             ("oracle_mass", "oracle", "dot", 1), ("output_rel_error", "error", "solid", 2))
    for column, what, dash, col in lines:
        fig.add_trace(go.Scatter(
            x=x, y=rows[column], name=f"{name} {what}", legendgroup=name,
            showlegend=legend and what == "mean", mode="lines+markers",
            line={"color": colour, "dash": dash},
            hovertemplate=f"{name} {what}: %{{y:.3f}}<extra></extra>"), row=row, col=col)


def budget_figures(summary, floor: float) -> list[go.Figure]:
    """Per (source, mode): rows = lengths; mass recall and output error against budget."""
    out = []
    for (source, mode), part in summary.groupby(["source", "mode"], sort=True):
        lengths = sorted(part["length"].unique())
        titles = [t for n in lengths for t in (f"{fmt_tokens(n)} tokens: mass recall",
                                                f"{fmt_tokens(n)} tokens: output rel. error")]
        fig = make_subplots(rows=len(lengths), cols=2, subplot_titles=titles,
                            vertical_spacing=min(0.12, 0.3 / len(lengths)))
        for r, n in enumerate(lengths, 1):
            for i, (size, rows) in enumerate(part[part["length"] == n].groupby("page_size")):
                _curves(fig, rows.sort_values("budget"), r, PALETTE[i % len(PALETTE)],
                        f"page {size}", r == 1)
            fig.add_hline(y=floor, line={"color": "#888", "dash": "dot", "width": 1}, row=r, col=1)
        _budget_axis(fig, part["budget"])
        fig.update_yaxes(range=[0, 1.02], col=1)
        fig.update_yaxes(type="log", col=2)
        fig.update_xaxes(title_text="token budget", row=len(lengths))
        out.append(finish(fig, f"{source}, {mode}: solid mean, dashed p10 over heads, dotted "
                               f"oracle; grey line = floor {floor:g}", 260 * len(lengths) + 120))
    return out


def heat_figure(grid, where: tuple, dense_layers: int) -> go.Figure:
    """mass_recall per layer x head at one setting; the dense layers named on the y axis."""
    source, length, size, budget, mode = where
    labels = [f"{int(l)} (dense)" if l < dense_layers else str(int(l)) for l in grid.index]
    fig = go.Figure(go.Heatmap(
        z=grid.to_numpy(), x=[f"q{int(h)}" for h in grid.columns], y=labels, zmin=0, zmax=1,
        colorscale="RdYlGn", colorbar={"title": "mass recall"},
        hovertemplate="layer %{y}, head %{x}: %{z:.3f}<extra></extra>"))
    fig.update_yaxes(type="category", title_text="layer", autorange="reversed")
    fig.update_xaxes(type="category", title_text="q head")
    return finish(fig, f"{source}: mass recall per layer and head at {fmt_tokens(length)} tokens, "
                       f"page {size}, budget {fmt_tokens(budget)}, {mode}",
                  120 + 18 * max(len(labels), 8), hovermode="closest")


def layer_figure(layers, where: tuple) -> go.Figure:
    """Mass recall per layer at one setting: mean and 10th percentile over heads."""
    source, length, size, budget, mode = where
    fig = go.Figure()
    for column, dash in (("mean", "solid"), ("p10", "dash")):
        fig.add_trace(go.Scatter(x=layers["layer"], y=layers[column], name=column,
                                 mode="lines+markers", line={"color": PALETTE[0], "dash": dash},
                                 hovertemplate=f"{column}: %{{y:.3f}}<extra></extra>"))
    dense = layers[layers["dense_layer"].fillna(False).astype(bool)]
    if len(dense):
        fig.add_vrect(x0=dense["layer"].min() - 0.5, x1=dense["layer"].max() + 0.5,
                      fillcolor="#ccc", opacity=0.3, line_width=0,
                      annotation_text="dense layers", annotation_position="top left")
    fig.update_xaxes(title_text="layer", dtick=1 if len(layers) <= 40 else None)
    fig.update_yaxes(range=[0, 1.02], title_text="mass recall over heads")
    return finish(fig, f"{source}: per layer at {fmt_tokens(length)} tokens, page {size}, "
                       f"budget {fmt_tokens(budget)}, {mode}", 360)


def passkey_figure(task) -> go.Figure:
    """Share of prompts answered right against budget per (length, page size); dense dotted."""
    fig = go.Figure()
    for i, ((length, size), rows) in enumerate(task.groupby(["length", "page_size"])):
        rows = rows.sort_values("budget")
        fig.add_trace(go.Scatter(
            x=rows["budget"], y=rows["passkey_quest_correct"], mode="lines+markers",
            name=f"{fmt_tokens(length)}, page {size}", line={"color": PALETTE[i % len(PALETTE)]},
            hovertemplate="Quest: %{y:.0%}<extra></extra>"))
    for length, rows in task.groupby("length"):
        fig.add_trace(go.Scatter(
            x=sorted(rows["budget"].unique()), y=[rows["passkey_dense_correct"].mean()] *
            rows["budget"].nunique(), mode="lines", name=f"{fmt_tokens(length)} dense",
            line={"color": "#222", "dash": "dot", "width": 1}))
    _budget_axis(fig, task["budget"])
    fig.update_yaxes(range=[-0.02, 1.02], tickformat=".0%", title_text="passkey correct")
    fig.update_xaxes(title_text="token budget")
    return finish(fig, "Passkey retrieval with Quest in the decode loop (dotted: dense)", 420)


def _interval(rows) -> dict | None:
    """Error bars of the p10's 95% interval, where the rows carry one."""
    if "mass_recall_p10_lo" not in rows or rows["mass_recall_p10_lo"].isna().all():
        return None
    return {"type": "data", "symmetric": False, "thickness": 1.5,
            "array": (rows["mass_recall_p10_hi"] - rows["mass_recall_p10"]).fillna(0),
            "arrayminus": (rows["mass_recall_p10"] - rows["mass_recall_p10_lo"]).fillna(0)}


def frontier_figure(table, floor: float) -> go.Figure:
    """Speedup (x) against p10 mass recall (y) per setting, with its 95% interval where
    recorded; the floor as a line."""
    table = table.dropna(subset=["speedup"])
    text = [f"S={int(s)}, B={fmt_tokens(b)}" for s, b in zip(table["page_size"], table["budget"])]
    fig = go.Figure()
    for i, (size, rows) in enumerate(table.groupby("page_size")):
        mask = table["page_size"] == size
        fig.add_trace(go.Scatter(
            x=rows["speedup"], y=rows["mass_recall_p10"], mode="markers+text",
            text=np.array(text)[mask.to_numpy()], textposition="top center",
            name=f"page {size}", marker={"size": 10, "color": PALETTE[i % len(PALETTE)]},
            error_y=_interval(rows),
            hovertemplate="%{text}: %{x:.2f}x, p10 mass recall %{y:.3f}<extra></extra>"))
    fig.add_hline(y=floor, line={"color": "#888", "dash": "dot"})
    fig.update_xaxes(type="log", title_text="speedup over dense (longest length, smallest batch)")
    fig.update_yaxes(title_text="mass recall, 10th percentile over heads")
    return finish(fig, f"Speed against fidelity; dotted: floor {floor:g}; bars: 95% intervals",
                  480, hovermode="closest")
