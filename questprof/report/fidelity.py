"""The fidelity part of a report: what each page size and budget keeps of dense attention.

fidelity_section(df, meta): mass recall and output error against budget per page size, a layer
x head heatmap at one budget, passkey accuracy, the dense layers apart. frontier_section: speed
against fidelity per setting. glance(df, meta): the fastest setting whose 10th-percentile mass
recall reaches the floor (meta['min_recall'], default 0.9).
"""

from __future__ import annotations

import pandas as pd

from questprof.report import budgets
from questprof.report import fidelity_figures as figs
from questprof.report import fidelity_frames as ff
from questprof.report import recommend
from questprof.report.frames import fmt_tokens, fmt_x
from questprof.report.html import esc, figure, table

DEFAULT_MIN_RECALL = 0.9
SOURCES = {"passkey": "passkey retrieval prompts (filler text, a 5-digit key at several depths)",
           "natural": "natural text: CPython's pydoc_data.topics (language reference help)",
           "synthetic-random": "synthetic: i.i.d. random keys (the worst case)",
           "synthetic-drift": "synthetic: topic spans, the query drifting from one to another",
           "cache": "a saved capture (safetensors)"}
NOTE_COLUMNS = {"source": "source", "length_t": "length", "page_size": "page size",
                "budget_t": "budget", "mode": "mode", "mr": "mass recall (mean)",
                "mr10": "mass recall (p10)", "om": "oracle mass", "t10": "top-10 recall",
                "pr": "page recall", "err": "output rel. error", "slack": "bound slack (q.k)"}


def has_rows(df: pd.DataFrame) -> bool:
    """Whether df holds fidelity rows."""
    return ff.has_fidelity(df)


def min_recall(meta: dict) -> float:
    return float((meta or {}).get("min_recall") or DEFAULT_MIN_RECALL)


def _fmt(table_: pd.DataFrame) -> pd.DataFrame:
    """Summary rows with display columns for NOTE_COLUMNS."""
    f3 = lambda v: "–" if pd.isna(v) else f"{v:.3f}"  # noqa: E731
    return table_.assign(length_t=table_["length"].map(fmt_tokens),
                         budget_t=table_["budget"].map(fmt_tokens),
                         mr=table_["mass_recall"].map(f3), mr10=table_["mass_recall_p10"].map(f3),
                         om=table_["oracle_mass"].map(f3), t10=table_["top10_recall"].map(f3),
                         pr=table_["page_recall"].map(f3), err=table_["output_rel_error"].map(f3),
                         slack=table_["bound_slack"].map(lambda v: f"{v:.1f}"))


def summary_table(df: pd.DataFrame, floor: float) -> str:
    """The per-setting table: means over the sparse layers' heads, p10 with its 95% interval
    where recorded, highlighted >= floor."""
    s = ff.summary(df).merge(recommend.intervals(df), on=ff.SETTING, how="left")
    s["ci"] = [("–" if pd.isna(lo) else f"{lo:.3f}-{hi:.3f}")
               for lo, hi in zip(s["mass_recall_p10_lo"], s["mass_recall_p10_hi"])]
    columns = {**NOTE_COLUMNS}
    columns = dict(list(columns.items())[:7] + [("ci", "p10 95% interval")]
                   + list(columns.items())[7:])
    numeric = {"mr", "mr10", "ci", "om", "t10", "pr", "err", "slack"}
    return table(_fmt(s), columns, "fidelity-table", numeric=numeric,
                 best=s["mass_recall_p10"] >= floor)


def _sources(df: pd.DataFrame) -> str:
    names = sorted(df[df["stage"] == "fidelity"]["source"].dropna().unique())
    items = "".join(f"<li><code>{esc(n)}</code>: {esc(SOURCES.get(n, n))}</li>" for n in names)
    models = ", ".join(sorted(df[df["stage"] == "fidelity"]["model"].dropna().astype(str).unique()))
    return f"<p>Model: {esc(models)}. Sources:</p><ul>{items}</ul>"


