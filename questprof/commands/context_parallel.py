"""Context-parallel Quest over torch.distributed: NCCL on GPUs, gloo on the CPU (tests).

One process per rank, each running every configuration: the same global pools from the seed,
its own pages kept, then workload.parallel_step.time_rank (the exact step of a layer as one
CUDA graph with its two all-gathers, the cheap step, each phase and each all-gather alone, all
by the one timing loop) and on rank 0 the single-GPU Quest step. The parent turns the slowest
rank's times, the cheap variant's miss rate and the bytes per GPU into rows.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import queue as queues

from questprof.backends import get_backend
from questprof.core import model
from questprof.core import sharding as cp
from questprof.core.config import Config, parse_sizes
from questprof.core.scenarios import load_scenario
from questprof.results import append_rows, make_row, read_rows
from questprof.workload import parallel_step as ps
from questprof.workload.parallel_step import global_tables, single_gpu
from questprof.workload.pools import release, sim_layers

SINGLE = "single_gpu_step"


def run_rank(rank: int, world: int, configs: list, dist_backend: str, port: int,
             timing: dict, layers: int | None, result_queue) -> None:
    """Entry point of one rank: per configuration, build and time; put (rank, index, result)."""
    import torch.distributed as dist

    if dist_backend == "nccl":
        __import__("cupy").cuda.Device(rank).use()
        __import__("torch").cuda.set_device(rank)
    dist.init_process_group(dist_backend, init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        backend = get_backend("cupy" if dist_backend == "nccl" else "numpy")
        comm = ps.TorchComm(backend)
        for index, cfg in enumerate(configs):
            n = comm.min_int(layers or sim_layers(ps.local_config(cfg, world), backend))
            shard = cp.shard_bounds([cfg.pages] * cfg.batch, world, rank)
            pools = ps.rank_pools(cfg, backend, shard, n)
            times, host = ps.time_rank(backend, comm, pools, **timing)
            single = _single(cfg, backend, host, timing) if rank == 0 else None
            del pools
            release(backend)
            comm.barrier()  # the other ranks wait while rank 0 times one GPU alone
            result_queue.put((rank, index, {"times": times, "host": host, "layers": n,
                                            "single": single}))
    finally:
        dist.destroy_process_group()


def _single(cfg, backend, host: dict, timing: dict):
    """Rank 0's single-GPU step and check, or (None, {reason}) when it cannot run here."""
    try:
        return single_gpu(cfg, backend, host, **timing)
    except Exception as exc:  # the others wait at a barrier: never leave them hanging
        return None, {"single_error": f"{type(exc).__name__}: {exc}"}


def launch(world: int, configs: list, dist_backend: str = "gloo", port: int | None = None,
           timing: dict | None = None, layers: int | None = None) -> list[list[dict]]:
    """Spawn `world` ranks over `configs`; per configuration, every rank's result by rank."""
    import torch.multiprocessing as mp

    port = port or 29500 + os.getpid() % 1000
    timing = timing or {"warmup": 3, "repeats": 20, "graph": True}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, world, configs, dist_backend, port, timing,
                                                layers, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = _collect(queue, procs, world * len(configs), timeout_s=600)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    out = [[None] * world for _ in configs]
    for rank, index, result in got:
        out[index][rank] = result
    return out


def _collect(queue, procs, expected: int, timeout_s: float) -> list:
    """Every rank's results; fails fast (instead of hanging) when a rank dies or no result
    comes for timeout_s (a deadline per result, so a long grid of configurations is not cut)."""
    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < expected:
        try:
            results.append(queue.get(timeout=1.0))
            deadline = time.monotonic() + timeout_s
        except queues.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a rank failed (exit status {dead})" if dead
                                   else "ranks did not finish in time")
    return results


def host_figures(cfg, world: int, ranks: list[dict]) -> dict:
    """From the ranks' layer 0, on the host: how often the cheap variant (K/N local pages per
    rank, no collective) misses exact pages, and the formula bytes the busiest rank reads
    against one GPU holding the whole cache (T_index + T_selected)."""
    kv = global_tables(cfg, np.random.default_rng(cfg.seed))
    sel, count = ranks[0]["host"]["sel"], ranks[0]["host"]["count"]
    shards = [cp.shard_bounds(kv.pages(), world, r) for r in range(world)]
    scores = [(r["host"]["scores"], r["host"]["indptr"]) for r in ranks]
    heads = cfg.model.kv_heads
    per_rank = [model.shard_read(cfg.model, *cp.held_work(kv, s, sel, count, heads))
                for s in shards]
    whole = cp.shard_bounds(kv.pages(), 1, 0)
    return {"cheap_variant_miss_rate": cp.miss_rate(sel, count, cp.local_only(
                scores, shards, kv.pages(), cfg.k_pages)),
            "gpu_read_bytes_max": max(per_rank), "gpu_read_bytes_min": min(per_rank),
            "single_read_bytes": model.shard_read(cfg.model, *cp.held_work(
                kv, whole, sel, count, heads))}


