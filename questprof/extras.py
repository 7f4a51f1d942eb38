"""Measurements a sweep can add beside its grid: end-to-end decode steps (--e2e) and
context-parallel Quest over several GPUs (--gpus N); rows land in the same results directory."""

from __future__ import annotations

from questprof.results import ResultsWriter, load


def _append(out_dir, rows: list[dict], **meta) -> None:
    """Add rows (and meta fields) to an existing results directory."""
    old = load(out_dir)[1]
    with ResultsWriter(out_dir, old) as writer:
        writer.write_meta(**meta)
        for row in rows:
            writer.append(row)


def run_e2e(scenario, configs, backend, out_dir, page_size: int, budget: int,
            steps: int = 10) -> list[dict]:
    """Measured decode steps of a random-weight decoder, dense vs Quest, at the grid's lengths."""
    from questprof import e2e

    lengths = sorted({c.length for c in configs})
    batch = min(c.batch for c in configs)
    rows = e2e.measure_e2e(scenario.model, lengths, page_size, budget, batch, backend,
                           steps=steps, scenario=scenario.name)
    _append(out_dir, rows, e2e={"page_size": page_size, "budget": budget, "batch": batch})
    return rows


def run_context_parallel(scenario, configs, out_dir, gpus: int, steps: int = 10) -> list[dict]:
    """Per configuration: phase times of an exact context-parallel step on `gpus` GPUs (NCCL),
    the single-GPU step beside it, the miss rate of the no-collective variant and the formula
    bytes of the busiest GPU against one GPU."""
    from questprof import distributed

    rows = []
    for cfg in configs:
        m = cfg.model
        shape = dict(length=cfg.length, batch=cfg.batch, page_size=cfg.page_size,
                     kv_heads=m.kv_heads, q_heads=m.q_heads, head_dim=m.head_dim, dtype=m.dtype)
        results = distributed.launch(gpus, shape, cfg.k_pages, cfg.mode, cfg.seed, "nccl", steps)
        host = distributed.host_figures(shape, cfg.seed, gpus, cfg.k_pages, cfg.mode,
                                        results[0][3])
        for phase, ms in distributed.summarize(results, gpus):
            rows.append({"scenario": scenario.name, **cfg.as_dict(), "stage": "context-parallel",
                         "phase": phase, "gpus": gpus, "median_ms": ms, "backend": "cupy+nccl",
                         **host, "status": "ok", "reason": None})
    _append(out_dir, rows, context_parallel={"gpus": gpus})
    return rows
