"""Context-parallel Quest over torch.distributed: NCCL on GPUs, gloo on the CPU (tests).

One process per rank. Every rank builds the same global cache from the seed and keeps only its
own pages; the two collectives of a decode step (candidates, partial outputs) are all-gathers,
timed separately from the local stages because they sit on the decode critical path.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import numpy as np

from questprof.core import layout, model
from questprof.core import sharding as cp
from questprof.results import append_rows


def _to_torch(array, torch):
    return torch.from_numpy(np.ascontiguousarray(array)) if isinstance(array, np.ndarray) \
        else torch.from_dlpack(array)


def _from_torch(tensor, backend):
    return tensor.numpy() if not backend.is_gpu else __import__("cupy").from_dlpack(tensor)


def all_gather(array, backend):
    """[W, ...] stack of every rank's `array` (same shape on every rank)."""
    import torch
    import torch.distributed as dist

    local = _to_torch(array, torch).contiguous()
    world = dist.get_world_size()
    out = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=local.dtype,
                      device=local.device)
    # Ranks concatenated on dim 0 (gloo insists); the function was renamed in torch 2.13.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local)
    return _from_torch(out.reshape(world, *local.shape), backend)


def collective_ms(array, backend, repeats: int = 50) -> float:
    """Device time of one all-gather of `array` (ms, CUDA events around `repeats` back-to-back
    calls after a barrier): the collective alone, without the wait for a slower rank or the host
    work that the phase wall times include."""
    import torch
    import torch.distributed as dist

    for _ in range(5):
        all_gather(array, backend)
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        all_gather(array, backend)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _build(cfg, seed: int):
    """The same global cache and queries on every rank, from the seed (host arrays).

    K and V tile one random block (layout.TILE values): drawing 4 GiB of normals for a 128K
    longchat-7b cache took most of a 60 s budget per rank on the H200 host.
    """
    rng = np.random.default_rng(seed)
    lengths, size = [cfg["length"]] * cfg["batch"], cfg["page_size"]
    n = sum(layout.pages_for(x, size) for x in lengths)
    indptr, indices, last = layout.page_tables(lengths, size, n, rng)
    tile = layout.to_storage(rng.standard_normal(min(layout.TILE, n * size * cfg["head_dim"] * 2),
                                                 dtype=np.float32), cfg["dtype"])
    shape = (n, cfg["kv_heads"], size, cfg["head_dim"])
    nan = layout.to_storage(np.full((n, cfg["kv_heads"], 2, cfg["head_dim"]), np.nan), cfg["dtype"])
    kv = layout.PagedKV(layout.tiled(np, tile, shape, 0), layout.tiled(np, tile, shape, 257),
                        nan, indptr, indices, last, tuple(lengths), size, cfg["dtype"])
    from questprof.backends.numpy import NumpyBackend
    plan = layout.append_plan(kv.kv_indptr, kv.kv_indices, kv.last_page_len, kv.lengths,
                              kv.page_size)
    NumpyBackend().summary(kv, plan)  # same summaries on every rank, built once on the host
    q = layout.random_queries(rng, cfg["batch"], cfg["q_heads"], cfg["head_dim"], cfg["dtype"])
    return kv, q


def decode_step(backend, q, kv_global, kv_local, shard, k_pages: int, mode: str, clock):
    """One exact context-parallel decode step; returns (out, lse, sel, count, phase times)."""
    times = {}
    with clock("local_candidates", times):
        pos, score = cp.candidates(backend, q, kv_local, shard, k_pages, mode)
    with clock("gather_candidates", times):
        pos, score = all_gather(pos, backend), all_gather(score, backend)
    with clock("select", times):
        sel, count = cp.select(backend, pos, score, kv_global, k_pages)
    with clock("local_attention", times):
        out, lse = cp.partial(backend, q, kv_local, shard, sel, count)
    out32 = cp.to_float32(out, kv_local.dtype, cp._xp(out))
    with clock("gather_partials", times):
        outs, lses = all_gather(out32, backend), all_gather(lse, backend)
    with clock("merge", times):
        out, lse = cp.merge(outs, lses, "fp32")
    return out, lse, sel, count, times


