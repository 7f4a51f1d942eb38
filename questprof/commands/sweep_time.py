"""How long a sweep will take, said before it starts (sweep_say.announce), for the
configurations left to time (a resume counts only those not yet on disk).

On a GPU, seconds per configuration seen on an H200: the longchat-7b main job, 168
configurations, took 128-134 s with DRAM bytes and end-to-end steps. On a CPU the NumPy fp32
path's time follows the values it moves: each pool (length, batch, page size) is built once and
its dense stage reads all of K and V once per pass; each configuration's attention and Quest
step gather the K and V of their budget. The per-value CPU costs below are those of the main job
on the 2-core machine: 148 CPU-s (user + sys; 2026-12-01 at 7d2f648), 81 of them building
pools, whose reads run on fp32_copies.READERS threads, and 67 timing the stages on one.

The wall time is each part's CPU time over the cores it gets: t threads among L other runnable
tasks on c cores get min(t, t c / (L + t)) of a core under fair scheduling, L read from the
1-minute load average when the sweep starts. Measured on that machine: 115 s idle right after
the install (its load not recorded; 0.5 assumed, what the install leaves), and, shared with
other work, 210 s at a load of 2.8 rising to 5.3 and 311 s at 4.0 rising to 6.0, where this rule
says 121, 231 and 298 s. The rule before it (a half-second
probe of this process's share of one core, averaged with 0.75) announced 3.6 min for the 115 s
run: it saw neither the second reader thread of a free machine nor a load that stays.
"""

from __future__ import annotations

import os

from questprof.backends import timing_backend
from questprof.backends.fp32_copies import READERS
from questprof.workload.pools import fit_reason

GPU_SECONDS_PER_CONFIG = 0.8
CPU_START_S = 4.0  # imports, ceilings, the report
CPU_BUILD_NS = 4.25  # per K/V value of a pool: tile it, read its float32 copies, summarise
CPU_DENSE_NS = 0.38  # per K/V value per timed pass of dense attention
CPU_SPARSE_NS = 1.0  # per selected K/V value per timed pass of attention and of the Quest step
CPU_CONFIG_S = 0.04  # per configuration: estimate, top-K, summary, six rows written


def cores_for(threads: int, load: float | None = None) -> float:
    """Cores that `threads` busy threads of this process get among the others' runnable work
    (`load`: the 1-minute load average, read here when None; 0 where there is none)."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average on this OS: take a free machine
            load = 0.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return min(threads, threads * cores / (load + threads))


def cpu_parts(configs, backend, repeats: int = 3) -> tuple[float, float]:
    """(CPU seconds building pools, CPU seconds of the rest) of a sweep of `configs` on the
    NumPy fp32 path (pools that do not fit in host memory now are skipped rows: no work)."""
    timed = timing_backend(backend)
    pools, build, rest = set(), 0.0, CPU_START_S
    for cfg in configs:
        m = cfg.model
        key = (m, cfg.length, cfg.batch, cfg.page_size, cfg.seed)
        if key not in pools and fit_reason(cfg, timed, 1) is not None:
            continue
        values = 2 * cfg.batch * cfg.length * m.kv_heads * m.head_dim
        if key not in pools:
            pools.add(key)
            build += values * CPU_BUILD_NS * 1e-9
            rest += values * repeats * CPU_DENSE_NS * 1e-9
        if not cfg.is_dense_budget:
            chosen = 2 * cfg.batch * m.q_heads * cfg.budget * m.head_dim
            rest += 2 * repeats * chosen * CPU_SPARSE_NS * 1e-9
        rest += CPU_CONFIG_S
    return build, rest


def cpu_seconds(configs, backend, repeats: int = 3) -> float:
    """CPU seconds of a sweep of `configs` on the NumPy fp32 path."""
    return sum(cpu_parts(configs, backend, repeats))


def sweep_seconds(configs, backend, load: float | None = None) -> float:
    """About how many seconds a sweep of `configs` on `backend` takes (default timing; on a
    CPU at the load average `load`, read now when None)."""
    if backend.is_gpu:
        return len(configs) * GPU_SECONDS_PER_CONFIG

    build, rest = cpu_parts(configs, backend)
    return build / cores_for(READERS, load) + rest / cores_for(1, load)
