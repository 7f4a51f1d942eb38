"""How long a sweep will take, said before it starts (sweep_job.announce).

On a GPU, seconds per configuration seen on an H200: the longchat-7b main job, 168
configurations, took 128-134 s with DRAM bytes and end-to-end steps. On a CPU the NumPy fp32
path's time follows the values it moves: each pool (length, batch, page size) is built once and
its dense stage reads all of K and V once per pass; each configuration's attention and Quest
step gather the K and V of their budget. The per-value CPU costs below are those of the full
main job on the 2-core machine (2026-12-01: 128-151 CPU-s, user + sys, in four runs); the wall
time is that CPU time over the share of a core this process gets. The machine is shared: the
main job got 0.65, 0.81, 0.75 and 0.65 of a core (load 4.7, 2.7, 3.6, 2.2-4.4; 209, 172, 170,
229 s). A half-second probe says how busy the machine is now, but the load moves over a
3-minute job (a quarter-second probe that saw 0.57 preceded a run that got 0.75), so the share
used is the mean of the probe and 0.75: the last run announced 3.6 min and took 3.8.
"""

from __future__ import annotations

import time

import numpy as np

GPU_SECONDS_PER_CONFIG = 0.8
CPU_START_S = 4.0  # imports, ceilings, the report
CPU_BUILD_NS = 4.25  # per K/V value of a pool: tile it, read its float32 copies, summarise
CPU_DENSE_NS = 0.38  # per K/V value per timed pass of dense attention
CPU_SPARSE_NS = 1.0  # per selected K/V value per timed pass of attention and of the Quest step
CPU_CONFIG_S = 0.04  # per configuration: estimate, top-K, summary, six rows written
PROBE_S = 0.5
TYPICAL_SHARE = 0.75  # of a core, the main job's on the shared 2-core machine (above)


def core_share(seconds: float = PROBE_S) -> float:
    """CPU time this process got per second of wall time over `seconds` of NumPy work (1 on a
    free core, less where other processes share it), clamped to 0.2..1."""
    a = np.random.default_rng(0).standard_normal(1 << 20, dtype=np.float32)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall0 < seconds:
        np.sort(a)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return min(1.0, max(0.2, cpu / wall))


def cpu_seconds(configs, backend, repeats: int = 3) -> float:
    """CPU seconds of a sweep of `configs` on the NumPy fp32 path (pools that do not fit in
    host memory now are skipped rows, which cost nothing)."""
    from questprof.backends import timing_backend
    from questprof.workload.pools import fit_reason

    timed = timing_backend(backend)
    pools, total = set(), CPU_START_S
    for cfg in configs:
        m = cfg.model
        key = (m, cfg.length, cfg.batch, cfg.page_size, cfg.seed)
        if key not in pools and fit_reason(cfg, timed, 1) is not None:
            continue
        values = 2 * cfg.batch * cfg.length * m.kv_heads * m.head_dim
        if key not in pools:
            pools.add(key)
            total += values * (CPU_BUILD_NS + repeats * CPU_DENSE_NS) * 1e-9
        if not cfg.is_dense_budget:
            chosen = 2 * cfg.batch * m.q_heads * cfg.budget * m.head_dim
            total += 2 * repeats * chosen * CPU_SPARSE_NS * 1e-9
        total += CPU_CONFIG_S
    return total


def sweep_seconds(configs, backend) -> float:
    """About how many seconds a sweep of `configs` on `backend` takes (default timing)."""
    if backend.is_gpu:
        return len(configs) * GPU_SECONDS_PER_CONFIG
    return cpu_seconds(configs, backend) / ((core_share() + TYPICAL_SHARE) / 2)