class _Clock:
    """Wall time of a phase after synchronising the device (collectives block the host anyway)."""

    def __init__(self, backend):
        self.backend = backend

    def __call__(self, name, times):
        clock = self

        class _Phase:
            def __enter__(self):
                clock.backend.synchronize()
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                clock.backend.synchronize()
                times[name] = times.get(name, 0.0) + (time.perf_counter() - self.start) * 1e3
        return _Phase()


def _single(backend, kv, q, k_pages: int, mode: str, steps: int) -> list[dict]:
    """The same Quest step on one GPU holding the whole cache, timed the same way (baseline)."""
    whole, clock, out = backend.put(kv), _Clock(backend), []
    for _ in range(steps):
        times = {}
        with clock("single_estimate", times):
            scores = backend.estimate(q, whole, mode)
        with clock("single_topk", times):
            sel, count = backend.topk(scores, whole, k_pages)
        with clock("single_attention", times):
            backend.attention(q, whole, sel, count)
        out.append(times)
    return out


def run_rank(rank: int, world: int, cfg: dict, k_pages: int, mode: str, seed: int,
             dist_backend: str, port: int, steps: int, result_queue) -> None:
    """Entry point of one rank: build, run `steps` decode steps, report times and the output."""
    import torch.distributed as dist

    from questprof.backends import get_backend

    if dist_backend == "nccl":
        __import__("cupy").cuda.Device(rank).use()
        __import__("torch").cuda.set_device(rank)
    dist.init_process_group(dist_backend, init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        backend = get_backend("cupy" if dist_backend == "nccl" else "numpy")
        kv, q = _build(cfg, seed)
        shard = cp.shard_bounds(kv.pages(), world, rank)
        local = backend.put(cp.local_kv(kv, shard))
        glob = backend.put(cp.tables_only(kv))
        qd = backend.asarray(q)
        samples = []
        for _ in range(steps):
            out, lse, sel, count, times = decode_step(backend, qd, glob, local, shard, k_pages,
                                                      mode, _Clock(backend))
            samples.append(times)
        if dist_backend == "nccl":
            pos, _ = cp.candidates(backend, qd, local, shard, k_pages, mode)
            device = {"device_gather_candidates": 2 * collective_ms(pos, backend),  # pos, score
                      "device_gather_partials": collective_ms(out, backend) +
                      collective_ms(lse, backend)}
            samples = [{**t, **device} for t in samples]
        if rank == 0 and dist_backend == "nccl":
            samples = [{**t, **b} for t, b in zip(samples, _single(backend, kv, qd, k_pages, mode,
                                                                  steps))]
        result_queue.put((rank, backend.to_host(out), backend.to_host(lse),
                          backend.to_host(sel), samples))
    finally:
        dist.destroy_process_group()


def launch(world: int, cfg: dict, k_pages: int, mode: str = "per-head", seed: int = 0,
           dist_backend: str = "gloo", steps: int = 1, port: int | None = None):
    """Spawn `world` ranks; returns [(rank, out, lse, sel, phase-time samples)] sorted by rank."""
    import torch.multiprocessing as mp

    port = port or 29500 + os.getpid() % 1000
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, world, cfg, k_pages, mode, seed, dist_backend,
                                                port, steps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = _collect(queue, procs, timeout_s=600)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return sorted(results, key=lambda r: r[0])


def _collect(queue, procs, timeout_s: float) -> list:
    """Every rank's result; fails fast (instead of hanging) when a rank dies."""
    import queue as queues

    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=1.0))
        except queues.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a rank failed (exit status {dead})" if dead
                                   else "ranks did not finish in time")
    return results


def host_figures(cfg: dict, seed: int, world: int, k_pages: int, mode: str, sel) -> dict:
    """From the exact selection, on the host: how often the cheap variant (K/N local pages per
    rank, no collective) misses exact pages, and the formula bytes the busiest rank reads
    against one GPU holding the whole cache (T_index + T_selected)."""
    from questprof.backends.numpy import NumpyBackend

    kv, q = _build(cfg, seed)
    backend, shape = NumpyBackend(), SimpleNamespace(**cfg)
    shards = [cp.shard_bounds(kv.pages(), world, r) for r in range(world)]
    scores = []
    for shard in shards:
        part = cp.local_kv(kv, shard)
        scores.append((backend.estimate(q, part, mode), part.kv_indptr))
    count = np.minimum(k_pages, np.asarray(kv.pages()))
    per_rank = [model.shard_read(shape, *cp.held_work(kv, s, sel, count, cfg["kv_heads"]))
                for s in shards]
    whole = cp.shard_bounds(kv.pages(), 1, 0)
    return {"cheap_variant_miss_rate": cp.miss_rate(sel, count, cp.local_only(
                scores, shards, kv.pages(), k_pages)),
            "gpu_read_bytes_max": max(per_rank), "gpu_read_bytes_min": min(per_rank),
            "single_read_bytes": model.shard_read(shape, *cp.held_work(
                kv, whole, sel, count, cfg["kv_heads"]))}


