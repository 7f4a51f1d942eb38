"""The report's host-tier section (core/tier.py), drawn only when rows carry kv_tier host: time
per stage with its link bytes, Quest's attention against dense over the same tier, the link
ceilings of the run, and the replayed hit rate against the cache size C where the directory
holds `questprof reuse` rows, and beside it the rows timed through the page cache over a
replayed selection sequence (sweep --reuse-overlap / --reuse-trace): hit rate against C on the
device and by the rule's replay, link bytes and time against the model at that miss rate.
Where the run counted link bytes (CUPTI's pcie__read_bytes.sum, commands/link_bytes.py), each stage's measured link reads, raw and calibrated, stand beside the
modelled ones; where it did not, one line says why."""

from __future__ import annotations

import pandas as pd

from questprof.core import tier
from questprof.report.frames import fmt_tokens
from questprof.report.html import esc, table

TITLE = "Host tier"
LEDE = ("K and V pages in host memory, read over the host link: each stage's time and the bytes "
        "it moves over the link (the byte model of the tier), and Quest's step against dense "
        "attention over the same tier. Random pools have no step-to-step reuse: every chosen page "
        "crosses, but in the rows of an HBM page cache that replay a selection sequence "
        "(below); the hit rate of a real model's selections comes from its replay.")
NO_CEILINGS = ("No link ceilings in this run: sweep and bench measure them on a GPU (a byte check "
               "does not; on the CPU the host is the host and the link bytes are modelled).")
# one configuration: dense pairs with the Quest step of the same model and cache only
KEY = ["model", "kv_dtype", "summary_dtype", "tp", "length", "batch", "page_size", "budget",
       "mode", "summary_tier", "hbm_pages"]


def has_tier(df: pd.DataFrame) -> bool:
    """Whether any timed row ran over the host tier."""
    return "kv_tier" in df and bool((df["kv_tier"] == "host").any())


def _row_ms(rows: pd.DataFrame) -> pd.Series:
    """A row's time per layer: the timed passes' mean where a page cache replay recorded it (the
    steps its counts are of), else the median."""
    mean = (pd.to_numeric(rows["mean_ms"], errors="coerce") if "mean_ms" in rows
            else pd.Series(float("nan"), index=rows.index))
    return mean.fillna(rows["median_ms"])


