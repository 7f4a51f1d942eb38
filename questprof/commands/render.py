"""report.html of a results directory: after a command that measured (sweep, bench, fidelity),
or when asked for (`questprof report`). Without plotly: one line (a warning after a run, whose
results are on disk; an error when the report is what was asked for)."""

from __future__ import annotations

from pathlib import Path

import typer

from questprof import console
from questprof.core.config import ConfigError


def write_report(out_dir: Path, asked: bool = False) -> None:
    """report.html from the results in out_dir, then the report's "At a glance" lines."""
    from questprof import results
    from questprof.report import glance_lines, write_report as draw

    df, meta = results.load(out_dir)
    try:
        path = draw(df, meta, out_dir / "report.html")
    except KeyboardInterrupt:
        console.err.print(f"interrupted while drawing report.html: every row is kept in "
                          f"{out_dir}; `questprof report {out_dir}` draws it", highlight=False)
        raise typer.Exit(130) from None
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("plotly"):
            raise
        why = (f"report.html is not written: plotly is not installed here (pip install plotly); "
               f"the results are in {out_dir}, and `questprof report {out_dir}` draws it")
        if asked:
            raise ConfigError(why) from None
        console.warn(why)
        return
    for line in glance_lines(df, meta, out_dir):  # the report's "At a glance" recommendation
        console.out.print(line, highlight=False, markup=False)
    console.out.print(f"report: {path or out_dir / 'report.html'}", highlight=False)
