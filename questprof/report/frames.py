"""Tables derived from result rows: quest vs dense per point, crossovers, the at-a-glance lines.

A point is (batch, mode, page_size, budget, length); a curve is a point without its length; a
panel is (batch, mode): one crossover figure, one speedup figure and one heatmap each.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from questprof.core import model

PANEL = ["shape", "batch", "mode"]  # shape: model and cache, when a run holds several (bench)
CURVE = PANEL + ["page_size", "budget"]
POINT = CURVE + ["length"]
OURS = "ours"  # impl of our kernels (results.OURS; rows written before impl existed)
SPREAD = ("median_ms", "p20_ms", "p80_ms")
DEFAULT_MODE = "per-head"  # rows written before modes existed, and MHA rows, carry none

CPU_BANNER = "CPU run (NumPy): times are CPU times"  # the report's banner on CPU runs


def fmt_tokens(n) -> str:
    """16384 -> '16k', 1048576 -> '1M', 1000 -> '1000' (k = 1024, as in the range syntax)."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "–"
    n = int(round(n))
    if n >= 1024**2 and n % 1024**2 == 0:
        return f"{n // 1024**2}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)


def fmt_about(n) -> str:
    """An interpolated length: '≈ 22.4k' (k = 1024), '≈ 900', or '–' when missing."""
    if n is None or pd.isna(n):
        return "–"
    return f"≈ {n / 1024:.1f}k" if n >= 1024 else f"≈ {n:.0f}"


def fmt_x(value) -> str:
    """A speedup as '3.21x', or '–' when missing."""
    return "–" if value is None or pd.isna(value) else f"{value:.2f}x"


def measured(df: pd.DataFrame) -> pd.DataFrame:
    """Rows with status ok of the per-layer stages (the 'e2e' rows are left to the Amdahl part)."""
    if df.empty or "status" not in df:
        return df.iloc[0:0]
    ok = df[(df["status"] == "ok") & (df["stage"] != "e2e")].copy()
    for col, default in (("mode", DEFAULT_MODE), ("impl", OURS)):
        if col not in ok:
            ok[col] = default
        ok[col] = ok[col].fillna(default)
    ok["shape"] = shape_names(ok)
    return ok


def shape_names(rows: pd.DataFrame) -> pd.Series:
    """The model of each row, and its summaries over an FP8 cache: a bench holds several models
    and caches, whose points must never be pooled."""
    name = rows["model"].fillna("model").astype(str) if "model" in rows else pd.Series(
        "model", index=rows.index)
    if "kv_dtype" in rows:
        kv = rows["kv_dtype"].fillna("").astype(str)
        summ = rows["summary_dtype"].fillna("").astype(str) if "summary_dtype" in rows else kv
        fp8 = kv.str.startswith("fp8")
        name = name.where(~fp8, name + " (FP8 cache, " + summ + " summaries)")
    return name


def _stage_ms(ok: pd.DataFrame) -> pd.DataFrame:
    """Median ms per point, one column per stage present."""
    if ok.empty:
        return pd.DataFrame(columns=POINT).set_index(POINT)
    return ok.pivot_table(index=POINT, columns="stage", values="median_ms", aggfunc="median")


