"""One line per case of a `questprof bench` results directory: each stage's time (us per layer,
its read ratio to the run's ceiling), the Quest step in each of our implementations, dense
(ours, torch SDPA) and the speedup of our default step against the fastest dense.

    python tools/bench_summary.py DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# our Quest step's implementations, those that left the code included (older directories)
STEP_IMPLS = (("quest", "ours"), ("quest", "ours-2-kernels"), ("quest", "ours-3-kernels"),
              ("quest", "ours-fused"), ("quest", "ours-persistent"))
COLUMNS = (("estimate", "ours"), ("topk", "ours"), ("attention", "ours"), *STEP_IMPLS,
           ("dense", "ours"), ("dense", "torch-sdpa"))


def load_rows(folder: Path) -> list[dict]:
    """The rows of a bench directory: rows.json, or rows.jsonl of a run cut short (the cases it
    finished)."""
    if (folder / "rows.json").is_file():
        return json.loads((folder / "rows.json").read_text(encoding="utf-8"))
    return [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a `questprof bench` results directory")
    cases: dict[tuple, dict] = {}
    for r in load_rows(parser.parse_args().folder):
        key = (r["model"], r["length"], r["batch"], r["mode"])
        cases.setdefault(key, {})[(r["stage"], r.get("impl"))] = r
    head = " ".join(f"{s[:5]}:{i.removeprefix('ours-')[:6]}" for s, i in COLUMNS)
    print(f"{'case':<36} {head} speedup")
    for (m, length, batch, mode), got in cases.items():
        cells = []
        for key in COLUMNS:
            r = got.get(key)
            if not r or not r.get("median_ms"):
                cells.append("-")
                continue
            us = f"{r['median_ms'] * 1e3:.1f}"
            ratio = r.get("ratio")
            cells.append(us + (f"({ratio:.2f})" if ratio and key[0] == "estimate" else ""))
        ours = got.get(("quest", "ours")) or {}
        speed = ours.get("speedup")
        if speed is None and ours.get("median_ms"):  # rows.jsonl: before add_speedups
            dense = [r["median_ms"] for (s, _), r in got.items() if s == "dense"
                     and r.get("median_ms")]
            speed = min(dense) / ours["median_ms"] if dense else None
        print(f"{m[:16]:<16} {length // 1024:>4}K B{batch} {mode[:11]:<11} " + " ".join(cells)
              + (f" {speed:.2f}x" if speed else " -"))


if __name__ == "__main__":
    main()
