"""How long `questprof fidelity` on a real model takes, said before it starts (fidelity/pace.py
holds the estimate and the progress lines; on a CPU the wall time is the estimate's one-core
seconds over the share of a core this process gets).

The share: what the load average leaves one thread, cores / (load + 1) (the sweep's rule,
sweep_time.cores_for). The default 2k run on the shared 2-core machine (2026-12-01, 61c6cd6) got
0.46 of a core over 6.3 minutes at a load of 3.4-6.3 while a half-second probe of this process
saw 0.99 (it announced 3.8 minutes); 2 / (3.37 + 1) = 0.46. The run at 7d2f648 got 0.46 at a
starting load of 3.8.
"""

from __future__ import annotations

from questprof.commands.sweep_time import cores_for
from questprof.core.config import ModelShape
from questprof.fidelity.models import known_shape, model_name
from questprof.fidelity.pace import Pace, shape_dims
from questprof.report.frames import fmt_tokens


def pace_here(backend) -> Pace:
    """The pace of this machine now: the GPU, or the CPU at the share of a core it gives."""
    if backend.is_gpu:
        return Pace(gpu=True)

    return Pace(share=max(0.2, cores_for(1)))


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _listed(word: str, values) -> str:
    """'page size 16', 'page sizes 8, 16, 32'."""
    return f"{word}{'' if len(values) == 1 else 's'} {', '.join(map(str, values))}"


def announcement(request, shape: ModelShape | None, pace: Pace, name: str) -> str:
    """One line: the model, the work and about how long it takes (when the shape is known)."""
    grid = request.grid
    lengths = ", ".join(fmt_tokens(n) for n in request.lengths)
    work = (f"fidelity --source {request.source} on {name}: {_count(request.prompts, 'prompt')} "
            f"of {lengths} tokens, {_count(request.steps, 'decode step')}, "
            f"{_listed('page size', grid.page_sizes)} x {_listed('budget', grid.budgets)}"
            f"{', the task' if request.task else ''}")
    if shape is None:
        return f"{work}; the time is estimated once the model is loaded"
    phases = pace.expected(shape_dims(shape), request)
    where = "on the GPU" if pace.gpu else f"on the CPU at {pace.share:.2f} of a core"
    parts = ", ".join(f"{k} {v:.0f} s" for k, v in phases.items() if v >= 1)
    return f"{work}: about {sum(phases.values()) / 60:.1f} min {where} ({parts})"


def announce(request, backend, log) -> Pace:
    """Say what a real model's run will do and about how long it takes; its Pace."""
    pace = pace_here(backend)
    log(announcement(request, known_shape(request.model), pace, model_name(request.model)))
    return pace
