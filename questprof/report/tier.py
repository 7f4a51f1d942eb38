"""The report's host-tier section (core/tier.py), drawn only when rows carry kv_tier host: time
per stage with its link bytes, Quest's attention against dense over the same tier, the link
ceilings of the run, and the replayed hit rate against the cache size C where the directory
holds `questprof reuse` rows."""

from __future__ import annotations

import pandas as pd

from questprof.report.frames import fmt_tokens
from questprof.report.html import esc, table

TITLE = "Host tier"
LEDE = ("K and V pages in host memory, read over the host link: each stage's time and the bytes "
        "it moves over the link (the byte model of the tier), and Quest's step against dense "
        "attention over the same tier. The pools are random: no step-to-step reuse, every chosen "
        "page crosses; the hit rate of an HBM page cache comes from a real model's replay.")
NO_CEILINGS = ("No link ceilings in this run (measured on a GPU only; on the CPU the host is the "
               "host and the link bytes are modelled).")
# one configuration: dense pairs with the Quest step of the same model and cache only
KEY = ["model", "kv_dtype", "summary_dtype", "tp", "length", "batch", "page_size", "budget",
       "mode", "summary_tier", "hbm_pages"]


def has_tier(df: pd.DataFrame) -> bool:
    """Whether any timed row ran over the host tier."""
    return "kv_tier" in df and bool((df["kv_tier"] == "host").any())


def _stages(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (configuration, stage) of our kernels: us, link MB, link GB/s, and the
    dense-over-host time over the Quest step's."""
    ours = rows[(rows["impl"] == "ours") & rows["median_ms"].notna()].copy()
    ours["us"] = ours["median_ms"] * 1e3
    ours["link_mb"] = ours["link_bytes"] / 1e6
    ours["link_gbs"] = ours["link_bytes"] / (ours["median_ms"] * 1e-3) / 1e9
    key = [k for k in KEY if k in ours]
    ours[key] = ours[key].astype(object).where(ours[key].notna(), "")  # NaN keys pair as equal
    dense = ours[ours["stage"] == "dense"].set_index(key)["median_ms"]
    quest = ours[ours["stage"] == "quest"].set_index(key)["median_ms"]
    speed = (dense / quest).rename("dense_over_quest").reset_index()
    ours = ours.merge(speed, on=key, how="left")
    ours["length"] = ours["length"].map(fmt_tokens)
    ours = ours.round({"us": 1, "link_mb": 1, "link_gbs": 1, "dense_over_quest": 2})
    ours["link_gbs"] = ours["link_gbs"].where(ours["link_bytes"] > 0, "-")  # nothing crossed
    return ours


def _reuse(df: pd.DataFrame) -> str:
    rows = df[(df.get("kind") == "reuse") & df["layer"].isna()] if "kind" in df else df.iloc[:0]
    if rows.empty:
        return ("<p>No reuse rows here: <code>questprof reuse --out DIR</code> replays a real "
                "model's selection through a C-page cache and adds its hit rate.</p>")
    rows = rows.assign(hit_rate=1 - rows["miss_rate"])
    return table(rows, {"model": "model", "budget": "budget", "mode": "mode", "hbm_pages": "C",
                        "overlap": "overlap", "hit_rate": "hit rate"},
                 numeric=("budget", "hbm_pages", "overlap", "hit_rate"))


def section(df: pd.DataFrame, meta: dict) -> str:
    """The section's HTML ('' without host-tier rows)."""
    if not has_tier(df):
        return ""
    rows = _stages(df[df["kv_tier"] == "host"])
    ceilings = meta.get("link_ceilings") or {}
    said = (f"<p>{esc(ceilings['reason'])}</p>" if "reason" in ceilings else
            f"<p>Link ceilings of this run: pinned copy {ceilings['copy_gbs']:.1f} GB/s, "
            f"zero-copy read {ceilings['zero_copy_gbs']:.1f} GB/s.</p>" if ceilings else
            f"<p>{esc(NO_CEILINGS)}</p>")
    cols = {"length": "length", "batch": "B", "budget": "budget", "mode": "mode",
            "summary_tier": "summaries", "stage": "stage", "us": "us / layer",
            "link_mb": "link MB", "link_gbs": "link GB/s", "dense_over_quest": "dense / Quest"}
    return said + table(rows, cols, numeric=("us", "link_mb", "link_gbs",
                                             "dense_over_quest")) + _reuse(df)
