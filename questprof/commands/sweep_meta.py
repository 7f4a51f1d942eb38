"""meta.json of a sweep (notes/CONTRACTS.md): the scenario and its model shape (one GPU's under
tensor parallelism, and in words), the command, the git commit, the machine, the backend,
measured ceilings, the grid swept, how it was timed; a resumed run's keeps the first run's
start and command and lists each resumption's."""

from __future__ import annotations

import sys
from dataclasses import asdict

from questprof.core.machine import git_fields, machine_info
from questprof.measure.ceilings import link_ceilings, measure_ceilings
from questprof.results import load, now


def _grid(configs) -> dict:
    """The values swept, from the configurations."""
    values = lambda name: sorted({getattr(c, name) for c in configs})  # noqa: E731
    return {"lengths": values("length"), "batches": values("batch"),
            "page_sizes": values("page_size"), "budgets": values("budget"),
            "modes": values("mode"), "seeds": values("seed")}


def _ceilings(backend) -> dict:
    """measure.ceilings.measure_ceilings(backend), or why it could not run."""
    try:
        return measure_ceilings(backend)
    except Exception as exc:  # ceilings are context for the report, never a reason to stop
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}


def sweep_meta(scenario, configs, backend, command: str | None = None, opts=None,
               byte_status: dict | None = None) -> dict:
    """meta.json of a run (notes/CONTRACTS.md)."""
    timing = {k: getattr(opts, k) for k in ("repeats", "warmup", "graph", "layers", "peers",
                                            "flashinfer")} if opts else {}
    return {"scenario": scenario.name, "scenario_path": str(scenario.path),
            "shape": {**asdict(scenario.model), "text": scenario.model.text()},
            "command": command or " ".join(sys.argv), "started": now(), "finished": None,
            **git_fields(), "machine": machine_info(), "backend": backend.name,
            "fallback_reason": getattr(backend, "fallback_reason", None),
            "ceilings": _ceilings(backend), "link_ceilings": link_ceilings(configs, backend),
            "grid": _grid(configs), "timing": timing,
            "bytes": byte_status or {}}


def resumed_meta(out_dir, meta: dict) -> dict:
    """meta.json of a resumed run: the first run's start and command, and each resumption's."""
    old = load(out_dir)[1]
    resumed = list(old.get("resumed", [])) + [meta["started"]]
    commands = list(old.get("resumed_commands", [])) + [meta["command"]]
    return {**meta, "started": old.get("started", meta["started"]),
            "command": old.get("command", meta["command"]), "resumed": resumed,
            "resumed_commands": commands}
