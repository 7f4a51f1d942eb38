"""What a person streaming tokens reads off a served mix: per-token latency, time to first
token and tokens per second, from the time each token came out.

A request added at time a whose tokens came out at t_1 < ... < t_n has time to first token
t_1 - a and per-token latencies t_i - t_{i-1} (i >= 2): the gaps a reader of the stream waits.
Percentiles pool the gaps of every request (numpy's linear interpolation); tokens per second
is every token of the mix over the time from the first request's arrival to the last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 95, 99)


def token_gaps_ms(timestamps) -> np.ndarray:
    """Per-token latencies [n - 1] in ms of one request's token times (seconds)."""
    return np.diff(np.asarray(timestamps, dtype=np.float64)) * 1e3


def percentiles_ms(values) -> dict:
    """{'p50_ms', 'p95_ms', 'p99_ms'}: NaN for no values."""
    values = np.asarray(values, dtype=np.float64)
    if not values.size:
        return {f"p{p}_ms": float("nan") for p in PERCENTILES}
    return {f"p{p}_ms": float(np.percentile(values, p)) for p in PERCENTILES}


@dataclass(frozen=True)
class Summary:
    """One served mix's figures (ms; tokens per second)."""

    token: dict
    ttft: dict
    tokens: int
    tokens_per_s: float

    def fields(self) -> dict:
        """The figures as row fields: token_p50_ms.. per token, ttft_p50_ms.. for TTFT."""
        return {**{f"token_{k}": v for k, v in self.token.items()},
                **{f"ttft_{k}": v for k, v in self.ttft.items()},
                "tokens": self.tokens, "tokens_per_s": self.tokens_per_s}


def summarize(served) -> Summary:
    """Summary of served requests (loop.Served: added, timestamps)."""
    gaps = [token_gaps_ms(s.timestamps) for s in served]
    ttft = [(s.timestamps[0] - s.added) * 1e3 for s in served if s.timestamps]
    tokens = sum(len(s.timestamps) for s in served)
    ends = [s.timestamps[-1] for s in served if s.timestamps]
    span = max(ends) - min(s.added for s in served) if ends else 0.0
    return Summary(percentiles_ms(np.concatenate(gaps) if gaps else []), percentiles_ms(ttft),
                   tokens, tokens / span if span > 0 else float("nan"))


def cdf(values) -> tuple[np.ndarray, np.ndarray]:
    """(sorted values, fraction of values <= each): the empirical CDF."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    return x, np.arange(1, len(x) + 1) / max(len(x), 1)
