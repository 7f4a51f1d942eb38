"""Timing figures of one panel (batch, mode): crossover, speedup vs ideal, page size x budget heatmap.

Every figure is a function of `frames.paired(df)` rows; none reads anything else.
"""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from questprof.report.frames import crossover, fmt_tokens, fmt_x, stage_bands

STAGE_COLOURS = {"estimate": "#f2b134", "topk": "#ed553b", "attention": "#3f88c5",
                 "dense": "#222222", "summary": "#8c6bb1", "quest": "#2a9d8f"}
PALETTE = qualitative.D3
CELL_HEIGHT = 230  # px per subplot row: tall enough for the crossover label and two ticks


def length_axis(fig: go.Figure, lengths, **where) -> None:
    """Log x axis with a tick at each measured length ('4k', '8k', ...): log2 spacing for doublings."""
    ticks = sorted(set(int(n) for n in lengths))
    fig.update_xaxes(type="log", tickvals=ticks, ticktext=[fmt_tokens(n) for n in ticks], **where)


def _stack(fig, curve, row, col, legend: bool) -> None:
    """Estimate, topk, attention stacked (areas scaled to the Quest total: frames.stage_bands),
    the Quest total and dense as lines; the hover gives each stage as timed apart too."""
    x, bands = curve["length"], stage_bands(curve)
    for stage in ("estimate", "topk", "attention"):
        fig.add_trace(go.Scatter(
            x=x, y=bands[f"{stage}_ms"], name=f"{stage} (share of total)", legendgroup=stage,
            showlegend=legend, stackgroup="quest", mode="lines", customdata=curve[f"{stage}_ms"],
            line={"width": 0.5, "color": STAGE_COLOURS[stage]},
            hovertemplate=f"{stage}: %{{y:.4f}} ms of the total (timed apart: "
                          "%{customdata:.4f} ms)<extra></extra>"), row=row, col=col)
    fig.add_trace(go.Scatter(
        x=x, y=curve["quest_ms"], name="Quest total", legendgroup="quest", showlegend=legend,
        mode="lines+markers", line={"color": STAGE_COLOURS["quest"], "width": 2},
        hovertemplate="Quest: %{y:.4f} ms<extra></extra>"), row=row, col=col)
    fig.add_trace(go.Scatter(
        x=x, y=curve["dense_ms"], name="dense", legendgroup="dense", showlegend=legend,
        mode="lines+markers", line={"color": STAGE_COLOURS["dense"], "width": 2, "dash": "dot"},
        hovertemplate="dense: %{y:.4f} ms<extra></extra>"), row=row, col=col)


def _mark_crossover(fig, curve, row, col) -> None:
    """A dashed vertical line where Quest starts to win, labelled with the measured length."""
    found = crossover(curve)
    if found["kind"] != "from":
        fig.add_annotation(text=found["text"], xref="x domain", yref="y domain", x=0.02, y=0.98,
                           showarrow=False, xanchor="left", font={"size": 11}, row=row, col=col)
        return
    fig.add_vline(x=found["length"], line={"dash": "dash", "color": "#2a9d8f"}, row=row, col=col)
    # annotations on a log axis take log10 of the value (shapes such as the vline do not)
    fig.add_annotation(text=f"wins from {fmt_tokens(found['length'])}",
                       x=math.log10(found["length"]),
                       xref="x", yref="y domain", y=0.98, showarrow=False, xanchor="left",
                       font={"size": 11, "color": "#2a9d8f"}, row=row, col=col)


def crossover_figure(panel, title: str) -> go.Figure:
    """Rows = page sizes, columns = budgets; time per layer vs length, Quest stacked beside dense."""
    sizes, budgets = sorted(panel["page_size"].unique()), sorted(panel["budget"].unique())
    fig = make_subplots(rows=len(sizes), cols=len(budgets), shared_xaxes=True,
                        subplot_titles=[f"page {s} tokens, budget {fmt_tokens(b)}"
                                        for s in sizes for b in budgets],
                        vertical_spacing=min(0.12, 0.3 / len(sizes)), horizontal_spacing=0.06)
    first = True
    for r, s in enumerate(sizes, 1):
        for c, b in enumerate(budgets, 1):
            curve = panel[(panel["page_size"] == s) & (panel["budget"] == b)].sort_values("length")
            if curve.empty:
                continue
            _stack(fig, curve, r, c, first)
            _mark_crossover(fig, curve, r, c)
            first = False
    length_axis(fig, panel["length"])
    fig.update_yaxes(rangemode="tozero")
    fig.update_yaxes(title_text="ms per layer", col=1)
    fig.update_xaxes(title_text="context length (tokens)", row=len(sizes))
    return finish(fig, f"{title}: bands are each stage's share of the Quest total (its time "
                       "apart, scaled to the step timed as one pass)", CELL_HEIGHT * len(sizes) + 120)