def _stages(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (configuration, stage) of our kernels, timed or with counted link bytes (a
    byte check's rows): us, link MB, link GB/s, and the dense-over-host time over the Quest
    step's ('-' where untimed)."""
    counted = (pd.to_numeric(rows["calibrated_link_bytes"], errors="coerce").notna()
               if "calibrated_link_bytes" in rows else False)
    ours = rows[(rows["impl"] == "ours") & (rows["median_ms"].notna() | counted)].copy()
    ours["ms"] = _row_ms(ours)
    ours["us"] = ours["ms"] * 1e3
    ours["link_mb"] = ours["link_bytes"] / 1e6
    ours["link_gbs"] = ours["link_bytes"] / (ours["ms"] * 1e-3) / 1e9
    key = [k for k in KEY if k in ours]
    ours[key] = ours[key].astype(object).where(ours[key].notna(), "")  # NaN keys pair as equal
    dense = ours[ours["stage"] == "dense"].set_index(key)["ms"]
    quest = ours[ours["stage"] == "quest"].set_index(key)["ms"]
    speed = (dense / quest).rename("dense_over_quest").reset_index()
    ours = ours.merge(speed, on=key, how="left")
    ours["length"] = ours["length"].map(fmt_tokens)
    for col in ("batch", "budget"):  # whole numbers, where a NaN elsewhere made them floats
        ours[col] = ours[col].map(lambda v: int(v) if pd.notna(v) else "-")
    ours = ours.round({"us": 1, "link_mb": 1, "link_gbs": 1, "dense_over_quest": 2})
    ours["link_gbs"] = ours["link_gbs"].where(ours["link_bytes"] > 0, "-")  # nothing crossed
    for col in ("us", "link_gbs", "dense_over_quest"):  # a byte check's rows are untimed
        ours[col] = ours[col].astype(object).where(ours[col].notna(), "-")
    return ours


def _of_copy(ours: pd.DataFrame, copy_gbs: float | None) -> pd.DataFrame:
    """ours with each timed row's link GB/s over the run's pinned-copy ceiling ('-' without a
    ceiling, or where nothing crossed or nothing was timed)."""
    rate = pd.to_numeric(ours["link_gbs"], errors="coerce")
    share = (rate / copy_gbs).round(2) if copy_gbs else rate * float("nan")
    ours["of_copy"] = share.astype(object).where(share.notna(), "-")
    return ours


def has_measured_link(rows: pd.DataFrame) -> bool:
    """Whether any row carries calibrated link bytes (directories before them have no column)."""
    return ("calibrated_link_bytes" in rows
            and bool(pd.to_numeric(rows["calibrated_link_bytes"], errors="coerce").notna().any()))


def _measured_link(ours: pd.DataFrame) -> pd.DataFrame:
    """ours with the measured link columns: raw and calibrated MB per layer, and calibrated over
    the tier model's link reads ('-' where the model moves nothing or nothing was counted)."""
    raw = pd.to_numeric(ours["measured_link_bytes"], errors="coerce")
    calibrated = pd.to_numeric(ours["calibrated_link_bytes"], errors="coerce")
    model = pd.to_numeric(ours.get("link_read_bytes", ours["link_bytes"]), errors="coerce")
    ours["link_raw_mb"] = (raw / 1e6).round(1)
    ours["link_cal_mb"] = (calibrated / 1e6).round(1)
    ratio = (calibrated / model).round(4)  # 1.0003, where 3 places read as 1.0
    ours["link_ratio"] = ratio.where((model > 0) & calibrated.notna(), "-")
    for col in ("link_raw_mb", "link_cal_mb"):
        ours[col] = ours[col].astype(object).where(ours[col].notna(), "-")
    return ours


def _link_said(rows: pd.DataFrame, meta: dict) -> str:
    """One paragraph on the link counter: its calibration in this run, or why nothing was
    counted ('' for runs that predate it and say nothing)."""
    info = meta.get("link_bytes") or {}
    if has_measured_link(rows) and info.get("factor") is not None:
        return (f"<p>Measured link bytes: CUPTI's <code>{esc(info.get('metric', ''))}</code>, "
                f"which counted {info['factor']:.4f}x the bytes of a zero-copy read of "
                f"{info['known'] / 2**20:,.0f} MiB in this run (a second read "
                f"{info['spread']:+.2%}); calibrated = raw / {info['factor']:.4f}.</p>")
    why = info.get("reason")
    if why is None and "link_reason" in rows:
        why = next((r for r in rows["link_reason"].dropna()), None)
    return f"<p>Link bytes not measured here: {esc(why)}.</p>" if why else ""


def _split_at(cols: dict, key: str) -> tuple[dict, dict]:
    """(the columns before `key`, `key` and those after it)."""
    keys = list(cols)
    at = keys.index(key)
    return {k: cols[k] for k in keys[:at]}, {k: cols[k] for k in keys[at:]}


def _reuse(df: pd.DataFrame) -> str:
    rows = df[(df.get("kind") == "reuse") & df["layer"].isna()] if "kind" in df else df.iloc[:0]
    if rows.empty:
        return ("<p>No reuse rows here: <code>questprof reuse --out DIR</code> replays a real "
                "model's selection through a C-page cache and adds its hit rate.</p>")
    rows = rows.assign(hit_rate=1 - rows["miss_rate"])
    return table(rows, {"model": "model", "budget": "budget", "mode": "mode", "hbm_pages": "C",
                        "overlap": "overlap", "hit_rate": "hit rate"},
                 numeric=("budget", "hbm_pages", "overlap", "hit_rate"))


REPLAY_TOLERANCE = 0.10  # issue 33: link bytes and time as modelled from the replayed miss rate


def _model_us(rows: pd.DataFrame, meta: dict) -> pd.Series:
    """Each replayed row's time by the byte model (core/tier.tier_seconds) at the run's
    zero-copy link and HBM read ceilings, in us; NaN where the run measured no ceilings."""
    link = (meta.get("link_ceilings") or {}).get("zero_copy_gbs")
    hbm = (meta.get("ceilings") or {}).get("read_gbs")
    if not link or not hbm:
        return pd.Series(float("nan"), index=rows.index)
    return rows.apply(lambda r: 1e6 * tier.tier_seconds(tier.TierBytes(
        r["stage"], r["tier_hbm_bytes"], r["link_bytes"]), link, hbm), axis=1)


def _within(ratio: pd.Series) -> pd.Series:
    return ratio.map(lambda v: "-" if pd.isna(v) else
                     ("yes" if abs(v - 1) <= REPLAY_TOLERANCE else "no"))


def _replayed(df: pd.DataFrame, meta: dict) -> str:
    """Hit rate against C of the rows timed through the page cache, measured on the device
    beside the replay of the same steps, and link bytes and time against the model at it."""
    if "cache_steps" not in df:
        return ""
    rows = df[pd.to_numeric(df["cache_steps"], errors="coerce") > 0].copy()
    if rows.empty:
        return ""
    rows["hit"] = (1 - rows["cache_miss_rate"]).round(4)
    rows["hit_model"] = (1 - rows["replayed_miss_rate"]).round(4)
    counted = (pd.to_numeric(rows["calibrated_link_bytes"], errors="coerce")
               if "calibrated_link_bytes" in rows else pd.Series(float("nan"), index=rows.index))
    rows["link_ratio_cache"] = (counted / rows["link_bytes"]).round(4)  # NaN: not counted
    rows["us"] = (_row_ms(rows) * 1e3).round(1)  # rows before 2026-12-03: the median
    rows["model_us"] = _model_us(rows, meta).round(1)
    rows["time_ratio"] = (rows["us"] / rows["model_us"]).round(3)
    rows["bytes_ok"], rows["time_ok"] = (_within(rows["link_ratio_cache"]),
                                         _within(rows["time_ratio"]))
    rows["link_mb"] = (rows["cache_link_bytes"] / 1e6).round(3)
    rows["length"] = rows["length"].map(fmt_tokens)
    rows["reuse_overlap"] = pd.to_numeric(rows["reuse_overlap"], errors="coerce").round(3)
    rows = rows.astype(object).where(rows.notna(), "-")
    cols = {"length": "length", "batch": "B", "budget": "budget", "hbm_pages": "C",
            "stage": "stage", "reuse_overlap": "overlap", "hit": "hit rate (device)",
            "hit_model": "hit rate (replay)", "link_mb": "link MB / layer (misses)",
            "link_ratio_cache": "counted link / model", "bytes_ok": "within 10%",
            "us": "us / layer",
            "model_us": "model us", "time_ratio": "time / model", "time_ok": "within 10%"}
    return ("<h3>HBM page cache, replayed selections</h3><p>Attention and the Quest step "
            "through C pages per (request, KV head) in HBM, over a selection sequence with "
            f"reuse ({esc(str(rows['reuse_source'].iloc[0]))}): the device's hits beside the same "
            "steps replayed by the rule's reference; link MB are the misses' pages as the "
            "device counted them; us / layer is the mean of the timed passes, the steps "
            "counted (the median where a run did not record it); the model is the tier's bytes "
            "at the replayed miss rate, its time those bytes at the run's zero-copy and HBM "
            "read ceilings; link bytes are judged against the model only where CUPTI counted "
            "them (--bytes cupti), '-' elsewhere.</p>"
            + table(rows, cols, numeric=("hit", "hit_model", "link_mb", "link_ratio_cache",
                                         "us", "model_us", "time_ratio", "reuse_overlap")))


def section(df: pd.DataFrame, meta: dict) -> str:
    """The section's HTML ('' without host-tier rows)."""
    if not has_tier(df):
        return ""
    host = df[df["kv_tier"] == "host"]
    ceilings = meta.get("link_ceilings") or {}
    rows = _of_copy(_stages(host), ceilings.get("copy_gbs"))
    said = (f"<p>{esc(ceilings['reason'])}</p>" if "reason" in ceilings else
            f"<p>Link ceilings of this run: pinned copy {ceilings['copy_gbs']:.1f} GB/s, "
            f"zero-copy read {ceilings['zero_copy_gbs']:.1f} GB/s.</p>" if ceilings else
            f"<p>{esc(NO_CEILINGS)}</p>")
    cols = {"length": "length", "batch": "B", "budget": "budget", "mode": "mode",
            "summary_tier": "summaries", "stage": "stage", "us": "us / layer",
            "link_mb": "link MB", "link_gbs": "link GB/s", "of_copy": "of the copy ceiling",
            "dense_over_quest": "dense / Quest"}
    if has_measured_link(rows):
        rows, (head, tail) = _measured_link(rows), _split_at(cols, "link_gbs")
        cols = {**head, "link_mb": "link MB (model)", "link_raw_mb": "measured MB (raw)",
                "link_cal_mb": "measured MB (calibrated)", "link_ratio": "calibrated / model",
                **tail}
    numeric = ("us", "link_mb", "link_gbs", "of_copy", "dense_over_quest", "link_raw_mb",
               "link_cal_mb", "link_ratio")
    return (said + _link_said(host, meta) + table(rows, cols, numeric=numeric)
            + _replayed(host, meta) + _reuse(df))
