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
from questprof.report.fidelity_frames import SOURCE_RANK, head_rows
from questprof.report.html import figure, table
from questprof.report.recommend import fmt_share

POINT = ["source", "length", "page_size", "budget", "selector"]
COLUMNS = {"source": "source", "length": "tokens", "page_size": "page", "budget": "budget",
           "selector": "selector", "rho": "rho", "pages_read": "pages read",
           "pages_read_p95": "p95", "pages_read_max": "max", "mass_recall": "mass recall",
           "mass_recall_p10": "p10", "top10_recall": "top-10", "output_rel_error": "output err",
           "task": "task (in the loop)", "task_dense": "task dense", "agree": "tokens = dense",
           "diverge": "diverges at", "forced": "teacher-forced match", "frontier": "frontier"}
TASK = {"passkey_quest_correct": "task_share", "passkey_dense_correct": "dense_share",
        "samples": "task_n", "dense_agreement": "agree", "first_divergence_median": "diverge",
        "forced_match": "forced"}
LEDE = ("Each selector on the same captures, queries and decode steps: the bytes it reads per "
        "query against dense (rho, summaries included: c boxes read c summaries, FP8 summaries "
        "half) against what it keeps of dense attention. Marked rows are the frontier: no other "
        "selector or budget of the same source, length and page size reads fewer bytes for a "
        "higher p10 mass recall (the oracle, a ceiling that needs every key, is no candidate). "
        "h2o and tova evict for good; the first query's attention stands in for the prompt's, "
        "and decode steps that open no new page evict nothing more. bnb reads until its top-R "
        "tokens are exact, whatever the budget. The task columns answer the prompts with the "
        "selector in the decode loop (every layer but the dense ones): its accuracy with a 95% "
        "Wilson interval, dense's beside it, the share of prompts whose tokens all equal "
        "dense's, the median step at which the others first differ, and, teacher-forced "
        "(dense's tokens fed), the share of steps whose next token equals dense's. p95 and max "
        "are the tail of the pages a dynamic budget read.")


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
    return out.merge(task(df), on=POINT, how="left")


def task(df: pd.DataFrame) -> pd.DataFrame:
    """One row per POINT of the task rows (stage passkey): accuracy with the selector in the
    decode loop and dense, prompts, agreement with dense's tokens, where answers diverge."""
    rows = df[df["stage"] == "passkey"] if "stage" in df else df.iloc[0:0]
    if rows.empty:
        return pd.DataFrame(columns=POINT + list(TASK.values()))
    rows = rows.assign(selector=selector_of(rows))
    for col in TASK:
        rows = rows.assign(**{col: pd.to_numeric(rows.get(col), errors="coerce")})
    got = rows.groupby(POINT, sort=True)[list(TASK)].first().reset_index()
    return got.rename(columns=TASK)


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


def _figure(pts: pd.DataFrame, y: str, label: str, title: str,
            floor: float | None = None) -> go.Figure:
    """rho against column y, one trace per selector (the floor as a line when given)."""
    fig = go.Figure()
    for name, rows in pts.groupby("selector", sort=False):
        rows = rows.sort_values("rho")
        fig.add_trace(go.Scatter(x=rows["rho"], y=rows[y], name=str(name),
                                 mode="lines+markers", text=rows["budget"].map(str),
                                 hovertemplate="budget %{text}: rho %{x:.3f}, "
                                               + label + " %{y:.3f}"))
    if floor is not None:
        fig.add_hline(y=floor, line_dash="dot", annotation_text=f"floor {floor:g}")
    fig.update_layout(title=title, xaxis_title="rho (bytes read / dense)", yaxis_title=label,
                      height=420, margin={"t": 40})
    return fig


