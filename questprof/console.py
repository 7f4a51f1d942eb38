"""What the command line prints (Rich lives here and in cli.py only): tables, banners, progress.

Progress on a terminal is a live bar; without one (output redirected to a file, CI) it is one
plain line every PROGRESS_SECONDS with done/total, rate and ETA, so a long sweep shows it lives.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from questprof.core.machine import INSTALL_GPU

WIDE = 160  # columns when output goes to a file: Rich's 80 squeezed bench's table to "3…"


def _console(stderr: bool = False) -> Console:
    probe = Console(stderr=stderr)
    return Console(stderr=stderr, soft_wrap=True,
                   width=None if probe.is_terminal else max(WIDE, probe.width))


out = _console()
err = _console(stderr=True)
PROGRESS_SECONDS = 10.0
HEADERS = {"length": "L", "batch": "B", "page_size": "S", "dense_ms": "dense",
           "quest_ms": "quest", "rho_formula": "rho", "median_ms_a": "A ms", "median_ms_b": "B ms"}


def fmt(value, digits: int = 3) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def fold(df, columns):
    """(df without the `columns` that hold one value, 'name=value, ...' of those), short headers."""
    fixed = [c for c in columns if c in df and len(df) and df[c].nunique(dropna=False) == 1]
    text = ", ".join(f"{HEADERS.get(c, c)}={df[c].iloc[0]}" for c in fixed)
    return df.drop(columns=fixed).rename(columns=HEADERS), text


def table(df, title: str, styles: dict | None = None) -> Table:
    """A Rich table of a DataFrame; styles maps a cell value to a style (e.g. verdicts)."""
    t = Table(title=title, title_justify="left")
    for col in df.columns:
        t.add_column(str(col), justify="right" if df[col].dtype.kind in "if" else "left")
    for _, row in df.iterrows():
        cells = [fmt(v) for v in row]
        style = next((s for v, s in (styles or {}).items() if v in cells), None)
        t.add_row(*cells, style=style)
    return t


def banner(backend) -> None:
    """The yellow warning that times are CPU times when the NumPy backend runs."""
    if backend.is_gpu:
        return
    reason = backend.fallback_reason or "--backend numpy"
    err.print(f"[yellow]No usable GPU ({escape(reason)}): timing the NumPy backend's float32 "
              "path (numpy-fp32); times are CPU times, not GPU kernel times. On a GPU machine: "
              f"{escape(INSTALL_GPU)}[/yellow]", highlight=False)


def warn(text: str) -> None:
    err.print(f"[yellow]{escape(text)}[/yellow]", highlight=False)


def error(text: str) -> None:
    err.print(f"[red]error:[/red] {escape(text)}", highlight=False)


class Ticker:
    """Progress of `total` steps: a live bar on a terminal, else a line every PROGRESS_SECONDS."""

    def __init__(self, name: str, total: int, live: bool | None = None):
        self.name, self.total, self.start = name, total, time.monotonic()
        self.last = -PROGRESS_SECONDS
        self.bar = None
        if err.is_terminal if live is None else live:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"),
                                TimeRemainingColumn(), console=err, transient=False)
            self.task = self.bar.add_task(name, total=total)

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, done: int, what: str, first: int = 0) -> None:
        """`done` steps finished (of which `first` were done before this run started)."""
        if self.bar is not None:
            self.bar.update(self.task, completed=done, description=what)
            return
        now = time.monotonic()
        if now - self.last < PROGRESS_SECONDS and done < self.total:
            return
        self.last = now
        rate = (done - first) / max(now - self.start, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        err.print(f"{self.name}: {done}/{self.total} rows, {rate:.1f} rows/s, "
                  f"ETA {eta:.0f} s ({what})", highlight=False)
