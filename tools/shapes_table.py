"""The table of reports/example-h200-shapes/README.md from a bench results directory: one line per
(model, length, batch) of our stages beside torch SDPA, us per layer, the stage's ratio to the
run's read ceiling in brackets.

    python tools/shapes_table.py RESULTS_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

HEADER = ("| model | q/KV | d | KV | L | B | estimate us (ratio) | sparse attention us (ratio) | "
          "dense us (ratio) | SDPA us | dense / SDPA | Quest step us | vs fastest dense |\n"
          "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    args = parser.parse_args()
    import pandas as pd

    df = pd.read_parquet(args.results / "results.parquet")
    print(HEADER)
    for (model, length, batch), g in df.groupby(["model", "length", "batch"], sort=False):
        print(line(model, length, batch, g, pd))


def line(model, length, batch, g, pd) -> str:
    def row(stage, impl="ours"):
        hit = g[(g["stage"] == stage) & (g["impl"] == impl)]
        return hit.iloc[0] if len(hit) else None

    def us(r) -> str:
        return "-" if r is None or pd.isna(r["median_ms"]) else f"{r['median_ms'] * 1e3:,.1f}"

    def with_ratio(r) -> str:
        return us(r) if r is None or pd.isna(r.get("ratio")) else f"{us(r)} ({r['ratio']:.2f})"

    first = g.iloc[0]
    kv = first["kv_dtype"] if isinstance(first["kv_dtype"], str) and first["kv_dtype"] else \
        first["dtype"]
    dense, sdpa, quest = row("dense"), row("dense", "torch-sdpa"), row("quest")
    times = [r["median_ms"] for r in (dense, sdpa) if r is not None and not pd.isna(r["median_ms"])]
    ratio = (f"{dense['median_ms'] / sdpa['median_ms']:.2f}" if dense is not None and
             sdpa is not None and not pd.isna(sdpa["median_ms"]) else "-")
    speedup = (f"{min(times) / quest['median_ms']:.2f}x" if times and quest is not None and
               not pd.isna(quest["median_ms"]) else "-")
    tokens = f"{length // 1024}K"
    return (f"| {model} | {first['q_heads']}/{first['kv_heads']} | {first['head_dim']} | {kv} | "
            f"{tokens} | {batch} | {with_ratio(row('estimate'))} | "
            f"{with_ratio(row('attention'))} | {with_ratio(dense)} | {us(sdpa)} | {ratio} | "
            f"{us(quest)} | {speedup} |")


if __name__ == "__main__":
    main()
