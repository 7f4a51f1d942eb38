"""How long a real model's fidelity run takes, said before it starts, and a line every
PROGRESS_SECONDS while a phase runs (a 2k passkey run on the 2-core CPU was silent for 138 s
through the model's load and the capture; the sweep prints a line every 10 s).

The estimate counts each phase's work in one unit and divides by a rate measured on the
SmolLM2-135M default run (20 passkey prompts, 8 decode steps, page sizes 8, 16, 32, five
budgets, the task): on the 2-core CPU at 2k tokens (2026-12-01, 7d2f648 and this module's
commit: seconds of CPU, one core) and on one H200 at 8k with random weights (a255945: wall
seconds). Prefill and decode cost 2 FLOPs per weight and token plus 4 per cached token, layer,
q head and dimension; passkey prompts share the filler before their key line, so a batch
prefills about half of each prompt after the first (model_run.prefill_shared).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from questprof.core.model import weight_params

PROGRESS_SECONDS = 10.0


@dataclass(frozen=True)
class Dims:
    """What the estimate needs of a model: weights read per token and its attention shape."""

    params: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int

    def flops(self, context: float) -> float:
        """FLOPs of one token over `context` cached tokens."""
        return 2 * self.params + 4 * self.layers * self.q_heads * self.head_dim * context


@dataclass(frozen=True)
class Rates:
    """Work per second of each phase (CPU: per second of one core; GPU: per wall second)."""

    load_s: float        # seconds per 100M weights: read, dequantise, tokenizer, to the device
    flops: float         # FLOP/s of the capture's prefill and decode
    task_flops: float    # FLOP/s of the task's decode (every setting's rows, selection each step)
    index: float         # prefilled K values summarised per second, per page size
    metrics: float       # (prompt, step, layer, q head, token, setting) per second
    rows_s: float        # seconds to make a length's rows
    other_s: float       # the backend, imports, writing and the report (the phase table's rest)


# CPU: capture 93 s, index 3.5 s, metrics 35 s, task 42 s at load 1.0 (1b88df1); the load
# 18 s (7d2f648). H200: load 14.4, capture 9.4, index 1.4, metrics 4.0, task 3.9, rows 1.9 s,
# 44.3 s in all.
CPU = Rates(load_s=13.5, flops=7.9e10, task_flops=2.35e10, index=2.0e8, metrics=3.8e7,
            rows_s=2.0, other_s=4.0)
GPU = Rates(load_s=10.7, flops=9.6e12, task_flops=5.1e11, index=2.0e9, metrics=1.33e9,
            rows_s=1.9, other_s=9.3)


def _shared(request) -> float:
    """Prompts' worth of tokens a batch prefills: passkey prompts share about half (a random
    model's random tokens share nothing)."""
    prompts = request.prompts
    if request.source == "passkey" and not request.model.startswith("random:"):
        return 1 + (prompts - 1) / 2
    return float(prompts)


def phase_seconds(dims: Dims, request, gpu: bool) -> dict[str, float]:
    """{phase: seconds} of a real model's run at one core's pace (CPU) or on the GPU; the load
    once, the others summed over the lengths."""
    rate, grid = (GPU if gpu else CPU), request.grid
    sizes, settings = len(grid.page_sizes), len(grid.budgets) * len(grid.selectors)
    prompts, steps = request.prompts, request.steps
    out = {"load": rate.load_s * dims.params / 1e8}
    for n in request.lengths:
        add = {
            "capture": (n * _shared(request) * dims.flops(n / 2)
                        + prompts * steps * dims.flops(n)) / rate.flops,
            "index": prompts * dims.layers * dims.kv_heads * n * dims.head_dim * sizes
                     / rate.index,
            "metrics": prompts * steps * dims.layers * dims.q_heads * n * sizes * settings
                       * len(grid.modes) / rate.metrics,
            "task": (prompts * sizes * settings * steps * dims.flops(n) / rate.task_flops
                     if request.task else 0.0),
            "rows": rate.rows_s}
        for phase, seconds in add.items():
            out[phase] = out.get(phase, 0.0) + seconds
    return {**out, "other": rate.other_s}


@dataclass(frozen=True)
class Pace:
    """Where a run's phases are paced: on a GPU, or on the CPU at `share` of a core."""

    share: float = 1.0
    gpu: bool = False

    def expected(self, dims: Dims | None, request) -> dict[str, float]:
        """{phase: wall seconds} of `request` ({} when the model's dims are unknown)."""
        if dims is None:
            return {}
        return {k: v / (1.0 if self.gpu else self.share)
                for k, v in phase_seconds(dims, request, self.gpu).items()}


def shape_dims(shape) -> Dims:
    """Dims of a core.config.ModelShape."""
    return Dims(weight_params(shape), shape.layers, shape.q_heads, shape.kv_heads,
                shape.head_dim)


def model_dims(model) -> Dims:
    """Dims of a loaded transformers causal LM."""
    c = model.config
    q_heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // q_heads
    return Dims(sum(p.numel() for p in model.parameters()), c.num_hidden_layers, q_heads,
                getattr(c, "num_key_value_heads", None) or q_heads, head_dim)


@contextmanager
def heartbeat(log, what: str, expected: float | None = None, every: float | None = None):
    """Inside the block, `log` a line every `every` seconds (PROGRESS_SECONDS): what runs, for
    how long, and of about how long when `expected` (seconds) is known."""
    done, start, every = threading.Event(), time.perf_counter(), every or PROGRESS_SECONDS

    def beat() -> None:
        while not done.wait(every):
            about = f" of about {expected:.0f} s" if expected else ""
            log(f"{what}: {time.perf_counter() - start:.0f} s{about}")
    thread = threading.Thread(target=beat, name="questprof-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
