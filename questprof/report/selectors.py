"""The selectors section: bytes (rho) against p10 mass recall per selector, and the frontier.

Fidelity rows with a `selector` column other than 'quest' (questprof fidelity --selector) are
set apart here; every other section sees plain Quest only (rows without the column are Quest).
A point is (source, length, page size, budget, selector) over the sparse layers' per-head rows:
rho from the byte model (summaries included), mass recall mean and 10th percentile over heads,
top-10 recall, output error and the pages read (mean, and the setting's p95 and max).
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from questprof.report.fidelity import min_recall
from questprof.report.fidelity_frames import head_rows
from questprof.report.html import figure, table

POINT = ["source", "length", "page_size", "budget", "selector"]
COLUMNS = {"source": "source", "length": "tokens", "page_size": "page", "budget": "budget",
           "selector": "selector", "rho": "rho", "pages_read": "pages read",
           "pages_read_p95": "p95", "pages_read_max": "max", "mass_recall": "mass recall",
           "mass_recall_p10": "p10", "top10_recall": "top-10", "output_rel_error": "output err",
           "frontier": "frontier"}
LEDE = ("Each selector on the same captures, queries and decode steps: the bytes it reads per "
        "query against dense (rho, summaries included: c boxes read c summaries, FP8 summaries "
        "half) against what it keeps of dense attention. Marked rows are the frontier: no other "
        "selector or budget of the same source, length and page size reads fewer bytes for a "
        "higher p10 mass recall (the oracle, a ceiling that needs every key, is no candidate). "
        "h2o and tova evict for good; the first query's attention stands in for the prompt's, "
        "and decode steps that open no new page evict nothing more. bnb reads until its top-R "
        "tokens are exact, whatever the budget.")


def selector_of(df: pd.DataFrame) -> pd.Series:
    """The selector of each row ('quest' where the column is missing or empty)."""
    if "selector" not in df:
        return pd.Series("quest", index=df.index)
    return df["selector"].fillna("quest")


def quest_only(df: pd.DataFrame) -> pd.DataFrame:
    """df without the rows of selectors other than Quest (what the other sections read)."""
    return df[selector_of(df) == "quest"]


def points(df: pd.DataFrame) -> pd.DataFrame:
    """One row per POINT: rho, pages read, mass recall mean and p10, top-10, output error."""
    rows = head_rows(df.assign(selector=selector_of(df)))
    if rows.empty or "pages_read" not in rows:
        return pd.DataFrame(columns=list(COLUMNS))
    for col in ("selector_rho", "pages_read", "pages_read_p95", "pages_read_max"):
        rows = rows.assign(**{col: pd.to_numeric(rows.get(col), errors="coerce")})
    grouped = rows.groupby(POINT, sort=True)
    out = grouped[["mass_recall", "top10_recall", "output_rel_error", "pages_read"]].mean()
    out["mass_recall_p10"] = grouped["mass_recall"].quantile(0.10)
    out["rho"] = grouped["selector_rho"].first()
    out["pages_read_p95"] = grouped["pages_read_p95"].first()
    out["pages_read_max"] = grouped["pages_read_max"].first()
    out = out.reset_index()
    out["frontier"] = _frontier(out)
    return out


def _frontier(pts: pd.DataFrame) -> pd.Series:
    """True where no point of the same source, length and page size has rho <= and p10 >=,
    one of them strictly."""
    marks = pd.Series(False, index=pts.index)
    real = pts[pts["selector"] != "oracle"]  # the oracle needs every key: a ceiling, not a choice
    for _, group in real.groupby(["source", "length", "page_size"]):
        for i, row in group.iterrows():
            better = group[(group["rho"] <= row["rho"])
                           & (group["mass_recall_p10"] >= row["mass_recall_p10"])
                           & ((group["rho"] < row["rho"])
                              | (group["mass_recall_p10"] > row["mass_recall_p10"]))]
            marks[i] = better.empty and pd.notna(row["rho"])
    return marks


def _figure(pts: pd.DataFrame, floor: float) -> go.Figure:
    """rho against p10 mass recall, one trace per selector, the floor as a line."""
    fig = go.Figure()
    for name, rows in pts.groupby("selector", sort=False):
        rows = rows.sort_values("rho")
        fig.add_trace(go.Scatter(x=rows["rho"], y=rows["mass_recall_p10"], name=str(name),
                                 mode="lines+markers", text=rows["budget"].map(str),
                                 hovertemplate="budget %{text}: rho %{x:.3f}, p10 %{y:.3f}"))
    fig.add_hline(y=floor, line_dash="dot", annotation_text=f"floor {floor:g}")
    fig.update_layout(xaxis_title="rho (bytes read / dense)", yaxis_title="p10 mass recall",
                      height=420, margin={"t": 30})
    return fig


def _shown(pts: pd.DataFrame) -> pd.DataFrame:
    out = pts.copy()
    for col in ("rho", "pages_read", "mass_recall", "mass_recall_p10", "top10_recall",
                "output_rel_error"):
        out[col] = out[col].map(lambda x: f"{x:.3f}" if pd.notna(x) else None)
    out["frontier"] = out["frontier"].map({True: "yes", False: ""})
    return out


def sections(df: pd.DataFrame, meta: dict) -> list[tuple[str, str, str, str]]:
    """[(anchor, title, lede, html)] of the selectors section; [] without other selectors."""
    if "selector" not in df or not (selector_of(df) != "quest").any():
        return []
    pts = points(df)
    if pts.empty:
        return []
    body = figure(_figure(pts, min_recall(meta)), "selectors")
    body += table(_shown(pts), COLUMNS, "selectors-table",
                  numeric=[c for c in COLUMNS if c not in ("source", "selector")],
                  best=pts["frontier"])
    return [("selectors", "Selectors: bytes against fidelity", LEDE, body)]
