"""The persistent Quest step against the three-kernel one, from a bench results directory:
python3 tools/quest_step_table.py DIR, after `questprof bench --quick --out DIR`.

One line per case: both steps' us per layer, our dense and torch SDPA, a plain cold read of the
step's bytes (the bench's same-bytes read), the speedups against the fastest dense, 3-kernel /
persistent, and the persistent step's share of the plain read (goal >= 0.80 at 32K B1).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = ("case", "3-kernel us", "persistent us", "dense us", "SDPA us", "plain read us",
           "3-kernel x", "persistent x", "3k / pers", "read / pers")


def _us(row) -> float | None:
    return row["median_ms"] * 1e3 if row and row.get("median_ms") else None


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}" if x < 20 else f"{x:.1f}"


def table(rows: list[dict]) -> list[str]:
    """Markdown lines of the table, one row per (model, length, batch, budget, mode)."""
    keys = sorted({(r["model"], r["length"], r["batch"], r["budget"], r["mode"]) for r in rows},
                  key=lambda k: (k[0], k[2], k[1], k[3], k[4]))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    name = lambda r: (r["model"], r["length"], r["batch"], r["budget"], r["mode"])  # noqa: E731
    for key in keys:
        at = [r for r in rows if name(r) == key]
        get = lambda stage, impl: next((r for r in at if r["stage"] == stage  # noqa: E731
                                        and r["impl"] == impl and r.get("median_ms")), None)
        three, pers = get("quest", "ours"), get("quest", "ours-persistent")
        dense, sdpa = _us(get("dense", "ours")), _us(get("dense", "torch-sdpa"))
        best = min(x for x in (dense, sdpa, float("inf")) if x is not None)
        read = pers.get("same_read_ms") * 1e3 if pers and pers.get("same_read_ms") else None
        t3, tp = _us(three), _us(pers)
        cells = [f"{key[0]} {key[1] // 1024}K B{key[2]} b{key[3]} {key[4]}", _fmt(t3), _fmt(tp),
                 _fmt(dense), _fmt(sdpa), _fmt(read),
                 _fmt(best / t3 if t3 and best < float("inf") else None),
                 _fmt(best / tp if tp and best < float("inf") else None),
                 _fmt(t3 / tp if t3 and tp else None), _fmt(read / tp if read and tp else None)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, nargs="?", default=Path("."),
                        help="a bench results directory (its rows.json)")
    rows = json.loads((parser.parse_args().directory / "rows.json").read_text(encoding="utf-8"))
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
