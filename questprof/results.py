"""Results on disk: one row per configuration x stage (notes/CONTRACTS.md), crash-safe.

A results directory holds
  rows.jsonl       every finished row, appended, flushed and fsynced at once (the source of truth)
  results.parquet  the same rows as a table, rewritten from rows.jsonl when a sweep ends or dies
  meta.json        the run: scenario, command, times, git commit, machine, backend, ceilings, grid
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from questprof.config import ConfigError
from questprof.model import STAGES

ROWS = "rows.jsonl"
PARQUET = "results.parquet"
META = "meta.json"

COLUMNS = (
    "scenario", "model", "layers", "q_heads", "kv_heads", "head_dim", "dtype", "length", "batch",
    "page_size", "budget", "k_pages", "pages", "mode", "stage", "backend", "method", "median_ms",
    "p20_ms", "p80_ms", "p95_ms", "read_bytes", "unmodelled_bytes", "write_bytes", "flops",
    "bandwidth_gbs", "measured_read_bytes", "measured_write_bytes", "bytes_source", "rho_formula",
    "rho_model", "sm_clock_mhz", "mem_clock_mhz", "throttled", "status", "reason",
)
# Beyond the contract: the resume key, the seed and the layers of the timed (cold-cache) pass.
EXTRA_COLUMNS = ("config_key", "seed", "sim_layers")
VERDICTS = ("SAME", "FASTER", "SLOWER", "MISSING")
STAGE_ORDER = (*STAGES, "quest")  # the order of the rows of one configuration


def now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _json_default(value):
    """JSON for NumPy scalars and paths."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _write_atomic(path: Path, text: str) -> None:
    """Write text to path through a temporary file and a rename (never a half-written file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ResultsWriter:
    """Appends rows to `out_dir/rows.jsonl` as they finish; writes parquet and meta on close.

    Use as a context manager: results.parquet is rewritten on exit, also on an exception or Ctrl-C.
    """

    def __init__(self, out_dir, meta: dict | None = None) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.meta = dict(meta or {})
        self._rows = open(self.dir / ROWS, "a", encoding="utf-8")
        self.write_meta()

    def append(self, row: dict) -> None:
        """Put one row on disk now (flushed and fsynced)."""
        self._rows.write(json.dumps(row, default=_json_default) + "\n")
        self._rows.flush()
        os.fsync(self._rows.fileno())

    def write_meta(self, **fields) -> None:
        """Update meta.json with `fields`."""
        self.meta.update(fields)
        _write_atomic(self.dir / META, json.dumps(self.meta, indent=1, default=_json_default))

    def close(self, finished: bool = True) -> Path:
        """Rewrite results.parquet from rows.jsonl; stamp meta 'finished' when the run completed."""
        if not self._rows.closed:
            self._rows.close()
        self.write_meta(finished=now() if finished else None)
        return write_parquet(self.dir)

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finished=exc_type is None)


def read_rows(out_dir) -> list[dict]:
    """Rows of rows.jsonl; a torn last line (a crash mid-write) is dropped."""
    path = Path(out_dir) / ROWS
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def frame(rows: list[dict]) -> pd.DataFrame:
    """Rows as a DataFrame with the contract's columns first (missing ones as None)."""
    df = pd.DataFrame(rows)
    for col in COLUMNS:
        if col not in df.columns:
            df[col] = None
    rest = [c for c in df.columns if c not in COLUMNS]
    return df[list(COLUMNS) + rest]


def write_parquet(out_dir) -> Path:
    """Rewrite out_dir/results.parquet from rows.jsonl; returns its path."""
    path = Path(out_dir) / PARQUET
    tmp = path.with_name(path.name + ".tmp")
    frame(read_rows(out_dir)).to_parquet(tmp, index=False)
    os.replace(tmp, path)
    return path