def phase_rows(scenario: str, cfg, world: int, ranks: list[dict], backend: str) -> list[dict]:
    """One row per phase (the slowest rank's times per layer), then the single-GPU step."""
    host = host_figures(cfg, world, ranks)
    single, check = ranks[0]["single"] or (None, {})
    common = dict(scenario=scenario, backend=backend, gpus=world, **host, **check)
    rows = []
    for phase in ranks[0]["times"]:
        times = [r["times"][phase] for r in ranks]
        error = next((t["error"] for t in times if "error" in t), None)
        slowest = max(times, key=lambda t: t["median_ms"])
        rows.append(make_row(cfg, "context-parallel", timing=None if error else slowest,
                             layers=ranks[0]["layers"], phase=phase, reason=error,
                             status="skipped" if error else "ok", **common))
    if single is not None:
        rows.append(make_row(cfg, "context-parallel", timing=single, layers=single["sim_layers"],
                             phase=SINGLE, **common))
    return rows


def run_context_parallel(scenario, configs, out_dir, gpus: int, timing: dict | None = None
                         ) -> list[dict]:
    """Per configuration, rows of the exact context-parallel step on `gpus` GPUs (NCCL), its
    phases and all-gathers, the cheap variant and the single-GPU step; appended to out_dir."""
    results = launch(gpus, list(configs), "nccl", timing=timing)
    rows = [row for cfg, ranks in zip(configs, results)
            for row in phase_rows(scenario.name, cfg, gpus, ranks, "cupy+nccl")]
    append_rows(out_dir, rows, context_parallel={"gpus": gpus, "method": "cuda-graph per rank"})
    return rows


def goal_table(rows: list[dict]) -> list[dict]:
    """Per configuration: exact step, single-GPU step, all-gathers, goal and ratio (ms)."""
    out = {}
    for r in rows:
        key = (r["length"], r["batch"], r["budget"])
        out.setdefault(key, {"length": r["length"], "batch": r["batch"]})[r["phase"]] = \
            r["median_ms"]
    for t in out.values():
        goal = cp.step_goal_ms(t.get(SINGLE), t.get("gather_candidates"), rows[0]["gpus"])
        step = t.get("exact_step")
        t["goal_ms"], t["ratio"] = goal, step / goal if goal and step is not None else None
    return list(out.values())


def main(argv=None) -> None:
    """python3 -m questprof.commands.context_parallel --world 2 --lengths 32k,128k [--out DIR]"""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--scenario", default="longchat-7b")
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--mode", default="per-head")
    ap.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    ap.add_argument("--rows", help="only print the table of this results directory's rows")
    args = ap.parse_args(argv)
    if args.rows:
        print_rows([r for r in read_rows(args.rows) if r.get("stage") == "context-parallel"])
        return
    scenario = load_scenario(args.scenario)
    configs = [Config(scenario.model, n, b, args.page_size, args.budget, args.mode)
               for b in parse_sizes(args.batch, "batch") for n in parse_sizes(args.lengths)]
    results = launch(args.world, configs, args.backend)
    print_rows([row for cfg, ranks in zip(configs, results)
                for row in phase_rows(scenario.name, cfg, args.world, ranks, args.backend)])


def _us(ms) -> float:
    return np.nan if ms is None else 1e3 * ms


def print_rows(rows: list[dict]) -> None:
    """Each phase's time, the figures of each configuration, then the goal table (us)."""
    for r in rows:
        why = f" {r['reason']}" if r["reason"] else ""
        print(f"{r['length']:>7} B={r['batch']} {r['phase']:18s} {_us(r['median_ms']):9.1f} us"
              f"  ({r['method']}, {r['sim_layers']} layers){why}")
    for r in {(r["length"], r["batch"]): r for r in rows}.values():
        print(f"{r['length']:>7} B={r['batch']}: cheap variant misses "
              f"{r['cheap_variant_miss_rate']:.1%} of exact pages; formula bytes, busiest GPU / "
              f"one GPU {r['gpu_read_bytes_max'] / r['single_read_bytes']:.3f}; exact = single: "
              f"same pages {r.get('exact_same_pages')}, rel err {r.get('exact_rel_err')}")
    print("length batch  step_us single_us gather_cand_us gather_part_us goal_us ratio")
    for t in goal_table(rows):
        print(f"{t['length']:>6} {t['batch']:>5} {_us(t.get('exact_step')):8.1f} "
              f"{_us(t.get(SINGLE)):9.1f} {_us(t.get('gather_candidates')):14.1f} "
              f"{_us(t.get('gather_partials')):14.1f} {_us(t['goal_ms']):7.1f} "
              f"{t['ratio'] if t['ratio'] is not None else np.nan:5.2f}")

if __name__ == "__main__":
    main()
