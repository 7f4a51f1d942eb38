"""HTML pieces of the report: the page (CSS, plotly.js inlined once), tables, figure divs, meta.
Loads without plotly (a fidelity run's budgets table is HTML too); page() imports it to inline
plotly.js."""

from __future__ import annotations

import html
import json

import pandas as pd

CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d1d1f;
       max-width: 1320px; margin: 0 auto; padding: 0 24px 48px; }
h1 { font-size: 26px; margin: 24px 0 4px; } h2 { font-size: 20px; margin: 36px 0 6px;
     border-bottom: 2px solid #e4e4e7; padding-bottom: 4px; } h3 { font-size: 16px; margin: 20px 0 4px; }
p.lede { color: #555; margin-top: 0; } p.note { color: #555; font-size: 14px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 14px; }
th, td { border: 1px solid #e4e4e7; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f4f4f5; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.best td { background: #e6f4ea; font-weight: 600; }
tr.off td { background: #fdecea; }
.banner { background: #fff4e5; border: 2px solid #f0a020; padding: 10px 14px; font-weight: 600;
          margin: 12px 0; }
.figure { margin: 8px 0 20px; }
nav a { margin-right: 14px; }
code { background: #f4f4f5; padding: 1px 4px; }
p.verdict { font-size: 17px; font-weight: 600; margin: 8px 0 12px; }
ul.recommend { background: #f4f8fd; border-left: 4px solid #2f6fb5; padding: 8px 14px 8px 30px;
               margin: 8px 0 16px; } ul.recommend li { margin: 3px 0; }
"""
PLOT_CONFIG = {"displaylogo": False, "responsive": True}


def esc(value) -> str:
    """Text escaped for HTML; missing values as an en dash."""
    if value is None or (not isinstance(value, (str, dict, list)) and pd.isna(value)):
        return "–"
    return html.escape(str(value))


def table(rows: pd.DataFrame, columns: dict, table_id: str = "", numeric=(),
          best=None, mark: str = "best") -> str:
    """rows as an HTML table; columns maps a column of rows to its header (in order).

    numeric: columns aligned right; best: a boolean Series marking rows drawn highlighted, with
    CSS class `mark` ('best' green, 'off' red).
    """
    head = "".join(f"<th>{esc(h)}</th>" for h in columns.values())
    body = []
    for i, (_, row) in enumerate(rows.iterrows()):
        cells = "".join(f"<td class=\"num\">{esc(row[c])}</td>" if c in numeric
                        else f"<td>{esc(row[c])}</td>" for c in columns)
        marked = best is not None and bool(best.iloc[i])
        body.append(f"<tr class=\"{mark}\">{cells}</tr>" if marked else f"<tr>{cells}</tr>")
    ident = f" id=\"{esc(table_id)}\"" if table_id else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def figure(fig, name: str) -> str:
    """One figure (a plotly Figure) as a div with id 'fig-<name>' and its script; plotly.js comes once from the
    page head. The prefix keeps figure ids apart from section anchors: Plotly.newPlot draws into
    whatever getElementById returns, and a section named 'roofline' would swallow the plot."""
    div = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"fig-{name}",
                      config=PLOT_CONFIG)
    return f"<div class=\"figure\">{div}</div>"


def page(title: str, body: str, with_plotly: bool) -> str:
    """The whole document: CSS and (when there are figures) plotly.js inlined, no external asset."""
    script = ""
    if with_plotly:
        import plotly.offline

        script = f"<script type=\"text/javascript\">{plotly.offline.get_plotlyjs()}</script>"
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{CSS}</style>{script}</head>"
            f"<body>{body}</body></html>\n")


def section(anchor: str, title: str, lede: str, content: str) -> str:
    """An h2 section with a one-paragraph explanation of how to read it."""
    return (f"<section id=\"{esc(anchor)}\"><h2>{esc(title)}</h2>"
            f"<p class=\"lede\">{lede}</p>{content}</section>")


MACHINE_ORDER = (("machine", "gpu"), ("machine", "driver"), ("machine", "cuda"),
                 ("machine", "cupy"), ("machine", "torch"), ("machine", "numpy"),
                 ("machine", "python"), ("machine", "sm_count"), ("machine", "l2_bytes"),
                 ("backend",), ("fallback_reason",), ("ceilings", "read_gbs"),
                 ("ceilings", "copy_gbs"), ("ceilings", "fp16_tflops"),
                 ("ceilings", "datasheet_gbs"), ("ceilings", "datasheet_tflops"),
                 ("git_commit",), ("command",), ("scenario",), ("started",), ("finished",))


def _flatten(meta: dict, prefix: tuple = ()) -> dict:
    """{('machine', 'gpu'): 'H200', ...}: nested dicts opened one level deep."""
    flat = {}
    for key, value in meta.items():
        if isinstance(value, dict) and not prefix:
            flat.update(_flatten(value, (key,)))
        else:
            flat[prefix + (key,)] = value
    return flat


def _shown(value) -> str:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str)
    return value


def meta_table(meta: dict, clocks: dict) -> str:
    """Every meta field (the known ones first, in MACHINE_ORDER), then the clocks seen in rows."""
    flat = _flatten(meta)
    keys = [k for k in MACHINE_ORDER if k in flat] + [k for k in flat if k not in MACHINE_ORDER]
    rows = [(".".join(k), _shown(flat[k])) for k in keys] + list(clocks.items())
    frame = pd.DataFrame(rows, columns=["field", "value"])
    return table(frame, {"field": "field", "value": "value"}, table_id="machine-table")


def clocks(df: pd.DataFrame) -> dict:
    """Clocks recorded with the rows (median, range) and how many samples were throttled."""
    out = {}
    for column, name in (("sm_clock_mhz", "SM clock"), ("mem_clock_mhz", "memory clock")):
        if column in df and df[column].notna().any():
            c = df[column].dropna()
            out[f"{name} (rows)"] = f"median {c.median():.0f} MHz, {c.min():.0f}..{c.max():.0f}"
    if "throttled" in df and df["throttled"].notna().any():
        out["throttled rows"] = f"{int(df['throttled'].fillna(False).astype(bool).sum())} of {len(df)}"
    return out
