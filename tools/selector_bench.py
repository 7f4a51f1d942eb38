"""The selectors' bench rows on a GPU, as one short table.

python3 tools/selector_bench.py [--repeats N] [--no-peers]: the cases of scenarios/bench.toml
that name `selectors` (MHA 32 heads, d 128, fp16, page 16: 32K budget 2048 and 128K budget
4096 at batch 1), every row of `questprof bench` for them (torch SDPA and FlashInfer where
installed, for the fastest dense), then per selector: estimate, top-K, attention and step us
per layer, pages read per row (mean / p95 / max), the step's bytes measured by CUPTI over
its modelled bytes, and its speedup against the fastest dense. Rows land in --out too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from questprof.commands.bench import BENCH_FILE, load_bench, run_bench  # noqa: E402
from questprof.commands.bench_selectors import selectors_of  # noqa: E402


def table(rows: list[dict]) -> pd.DataFrame:
    """One line per (case, selector): stage times, pages read, bytes, speedup."""
    df = pd.DataFrame([r for r in rows if r.get("selector") and r.get("median_ms")])
    out = []
    for (length, name), g in df.groupby(["length", "selector"], sort=False):
        us = {r["stage"]: r["median_ms"] * 1e3 for _, r in g.iterrows()}
        step = g[g["stage"] == "quest"].iloc[0]
        measured = step.get("measured_read_bytes")
        out.append({"selector": name, "length": f"{length // 1024}K",
                    "estimate_us": us.get("estimate"), "topk_us": us.get("topk"),
                    "attention_us": us.get("attention"), "step_us": us.get("quest"),
                    "pages_mean": step["pages_read_row_mean"], "pages_p95": step["pages_read_p95"],
                    "pages_max": step["pages_read_max"],
                    "MB_measured": measured / 1e6 if measured == measured and measured else None,
                    "MB_model": (step["read_bytes"] + step["unmodelled_bytes"]) / 1e6,
                    "bytes_ratio": step.get("bytes_ratio"),
                    "vs_dense": step.get("speedup"), "dense": step.get("dense_impl")})
    return pd.DataFrame(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--out", default="selector-bench.json")
    args = parser.parse_args()
    named = selectors_of(BENCH_FILE)
    cases = [c for c in load_bench(BENCH_FILE)[0] if c.key() in named]
    rows, _ = run_bench(cases, args.repeats, with_peers=not args.no_peers, selectors=named)
    Path(args.out).write_text(json.dumps(rows, indent=1, default=str), encoding="utf-8")
    ours = pd.DataFrame([r for r in rows if r.get("impl") == "ours" and r["stage"] == "quest"])
    print(ours[["length", "median_ms", "speedup", "dense_impl"]].to_string(index=False))
    print(table(rows).to_string(index=False, float_format=lambda x: f"{x:.3g}"))


if __name__ == "__main__":
    main()
