"""One rank's context-parallel Quest on prepared pools, timed by the one timing loop.

Every rank builds the same global pools from the seed, layer by layer, with the tiling of
workload.pools.build_pools (so layer l is the single-GPU Workload's layer l), keeps only its own
pages, and times over a cold pass of its layers: the exact step (core.sharding.exact_step, the
two all-gathers inside the captured graph), the cheap step, each phase and each all-gather
alone. Rank 0 also times the single-GPU Quest step over the whole cache (Workload's `quest`, as
the sweep does) and checks the exact step of layer 0 against it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from questprof.core import sharding as cp
from questprof.core.layout import (TILE, AppendPlan, PagedKV, append_plan, from_storage,
                                   page_tables, random_queries, storage_dtype, tiled, to_storage)
from questprof.measure.timing import time_layers
from questprof.workload.pools import ALIGN, Workload, sim_layers

PHASES = ("exact_step", "cheap_step", "local_candidates", "gather_candidates", "select",
          "local_attention", "gather_partials", "merge")


class TorchComm:
    """All-gathers through torch.distributed (NCCL or gloo) on persistent buffers, one pair per
    (shape, dtype), made on first use: that is the eager pass before any capture, so a captured
    graph replays the same buffers and the step's arrays stay the backend's own (DLPack views)."""

    def __init__(self, backend):
        import torch.distributed as dist

        self.dist, self.is_gpu = dist, backend.is_gpu
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self._buffers: dict = {}
        # ranks concatenated on dim 0 (gloo insists); the function was renamed in torch 2.13
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def _pair(self, shape, dtype):
        import torch

        key = (tuple(shape), np.dtype(dtype).str)
        if key not in self._buffers:
            device = torch.device("cuda", torch.cuda.current_device()) if self.is_gpu else "cpu"
            kind = {np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32}
            src = torch.empty(shape, dtype=kind[np.dtype(dtype)], device=device)
            dst = torch.empty((self.world * shape[0], *shape[1:]), dtype=src.dtype, device=device)
            view = __import__("cupy").from_dlpack if self.is_gpu else (lambda t: t.numpy())
            self._buffers[key] = (src, dst, view(src), view(dst).reshape(self.world, *shape))
        return self._buffers[key]

    def send(self, shape, dtype):
        """The array to fill before all_gather (no copy then)."""
        return self._pair(shape, dtype)[2]

    def all_gather(self, x):
        """[W, *x.shape] of every rank's x; the result is a buffer the next call overwrites."""
        src, dst, send, received = self._pair(x.shape, x.dtype)
        if x is not send:
            send[...] = x
        self._gather(dst, src)
        return received

    def collective(self, shape, dtype):
        """A launch of the all-gather alone on the buffers of (shape, dtype), to time it."""
        src, dst, _, _ = self._pair(shape, dtype)
        return lambda: self._gather(dst, src)

    def barrier(self) -> None:
        import torch

        self.dist.barrier()
        if self.is_gpu:
            torch.cuda.synchronize()

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (layer counts must agree: collectives pair up)."""
        import torch

        t = torch.tensor([value], device="cuda" if self.is_gpu else "cpu")
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return int(t.item())


def _xp(backend):
    return __import__("cupy") if backend.is_gpu else np


def local_config(cfg, world: int):
    """One rank's share as a configuration (length / N, budget / N): its cold-pass rule."""
    budget = max(cfg.page_size, cfg.budget // world // cfg.page_size * cfg.page_size)
    return dataclasses.replace(cfg, length=-(-cfg.length // world), budget=budget)


def global_tables(cfg, rng) -> PagedKV:
    """The global page tables (host) over a one-page placeholder pool; draws them from rng
    first, as build_pools does."""
    m, lengths = cfg.model, [cfg.length] * cfg.batch
    tables = page_tables(lengths, cfg.page_size, cfg.batch * cfg.pages, rng)
    dtype = storage_dtype(m.dtype)
    return PagedKV(np.zeros((1, m.kv_heads, cfg.page_size, m.head_dim), dtype),
                   np.zeros((1, m.kv_heads, cfg.page_size, m.head_dim), dtype),
                   np.zeros((1, m.kv_heads, 2, m.head_dim), dtype), *tables, tuple(lengths),
                   cfg.page_size, m.dtype)


def prefill_plan(backend, tables: PagedKV) -> AppendPlan:
    """The prefill of every token (build_pools' summaries), on the backend."""
    plan = append_plan(tables.kv_indptr, tables.kv_indices, tables.last_page_len, tables.lengths,
                       tables.page_size)
    return AppendPlan(*(backend.asarray(a) for a in (plan.page_ids, plan.first, plan.end)))


def global_layer(cfg, backend, tables: PagedKV, tile, layer: int, prefill=None) -> PagedKV:
    """Layer `layer` of build_pools: the whole pool on the backend, summaries by prefill, with
    host tables (local_kv reads them)."""
    m, xp = cfg.model, _xp(backend)
    shape = (cfg.batch * cfg.pages, m.kv_heads, cfg.page_size, m.head_dim)
    k, v = (tiled(xp, tile, shape, ALIGN * (2 * layer + i)) for i in (0, 1))
    nan = to_storage(np.array([np.nan]), m.dtype)[0]
    summ = xp.full((shape[0], m.kv_heads, 2, m.head_dim), nan, dtype=tile.dtype)
    kv = dataclasses.replace(tables, k=k, v=v, summary=summ)
    backend.summary(kv, prefill if prefill is not None else prefill_plan(backend, tables))
    return kv


@dataclass
class RankPools:
    """One rank's prepared layers: its own pages of each layer's pool, the step's plan, q."""

    cfg: object
    shard: cp.Shard
    tables: PagedKV
    kvs: list
    plan: cp.StepPlan
    q: object


def rank_pools(cfg, backend, shard: cp.Shard, layers: int) -> RankPools:
    """Build the global pools layer by layer (one at a time on the device) and keep the rank's
    pages of each; the rng draws tables, tile and queries in the order Workload does."""
    m, rng = cfg.model, np.random.default_rng(cfg.seed)
    tables = global_tables(cfg, rng)
    tile = backend.asarray(to_storage(rng.standard_normal(TILE, dtype=np.float32), m.dtype))
    q = backend.asarray(random_queries(rng, cfg.batch, m.q_heads, m.head_dim, m.dtype))
    kvs, host, prefill = [], None, prefill_plan(backend, tables)
    for layer in range(layers):
        host = cp.local_kv(global_layer(cfg, backend, tables, tile, layer, prefill), shard)
        kvs.append(backend.put(host))
    heads = m.q_heads if cfg.mode == "per-head" else m.kv_heads
    plan = cp.make_plan(backend, tables, host, shard, heads, cfg.k_pages, cfg.mode)
    return RankPools(cfg, shard, tables, kvs, plan, q)


def _eager(backend, comm, pools: RankPools):
    """Layer 0's exact step on the host, and each layer's phase inputs (gathered candidates,
    selection, gathered partials) for timing the phases alone."""
    b, plan, q, kvs = backend, pools.plan, pools.q, pools.kvs
    names = ("out", "lse", "sel", "count")
    host = {n: b.to_host(a) for n, a in zip(names, cp.exact_step(b, comm, q, kvs[0], plan))}
    host["scores"] = b.to_host(b.estimate(q, kvs[0], plan.mode))
    host["indptr"] = b.to_host(kvs[0].kv_indptr)
    inputs = []
    for kv in kvs:
        send = comm.send(plan.candidate_shape, np.float32)
        cp.candidates(b, q, kv, plan, send)
        gathered = comm.all_gather(send).copy()
        sel, count = cp.select(b, gathered, plan)
        out, lse = cp.partial(b, q, kv, plan, sel, count)
        inputs.append((gathered, (sel, count), comm.all_gather(cp.pack(comm, out, lse,
                                                                       kv.dtype)).copy()))
    return host, inputs


def time_rank(backend, comm, pools: RankPools, warmup: int = 3, repeats: int = 20,
              graph: bool = True) -> tuple[dict, dict]:
    """({phase: Timing.summary()} of this rank over a pass of its layers, layer 0 on the host).

    Every rank times the same phases in the same order after a barrier: the captured
    all-gathers pair up across ranks, and each rank's events include its wait for the others."""
    b, plan, q, kvs = backend, pools.plan, pools.q, pools.kvs
    host, inputs = _eager(b, comm, pools)
    part_shape = inputs[0][2].shape[1:]
    gather_c = comm.collective(plan.candidate_shape, np.float32)
    gather_p = comm.collective(part_shape, np.float32)
    runs = {
        "exact_step": lambda l: cp.exact_step(b, comm, q, kvs[l], plan),
        "cheap_step": lambda l: cp.cheap_step(b, comm, q, kvs[l], plan),
        "local_candidates": lambda l: cp.candidates(
            b, q, kvs[l], plan, comm.send(plan.candidate_shape, np.float32)),
        "gather_candidates": lambda l: gather_c(),
        "select": lambda l: cp.select(b, inputs[l][0], plan),
        "local_attention": lambda l: cp.partial(b, q, kvs[l], plan, *inputs[l][1]),
        "gather_partials": lambda l: gather_p(),
        "merge": lambda l: cp.merge(inputs[l][2][..., :-1], inputs[l][2][..., -1]),
    }
    out = {}
    for name in PHASES:
        comm.barrier()
        try:
            out[name] = time_layers(b, runs[name], len(kvs), warmup, repeats, graph,
                                    uses_torch=b.is_gpu).summary()
        except Exception as exc:  # deliberately any: a phase that fails is a row with its error,
            # not a lost run; every rank runs the same code, so the others fail alike
            out[name] = {"median_ms": float("nan"), "error": f"{type(exc).__name__}: {exc}"}
    return out, host


def single_gpu(cfg, backend, layer0: dict, warmup: int = 3, repeats: int = 20,
               graph: bool = True) -> tuple[dict, dict]:
    """(Timing.summary() of the single-GPU Quest step over the whole cache, its cold pass as the
    sweep's; how the exact step of layer 0 compares with it: same pages, relative error)."""
    work = Workload(cfg, backend, sim_layers(cfg, backend))
    timing = time_layers(backend, work.launcher("quest"), work.layers, warmup, repeats, graph)
    out, _ = work.quest(0)
    want = from_storage(backend.to_host(out), cfg.model.dtype).astype(np.float64)
    err = np.linalg.norm(layer0["out"].astype(np.float64) - want) / max(np.linalg.norm(want),
                                                                       1e-30)
    check = {"exact_rel_err": float(err), "single_layers": work.layers}
    if work.selections:
        sel, count = (backend.to_host(a) for a in work.selections[0])
        check["exact_same_pages"] = bool(np.array_equal(sel, layer0["sel"])
                                         and np.array_equal(count, layer0["count"]))
    return {**timing.summary(), "sim_layers": work.layers}, check
