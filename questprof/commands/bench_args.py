"""BenchArgs: the arguments of `questprof bench` as one typed, frozen object, each with its
default (the command line's defaults are these)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchArgs:
    """The arguments of `questprof bench` (where it writes travels beside them)."""

    quick: bool = False  # only the cases marked quick
    peers: bool = True  # the torch and FlashInfer peers beside ours (where torch sees a GPU)
    graph: bool = True  # time CUDA-graph replays of each pass
    repeats: int = 20  # timed passes per stage
    cases: Path | None = None  # the bench file; None: scenarios/bench.toml (bench.BENCH_FILE)
    kv_tier: str = "hbm"  # every case's K and V pages in hbm or host memory (core/tier.py)
    summary_tier: str = "hbm"  # every case's summaries: hbm or host (host needs kv_tier host)
    hbm_pages: int = 0  # C pages per (request, KV head) cached in HBM; 0: none
