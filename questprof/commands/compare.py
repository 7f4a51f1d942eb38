"""`questprof compare A B`: B's times against A's per configuration, stage and implementation.

Rows match only where they time the same work: the same per-GPU model shape (q heads, KV heads,
head dim), query, cache and summary dtypes, scales and backend. Two runs that share no such
shape are one line naming what differs (ConfigError: exit 2), not ratios of unlike work (a bf16
run against an FP8 one once gave 102.9x). CPU times are judged only beyond CPU_THRESHOLD.
"""

from __future__ import annotations

import math

import pandas as pd

from questprof.core.config import ConfigError
from questprof.results import OURS, STAGE_ORDER, check_rows, load

VERDICTS = ("SAME", "FASTER", "SLOWER", "NOISY", "MISSING")
# What makes two rows time the same work; missing columns (runs before FP8 caches) are filled
# from the query dtype, as a plain cache stores it.
SHAPE_KEYS = ("q_heads", "kv_heads", "head_dim", "dtype", "kv_dtype", "summary_dtype",
              "kv_scale", "backend")
SHAPE_NAMES = {"q_heads": "q heads", "kv_heads": "KV heads", "head_dim": "head dim",
               "kv_dtype": "KV cache", "summary_dtype": "summaries", "kv_scale": "FP8 scales"}
COMPARE_KEYS = ("model", *SHAPE_KEYS, "length", "batch", "page_size", "budget", "mode", "stage",
                "impl")
# Fewer timed passes than this leave p20..p80 resting on two or three samples: two back-to-back
# CPU smoke runs at 3 passes gave 4 SLOWER and 14 FASTER of 24 rows.
MIN_REPEATS = 5
# Backends that time on the host (backends/numpy.py, numpy_fp32.py). Two runs of the same code
# on the shared 2-core machine (longchat-7b 4k..32k, 7 passes, 2026-12-01, 7d2f648) differed
# by up to 1.6x on rows whose p20..p80 spreads did not overlap (the load of other jobs moves
# between runs, which no spread within a run sees); none differed by 2x. So CPU times are
# judged at a threshold of 1.0 at least: only B twice A's time, or half of it, is decided.
CPU_BACKENDS = ("numpy", "numpy-fp32")
CPU_THRESHOLD = 1.0


def _spread(row: pd.Series, side: str) -> float:
    """p20..p80 width of one side relative to its median."""
    return (row[f"p80_ms_{side}"] - row[f"p20_ms_{side}"]) / row[f"median_ms_{side}"]


def verdict(row: pd.Series, threshold: float, few_repeats: bool = False) -> str:
    """B against A: MISSING unless both are 'ok'; NOISY when either run timed fewer than
    MIN_REPEATS passes or either side's p20..p80 spread exceeds `threshold` of its median (a
    change of that size could be noise); else SLOWER / FASTER when the spreads do not overlap
    and the medians differ by more than `threshold` either way (B/A above 1 + threshold or below
    1 / (1 + threshold)), else SAME."""
    if row["status_a"] != "ok" or row["status_b"] != "ok":
        return "MISSING"
    if few_repeats or max(_spread(row, "a"), _spread(row, "b")) > threshold:
        return "NOISY"
    ratio = row["median_ms_b"] / row["median_ms_a"]
    if row["p20_ms_b"] > row["p80_ms_a"] and ratio > 1 + threshold:
        return "SLOWER"
    if row["p80_ms_b"] < row["p20_ms_a"] and ratio < 1 / (1 + threshold):
        return "FASTER"
    return "SAME"


def _repeats(meta: dict) -> int | None:
    """Timed passes per stage the run recorded (meta.json timing.repeats), None when unknown."""
    repeats = (meta.get("timing") or {}).get("repeats")
    return int(repeats) if isinstance(repeats, (int, float)) else None


def _side(out_dir) -> tuple[pd.DataFrame, int | None]:
    """The timed rows of a run (stages of STAGE_ORDER: fidelity rows of another model do not
    count), their shape columns filled, and the run's timed passes."""
    df, meta = load(out_dir)
    check_rows(df, out_dir)
    df = df[df["stage"].isin(STAGE_ORDER)].copy()
    df["impl"] = df["impl"].fillna(OURS) if "impl" in df else OURS  # rows before impl existed
    for key, fallback in (("kv_dtype", "dtype"), ("summary_dtype", "kv_dtype")):
        df[key] = df[key].fillna(df[fallback]) if key in df else df[fallback]
    for key in ("kv_scale", "backend"):  # "-": no scale (a plain cache), no backend named
        df[key] = df[key].fillna("-").replace("", "-") if key in df else "-"
    return df, _repeats(meta)


def _shapes(df: pd.DataFrame) -> set[tuple]:
    return set(df[list(SHAPE_KEYS)].astype(object).itertuples(index=False, name=None))


