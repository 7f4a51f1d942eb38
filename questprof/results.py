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
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from questprof.core import model, tier
from questprof.core.config import ConfigError
from questprof.core.stages import ROW_STAGES

ROWS = "rows.jsonl"
PARQUET = "results.parquet"
META = "meta.json"

# Link bytes counted over the host tier (commands/link_bytes.py), or why not (link_reason)
LINK_MEASURED = ("measured_link_bytes", "calibrated_link_bytes", "link_factor", "link_reason")
# An HBM page cache replaying a selection sequence (workload/replay.py): the device's counts of
# the timed steps, the replayed miss rate of the same steps, the misses' link bytes per layer,
# and the timed steps' mean ms per layer (the time of exactly the steps counted)
CACHE_REPLAYED = ("cache_steps", "cache_hits", "cache_misses", "cache_miss_rate",
                  "replayed_miss_rate", "cache_link_bytes", "reuse_source", "reuse_overlap",
                  "mean_ms")
COLUMNS = (
    "scenario", "model", "layers", "q_heads", "kv_heads", "head_dim", "dtype", "length", "batch",
    "page_size", "budget", "k_pages", "pages", "mode", "seed", "config_key", "stage", "impl",
    "backend", "method", "median_ms", "p20_ms", "p80_ms", "p95_ms", "read_bytes",
    "unmodelled_bytes", "write_bytes", "flops", "bandwidth_gbs", "measured_read_bytes",
    "measured_write_bytes", "bytes_source", "bytes_ratio", "rho_formula", "rho_model",
    "sm_clock_mhz", "mem_clock_mhz", "throttled", "sim_layers", "status", "reason", "note",
    "kv_tier", "summary_tier", "hbm_pages", "link_bytes", "tier_hbm_bytes", "miss_rate",
    "link_read_bytes", "tier_hbm_read_bytes", *LINK_MEASURED, *CACHE_REPLAYED,
)
TIMING_FIELDS = ("method", "median_ms", "p20_ms", "p80_ms", "p95_ms", "sm_clock_mhz",
                 "mem_clock_mhz", "throttled")
# Byte verdicts (bytes --check-formula and the report's bytes section judge alike): a row whose
# measured read is off the modelled read by more than BYTES_TOLERANCE is off the model; below
# MIN_JUDGED_BYTES per layer, sector granularity and the L2's state dominate, so not judged.
BYTES_TOLERANCE = 0.05
MIN_JUDGED_BYTES = 1 << 20
OURS = "ours"  # impl of our kernels; peers are named "torch-sdpa", "torch-naive", "torch-gather"
STAGE_ORDER = ROW_STAGES  # the order of the rows of one configuration


def make_row(cfg, stage: str, *, scenario: str, backend: str, impl: str = OURS,
             timing: dict | None = None, work=None, layers: int | None = None,
             union: float | None = None, status: str = "ok", reason: str | None = None,
             **extra) -> dict:
    """The one results row (notes/CONTRACTS.md) of `stage` of configuration cfg.

    timing: Timing.summary() (median/p20/p80/p95 ms per layer, method, clocks) or None;
    work: core.model.StageWork of the stage (bytes and FLOPs per layer) or None;
    extra: fields of one command (bench ratios, e2e step times, measured bytes, ...).
    bandwidth_gbs counts the bytes read (modelled + unmodelled) over the median: decode reads.
    """
    timing = dict(timing or {})
    median = timing.get("median_ms")
    read = work.total_read if work is not None else None
    row = {"scenario": scenario, **cfg.as_dict(), "config_key": cfg.key(), "stage": stage,
           "impl": impl, "backend": backend, **{k: timing.get(k) for k in TIMING_FIELDS},
           "read_bytes": getattr(work, "read", None),
           "unmodelled_bytes": getattr(work, "unmodelled_read", None),
           "write_bytes": getattr(work, "write", None), "flops": getattr(work, "flops", None),
           "bandwidth_gbs": read / (median * 1e-3) / 1e9 if read and median else None,
           "measured_read_bytes": None, "measured_write_bytes": None, "bytes_source": None,
           "bytes_ratio": None, **dict.fromkeys(LINK_MEASURED),
           **dict.fromkeys(CACHE_REPLAYED),
           "rho_formula": model.rho(cfg.page_size, cfg.k_pages, cfg.pages,
                                    model.summary_ratio(cfg.model)),
           "rho_model": model.quest_rho(cfg, union), "sim_layers": layers,
           "status": status, "reason": reason, "note": timing.get("note")}
    row.update(tier_fields(cfg, stage, union))
    row.update(extra)
    dram = dram_read(row)
    if row["measured_read_bytes"] is not None and dram:
        row["bytes_ratio"] = row["measured_read_bytes"] / dram
    return row


def dram_read(row: dict) -> float | None:
    """The modelled DRAM read of a row: formula + unmodelled bytes, or over the host tier the
    tier model's HBM reads (tier_hbm_read_bytes: the pages read over the link never reach
    DRAM); None without work."""
    if row.get("read_bytes") is None:
        return None
    if row.get("tier_hbm_read_bytes") is not None:
        return row["tier_hbm_read_bytes"]
    return row["read_bytes"] + (row.get("unmodelled_bytes") or 0.0)