def load(out_dir) -> tuple[pd.DataFrame, dict]:
    """(rows, meta) of a results directory: rows.jsonl when present, else results.parquet."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise FileNotFoundError(f"results directory {out_dir} not found")
    meta_path = out_dir / META
    meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
    if (out_dir / ROWS).is_file():
        return frame(read_rows(out_dir)), meta
    if (out_dir / PARQUET).is_file():
        return pd.read_parquet(out_dir / PARQUET), meta
    raise FileNotFoundError(f"{out_dir} holds no {ROWS} nor {PARQUET}: not a results directory")


def done_keys(out_dir) -> set[tuple[str, str]]:
    """(config_key, stage) of every row already on disk (ok or skipped), for resuming."""
    return {(r["config_key"], r["stage"]) for r in read_rows(out_dir)
            if r.get("config_key") and r.get("stage")}


def _verdict(row: pd.Series, threshold: float) -> str:
    """B against A: SLOWER / FASTER when the p20..p80 spreads do not overlap and the medians
    differ by more than `threshold` (a fraction), else SAME; MISSING unless both are 'ok'."""
    if row["status_a"] != "ok" or row["status_b"] != "ok":
        return "MISSING"
    ratio = row["median_ms_b"] / row["median_ms_a"]
    if row["p20_ms_b"] > row["p80_ms_a"] and ratio > 1 + threshold:
        return "SLOWER"
    if row["p80_ms_b"] < row["p20_ms_a"] and ratio < 1 - threshold:
        return "FASTER"
    return "SAME"


COMPARE_KEYS = ("model", "dtype", "length", "batch", "page_size", "budget", "mode", "stage")


def compare(dir_a, dir_b, threshold: float = 0.05) -> pd.DataFrame:
    """Per configuration and stage: median_a, median_b (ms), ratio b/a and verdict of B vs A."""
    if not (math.isfinite(threshold) and threshold >= 0):
        raise ConfigError(f"threshold {threshold} must be a fraction >= 0 (0.05 = 5%)")
    a, b = (load(d)[0] for d in (dir_a, dir_b))
    keys = [k for k in COMPARE_KEYS if k in a.columns and k in b.columns]
    cols = keys + ["status", "median_ms", "p20_ms", "p80_ms"]
    both = a[cols].merge(b[cols], on=keys, how="outer", suffixes=("_a", "_b"))
    both["verdict"] = [_verdict(row, threshold) for _, row in both.iterrows()]
    both["ratio"] = both["median_ms_b"] / both["median_ms_a"]
    rank = both["stage"].map({s: i for i, s in enumerate(STAGE_ORDER)})
    both = both.assign(_rank=rank).sort_values([*keys[:-1], "_rank"], kind="stable")
    return both[keys + ["median_ms_a", "median_ms_b", "ratio", "verdict"]].reset_index(drop=True)


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """One line per configuration: dense and quest ms, speedup (dense / quest), rho, a note."""
    keys = [k for k in ("length", "batch", "page_size", "budget", "mode") if k in df]
    df = df[df["stage"].isin(STAGE_ORDER)]  # e2e and context-parallel rows have their own views
    out = []
    for key, group in df.groupby(keys, sort=False, dropna=False):
        by_stage = {r["stage"]: r for _, r in group.iterrows()}
        dense, quest = by_stage.get("dense"), by_stage.get("quest")
        line = dict(zip(keys, key))
        ok = all(r is not None and r["status"] == "ok" for r in (dense, quest))
        line["dense_ms"] = dense["median_ms"] if ok else None
        line["quest_ms"] = quest["median_ms"] if ok else None
        line["speedup"] = dense["median_ms"] / quest["median_ms"] if ok else None
        line["rho_formula"] = quest["rho_formula"] if quest is not None else None
        skipped = group[group["status"] != "ok"]["reason"].dropna()
        dense_budget = line.get("budget", 0) >= line.get("length", 1)
        line["note"] = ("quest = dense (budget >= length)" if dense_budget
                        else f"skipped: {skipped.iloc[0]}" if len(skipped) else "")
        out.append(line)
    return pd.DataFrame(out)
