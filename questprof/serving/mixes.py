"""Request mixes for `serve`: a trace file, or a named mix drawn with a seed.

A trace is JSONL, one request a line: {"prompt": tokens, "output": tokens, "arrival": seconds
after the start (optional, default 0)}. A named mix draws `count` prompt lengths between the
shortest and the longest of `lengths`, each mix naming where its distribution comes from; every
request of a named mix arrives at 0 and generates `output` tokens.

`longbench` draws LongBench's English and code tasks (Bai et al., ACL 2024) in proportion to
their test samples, each request as long as its task's published average: LongBench's task.md
(github.com/THUDM/LongBench, LongBench/task.md) gives the average length in words (Python's
split). Words become tokens as SmolLM2's tokenizer counts them: TOKENS_PER_WORD on English
prose (GPL-3's text: 5,644 words, 7,658 tokens; Apache-2.0's: 1.41), CODE_TOKENS_PER_WORD on
code for LCC and RepoBench-P (Python's json/decoder.py, heapq.py, bisect.py and textwrap.py:
7,636 words, 15,634 tokens; questprof's own serving/ and core/: 2.47). The averages are all it
publishes, so each task is one length; its Chinese tasks (lengths in characters) are left out.
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
MIXES["longbench"] = ("LongBench's English and code tasks in proportion to their test samples, "
                      "each at its published average length (THUDM/LongBench task.md), words x "
                      "1.36 tokens (code: x 2.05); --lengths, when given, keeps the tasks inside "
                      "it")
# task: (average length in words, test samples), LongBench/task.md of THUDM/LongBench
LONGBENCH = {"HotpotQA": (9151, 200), "2WikiMultihopQA": (4887, 200), "MuSiQue": (11214, 200),
             "MultiFieldQA-en": (4559, 150), "NarrativeQA": (18409, 200), "Qasper": (3619, 200),
             "GovReport": (8734, 200), "QMSum": (10614, 200), "MultiNews": (2113, 200),
             "TriviaQA": (8209, 200), "SAMSum": (6258, 200), "TREC": (5177, 200),
             "PassageRetrieval-en": (9289, 200), "PassageCount": (11141, 200),
             "LCC": (1235, 500), "RepoBench-P": (4206, 500)}
TOKENS_PER_WORD = 1.36  # SmolLM2's tokenizer on GPL-3's English text (module docstring)
CODE_TOKENS_PER_WORD = 2.05  # the same tokenizer on four modules of Python's stdlib
CODE_TASKS = ("LCC", "RepoBench-P")


@dataclass(frozen=True)
class Spec:
    """One request of a mix: prompt and output lengths in tokens, arrival in seconds."""

    prompt: int
    output: int
    arrival: float = 0.0


MAX_TOKENS = 2**24  # a request's prompt or output: past any model's context, and numpy's sizes
MAX_ARRIVAL_S = 86_400.0  # a day: a later arrival is a typo (1e308 overflowed the feeder's sleep)


def _spec(line: str, where: str) -> Spec:
    """One trace line as a Spec; ConfigError naming the line. Token counts are JSON integers
    (64.5, "64" and true are refused, not rounded), arrival a number of seconds."""
    try:
        data = json.loads(line)
        prompt, output, arrival = data["prompt"], data["output"], data.get("arrival", 0.0)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{where}: not a request ({type(exc).__name__}: {exc}); expected "
                          '{"prompt": tokens, "output": tokens, "arrival": seconds}') from None
    tokens = [v for v in (prompt, output) if isinstance(v, int) and not isinstance(v, bool)]
    if len(tokens) < 2 or isinstance(arrival, bool) or not isinstance(arrival, (int, float)):
        raise ConfigError(f"{where}: prompt and output must be whole numbers of tokens and "
                          f"arrival a number of seconds, got {prompt!r}, {output!r}, {arrival!r}")
    if not (1 <= prompt <= MAX_TOKENS and 1 <= output <= MAX_TOKENS) or not (
            math.isfinite(arrival) and 0 <= arrival <= MAX_ARRIVAL_S):
        raise ConfigError(f"{where}: prompt and output must be 1 to {MAX_TOKENS:,} tokens and "
                          f"arrival 0 to {MAX_ARRIVAL_S:,.0f} s, got {prompt}, {output}, {arrival}")
    return Spec(prompt, output, float(arrival))


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
    if name not in MIXES:
        raise ConfigError(f"unknown mix {name!r}: expected one of {', '.join(MIXES)}")
    if name == "longbench":
        return longbench_mix(lengths, count, output, seed)
    if not lengths:
        raise ConfigError(f"mix {name} names no lengths: give --lengths, e.g. 8k..128k")
    lo, hi = min(lengths), max(lengths)
    rng = np.random.default_rng(seed)
    if name == "uniform":
        drawn = rng.integers(lo, hi + 1, size=count)
    else:
        drawn = np.exp(rng.uniform(np.log(lo), np.log(hi), size=count))
    return [Spec(int(np.rint(n)), output) for n in drawn]


def longbench_tokens() -> dict[str, int]:
    """Each LongBench task's average prompt in tokens (its words x the prose or code ratio)."""
    return {task: int(round(words * (CODE_TOKENS_PER_WORD if task in CODE_TASKS
                                      else TOKENS_PER_WORD)))
            for task, (words, _) in LONGBENCH.items()}


def longbench_mix(lengths: list[int] | None, count: int, output: int, seed: int = 0) -> list[Spec]:
    """`count` requests of the longbench mix (module docstring), the tasks outside lengths'
    range left out when lengths are given; ConfigError when none is left."""
    tokens = longbench_tokens()
    if lengths:
        lo, hi = min(lengths), max(lengths)
        tokens = {t: n for t, n in tokens.items() if lo <= n <= hi}
        if not tokens:
            raise ConfigError(f"mix longbench: no task's average length lies in {lo}..{hi} tokens "
                              f"(they span {min(longbench_tokens().values())}.."
                              f"{max(longbench_tokens().values())})")
    tasks = sorted(tokens)
    weights = np.array([LONGBENCH[t][1] for t in tasks], dtype=float)
    drawn = np.random.default_rng(seed).choice(len(tasks), size=count, p=weights / weights.sum())
    return [Spec(tokens[tasks[i]], output) for i in drawn]
