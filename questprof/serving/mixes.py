"""Request mixes for `serve`: a trace file, or a named mix drawn with a seed.

A trace is JSONL, one request a line: {"prompt": tokens, "output": tokens, "arrival": seconds
after the start (optional, default 0)}. A named mix draws `count` prompt lengths between the
shortest and the longest of `lengths`, each mix naming where its distribution comes from; every
request of a named mix arrives at 0 and generates `output` tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from questprof.core.config import ConfigError

MIXES = {
    "uniform": "prompt lengths uniform between the shortest and longest given",
    "log-uniform": "prompt lengths log-uniform between the shortest and longest given (every "
                   "doubling of length equally likely: long-context traffic in which short "
                   "requests outnumber long ones)",
}
NOT_YET = {"longbench": "the LongBench mix needs its per-task length table, not in questprof "
                        "yet: give its lengths as a --trace"}


@dataclass(frozen=True)
class Spec:
    """One request of a mix: prompt and output lengths in tokens, arrival in seconds."""

    prompt: int
    output: int
    arrival: float = 0.0


def _spec(line: str, where: str) -> Spec:
    """One trace line as a Spec; ConfigError naming the line."""
    try:
        data = json.loads(line)
        spec = Spec(int(data["prompt"]), int(data["output"]), float(data.get("arrival", 0.0)))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{where}: not a request ({type(exc).__name__}: {exc}); expected "
                          '{"prompt": tokens, "output": tokens, "arrival": seconds}') from None
    if spec.prompt < 1 or spec.output < 1 or not math.isfinite(spec.arrival) or spec.arrival < 0:
        raise ConfigError(f"{where}: prompt and output must be at least 1 token and arrival "
                          "a time >= 0")
    return spec


def read_trace(path) -> list[Spec]:
    """The requests of a JSONL trace (blank lines skipped); ConfigError on a bad line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"trace {path} cannot be read: {exc}") from None
    specs = [_spec(text, f"trace {path} line {i}") for i, text in enumerate(lines, 1)
             if text.strip()]
    if not specs:
        raise ConfigError(f"trace {path} holds no request")
    return specs


def named_mix(name: str, lengths: list[int] | None, count: int, output: int,
              seed: int = 0) -> list[Spec]:
    """`count` requests of mix `name` over lengths' range; ConfigError when unusable."""
    if name in NOT_YET:
        raise ConfigError(f"mix {name}: {NOT_YET[name]}")
    if name not in MIXES:
        raise ConfigError(f"unknown mix {name!r}: expected one of {', '.join(MIXES)}")
    if not lengths:
        raise ConfigError(f"mix {name} names no lengths: give --lengths, e.g. 8k..128k")
    lo, hi = min(lengths), max(lengths)
    rng = np.random.default_rng(seed)
    if name == "uniform":
        drawn = rng.integers(lo, hi + 1, size=count)
    else:
        drawn = np.exp(rng.uniform(np.log(lo), np.log(hi), size=count))
    return [Spec(int(np.rint(n)), output) for n in drawn]