def _values(df: pd.DataFrame, key: str) -> str:
    """The column's values as text; a whole float (a column NaN made float: tp 1.0) as an int."""
    def text(v) -> str:
        return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)
    return ", ".join(sorted({text(v) for v in df[key].dropna()})) or "-"


def check_comparable(a: pd.DataFrame, b: pd.DataFrame, dir_a, dir_b) -> None:
    """ConfigError naming what differs when no timed row of A times the work of one of B, or
    naming the run that times no stage (a fidelity, serve or reuse run: every row was MISSING)."""
    for df, path in ((a, dir_a), (b, dir_b)):
        if df.empty:
            raise ConfigError(f"{path} holds no timed stage rows (a fidelity, serve or reuse "
                              "run?): compare judges two sweep, bench or bytes runs")
    if _shapes(a) & _shapes(b):
        return
    keys = [*SHAPE_KEYS, "tp"] if "tp" in a and "tp" in b else SHAPE_KEYS
    differ = [f"{SHAPE_NAMES.get(k, k)} {_values(a, k)} against {_values(b, k)}"
              for k in keys if _values(a, k) != _values(b, k)]
    raise ConfigError(f"{dir_a} and {dir_b} time different work ({'; '.join(differ)}): no row "
                      "of one matches a row of the other; compare runs of one shape and cache")


def on_cpu(df: pd.DataFrame) -> bool:
    """Whether every timed row of a run was timed on the host."""
    return bool(len(df)) and df["backend"].isin(CPU_BACKENDS).all()


def compare(dir_a, dir_b, threshold: float = 0.05) -> pd.DataFrame:
    """Per configuration, stage and implementation: median_a, median_b (ms), ratio b/a and the
    verdict of B vs A (see verdict); attrs['notes']: lines to say before the table."""
    if not (math.isfinite(threshold) and threshold >= 0):
        raise ConfigError(f"threshold {threshold} must be a fraction >= 0 (0.05 = 5%)")
    (a, repeats_a), (b, repeats_b) = _side(dir_a), _side(dir_b)
    check_comparable(a, b, dir_a, dir_b)
    notes = []
    if on_cpu(a) and on_cpu(b) and threshold < CPU_THRESHOLD:
        notes.append(cpu_note(a, threshold))
        threshold = CPU_THRESHOLD
    few = any(r is not None and r < MIN_REPEATS for r in (repeats_a, repeats_b))
    keys = [k for k in COMPARE_KEYS if k in a.columns and k in b.columns]
    cols = keys + ["status", "median_ms", "p20_ms", "p80_ms"]
    both = a[cols].merge(b[cols], on=keys, how="outer", suffixes=("_a", "_b"))
    both["verdict"] = [verdict(row, threshold, few) for _, row in both.iterrows()]
    both["ratio"] = both["median_ms_b"] / both["median_ms_a"]
    rank = both["stage"].map({s: i for i, s in enumerate(STAGE_ORDER)})
    both = both.assign(_rank=rank).sort_values([*keys[:-2], "_rank", "impl"], kind="stable")
    out = both[keys + ["median_ms_a", "median_ms_b", "ratio", "verdict"]].reset_index(drop=True)
    known = [r for r in (repeats_a, repeats_b) if r is not None]
    noisy = noisy_note(out["verdict"], threshold, min(known, default=MIN_REPEATS))
    out.attrs["notes"] = notes + ([noisy] if noisy else [])
    return out


def cpu_note(a: pd.DataFrame, threshold: float) -> str:
    """The line that says why CPU times are judged at CPU_THRESHOLD, not at `threshold`."""
    backend = _values(a, "backend")
    return (f"both runs were timed on the CPU ({backend}): two runs of the same code on a "
            f"shared machine differ by up to 1.6x beyond their p20..p80 spreads, so CPU times "
            f"cannot be judged at a threshold of {threshold:g}; judging at {CPU_THRESHOLD} "
            "instead (B twice A's time or half of it); a GPU run is judged at the threshold "
            "given.")


def noisy_note(verdicts: pd.Series, threshold: float, repeats: int) -> str | None:
    """One line on why rows are NOISY (and what to do), None when none is."""
    noisy = int((verdicts == "NOISY").sum())
    if not noisy:
        return None
    if repeats < MIN_REPEATS:
        why = (f"a run timed {repeats} passes per stage, too few for a p20..p80 spread; "
               f"time both with --repeats {MIN_REPEATS} or more")
    else:
        why = (f"their p20..p80 spread exceeds the threshold ({threshold:.0%} of the median): "
               "time with more --repeats or on a quieter machine")
    return f"{noisy} of {len(verdicts)} rows are too noisy to judge (NOISY): {why}."