def tier_fields(cfg, stage: str, union: float | None = None,
                miss_rate: float = tier.NO_REUSE, fetch: str = "zero-copy") -> dict:
    """link_bytes (link_read_bytes of them read by the GPU) and tier_hbm_bytes
    (tier_hbm_read_bytes of them read) of a stage row
    over a host tier (core/tier.py), at `miss_rate`: the pools a run times are random, and
    random pages have no step-to-step reuse, so a timed row's chosen pages all miss
    (`questprof reuse` measures real reuse). None over HBM, and for stages the byte model
    does not hold. `fetch`: how the misses arrive (core/tier.py): sweep and bench read the host
    tier's pages in place (zero-copy); an HBM page cache writes them to its slots, which
    attention reads (gather)."""
    if tier.kv_tier(cfg) == "hbm" or stage not in ROW_STAGES:
        return {"link_bytes": None, "tier_hbm_bytes": None, "miss_rate": None,
                "link_read_bytes": None, "tier_hbm_read_bytes": None}
    parts = (tier.quest_tier_bytes(cfg, miss_rate, fetch, union_pages=union)
             if stage == "quest" else
             tier.tier_bytes(cfg, miss_rate, fetch, union_pages=union)[stage])
    return {"link_bytes": parts.link, "tier_hbm_bytes": parts.hbm,
            "miss_rate": miss_rate if cfg.hbm_pages else None, "link_read_bytes": parts.link_read,
            "tier_hbm_read_bytes": parts.hbm_read}


def now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _json_default(value):
    """JSON for NumPy scalars and paths."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def write_atomic(path: Path, text: str) -> None:
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
        if self.dir.exists() and not self.dir.is_dir():
            raise ConfigError(f"--out {self.dir}: a file, not a results directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.meta = dict(meta or {})
        if not (self.dir / ROWS).is_file() and (self.dir / PARQUET).is_file():
            _rows_from_parquet(self.dir)  # else closing would rewrite the parquet without them
        self._rows = open(self.dir / ROWS, "a", encoding="utf-8")
        self.write_meta()

    def append(self, row: dict) -> None:
        """Put one row on disk now (flushed and fsynced)."""
        self.extend([row])

    def extend(self, rows: list[dict]) -> None:
        """Put rows on disk now, with one fsync (5 ms each on the 2-core CPU's ext4 disk,
        2026-12-01: 21 s for the 4185 rows of one fidelity length, row by row)."""
        self._rows.write("".join(json.dumps(row, default=_json_default) + "\n" for row in rows))
        self._rows.flush()
        os.fsync(self._rows.fileno())

    def write_meta(self, **fields) -> None:
        """Update meta.json with `fields`."""
        self.meta.update(fields)
        write_atomic(self.dir / META, json.dumps(self.meta, indent=1, default=_json_default))

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


def _rows_from_parquet(out_dir: Path) -> None:
    """rows.jsonl from results.parquet, for a directory kept without it (a committed example)."""
    lines = []
    for record in pd.read_parquet(out_dir / PARQUET).to_dict("records"):
        row = {}
        for key, value in record.items():
            if hasattr(value, "tolist") and getattr(value, "ndim", 0):
                row[key] = value.tolist()  # list columns (e.g. passkey keys) come back as arrays
            elif value is not None and not (isinstance(value, float) and math.isnan(value)):
                row[key] = value
        lines.append(json.dumps(row, default=_json_default) + "\n")
    write_atomic(out_dir / ROWS, "".join(lines))


def append_rows(out_dir, rows: list[dict], **meta) -> None:
    """Add rows (and meta fields) to an existing results directory."""
    old = load(out_dir)[1]
    with ResultsWriter(out_dir, old) as writer:
        writer.write_meta(**meta)
        writer.extend(rows)


def check_new_run(out_dir, resumable: bool = False) -> None:
    """ConfigError when --out names a file or a directory that already holds a run's results:
    a new run there would append its rows to the first run's (resumable: say --resume)."""
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path}: a file, not a results directory")
    # a run that failed before its first row left meta.json alone: nothing there to lose
    held = [name for name in (ROWS, PARQUET) if (path / name).exists()
            and (name != ROWS or read_rows(path))]
    if held:
        how = f"--resume {path} continues it; " if resumable else ""
        raise ConfigError(f"--out {path} already holds a run's results ({', '.join(held)}): "
                          f"{how}a new run needs another --out")
    check_creatable(path)


def check_creatable(path: Path) -> None:
    """ConfigError naming --out where the directory cannot be made (said before the run, not
    as a bare OSError once it has begun); a trial folder in its nearest existing parent, removed
    again, is the test (a permission check misses /proc and read-only mounts)."""
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"--out {path}: {parent} is a file, not a folder")
    try:
        Path(tempfile.mkdtemp(prefix=".questprof-", dir=parent)).rmdir()
    except OSError as exc:
        raise ConfigError(f"--out {path}: cannot create it in {parent} "
                          f"({exc.strerror or exc})") from None