def _passkey(df: pd.DataFrame) -> str:
    task = ff.passkey(df)
    if task.empty:
        return ("<p class=\"note\">No passkey task rows (a source other than passkey, "
                "or --no-task).</p>")
    return figure(figs.passkey_figure(task), "fidelity-passkey") + _passkey_table(task)


def _passkey_table(task: pd.DataFrame) -> str:
    """Accuracy as k/n with its Wilson interval: 5 prompts cannot tell 40% from 60%."""
    share = lambda col: [recommend.fmt_share(v, n)  # noqa: E731
                         for v, n in zip(task[col], task.get("samples", [None] * len(task)))]
    shown = task.assign(length_t=task["length"].map(fmt_tokens),
                        budget_t=task["budget"].map(fmt_tokens),
                        dense=share("passkey_dense_correct"),
                        quest=share("passkey_quest_correct"))
    columns = {"length_t": "length", "page_size": "page size", "budget_t": "budget",
               "mode": "mode", "dense": "dense correct", "quest": "Quest correct"}
    return table(shown, columns, "passkey-table", numeric={"dense", "quest"})


def _heatmap(df: pd.DataFrame) -> str:
    where = ff.heat_setting(ff.summary(df))
    if where is None:
        return ""
    return (figure(figs.heat_figure(ff.heat(df, *where), where, dense_layers(df)), "fidelity-heat")
            + figure(figs.layer_figure(ff.per_layer(df, where), where), "fidelity-layers"))


def dense_layers(df: pd.DataFrame) -> int:
    rows = df[(df["stage"] == "fidelity") & df["head"].notna()]
    if "dense_layer" not in rows:
        return 0
    return int(rows[rows["dense_layer"].fillna(False).astype(bool)]["layer"].nunique())


def _dense_apart(df: pd.DataFrame) -> str:
    s = ff.dense_layer_summary(df)
    if s.empty:
        return "<p class=\"note\">No dense layers in these rows (dense_layers = 0).</p>"
    return ("<h3>The first layers, kept dense (what Quest would lose there)</h3>"
            + table(_fmt(s), NOTE_COLUMNS, "fidelity-dense-table"))


def fidelity_section(df: pd.DataFrame, meta: dict) -> str:
    """HTML of the fidelity section (empty string when df has no fidelity rows)."""
    if not ff.has_fidelity(df):
        return ""
    floor = min_recall(meta)
    figures = "".join(figure(fig, f"fidelity-budget-{i}")
                      for i, fig in enumerate(figs.budget_figures(ff.summary(df), floor)))
    return (_sources(df) + figures + _heatmap(df) + _passkey(df) + "<h3>Every setting</h3>"
            + summary_table(df, floor) + budgets.section_html(df, floor) + _dense_apart(df))


def frontier_section(df: pd.DataFrame, meta: dict) -> str:
    """HTML of the speed-fidelity frontier (a note when speed or fidelity rows are missing):
    the figure, then each setting with its p10 interval and verdict at the floor."""
    floor = min_recall(meta)
    table_ = recommend.frontier(df, floor)
    if table_.empty or table_["speedup"].isna().all():
        return ("<p>The frontier needs speed rows (a sweep) and fidelity rows in one results "
                "directory: <code>questprof sweep --fidelity</code>.</p>")
    return (figure(figs.frontier_figure(table_, floor), "fidelity-frontier")
            + _frontier_table(table_, floor, recommended(df, meta)))


def _frontier_table(t: pd.DataFrame, floor: float, pick: dict | None) -> str:
    t = t.dropna(subset=["speedup"]).sort_values("speedup", ascending=False)
    shown = t.assign(budget_t=t["budget"].map(fmt_tokens), sp=t["speedup"].map(fmt_x),
                     at=t["speed_length"].map(fmt_tokens),
                     fid=t["fidelity_length"].map(fmt_tokens),
                     p10=[recommend.fmt_recall(r) for _, r in t.iterrows()])
    columns = {"page_size": "page size", "budget_t": "budget", "mode": "mode",
               "sp": "speedup", "at": "at", "p10": "p10 mass recall", "fid": "fidelity at",
               "verdict": f"against the floor {floor:g}"}
    best = (pd.Series([all(r[k] == pick[k] for k in ff.JOIN) for _, r in t.iterrows()])
            if pick else None)
    note = ("<p class=\"note\">Verdict: <i>passes</i> when the whole 95% interval of the p10 "
            "is at or above the floor, <i>fails</i> when all of it is below, <i>not decided</i> "
            "when the floor lies inside it (more prompts would decide it); <i>no interval</i> "
            "for rows written before intervals were recorded. Highlighted: the recommendation."
            "</p>")
    return table(shown, columns, "frontier-table", numeric={"sp", "p10"}, best=best) + note


