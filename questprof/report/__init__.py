"""The report of a run: `write_report` draws report.html (report/document.py, with plotly),
`glance_lines` says its recommendation in sentences. Both import their module when first called,
so the package's plotly-free parts (frames, budgets, recommend) load where plotly is missing, and
a run there keeps its results and says in one line why report.html is not drawn (cli.py)."""

from __future__ import annotations

from questprof.report.frames import CPU_BANNER

__all__ = ["CPU_BANNER", "glance_lines", "write_report"]


def write_report(df, meta: dict, path):
    """report.html of rows `df` and metadata `meta` at `path` (document.write_report)."""
    from questprof.report import document

    return document.write_report(df, meta, path)


def glance_lines(df, meta: dict, out_dir=None) -> list[str]:
    """The recommendation of "At a glance" as plain sentences (document.glance_lines)."""
    from questprof.report import document

    return document.glance_lines(df, meta, out_dir)
