"""ReuseArgs: the arguments of `questprof reuse` as one typed, frozen object, each with its
default (the command line's defaults are these)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReuseArgs:
    """The arguments of `questprof reuse` (where it writes travels beside them)."""

    model: str = "smollm2"  # as fidelity's --model
    length: str = "2k"  # prompt tokens
    steps: int = 16  # decode steps captured (the passkey's digits and what follows)
    prompts: int = 4  # passkey prompts, depths spread over 0..1
    page_size: str = "16"
    budget: str = "256,512"
    mode: str = "shared-mean,per-head"
    hbm_pages: str | None = None  # C pages per (request, KV head); None: 1, 2 and 4 x K
    dense_layers: int = 2  # first layers left out (dense under Quest)
    backend: str = "numpy"  # where the selection runs: numpy (the reference) or auto
    seed: int = 0
    trace_out: str | None = None  # write one layer's selections as a reuse trace (.npz)
    trace_layer: int | None = None  # its layer; None: the one of median overlap
    trace_mode: str | None = None  # its mode; None: shared-mean, or the run's one shared mode