def summarize(results, world: int) -> list[tuple[str, float]]:
    """(phase, median ms over steps of the slowest rank) rows, then totals and the baseline."""
    phases = list(results[0][4][0])
    med = {p: max(float(np.median([t[p] for t in r[4] if p in t])) for r in results
                  if p in r[4][0]) for p in phases}
    parallel = [p for p in med if not p.startswith(("single_", "device_"))]
    rows = [(p, med[p]) for p in parallel]
    rows.append((f"context-parallel step ({world} ranks)", sum(med[p] for p in parallel)))
    rows.append(("collectives on the critical path", med["gather_candidates"] +
                 med["gather_partials"]))
    rows += [(p, med[p]) for p in med if p.startswith("device_")]
    single = [p for p in med if p.startswith("single_")]
    if single:
        rows += [(p, med[p]) for p in single]
        rows.append(("single-GPU Quest step", sum(med[p] for p in single)))
    return rows


def run_context_parallel(scenario, configs, out_dir, gpus: int, steps: int = 10) -> list[dict]:
    """Per configuration: phase times of an exact context-parallel step on `gpus` GPUs (NCCL),
    the single-GPU step beside it, the miss rate of the no-collective variant and the formula
    bytes of the busiest GPU against one GPU."""
    from questprof.commands import context_parallel as distributed

    rows = []
    for cfg in configs:
        m = cfg.model
        shape = dict(length=cfg.length, batch=cfg.batch, page_size=cfg.page_size,
                     kv_heads=m.kv_heads, q_heads=m.q_heads, head_dim=m.head_dim, dtype=m.dtype)
        results = launch(gpus, shape, cfg.k_pages, cfg.mode, cfg.seed, "nccl", steps)
        host = host_figures(shape, cfg.seed, gpus, cfg.k_pages, cfg.mode,
                                        results[0][3])
        for phase, ms in summarize(results, gpus):
            rows.append({"scenario": scenario.name, **cfg.as_dict(), "stage": "context-parallel",
                         "phase": phase, "gpus": gpus, "median_ms": ms, "backend": "cupy+nccl",
                         **host, "status": "ok", "reason": None})
    append_rows(out_dir, rows, context_parallel={"gpus": gpus})
    return rows


def main(argv=None) -> None:
    """python3 -m questprof.commands.context_parallel --world 2 --lengths 32k,128k ... (NCCL on GPUs)."""
    import argparse

    from questprof.core.config import parse_sizes
    from questprof.core.scenarios import load_scenario

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--scenario", default="longchat-7b")
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--mode", default="per-head")
    ap.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    shape = load_scenario(args.scenario).model
    for length in parse_sizes(args.lengths):
        cfg = dict(length=length, batch=args.batch, page_size=args.page_size,
                   kv_heads=shape.kv_heads, q_heads=shape.q_heads, head_dim=shape.head_dim,
                   dtype=shape.dtype)
        k_pages = args.budget // args.page_size
        results = launch(args.world, cfg, k_pages, args.mode, 0, args.backend, args.steps)
        fig = host_figures(cfg, 0, args.world, k_pages, args.mode, results[0][3])
        print(f"\n{shape.name} L={length} B={args.batch} S={args.page_size} "
              f"budget={args.budget} {args.mode} world={args.world} ({args.backend}); "
              f"cheap variant misses {fig['cheap_variant_miss_rate']:.1%} of the exact top-K "
              f"pages; formula bytes, busiest GPU / one GPU: "
              f"{fig['gpu_read_bytes_max'] / fig['single_read_bytes']:.3f}")
        for name, ms in summarize(results, args.world):
            print(f"  {name:40s} {1e3 * ms:10.1f} us")


if __name__ == "__main__":
    main()
