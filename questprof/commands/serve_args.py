"""ServeArgs: the arguments of `questprof serve` as one typed, frozen object, each with its
default (the command line's defaults are these)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServeArgs:
    """The arguments of `questprof serve` (where it writes travels beside them)."""

    model: str = "random:smollm2-135m"  # what fidelity loads, or a config.json (random weights)
    trace: Path | None = None  # JSONL of {"prompt", "output", "arrival"}; else --mix
    mix: str | None = None  # uniform, log-uniform or longbench (serving.mixes.MIXES)
    lengths: str | None = None  # range syntax: the mix's shortest and longest prompt
    requests: int = 8  # requests of a named mix
    output: int = 16  # tokens each request of a named mix generates
    policy: str = "dense,quest"  # comma-separated: dense, quest, hybrid
    page_size: int = 16
    budget: int = 256  # tokens Quest reads per request (whole pages, the tail page in)
    dense_layers: int = 2  # first layers kept dense
    concurrency: str = "8"  # requests per batch, range syntax
    sweep: Path | None = None  # a sweep's results directory: hybrid's crossover
    num_blocks: int | None = None  # cache pages; None: the `concurrency` longest requests
    max_batch_tokens: int | None = None  # tokens per forward; None: the longest prompt, <= 8K
    seed: int = 0  # of prompts and random weights
    engine: str = "host"  # host (torch), kernels (stages over a copy), inplace, transformers
    rounds: int = 1  # passes over the (policy, concurrency) grid, the order reversed every other
    cuda_graph: bool = False  # transformers' CUDA graphs of its forwards (engine transformers)
