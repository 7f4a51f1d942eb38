"""Per-layer budgets from fidelity rows: the smallest budget per layer that reaches the floor.

For one source and length (a real model's prompts first, the longest length), one page size
and mode, each layer gets the smallest budget measured whose 10th-percentile mass recall over
the layer's heads (each head's mean over prompts and steps) reaches the floor; a layer Quest
keeps dense, or where no budget below the whole context reaches the floor, stays dense. The
uniform budget is the smallest one whose 10th percentile over every sparse (layer, head)
reaches the same floor (the recommendation's rule). Bytes per decode step and request: a
sparse layer reads its summaries and its budget's keys and values (rho = 1/S + B/L of dense),
a dense layer all of them, at 2 bytes a value (the kernels' fp16). Of the page sizes and modes
measured, the table kept is the one that reads the fewest bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from questprof.core.budgets import BudgetTable
from questprof.report import fidelity_frames as ff
from questprof.report.html import esc, table

VALUE_BYTES = 2  # fp16, as the kernels store the cache


@dataclass(frozen=True)
class LayerBudgets:
    """The table, its per-layer account (layer, budget, p10, why) and the bytes it reads
    against the uniform budget (None when no uniform budget reaches the floor)."""

    table: BudgetTable
    layers: pd.DataFrame
    table_bytes: float | None  # None (and dense_bytes) where the rows lack the model's shape
    uniform_bytes: float | None
    dense_bytes: float | None


def _quest_heads(df: pd.DataFrame) -> pd.DataFrame:
    rows = df[(df["stage"] == "fidelity") & df["head"].notna() & (df["status"] == "ok")]
    if "selector" in rows:
        rows = rows[rows["selector"].fillna("quest") == "quest"]
    rows = rows.assign(mass_recall=pd.to_numeric(rows["mass_recall"], errors="coerce"))
    return rows.assign(dense_layer=rows.get("dense_layer", False))


def _basis(rows: pd.DataFrame) -> tuple[str, int] | None:
    """(source, length): the best-ranked source, its longest length."""
    if rows.empty:
        return None
    sources = list(rows["source"].dropna().unique())
    source = min(sources, key=lambda s: ff.SOURCE_RANK.index(s) if s in ff.SOURCE_RANK else 99)
    return source, int(rows[rows["source"] == source]["length"].max())


def _layer_bytes(budget, length: int, page: int, per_token: float) -> float:
    """Bytes one layer reads: summaries and the budget's tokens, or every token (dense)."""
    if budget is None:
        return length * per_token
    return (-(-length // page) + budget) * per_token


def _one(rows: pd.DataFrame, floor: float, length: int, page: int, mode: str,
         meta: dict) -> LayerBudgets:
    """The table of one page size and mode (rows: its head rows, every budget)."""
    p10 = rows.groupby(["layer", "budget"])["mass_recall"].quantile(0.10).unstack()
    dense = rows.groupby("layer")["dense_layer"].first().fillna(False).astype(bool)
    sparse = rows[~rows["dense_layer"].fillna(False).astype(bool)]
    overall = sparse.groupby("budget")["mass_recall"].quantile(0.10)
    reach = [int(b) for b, v in overall.items() if v >= floor and b < length]
    uniform = min(reach) if reach else None
    budgets, account = [], []
    for layer in sorted(p10.index):
        ok = [int(b) for b, v in p10.loc[layer].items() if v >= floor and b < length]
        pick = None if dense.get(layer, False) or not ok else min(ok)
        why = ("kept dense" if dense.get(layer, False) else
               "no budget below the context reaches the floor" if pick is None else "")
        budgets.append(pick)
        account.append({"layer": int(layer), "budget": pick,
                        "p10": None if pick is None else float(p10.loc[layer, pick]), "why": why})
    first = rows.iloc[0]
    tab = BudgetTable(tuple(budgets), page, mode, str(first.get("model") or ""), floor, uniform,
                      {**meta, "length": length})
    kv, d = first.get("kv_heads"), first.get("head_dim")
    if pd.isna(kv) or pd.isna(d):  # rows without the shape: the table, no bytes
        return LayerBudgets(tab, pd.DataFrame(account), None, None, None)
    size = lambda b: _layer_bytes(b, length, page, 2 * int(kv) * int(d) * VALUE_BYTES)  # noqa: E731
    kept_dense = dense.reindex(p10.index, fill_value=False)
    uniform_bytes = (None if uniform is None else
                     sum(size(None if kept else uniform) for kept in kept_dense))
    return LayerBudgets(tab, pd.DataFrame(account), sum(size(b) for b in budgets), uniform_bytes,
                        len(budgets) * size(None))


def per_layer(df: pd.DataFrame, floor: float) -> LayerBudgets | None:
    """The per-layer budgets that read the fewest bytes over the page sizes and modes measured
    (None without Quest's per-head fidelity rows)."""
    rows = _quest_heads(df) if ff.has_fidelity(df) else pd.DataFrame()
    basis = _basis(rows)
    if basis is None:
        return None
    source, length = basis
    rows = rows[(rows["source"] == source) & (rows["length"] == length)]
    meta = {"source": source, "prompts": int(rows["samples"].max()) if "samples" in rows else 0}
    tables = [_one(group, floor, length, int(page), str(mode), meta)
              for (page, mode), group in rows.groupby(["page_size", "mode"])]
    return min(tables, key=lambda t: t.table_bytes or 0.0) if tables else None


def _mb(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x / 1e6:.2f} MB" if x >= 1e6 else f"{x / 1e3:.1f} kB"


def saving_line(got: LayerBudgets) -> str:
    """One sentence: the table's bytes against the uniform budget's and dense."""
    t = got.table
    if got.table_bytes is None:
        return (f"Per-layer budgets (page {t.page_size}, {t.mode}): bytes not computed (the rows "
                "do not record kv_heads and head_dim).")
    base = (f"Per-layer budgets (page {t.page_size}, {t.mode}, {t.info.get('source')} at "
            f"{t.info.get('length')} tokens) read {_mb(got.table_bytes)} per decode step and "
            f"request, dense {_mb(got.dense_bytes)}")
    if got.uniform_bytes is None:
        return base + f"; no single budget reaches the floor {t.min_recall:g} in every sparse layer."
    saved = 1 - got.table_bytes / got.uniform_bytes
    return (base + f"; the uniform budget that reaches the same floor {t.min_recall:g}, "
            f"{t.uniform_budget} tokens, reads {_mb(got.uniform_bytes)}: the table reads "
            f"{abs(saved):.0%} {'less' if saved >= 0 else 'more'}.")


def all_dense_line(got: LayerBudgets) -> str | None:
    """The sentence for a table that keeps every layer dense (None when a layer is sparse):
    timed, it would be dense attention under Quest's name, so there is nothing to time."""
    t = got.table
    if t.largest is not None:
        return None
    return (f"No budget measured below the context reaches the floor {t.min_recall:g} in any "
            f"sparse layer (page {t.page_size}, {t.mode}, {t.info.get('source')} at "
            f"{t.info.get('length')} tokens): every layer would stay dense, so there is no "
            "per-layer table to time; raise the budget or lower --min-recall.")


def section_html(df: pd.DataFrame, floor: float) -> str:
    """The per-layer table and its byte saving, or why there is none to time ('' without rows
    to build it from)."""
    got = per_layer(df, floor)
    if got is None:
        return ""
    dense = all_dense_line(got)
    said = esc(dense) if dense else (f"{esc(saving_line(got))} Time it with <code>questprof "
                                     "sweep --budgets-file budgets.toml</code>.")
    shown = got.layers.assign(
        budget=got.layers["budget"].map(lambda b: "dense" if pd.isna(b) else str(int(b))),
        p10=got.layers["p10"].map(lambda v: "–" if pd.isna(v) else f"{v:.3f}"))
    return ("<h3>Per-layer budgets (budgets.toml)</h3>"
            f"<p>{said}</p>"
            + table(shown, {"layer": "layer", "budget": "budget (tokens)",
                            "p10": "p10 mass recall at it", "why": "note"},
                    "budgets-table", numeric={"layer", "budget", "p10"}))
