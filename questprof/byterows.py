"""Rows of a byte check and their verdicts: pure functions, tested without a GPU.

A Row holds one stage's modelled and measured bytes per layer; judge() fills its ratios and
verdict, verdict() turns the rows into the command's exit status and lines, agreement() holds
CUPTI against ncu on the same configuration, table() prints them (questprof.bytecheck measures).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

TOLERANCE = 0.05
AGREEMENT = 0.01  # CUPTI and ncu on the same configuration and stage
EXIT_OK, EXIT_FAIL, EXIT_NO_SOURCE = 0, 1, 3
MIN_JUDGED_BYTES = 1 << 20  # below 1 MiB per layer, sector granularity and L2 state dominate


@dataclass
class Row:
    """Modelled and measured bytes of one stage of one configuration, per layer."""

    config: str
    stage: str
    source: str
    modelled_read: float
    unmodelled_read: float
    modelled_write: float
    measured_read: float | None
    measured_write: float | None
    read_ratio: float | None = None
    write_ratio: float | None = None
    within: bool | None = None
    note: str = ""


@dataclass
class RhoRow:
    """Measured rho (quest read / dense read) of one configuration against the formula."""

    config: str
    source: str
    rho_measured: float
    rho_formula: float
    rho_model: float
    rho_unmodelled: float


@dataclass
class CheckResult:
    """Rows, rho rows, exit status and the lines that explain it."""

    rows: list[Row]
    rho: list[RhoRow]
    status: int
    lines: list[str]
    sources: dict[str, str | None] = field(default_factory=dict)  # source -> why unavailable

    def to_json(self) -> str:
        return json.dumps({"status": self.status, "message": self.lines, "sources": self.sources,
                           "rows": [asdict(r) for r in self.rows],
                           "rho": [asdict(r) for r in self.rho]}, indent=1)


def judge(row: Row, tolerance: float = TOLERANCE) -> Row:
    """Fill ratios and the verdict of `row` (pure). Total bytes for nvml (GPM cannot split)."""
    read = row.modelled_read + row.unmodelled_read
    ratio = lambda m, x: None if m is None or x <= 0 else m / x  # noqa: E731
    if row.source == "nvml":
        read += row.modelled_write
    row.read_ratio, row.write_ratio = ratio(row.measured_read, read), ratio(row.measured_write,
                                                                             row.modelled_write)
    if row.stage.startswith("naive"):  # expected to exceed: its excess is named, not judged
        return row
    if read < MIN_JUDGED_BYTES or row.read_ratio is None:
        row.note = row.note or f"not judged: {read:,.0f} B per layer is under 1 MiB"
        return row
    ok = abs(row.read_ratio - 1) <= tolerance
    # Writes are reported, not judged: DRAM writes of a window include the write-back of lines
    # dirtied before it (up to the 60 MiB L2: a pure read kernel showed 1.4 MB per 2 GiB call on
    # an H200), outputs the next stage reads at once (scores) stay in the write-back L2
    # (estimate's DRAM writes were 1-18% of its scores), and attention's fp32 split partials are
    # unmodelled. The naive peer's excess is named from both its reads and its writes.
    row.within = ok
    return row


def verdict(rows: list[Row], tolerance: float = TOLERANCE,
            sources: dict[str, str | None] | None = None) -> tuple[int, list[str]]:
    """Exit status and its lines: 0 all judged rows within tolerance, 1 some not (named, by
    how much), EXIT_NO_SOURCE when no measurement source was available (one line, why)."""
    if not rows:
        reasons = {r: s for s, r in (sources or {}).items() if r}  # one line: say each once
        why = "; ".join(r if len(reasons) == 1 else f"{s}: {r}" for r, s in reasons.items())
        why = why or "none asked"
        return EXIT_NO_SOURCE, [f"no DRAM byte source is available ({why})"]
    failed = [r for r in rows if r.within is False]
    judged = sum(r.within is not None for r in rows)
    if failed:
        lines = [f"{len(failed)} of {judged} judged stage rows outside {tolerance:.0%}:"]
        for r in failed:
            w = "" if r.write_ratio is None else f", write {r.write_ratio - 1:+.1%}"
            lines.append(f"  {r.stage} [{r.source}] {r.config}: read {r.read_ratio - 1:+.1%}{w}")
        return EXIT_FAIL, lines
    return EXIT_OK, [f"all {judged} judged stage rows within {tolerance:.0%} "
                     f"({len(rows) - judged} small or naive rows reported, not judged)"]


def agreement(rows: list[Row], tolerance: float = AGREEMENT) -> tuple[bool, list[str]]:
    """CUPTI's read ratio (measured / model) against ncu's for every stage judged by both on one
    configuration (the calibration reads differ in size, so ratios, not bytes):
    (all within tolerance, lines naming the largest difference and each one beyond it)."""
    ncu = {(r.config, r.stage): r for r in rows if r.source == "ncu" and r.within is not None}
    pairs = [(r, ncu[(r.config, r.stage)]) for r in rows
             if r.source == "cupti" and r.within is not None and (r.config, r.stage) in ncu]
    if not pairs:
        return True, []
    def diff(p):  # ratios, since the calibration reads differ in size; ncu at 0 B disagrees
        return p[0].read_ratio / p[1].read_ratio - 1 if p[1].read_ratio > 0 else math.inf
    worst = max(pairs, key=lambda p: abs(diff(p)))
    lines = [f"CUPTI vs ncu: {len(pairs)} stage rows, largest difference {diff(worst):+.2%} "
             f"({worst[0].stage}, {worst[0].config})"]
    off = [p for p in pairs if abs(diff(p)) > tolerance]
    lines += [f"  {a.stage} {a.config}: CUPTI {diff((a, b)):+.2%} against ncu (beyond "
              f"{tolerance:.0%})" for a, b in off]
    return not off, lines


def table(result: CheckResult) -> str:
    """Plain-text table of the rows and rho rows (the CLI renders its own with Rich)."""
    fmt = lambda x: "-" if x is None else f"{x:,.0f}"  # noqa: E731
    pct = lambda x: "-" if x is None else f"{x - 1:+.2%}"  # noqa: E731
    out = [f"{'config':44} {'stage':17} {'src':5} {'model read':>14} {'meas read':>14} "
           f"{'read':>8} {'model wr':>12} {'meas wr':>12} {'write':>8} ok"]
    for r in result.rows:
        out.append(f"{r.config[:44]:44} {r.stage:17} {r.source:5} "
                   f"{fmt(r.modelled_read + r.unmodelled_read):>14} {fmt(r.measured_read):>14} "
                   f"{pct(r.read_ratio):>8} {fmt(r.modelled_write):>12} "
                   f"{fmt(r.measured_write):>12} {pct(r.write_ratio):>8} "
                   f"{'-' if r.within is None else 'yes' if r.within else 'NO'} {r.note}")
    for r in result.rho:
        out.append(f"rho {r.config} [{r.source}]: measured {r.rho_measured:.4f}, "
                   f"1/S+K/P {r.rho_formula:.4f}, model {r.rho_model:.4f} "
                   f"+ unmodelled {r.rho_unmodelled:.4f}")
    return "\n".join(out + result.lines)
