"""Tables of fidelity rows: per-setting summaries, passkey accuracy, the speed-fidelity join.

Fidelity rows (stage 'fidelity') are per (setting, layer, head) with step None, or per
(setting, step); passkey rows (stage 'passkey') hold the share of prompts answered right.
A setting is (source, length, page_size, budget, mode).
"""

from __future__ import annotations

import pandas as pd

from questprof.core import model
from questprof.report import frames

SETTING = ["source", "length", "page_size", "budget", "mode"]
MEAN_METRICS = ("mass_recall", "oracle_mass", "top10_recall", "page_recall",
                "output_rel_error", "bound_slack", "stale_mass_recall")
METRICS = (*MEAN_METRICS, "mass_recall_worst_step", "mass_recall_p10")
JOIN = ["page_size", "budget", "mode"]
SOURCE_RANK = ("passkey", "natural", "cache", "random-tokens", "synthetic-drift",
               "synthetic-random")


def has_fidelity(df: pd.DataFrame) -> bool:
    """Whether df holds fidelity rows."""
    return "stage" in df and bool((df["stage"] == "fidelity").any())


def _as_float(rows: pd.DataFrame) -> pd.DataFrame:
    """rows with every metric column as float: a column whose values all rounded to None (NaN
    metrics of a capture with non-finite queries) loads as object dtype, which has no mean or
    quantile; missing values become NaN, which pandas skips."""
    present = [m for m in METRICS if m in rows and rows[m].dtype.kind != "f"]
    if not present:
        return rows
    return rows.assign(**{m: pd.to_numeric(rows[m], errors="coerce").astype(float)
                          for m in present})


def _setting_rows(df: pd.DataFrame, where: tuple) -> pd.DataFrame:
    """Per (layer, head) fidelity rows of one (source, length, page_size, budget, mode)."""
    source, length, page_size, budget, mode = where
    return _as_float(df[(df["stage"] == "fidelity") & df["head"].notna()
                        & (df["source"] == source) & (df["length"] == length)
                        & (df["page_size"] == page_size) & (df["budget"] == budget)
                        & (df["mode"] == mode)])


def head_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, head) fidelity rows of the sparse layers (dense layers are reported apart)."""
    if "head" not in df:  # timing rows alone (a bench's selector rows): no fidelity
        return df.iloc[0:0]
    rows = _as_float(df[(df["stage"] == "fidelity") & df["head"].notna() & (df["status"] == "ok")])
    dense = rows["dense_layer"].fillna(False).astype(bool) if "dense_layer" in rows else False
    return rows[~dense] if rows[~dense].size else rows


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per setting: metric means over sparse layers' heads, and p10 of mass_recall."""
    rows = head_rows(df)
    if rows.empty:
        return pd.DataFrame(columns=SETTING)
    present = [m for m in MEAN_METRICS if m in rows]
    grouped = rows.groupby(SETTING, sort=True)
    out = grouped[present].mean()
    out["mass_recall_p10"] = grouped["mass_recall"].quantile(0.10)
    out["heads"] = grouped.size()
    return out.reset_index()


def dense_layer_summary(df: pd.DataFrame) -> pd.DataFrame:
    """The same summary over the first (dense) layers only: what Quest would lose there."""
    rows = df[(df["stage"] == "fidelity") & df["head"].notna()]
    if "dense_layer" not in rows:
        return pd.DataFrame(columns=SETTING)
    return summary(rows[rows["dense_layer"].fillna(False).astype(bool)].assign(dense_layer=False))


def passkey(df: pd.DataFrame) -> pd.DataFrame:
    """Passkey accuracy per (length, page_size, budget, mode): dense and Quest, prompts."""
    rows = df[df["stage"] == "passkey"] if "stage" in df else df.iloc[0:0]
    cols = ["length", "page_size", "budget", "mode", "passkey_dense_correct",
            "passkey_quest_correct", "samples"]
    return rows[[c for c in cols if c in rows]].sort_values(cols[:4]).reset_index(drop=True)