def recommended(df: pd.DataFrame, meta: dict) -> dict | None:
    """{page_size, budget, mode} of the setting recommended under the fidelity floor, or None
    (no fidelity rows, or no setting reaches the floor)."""
    rec = ff.recommend(df, min_recall(meta)) if ff.has_fidelity(df) else None
    if rec is None or rec["setting"] is None:
        return None
    return {k: rec["setting"][k] for k in ff.JOIN}


def glance_lines(df: pd.DataFrame, meta: dict) -> list[str]:
    """The recommendation under the fidelity floor as plain sentences (what it rests on, how
    sure it is); with speed rows and no fidelity rows, that the ranking is by speed alone and
    the command that adds fidelity (meta['results_dir'] names the directory)."""
    meta = meta or {}
    words = str(meta.get("command") or "").split()
    if words[1:2] in (["bench"], ["bytes"]):  # kernels against ceilings: no setting to choose
        return []
    return recommend.advice(df, min_recall(meta)) or recommend.unmeasured(
        df, meta.get("results_dir"))


LEADS = ("Fidelity floor", "Recommended", "Not decided", "Decided", "How sure",
         "Ranked by speed alone", "Indistinguishable from the floor", "Among selectors")


def _html(line: str) -> str:
    """One sentence as HTML: its lead words bold, a command after 'with: ' as code."""
    lead = next((w for w in LEADS if line.startswith(w)), None)
    if lead is not None:
        return f"<b>{esc(lead)}</b>{esc(line[len(lead):])}"
    if "with: " in line:
        text, command = line.split("with: ", 1)
        return f"{esc(text)}with: <code>{esc(command)}</code>"
    return esc(line)


def glance(df: pd.DataFrame, meta: dict, more: list[str] = ()) -> str:
    """glance_lines and `more` (the selectors' lines) as a list, one sentence an item (empty
    when there is nothing to say)."""
    lines = glance_lines(df, meta) + list(more)
    if not lines:
        return ""
    items = "".join(f"<li>{_html(line)}</li>" for line in lines)
    return f"<ul class=\"recommend\">{items}</ul>"


SECTIONS = (("fidelity", "9. Fidelity"), ("frontier", "10. Speed against fidelity"))
LEDES = {
    "fidelity": "What each page size and budget keeps of dense attention, per decode query of "
                "each q head: mass recall (share of the softmax mass in Quest's pages), oracle "
                "mass (the best share with as many pages), top-10 recall, page recall, the "
                "output's relative error and the bound slack U_p(q) - max q.k (q.k units). Means "
                "and 10th percentiles are over the heads of the sparse layers and every decode "
                "step of the answer; the first dense layers are reported apart.",
    "frontier": "Each page size and budget at its speedup (sweep rows, longest length, smallest "
                "batch) and its 10th-percentile mass recall (fidelity rows of one source, a real "
                "model's prompts first, at its longest length, which may be shorter than the "
                "sweep's). Up and right is better; below the dotted floor the worst heads lose "
                "attention mass.",
}


def sections(df: pd.DataFrame, meta: dict) -> list[tuple[str, str, str, str]]:
    """(anchor, title, lede, html) of the fidelity sections; [] when df has no fidelity rows."""
    if not ff.has_fidelity(df):
        return []
    html = {"fidelity": fidelity_section(df, meta), "frontier": frontier_section(df, meta)}
    return [(a, t, LEDES[a], html[a]) for a, t in SECTIONS]
