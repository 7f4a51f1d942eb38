"""Verdicts of a byte check on results rows: pure functions, tested without a GPU.

judge() fills a row's ratios and `bytes_within`; verdict() turns rows into the command's exit
status and lines; agreement() holds CUPTI against ncu on the same configuration and stage;
table() prints them. Rows are results rows (results.make_row) with measured bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from questprof.results import BYTES_TOLERANCE as TOLERANCE
from questprof.results import MIN_JUDGED_BYTES

AGREEMENT = 0.01  # CUPTI and ncu on the same configuration and stage
EXIT_OK, EXIT_FAIL, EXIT_NO_SOURCE = 0, 1, 3
NOT_JUDGED_IMPLS = ("torch-gather",)  # peers expected to exceed: the excess is named


@dataclass
class CheckResult:
    """Rows, rho rows, exit status and the lines that explain it."""

    rows: list[dict]
    rho: list[dict]
    status: int
    lines: list[str]
    sources: dict[str, str | None] = field(default_factory=dict)  # source -> why unavailable

    def to_json(self) -> str:
        return json.dumps({"status": self.status, "message": self.lines, "sources": self.sources,
                           "rows": self.rows, "rho": self.rho}, indent=1, default=str)


def label(row: dict) -> str:
    """Short name of a row's configuration for messages."""
    if row.get("length") is None:
        return row.get("model") or "-"
    return (f"{row['model']} L={row['length']} B={row['batch']} S={row['page_size']} "
            f"budget={row['budget']} {row['mode']}")


def judge(row: dict, tolerance: float = TOLERANCE) -> dict:
    """Fill bytes_ratio, write_ratio and bytes_within of `row` (total bytes for nvml: GPM
    cannot split reads from writes). Returns the row."""
    read = (row.get("read_bytes") or 0) + (row.get("unmodelled_bytes") or 0)
    if row.get("bytes_source") == "nvml":
        read += row.get("write_bytes") or 0
    ratio = lambda m, x: None if m is None or not x or x <= 0 else m / x  # noqa: E731
    row["bytes_ratio"] = ratio(row.get("measured_read_bytes"), read)
    row["write_ratio"] = ratio(row.get("measured_write_bytes"), row.get("write_bytes"))
    row["bytes_within"] = None
    if row.get("impl") in NOT_JUDGED_IMPLS:
        return row
    if read < MIN_JUDGED_BYTES or row["bytes_ratio"] is None:
        row["note"] = row.get("note") or f"not judged: {read:,.0f} B per layer is under 1 MiB"
        return row
    # Writes are reported, not judged: DRAM writes of a window include the write-back of lines
    # dirtied before it (a pure read kernel showed 1.4 MB per 2 GiB call on an H200), outputs
    # the next stage reads at once (scores) stay in the write-back L2 (estimate's DRAM writes
    # were 1-18% of its scores), and attention's fp32 split partials are unmodelled.
    row["bytes_within"] = abs(row["bytes_ratio"] - 1) <= tolerance
    return row


def verdict(rows: list[dict], tolerance: float = TOLERANCE,
            sources: dict[str, str | None] | None = None) -> tuple[int, list[str]]:
    """Exit status and its lines: 0 all judged rows within tolerance, 1 some not (named, by
    how much), EXIT_NO_SOURCE when no measurement source was available (one line, why)."""
    if not rows:
        reasons = {r: s for s, r in (sources or {}).items() if r}  # one line: say each once
        why = "; ".join(r if len(reasons) == 1 else f"{s}: {r}" for r, s in reasons.items())
        return EXIT_NO_SOURCE, [f"no DRAM byte source is available ({why or 'none asked'})"]
    failed = [r for r in rows if r.get("bytes_within") is False]
    judged = sum(r.get("bytes_within") is not None for r in rows)
    if failed:
        lines = [f"{len(failed)} of {judged} judged stage rows outside {tolerance:.0%}:"]
        for r in failed:
            w = "" if r.get("write_ratio") is None else f", write {r['write_ratio'] - 1:+.1%}"
            lines.append(f"  {r['stage']} [{r['bytes_source']}] {label(r)}: "
                         f"read {r['bytes_ratio'] - 1:+.1%}{w}")
        return EXIT_FAIL, lines
    return EXIT_OK, [f"all {judged} judged stage rows within {tolerance:.0%} "
                     f"({len(rows) - judged} small or peer rows reported, not judged)"]


def agreement(rows: list[dict], tolerance: float = AGREEMENT) -> tuple[bool, list[str]]:
    """CUPTI's read ratio (measured / model) against ncu's for every stage judged by both on one
    configuration: (all within tolerance, lines naming the largest difference and each beyond)."""
    key = lambda r: (label(r), r["stage"], r.get("impl"))  # noqa: E731
    judged = lambda r, s: r.get("bytes_source") == s and r.get("bytes_within") is not None  # noqa: E731
    ncu = {key(r): r for r in rows if judged(r, "ncu")}
    pairs = [(r, ncu[key(r)]) for r in rows if judged(r, "cupti") and key(r) in ncu]
    if not pairs:
        return True, []

    def diff(p):  # ratios, since the calibration reads differ in size; ncu at 0 B disagrees
        return p[0]["bytes_ratio"] / p[1]["bytes_ratio"] - 1 if p[1]["bytes_ratio"] > 0 else math.inf
    worst = max(pairs, key=lambda p: abs(diff(p)))
    lines = [f"CUPTI vs ncu: {len(pairs)} stage rows, largest difference {diff(worst):+.2%} "
             f"({worst[0]['stage']}, {label(worst[0])})"]
    off = [p for p in pairs if abs(diff(p)) > tolerance]
    lines += [f"  {a['stage']} {label(a)}: CUPTI {diff((a, b)):+.2%} against ncu (beyond "
              f"{tolerance:.0%})" for a, b in off]
    return not off, lines


def table(result: CheckResult) -> str:
    """Plain-text table of the rows and rho rows (for --json readers and logs)."""
    fmt = lambda x: "-" if x is None else f"{x:,.0f}"  # noqa: E731
    pct = lambda x: "-" if x is None else f"{x - 1:+.2%}"  # noqa: E731
    out = [f"{'config':44} {'stage':17} {'src':5} {'model read':>14} {'meas read':>14} "
           f"{'read':>8} {'model wr':>12} {'meas wr':>12} {'write':>8} ok"]
    for r in result.rows:
        name = r["stage"] if r.get("impl") in (None, "ours") else f"{r['stage']}:{r['impl']}"
        model_read = (r.get("read_bytes") or 0) + (r.get("unmodelled_bytes") or 0)
        ok = r.get("bytes_within")
        out.append(f"{label(r)[:44]:44} {name:17} {r['bytes_source']:5} {fmt(model_read):>14} "
                   f"{fmt(r.get('measured_read_bytes')):>14} {pct(r.get('bytes_ratio')):>8} "
                   f"{fmt(r.get('write_bytes')):>12} {fmt(r.get('measured_write_bytes')):>12} "
                   f"{pct(r.get('write_ratio')):>8} {'-' if ok is None else 'yes' if ok else 'NO'}"
                   f" {r.get('note') or ''}")
    for r in result.rho:
        out.append(f"rho {r['config']} [{r['source']}]: measured {r['rho_measured']:.4f}, "
                   f"{r.get('rho_text', '1/S + K/P')} = {r['rho_formula']:.4f}, "
                   f"model {r['rho_model']:.4f} "
                   f"+ unmodelled {r['rho_unmodelled']:.4f}")
    return "\n".join(out + result.lines)