def speed(df: pd.DataFrame) -> pd.DataFrame:
    """Speedup per (page_size, budget, mode) at the longest length of the smallest batch."""
    pairs = frames.paired(df).dropna(subset=["speedup"])
    if pairs.empty:
        return pd.DataFrame(columns=JOIN + ["speedup", "speed_length", "batch"])
    pairs = pairs[pairs["batch"] == pairs["batch"].min()]
    last = pairs.sort_values("length").groupby(JOIN).tail(1)
    return last.rename(columns={"length": "speed_length"})[JOIN + ["speedup", "speed_length",
                                                                   "batch"]]


def judged_source(fid: pd.DataFrame) -> str:
    """The source the recommendation uses: a real model's prompts before saved caches, random
    tokens and synthetic caches (random keys would fail every floor and say nothing)."""
    present = list(fid["source"].unique())
    return min(present, key=lambda s: (SOURCE_RANK.index(s) if s in SOURCE_RANK else 2, s))


def frontier(df: pd.DataFrame) -> pd.DataFrame:
    """Speed joined with fidelity (judged source, its longest length) per setting."""
    fid = summary(df)
    if fid.empty:
        return fid
    fid = fid[fid["source"] == judged_source(fid)]
    fid = fid[fid["length"] == fid["length"].max()]
    keep = JOIN + ["source", "length", "mass_recall", "mass_recall_p10", "output_rel_error"]
    fid = fid[keep].rename(columns={"length": "fidelity_length"})
    return fid.merge(speed(df), on=JOIN, how="left")


def _formula_speed(row) -> float:
    """1/rho at the fidelity length: the byte formula's speedup, when no time was measured."""
    k = model.k_pages(int(row["budget"]), int(row["page_size"]))
    pages = model.pages(int(row["fidelity_length"]), int(row["page_size"]))
    return 1.0 / model.rho(int(row["page_size"]), min(k, pages), pages)


def recommend(df: pd.DataFrame, min_recall: float) -> dict | None:
    """The fastest setting whose p10 mass_recall >= min_recall (measured speed, else 1/rho); a
    budget that covers the fidelity length selects every page (dense under Quest's name) and is
    never recommended."""
    table = frontier(df)
    if table.empty:
        return None
    measured = table["speedup"].notna().any()
    table = table.assign(rank=table["speedup"] if measured else table.apply(_formula_speed, axis=1))
    sparse = table["budget"] < table["fidelity_length"]
    passing = table[sparse & (table["mass_recall_p10"] >= min_recall)].dropna(subset=["rank"])
    fastest = table.dropna(subset=["rank"]).sort_values("rank").tail(1)
    best = passing.sort_values("rank").tail(1)
    return {"setting": None if best.empty else best.iloc[0].to_dict(),
            "fastest": None if fastest.empty else fastest.iloc[0].to_dict(),
            "measured": bool(measured), "min_recall": min_recall}


def heat(df: pd.DataFrame, source: str, length: int, page_size: int, budget: int,
         mode: str) -> pd.DataFrame:
    """mass_recall per layer (rows) and head (columns) of one setting, dense layers included."""
    rows = _setting_rows(df, (source, length, page_size, budget, mode))
    return rows.pivot_table(index="layer", columns="head", values="mass_recall", aggfunc="mean")


def per_layer(df: pd.DataFrame, where: tuple) -> pd.DataFrame:
    """Per layer of one setting: mass_recall mean and 10th percentile over heads, dense flag."""
    rows = _setting_rows(df, where)
    grouped = rows.groupby("layer")["mass_recall"]
    out = pd.DataFrame({"mean": grouped.mean(), "p10": grouped.quantile(0.10)})
    dense = rows.groupby("layer")["dense_layer"].first() if "dense_layer" in rows else False
    return out.assign(dense_layer=dense).reset_index()


def heat_setting(table: pd.DataFrame) -> tuple | None:
    """(source, length, page_size, budget, mode) for the heatmap: the longest length, page 16 if
    measured, the middle budget, the first mode."""
    if table.empty:
        return None
    at = table[table["length"] == table["length"].max()]
    sizes = sorted(at["page_size"].unique())
    size = 16 if 16 in sizes else sizes[len(sizes) // 2]
    at = at[at["page_size"] == size]
    budgets = sorted(at["budget"].unique())
    first = at[at["budget"] == budgets[len(budgets) // 2]].iloc[0]
    return first["source"], int(first["length"]), size, int(first["budget"]), first["mode"]