def speedup_figure(panel, title: str) -> go.Figure:
    """One column per page size: measured speedup (solid) and ideal 1/rho (dashed) per budget."""
    sizes, budgets = sorted(panel["page_size"].unique()), sorted(panel["budget"].unique())
    fig = make_subplots(rows=1, cols=len(sizes), shared_yaxes=True,
                        subplot_titles=[f"page {s} tokens" for s in sizes], horizontal_spacing=0.03)
    for c, s in enumerate(sizes, 1):
        for i, b in enumerate(budgets):
            curve = panel[(panel["page_size"] == s) & (panel["budget"] == b)].sort_values("length")
            colour, name = PALETTE[i % len(PALETTE)], f"budget {fmt_tokens(b)}"
            fig.add_trace(go.Scatter(
                x=curve["length"], y=curve["speedup"], name=name, legendgroup=name,
                showlegend=c == 1, mode="lines+markers", line={"color": colour},
                hovertemplate=f"{name}: %{{y:.2f}}x measured<extra></extra>"), row=1, col=c)
            fig.add_trace(go.Scatter(
                x=curve["length"], y=curve["ideal"], name=f"{name} ideal 1/rho", legendgroup=name,
                showlegend=False, mode="lines", line={"color": colour, "dash": "dash", "width": 1},
                hovertemplate=f"{name}: %{{y:.2f}}x ideal (1/rho)<extra></extra>"), row=1, col=c)
        fig.add_hline(y=1.0, line={"color": "#888", "width": 1}, row=1, col=c)
    length_axis(fig, panel["length"])
    fig.update_xaxes(title_text="context length (tokens)")
    fig.update_yaxes(type="log")
    fig.update_yaxes(title_text="dense / Quest (x)", col=1)
    return finish(fig, f"{title}: solid measured, dashed ideal 1/rho", 420)


def heatmap_figure(panel, length: int, title: str) -> go.Figure:
    """Speedup at one length: page sizes down, budgets across; green beats dense, red loses.

    Colour is log2(speedup) on a fixed 1/16x..16x scale, so 0.5x and 2x are equally far from
    neutral and panels (and reports) compare by colour.
    """
    at = panel[panel["length"] == length]
    grid = at.pivot_table(index="page_size", columns="budget", values="speedup")
    ideal = at.pivot_table(index="page_size", columns="budget", values="ideal").reindex_like(grid)
    text = [[f"{fmt_x(v)}<br>ideal {fmt_x(i)}" for v, i in zip(vr, ir)]
            for vr, ir in zip(grid.to_numpy(), ideal.to_numpy())]
    ticks = [2.0**k for k in range(-4, 5)]
    fig = go.Figure(go.Heatmap(
        z=np.log2(grid.to_numpy()), x=[fmt_tokens(b) for b in grid.columns],
        y=[f"{s}" for s in grid.index], text=text, texttemplate="%{text}", customdata=grid.to_numpy(),
        colorscale="RdYlGn", zmin=-4, zmax=4, hovertemplate="page %{y}, budget %{x}: %{customdata:.2f}x"
                                                       "<extra></extra>",
        colorbar={"title": "speedup", "tickvals": np.log2(ticks), "ticktext": [f"{t:g}x" for t in ticks]}))
    fig.update_xaxes(type="category", title_text="token budget")
    fig.update_yaxes(type="category", title_text="page size (tokens)", autorange="reversed")
    return finish(fig, f"{title}: speedup at {fmt_tokens(length)} tokens",
                  140 + 70 * max(1, len(grid.index)), hovermode="closest")


def finish(fig: go.Figure, title: str, height: int, hovermode: str = "x unified") -> go.Figure:
    """Title, height, white template, legend right of the plot (clear of subplot titles)."""
    fig.update_layout(title={"text": title, "x": 0.01}, height=height, template="plotly_white",
                      margin={"l": 60, "r": 20, "t": 70, "b": 50}, hovermode=hovermode,
                      legend={"orientation": "v", "y": 1.0, "yanchor": "top", "x": 1.01,
                              "xanchor": "left"})
    return fig
