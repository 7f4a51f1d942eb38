"""FidelityArgs: the arguments of `questprof fidelity` as one typed, frozen object, each with its
default (the command line's defaults are these); commands.fidelity.make_request checks them and
makes the run's fidelity.runner.Request."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from questprof.core.selectors import QUEST


@dataclass(frozen=True)
class FidelityArgs:
    """The arguments of `questprof fidelity` (where it writes travels beside them)."""

    cache: Path | None = None  # the capture file of --source cache (safetensors)
    source: str = "synthetic"  # one of fidelity.runner.SOURCES
    scenario: str = "smoke"  # the model shape of synthetic caches
    model: str = "smollm2"  # a .gguf file, a transformers folder, 'smollm2' or 'random:<shape>'
    lengths: str | None = None  # range syntax; None: fidelity.DEFAULT_LENGTHS of the source
    page_size: str = "8,16,32"
    budget: str = "64,128,256,512,1024"
    mode: str = "per-head"  # selection modes, comma-separated
    selector: str = QUEST  # page selectors, comma-separated, or 'all' (core.selectors)
    steps: int = 8  # decode steps measured
    prompts: int | None = None  # prompts per length; None: fidelity.runner.PROMPTS
    depths: str | None = None  # passkey depths '0.1,0.5,0.9'; None: spread over 0..1
    dense_layers: int | None = None  # first layers kept dense; None: 2, synthetic the scenario's
    dtype: str = "auto"  # cache storage: auto (fp16 on a GPU, else fp32), fp32, fp16 or bf16
    task: bool = True  # the task answered with each selector in the decode loop
    teacher_forced: bool = False  # the task also fed the dense answer's tokens
    min_recall: float = 0.9  # the floor of 10th-percentile mass recall a recommendation needs
    backend: str = "auto"  # selection by auto, cupy or numpy
    seed: int = 0  # of prompts' keys and synthetic caches
