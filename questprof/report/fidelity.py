"""The fidelity part of a report: what each page size and budget keeps of dense attention.

fidelity_section(df, meta): mass recall and output error against budget per page size, a layer
x head heatmap at one budget, passkey accuracy, the dense layers apart. frontier_section: speed
against fidelity per setting. glance(df, meta): the fastest setting whose 10th-percentile mass
recall reaches the floor (meta['min_recall'], default 0.9).
"""

from __future__ import annotations

import pandas as pd

from questprof.report import fidelity_figures as figs
from questprof.report import fidelity_frames as ff
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
    """The per-setting table: means over the sparse layers' heads, p10, highlighted >= floor."""
    s = ff.summary(df)
    numeric = {"mr", "mr10", "om", "t10", "pr", "err", "slack"}
    return table(_fmt(s), NOTE_COLUMNS, "fidelity-table", numeric=numeric,
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
    pct = lambda v: "–" if pd.isna(v) else f"{v:.0%}"  # noqa: E731
    shown = task.assign(length_t=task["length"].map(fmt_tokens),
                        budget_t=task["budget"].map(fmt_tokens),
                        dense=task["passkey_dense_correct"].map(pct),
                        quest=task["passkey_quest_correct"].map(pct))
    columns = {"length_t": "length", "page_size": "page size", "budget_t": "budget",
               "mode": "mode", "samples": "prompts", "dense": "dense correct",
               "quest": "Quest correct"}
    return table(shown, columns, "passkey-table", numeric={"dense", "quest", "samples"})


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
            + summary_table(df, floor) + _dense_apart(df))


def frontier_section(df: pd.DataFrame, meta: dict) -> str:
    """HTML of the speed-fidelity frontier (a note when speed or fidelity rows are missing)."""
    table_ = ff.frontier(df)
    if table_.empty or table_["speedup"].isna().all():
        return ("<p>The frontier needs speed rows (a sweep) and fidelity rows in one results "
                "directory: <code>questprof sweep --fidelity</code>.</p>")
    return figure(figs.frontier_figure(table_, min_recall(meta)), "fidelity-frontier")


def recommended(df: pd.DataFrame, meta: dict) -> dict | None:
    """{page_size, budget, mode} of the setting recommended under the fidelity floor, or None
    (no fidelity rows, or no setting reaches the floor)."""
    rec = ff.recommend(df, min_recall(meta)) if ff.has_fidelity(df) else None
    if rec is None or rec["setting"] is None:
        return None
    return {k: rec["setting"][k] for k in ff.JOIN}


def glance(df: pd.DataFrame, meta: dict) -> str:
    """One paragraph: the recommended setting under the fidelity floor (empty without fidelity)."""
    floor = min_recall(meta)
    rec = ff.recommend(df, floor) if ff.has_fidelity(df) else None
    if rec is None:
        return ""
    how = "measured speedup" if rec["measured"] else "byte formula 1/rho (no speed rows)"
    head = ("<p class=\"recommend\"><b>Fidelity floor</b>: 10th-percentile mass recall "
            f"&ge; {floor:g}. ")
    if rec["setting"] is None:
        return head + ("No measured setting reaches it; raise the budget or lower "
                       "<code>--min-recall</code>.</p>")
    chosen = _describe(rec["setting"], rec["measured"])
    return head + f"Recommended: {chosen} ({how}).{_versus(rec)}</p>"


def _describe(row: dict, measured: bool) -> str:
    speed = f", {fmt_x(row['speedup'])} at {fmt_tokens(row['speed_length'])}" if measured else ""
    return (f"page {int(row['page_size'])}, budget {fmt_tokens(row['budget'])}, {esc(row['mode'])}"
            f"{speed}, p10 mass recall {row['mass_recall_p10']:.3f} at "
            f"{fmt_tokens(row['fidelity_length'])} tokens ({esc(row['source'])})")


def _versus(rec: dict) -> str:
    best, fastest = rec["setting"], rec["fastest"]
    same = all(best[k] == fastest[k] for k in ff.JOIN)
    if same:
        return " It is also the fastest setting."
    return (f" The fastest outright, {_describe(fastest, rec['measured'])}, misses the floor.")


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


def nav(df: pd.DataFrame) -> tuple:
    """(anchor, title) of the fidelity sections for the report's navigation."""
    return SECTIONS if ff.has_fidelity(df) else ()
