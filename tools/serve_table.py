"""The per-run rows of `questprof serve` result directories as one short table (policy, engine,
concurrency, the round of a --rounds run, per-token p50 / p95, TTFT p50, tokens per second,
each part's share of the decode steps), then the medians of the forwards that ran decode steps
only (no prefill chunk beside them).

    python tools/serve_table.py DIR [DIR ...]
"""

from __future__ import annotations

import argparse

import pandas as pd

COLUMNS = ["policy", "engine", "concurrency", "requests", "token_p50_ms", "token_p95_ms",
           "ttft_p50_ms", "tokens_per_s", "step_ms_mean", "step_pages_read_mean",
           "attention_share", "cache_share", "prefill_share", "model_rest_share", "python_share"]
STEP = ["step_ms", "attention_ms", "cache_ms", "model_rest_ms", "python_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", help="result directories of questprof serve")
    runs, steps = [], []
    for path in parser.parse_args().dirs:
        df = pd.read_parquet(f"{path}/results.parquet")
        runs.append(df[df["stage"] == "serve"])
        steps.append(df[df["stage"] == "serve-step"])
    table = pd.concat(runs)
    table = table.reindex(columns=COLUMNS[:3] + ["round"] * ("round" in table) + COLUMNS[3:])
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    steps = pd.concat(steps)
    decode = steps[(steps["prefill_tokens"] == 0) & (steps["decode_requests"] > 0)]
    print("\ndecode-only steps (no prefill chunk in the forward), medians in ms:")
    print(decode.groupby(["policy", "engine", "decode_requests"])[STEP].median()
          .join(decode.groupby(["policy", "engine", "decode_requests"]).size().rename("steps"))
          .to_string(float_format=lambda x: f"{x:.3g}"))


if __name__ == "__main__":
    main()