def check_out_file(path, flag: str) -> None:
    """ConfigError when a file to be written after the run cannot be: a directory in its place,
    or a folder that does not exist (said before the run, not after it)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: a directory; name the file to write")
    if not path.parent.is_dir():
        raise ConfigError(f"{flag} {path}: folder {path.parent} does not exist")


def check_joinable(out_dir, key: str, value: str, what: str) -> None:
    """ConfigError when out_dir is a file or already holds rows whose `key` is `value` (a run of
    this command): a sweep's directory without them is joined (its report draws both), a second
    run of the command there would add its rows to the first's."""
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path}: a file, not a results directory")
    if (path / ROWS).is_file() and any(r.get(key) == value for r in read_rows(path)):
        raise ConfigError(f"--out {path} already holds a run's {what} rows: a new run needs "
                          "another --out (a sweep's directory without them is joined)")


def _damaged(path: Path, why: str) -> ConfigError:
    return ConfigError(f"{path} is damaged ({why}): not a results directory questprof wrote; "
                       "start a new run with another --out")


def _file_or_none(path: Path) -> Path | None:
    """path when it is a file, None when absent; a folder in its place is damage."""
    if path.exists() and not path.is_file():
        raise _damaged(path, "a folder where a file belongs")
    return path if path.exists() else None


def read_rows(out_dir) -> list[dict]:
    """Rows of rows.jsonl; a torn line (a crash mid-write) is dropped. ConfigError for a file that
    is not rows (bytes that are not UTF-8, a line that is JSON but not an object)."""
    path = _file_or_none(Path(out_dir) / ROWS)
    if path is None:
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise _damaged(path, f"not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict):
            raise _damaged(path, f"line {number} is {type(row).__name__}, not a row")
        rows.append(row)
    return rows


def read_meta(out_dir) -> dict:
    """meta.json of a results directory ({} when absent); ConfigError when it is not an object."""
    path = _file_or_none(Path(out_dir) / META)
    if path is None:
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _damaged(path, f"not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise _damaged(path, f"{type(meta).__name__}, not an object")
    return meta


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
    try:
        frame(read_rows(out_dir)).to_parquet(tmp, index=False)
    except (TypeError, ValueError) as exc:  # pyarrow's ArrowTypeError / ArrowInvalid among them
        tmp.unlink(missing_ok=True)
        raise _damaged(Path(out_dir) / ROWS, f"rows of mixed types: {exc}") from None
    os.replace(tmp, path)
    return path


def load(out_dir) -> tuple[pd.DataFrame, dict]:
    """(rows, meta) of a results directory: rows.jsonl when present, else results.parquet."""
    out_dir = Path(out_dir)
    if out_dir.is_file():
        raise ConfigError(f"{out_dir} is a file: a results directory is the folder holding "
                          f"{ROWS} and {META}")
    if not out_dir.is_dir():
        raise FileNotFoundError(f"results directory {out_dir} not found")
    meta = read_meta(out_dir)
    if _file_or_none(out_dir / ROWS):
        return _numeric(frame(read_rows(out_dir)), out_dir / ROWS), meta
    if (out_dir / PARQUET).is_file():
        try:
            return pd.read_parquet(out_dir / PARQUET), meta
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise _damaged(out_dir / PARQUET, f"not a Parquet table: {exc}") from None
    raise FileNotFoundError(f"{out_dir} holds no {ROWS} nor {PARQUET}: not a results directory")


def check_rows(df: pd.DataFrame, out_dir) -> None:
    """ConfigError when a loaded directory holds no row of any stage (an empty or foreign
    rows.jsonl): its report or comparison would be empty, said as if all were well."""
    named = [df[col].notna() for col in ("stage", "kind") if col in df]  # reuse rows: a kind
    if df.empty or not any(has.any() for has in named):
        raise ConfigError(f"{out_dir} holds no result rows (no line of {ROWS} names a stage): "
                          "not a results directory, or a run that finished none")


NUMERIC = ("length", "batch", "page_size", "budget", "median_ms", "p20_ms", "p80_ms", "p95_ms")


def _numeric(df: pd.DataFrame, path: Path) -> pd.DataFrame:
    """df when its numeric columns hold numbers (or nothing); ConfigError naming the first that
    holds text, which every reader of the rows would trip over later."""
    for col in NUMERIC:
        if col in df.columns and df[col].dtype == object:
            bad = df[col].map(lambda v: v is not None and not isinstance(v, (int, float)))
            if bad.any():
                raise _damaged(path, f"{col} {df[col][bad].iloc[0]!r} is not a number")
    return df


def done_keys(out_dir) -> set[tuple[str, str, str]]:
    """(config_key, stage, impl) of every row already on disk (ok or skipped), for resuming."""
    return {(r["config_key"], r["stage"], r.get("impl") or OURS) for r in read_rows(out_dir)
            if r.get("config_key") and r.get("stage")}