def _figures(pts: pd.DataFrame, floor: float) -> str:
    """Per source and length: rho against p10 mass recall, and against task accuracy where
    task rows exist."""
    html = ""
    for (source, length), group in pts.groupby(["source", "length"], sort=True):
        where = f"{source} at {int(length)} tokens"
        html += figure(_figure(group, "mass_recall_p10", "p10 mass recall", where, floor),
                       f"selectors-{source}-{int(length)}")
        if group["task_share"].notna().any():
            html += figure(_figure(group.dropna(subset=["task_share"]), "task_share",
                                   "task accuracy (selector in the loop)", where),
                           f"selectors-task-{source}-{int(length)}")
    return html


def _shown(pts: pd.DataFrame) -> pd.DataFrame:
    out = pts.copy()
    for col in ("rho", "pages_read", "mass_recall", "mass_recall_p10", "top10_recall",
                "output_rel_error", "forced"):
        out[col] = out[col].map(lambda x: f"{x:.3f}" if pd.notna(x) else None)
    out["task"] = [fmt_share(v, n) for v, n in zip(out["task_share"], out["task_n"])]
    out["task_dense"] = [fmt_share(v, n) for v, n in zip(out["dense_share"], out["task_n"])]
    out["agree"] = out["agree"].map(lambda x: f"{x:.0%}" if pd.notna(x) else None)
    out["frontier"] = out["frontier"].map({True: "yes", False: ""})
    return out


def sections(df: pd.DataFrame, meta: dict) -> list[tuple[str, str, str, str]]:
    """[(anchor, title, lede, html)] of the selectors section; [] without other selectors."""
    if "selector" not in df or not (selector_of(df) != "quest").any():
        return []
    pts = points(df)
    if pts.empty:
        return []
    body = _figures(pts, min_recall(meta))
    body += table(_shown(pts), COLUMNS, "selectors-table",
                  numeric=[c for c in COLUMNS if c not in ("source", "selector")],
                  best=pts["frontier"])
    return [("selectors", "Selectors: bytes against fidelity", LEDE, body)]


def _basis(pts: pd.DataFrame) -> pd.DataFrame:
    """The points of the best-ranked source at its longest length."""
    source = min(pts["source"].unique(), key=lambda s: (SOURCE_RANK.index(s)
                                                        if s in SOURCE_RANK else 99, s))
    pts = pts[pts["source"] == source]
    return pts[pts["length"] == pts["length"].max()]


def _describe(p) -> str:
    task_ = "" if pd.isna(p.get("task_share")) else (
        f", task {fmt_share(p['task_share'], p['task_n'])}")
    return (f"{p['selector']} at {int(p['budget'])} tokens (page {int(p['page_size'])}): rho "
            f"{p['rho']:.3f}, p10 mass recall {p['mass_recall_p10']:.3f}{task_}")


def glance_lines(df: pd.DataFrame, meta: dict) -> list[str]:
    """Which selector and budget reads the fewest bytes at the floor (p10 mass recall), on the
    best source at its longest length, against the cheapest Quest setting there; [] without
    other selectors."""
    if "selector" not in df or not (selector_of(df) != "quest").any():
        return []
    pts = points(df)
    pts = pts[(pts["selector"] != "oracle") & pts["rho"].notna()]
    if pts.empty:
        return []
    pts, floor = _basis(pts), min_recall(meta)
    where = f"{pts['source'].iloc[0]} at {int(pts['length'].iloc[0])} tokens"
    under = pts[pts["mass_recall_p10"] >= floor].sort_values(["rho", "mass_recall_p10"],
                                                             ascending=[True, False])
    if under.empty:
        best = pts.sort_values("mass_recall_p10").iloc[-1]
        return [f"Among selectors ({where}), none reaches the floor {floor:g} at a budget "
                f"measured; the closest is {_describe(best)}."]
    line = (f"Among selectors ({where}), the fewest bytes at the floor {floor:g}: "
            f"{_describe(under.iloc[0])}")
    quest = under[under["selector"] == "quest"]
    if under.iloc[0]["selector"] != "quest":
        line += (f"; against {_describe(quest.iloc[0])}" if not quest.empty
                 else "; Quest reaches it at no budget measured")
    return [line + "."]