def _dense_ms(ok: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Fastest dense median ms of each point (ours or a peer, torch SDPA or FlashInfer, measured
    in the same run), the implementation that gave it, its p20 and p80, and our own dense,
    keyed by the point columns the dense rows actually carry."""
    dense = ok[ok["stage"] == "dense"]
    keys = [k for k in POINT if dense[k].notna().all()]
    by = {c: dense.groupby(keys + ["impl"])[c].median().unstack("impl") for c in SPREAD}
    by_impl = by["median_ms"]
    out = pd.DataFrame({"dense_ms": by_impl.min(axis=1), "dense_impl": by_impl.idxmin(axis=1)})
    for c in ("p20_ms", "p80_ms"):
        out[f"dense_{c[:3]}"] = [by[c].at[i, impl] if isinstance(impl, str) else np.nan
                                 for i, impl in out["dense_impl"].items()]
    out["dense_ours_ms"] = by_impl[OURS] if OURS in by_impl else np.nan
    return out, keys


def _quest_spread(ok: pd.DataFrame) -> pd.DataFrame:
    """p20 and p80 of our Quest step per point (quest_p20, quest_p80)."""
    quest = ok[(ok["stage"] == "quest") & (ok["impl"] == OURS)]
    if quest.empty:
        return pd.DataFrame(columns=POINT + ["quest_p20", "quest_p80"])
    got = quest.groupby(POINT)[["p20_ms", "p80_ms"]].median()
    return got.rename(columns={"p20_ms": "quest_p20", "p80_ms": "quest_p80"}).reset_index()


def _ideal_rho(points: pd.DataFrame, ok: pd.DataFrame) -> pd.Series:
    """rho_formula of each point from its rows; model.rho where a row has none."""
    given = ok.groupby(POINT)["rho_formula"].median() if "rho_formula" in ok else None
    rho = points.index.to_frame(index=False).apply(
        lambda p: model.rho(p.page_size, model.k_pages(p.budget, p.page_size),
                            model.pages(p.length, p.page_size)), axis=1)
    rho.index = points.index
    return rho if given is None else given.reindex(points.index).fillna(rho)


def paired(df: pd.DataFrame) -> pd.DataFrame:
    """One row per point: estimate/topk/attention/quest/dense ms, speedup, rho_formula, ideal.

    quest_ms is our 'quest' row (the three stages timed as one pass) when present, else the sum
    of our three stage medians (a peer's Quest rows, torch-naive or FlashInfer's, never stand in
    for ours); dense_ms is the fastest dense of the run (dense_impl names it: ours, torch-sdpa or
    flashinfer); speedup = dense_ms / quest_ms; ideal = 1 / rho_formula. speedup_lo / _hi: the
    speedup over the two p20..p80 spreads (dense p20 / Quest p80, dense p80 / Quest p20), NaN
    where a spread is not recorded.
    """
    ok = measured(df)
    for c in SPREAD:
        ok[c] = pd.to_numeric(ok[c], errors="coerce") if c in ok else np.nan
    points = _stage_ms(ok[(ok["stage"] != "dense") & (ok["impl"] == OURS)])
    for stage in (*model.QUEST_STAGES, "quest"):
        if stage not in points:
            points[stage] = np.nan
    stage_sum = points[list(model.QUEST_STAGES)].sum(axis=1, min_count=len(model.QUEST_STAGES))
    points["quest_ms"] = points["quest"].fillna(stage_sum)
    points = points.rename(columns={s: f"{s}_ms" for s in model.QUEST_STAGES})
    out = points.drop(columns="quest").reset_index()
    dense_cols = ["dense_ms", "dense_impl", "dense_p20", "dense_p80", "dense_ours_ms"]
    out = out.assign(**{c: np.nan for c in dense_cols}).astype({"dense_impl": object})
    if (ok["stage"] == "dense").any() and not out.empty:
        dense, keys = _dense_ms(ok)
        out = out.drop(columns=dense_cols).merge(dense.reset_index(), on=keys, how="left")
    out = out.merge(_quest_spread(ok), on=POINT, how="left") if len(out) else out.assign(
        quest_p20=np.nan, quest_p80=np.nan)
    out = out[out["quest_ms"].notna() | out["dense_ms"].notna()]
    out["speedup"] = out["dense_ms"] / out["quest_ms"]
    out["speedup_lo"] = out["dense_p20"] / out["quest_p80"]
    out["speedup_hi"] = out["dense_p80"] / out["quest_p20"]
    out["rho_formula"] = _ideal_rho(out.set_index(POINT), ok).to_numpy() if len(out) else []
    out["ideal"] = 1.0 / out["rho_formula"]
    return out.sort_values(POINT).reset_index(drop=True)


def stage_bands(curve: pd.DataFrame) -> pd.DataFrame:
    """The crossover figure's stacked bands of Quest's stages at each point of `curve` (rows of
    `paired`), stacking to quest_ms: each stage's share of the three timed apart, times the Quest
    step timed as one pass (timed apart they sum to 0.96-1.06x of it on the H200's longchat-7b
    example, 0.49-1.39x on the shared 2-core CPU, longchat-7b 4k..32k, 2026-12-01: stacked as
    measured they rose above the Quest total). Where the budget covers the length Quest is dense
    attention: one attention band of quest_ms."""
    cols = [f"{s}_ms" for s in model.QUEST_STAGES]
    parts = curve[cols].astype(float)
    whole = parts.sum(axis=1, min_count=1)
    bands = parts.fillna(0.0).mul(curve["quest_ms"] / whole, axis=0)
    covered = curve["budget"] >= curve["length"] if "budget" in curve else whole.isna()
    covered |= whole.isna() | (whole <= 0)
    bands.loc[covered, cols] = 0.0
    bands.loc[covered, "attention_ms"] = curve.loc[covered, "quest_ms"]
    return bands


def _interpolated(lose: pd.Series, win: pd.Series) -> float:
    """Length where log(speedup) crosses 0 between a losing (or tied) and a winning point, log2
    x; a tie above 1 puts it at the tie's length."""
    a, b = math.log(lose["speedup"]), math.log(win["speedup"])
    t = min(1.0, max(0.0, -a / (b - a))) if b != a else 0.5
    return 2 ** (math.log2(lose["length"]) + t * (math.log2(win["length"]) - math.log2(lose["length"])))


def sparse(curve: pd.DataFrame) -> pd.DataFrame:
    """Points where Quest selects fewer pages than there are: budget < length. At budget >=
    length Quest runs dense attention and ties with dense by construction, so such a point says
    nothing about where Quest starts to win (an interpolation to it lands at budget = length)."""
    if "budget" not in curve:
        return curve
    return curve[curve["budget"] < curve["length"]]


def outcome(point: pd.Series) -> str:
    """Quest against dense at one point of `paired`: 'win' or 'loss' when the speedup over the
    two runs' p20..p80 spreads (speedup_lo..speedup_hi) lies wholly above or below 1, else
    'tie' ("beats dense from 4k" was once claimed at 1.007x, inside it); where no spread is
    recorded, the median speedup decides."""
    lo, hi = point.get("speedup_lo", np.nan), point.get("speedup_hi", np.nan)
    if pd.isna(lo) or pd.isna(hi):
        lo = hi = point["speedup"]
    return "win" if lo > 1 else "loss" if hi < 1 else "tie"


def crossover(curve: pd.DataFrame) -> dict:
    """Where Quest starts to beat dense along one curve (rows of `paired`, any order), over the
    points with budget < length only (see `sparse`), each a win, tie or loss (see `outcome`).

    kind: 'from' (Quest wins from `length` on, `estimate` interpolated from the last point it
    did not win), 'always' (wins from the shortest length), 'ties' (ties at the longest, from
    `length` on), 'never' (loses at the longest), 'none' (no pair).
    """
    timed = curve.dropna(subset=["speedup"])
    both = sparse(timed).sort_values("length")
    if both.empty:
        text = ("budget >= every length: Quest is dense attention" if len(timed)
                else "no quest/dense pair measured")
        return {"kind": "none", "length": None, "estimate": None, "text": text}
    states = np.array([outcome(row) for _, row in both.iterrows()])
    if states[-1] == "loss":
        return {"kind": "never", "length": None, "estimate": None, "text": "no crossover in range"}
    if states[-1] == "tie":
        first = int(both["length"].iloc[len(states) - _trailing(states, "tie")])
        return {"kind": "ties", "length": first, "estimate": None,
                "text": f"ties with dense from {fmt_tokens(first)} (within the p20..p80 spread)"}
    if (states == "win").all():
        first = int(both["length"].iloc[0])
        shortest = "shortest length" + ("" if len(both) == len(timed) else " above the budget")
        return {"kind": "always", "length": first, "estimate": None,
                "text": f"Quest wins from the {shortest} ({fmt_tokens(first)})"}
    last_loss = int(np.flatnonzero(states != "win")[-1])
    lose, win = both.iloc[last_loss], both.iloc[last_loss + 1]
    length = int(win["length"])
    return {"kind": "from", "length": length, "estimate": _interpolated(lose, win),
            "text": f"{fmt_tokens(length)}"}


def _trailing(states: np.ndarray, state: str) -> int:
    """How many of the last entries of `states` are `state`."""
    other = np.flatnonzero(states != state)
    return len(states) - (int(other[-1]) + 1 if len(other) else 0)


def crossovers(pairs: pd.DataFrame) -> pd.DataFrame:
    """One row per curve: crossover kind, length, interpolated estimate, text."""
    rows = []
    for key, curve in pairs.groupby(CURVE, sort=True):
        rows.append({**dict(zip(CURVE, key)), **crossover(curve)})
    return pd.DataFrame(rows, columns=CURVE + ["kind", "length", "estimate", "text"])


def glance(pairs: pd.DataFrame) -> pd.DataFrame:
    """One row per curve: crossover, longest length, speedup there, ideal there, share of ideal."""
    cross = crossovers(pairs)
    rows = []
    for key, curve in pairs.dropna(subset=["speedup"]).groupby(CURVE, sort=True):
        last = curve.sort_values("length").iloc[-1]
        rows.append({**dict(zip(CURVE, key)), "longest": int(last["length"]),
                     "speedup": last["speedup"], "ideal": last["ideal"],
                     "of_ideal": last["speedup"] / last["ideal"]})
    longest = pd.DataFrame(rows, columns=CURVE + ["longest", "speedup", "ideal", "of_ideal"])
    return cross.merge(longest, on=CURVE, how="left")


def heatmap_length(pairs: pd.DataFrame, meta: dict) -> int | None:
    """meta['heatmap_length'] when it was measured, else the longest length with a speedup."""
    lengths = set(pairs.dropna(subset=["speedup"])["length"].astype(int))
    wanted = meta.get("heatmap_length")
    if wanted is not None and int(wanted) in lengths:
        return int(wanted)
    return max(lengths) if lengths else None


def varying(df: pd.DataFrame, keys) -> list[str]:
    """The keys that take more than one value in df (labels name only those)."""
    return [k for k in keys if k in df and df[k].nunique(dropna=False) > 1]


def label(keys, values, names=None) -> str:
    """'batch 4, per-head' from keys and values, keeping only `names` when given."""
    parts = []
    for k, v in zip(keys, values):
        if names is not None and k not in names:
            continue
        parts.append(str(v) if k == "mode" else {"page_size": f"S={v}", "budget": f"B={v}",
                                                  "batch": f"batch {v}"}.get(k, f"{k} {v}"))
    return ", ".join(parts)


SKIPPED_COLUMNS = ["reason", "rows", "stages", "lengths", "batches", "page sizes", "budgets",
                   "need GiB", "free GiB"]


def _values(series, fmt=str) -> str:
    """Distinct values, sorted as numbers where they are numbers, then formatted."""
    values = series.dropna().unique()
    numbers = pd.to_numeric(pd.Series(values), errors="coerce")
    key = (lambda v: float(v)) if numbers.notna().all() else str
    return ", ".join(fmt(v) for v in sorted(values, key=key))


def _gib_range(series) -> str:
    """'24.8' or '24.8–102.1' (min–max of a figure in GiB), '–' when none is recorded."""
    values = pd.to_numeric(series, errors="coerce").dropna()
    if values.empty:
        return "–"
    lo, hi = values.min(), values.max()
    return f"{lo:.1f}" if round(lo, 1) == round(hi, 1) else f"{lo:.1f}–{hi:.1f}"


def skipped(df: pd.DataFrame) -> pd.DataFrame:
    """Skipped rows grouped by cause (the reason): count, stages, lengths, batches, page sizes,
    budgets, and the memory figures (need_gib, free_gib: min–max) kept out of the cause.

    Causes with the most rows first; values within a cell sorted as numbers.
    """
    if df.empty or "status" not in df:
        return pd.DataFrame(columns=SKIPPED_COLUMNS)
    rows = df[df["status"] != "ok"].copy()
    rows["reason"] = rows.get("reason", pd.Series(index=rows.index, dtype=object)).fillna("(none given)")
    for col in ("need_gib", "free_gib"):
        if col not in rows:
            rows[col] = np.nan
    stage_rank = {s: i for i, s in enumerate((*model.STAGES, "quest"))}
    out = [{"reason": reason, "rows": len(g),
            "stages": ", ".join(sorted(g["stage"].dropna().unique(),
                                       key=lambda s: (stage_rank.get(s, 99), s))),
            "lengths": _values(g["length"], fmt_tokens), "batches": _values(g["batch"]),
            "page sizes": _values(g["page_size"]), "budgets": _values(g["budget"], fmt_tokens),
            "need GiB": _gib_range(g["need_gib"]), "free GiB": _gib_range(g["free_gib"])}
           for reason, g in rows.groupby("reason", sort=False)]
    out = pd.DataFrame(out, columns=SKIPPED_COLUMNS)
    return out.sort_values(["rows", "reason"], ascending=[False, True]).reset_index(drop=True)


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """One line per configuration: fastest dense and quest ms, speedup (dense / quest), which
    dense that was, rho, a note (report.frames.paired does the pairing)."""
    pairs = paired(df)
    if pairs.empty:
        return pd.DataFrame()
    keys = [k for k in ("length", "batch", "page_size", "budget", "mode") if k in pairs]
    out = pairs[keys + ["dense_ms", "quest_ms", "speedup", "dense_impl", "rho_formula"]].copy()
    out["note"] = ["quest = dense (budget >= length)" if b >= n else ""
                   for b, n in zip(out["budget"], out["length"])]
    return out
