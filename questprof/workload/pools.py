"""Prepared pools of one configuration, and the launch of every stage and peer on them.

Every command that times or measures a stage stands on `Workload`: `layers` simulated layers,
each with its own KV pool (tiled from one random block, summaries built by the `summary` stage
over a prefill plan), decode queries, and each stage's inputs ready (scores and selections).
The cold-pass rule (`sim_layers`, over core.model.cold_layers) reads the device's L2 and free
memory, and the memory checks (`free_bytes`, `fit_reason`, out-of-memory) live here too.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Callable

import numpy as np

from questprof.core import model, tier
from questprof.core.config import ConfigError
from questprof.core.fp8 import kv_scale, to_e4m3
from questprof.core.layout import (TILE, AppendPlan, PagedKV, append_plan, page_tables,
                                   random_queries, tiled, to_storage)
from questprof.core.selection import union_pages
from questprof.workload import peers

POOL_FRACTION = 0.5  # simulated layers' pools take at most half the free device memory
L2_DEFAULT = 60 << 20  # an H200's L2, when the device's own figure cannot be read
ALIGN = 256  # layer offsets into the tile, in elements: keeps every pool 512-byte aligned
FREE_FRACTION = 0.9  # use at most this share of free memory
HOST_COPIES = 6  # NumPy backend: the pool, and float64 copies of K and V in reference.attention
PLAIN_KV = ("fp16", "bf16", "fp32")  # the caches a backend runs when it lists none (kv_dtypes)


class DoesNotFit(RuntimeError):
    """A configuration's pools do not fit in free memory (the message says by how much)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """MemoryError, CuPy's or torch's OutOfMemoryError, or a CUDA allocation failure."""
    return (isinstance(exc, (MemoryError, DoesNotFit))
            or type(exc).__name__ == "OutOfMemoryError"
            or "cudaErrorMemoryAllocation" in str(exc))


def release(backend) -> None:
    """Give cached device blocks back (CuPy's pool, and torch's when the peers used it) so the
    next configuration, or a child process such as ncu's, sees the free memory."""
    if backend.is_gpu:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


@functools.cache
def l2_bytes() -> int:
    """The current device's L2 size in bytes, or L2_DEFAULT where none can be read."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"])
    except (ImportError, RuntimeError):  # no CuPy, or no device here (CUDARuntimeError)
        return L2_DEFAULT


def _host_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def host_free_bytes() -> int | None:
    """The host's available memory in bytes (where the host tier's pinned pools live); None
    where it cannot be read."""
    return _host_available()


def free_bytes(backend) -> int | None:
    """Free memory in bytes where the pools live: the GPU's (CuPy's cached blocks included),
    or the host's available memory for a CPU backend; None when unknown."""
    if not backend.is_gpu:
        available = _host_available()
        spare = getattr(backend, "spare_bytes", None)  # memory it holds for the next pool
        return None if available is None else available + (spare() if spare else 0)
    import cupy

    pool = cupy.get_default_memory_pool()
    return int(cupy.cuda.runtime.memGetInfo()[0]) + int(pool.free_bytes())


def sim_layers(cfg, backend, layers: int | None = None) -> int:
    """Layers of the timed pass: `layers` if given, 1 on a CPU backend, else a cold pass
    (model.cold_layers) within POOL_FRACTION of the free device memory."""
    if layers is not None:
        if layers < 1:
            raise ConfigError(f"layers {layers} must be at least 1")
        return layers
    if not backend.is_gpu:
        return 1
    free = free_bytes(backend)
    budget = POOL_FRACTION * free if free is not None else model.kv_pool_bytes(cfg)
    return model.cold_layers(cfg, l2_bytes(), budget)


def check_cache(shape, backend) -> None:
    """One line (ConfigError) when the backend does not run the shape's KV cache dtype."""
    kv = model.kv_dtype(shape)
    if kv not in getattr(backend, "kv_dtypes", PLAIN_KV):
        raise ConfigError(f"model {shape.name}: {kv} KV caches do not run on the "
                          f"{backend.name} backend yet (--backend numpy runs them)")


def _copies(backend, cfg) -> float:
    """Bytes held per byte of pool: 1 on a GPU; on the CPU the backend's working copies too (the
    float64 reference's are twice as many pool bytes over an FP8 cache)."""
    if backend.is_gpu:
        return 1
    own = getattr(backend, "host_copies", None)
    if own is not None:
        return own(model.kv_dtype(cfg.model))
    return HOST_COPIES * (2 if cfg.model.is_fp8 else 1)


def fit_need(cfg, backend, layers: int) -> tuple[int, int | None]:
    """(bytes the pools of `layers` layers need, bytes free) where they would live."""
    need = _copies(backend, cfg) * layers * model.kv_pool_bytes(cfg)
    return int(need) + 4 * TILE * 4, free_bytes(backend)


def fit_reason(cfg, backend, layers: int) -> str | None:
    """Why `layers` pools of cfg do not fit in free memory (the cause; figures in the
    row's need_gib / free_gib), or None when they do."""
    need, free = fit_need(cfg, backend, layers)
    if free is None or need <= FREE_FRACTION * free:
        return None
    return f"does not fit in {'GPU' if backend.is_gpu else 'host'} memory"


def _device_plan(backend, plan: AppendPlan) -> AppendPlan:
    return AppendPlan(*(backend.asarray(a) for a in (plan.page_ids, plan.first, plan.end)))


def _xp(backend):
    """The array module of the backend (cupy on a GPU, numpy otherwise)."""
    if backend.is_gpu:
        import cupy

        return cupy
    return np


def pool_tile(m, rng) -> tuple[np.ndarray, np.ndarray | None]:
    """The random block every pool of shape m is tiled from, in K/V storage, and for an FP8
    cache the float32 [Hkv] scales: amax / 448 of the block, quantized to nearest even. Every
    head draws from the same block, so per-head scales come out equal in value (the kernels read
    them per head either way)."""
    values = rng.standard_normal(TILE, dtype=np.float32)
    if not m.is_fp8:
        return to_storage(values, m.dtype), None
    scale = kv_scale(values.reshape(1, 1, 1, -1))[0]
    return to_e4m3(values / np.float64(scale)), np.full(m.kv_heads, scale, dtype=np.float32)


def _tiled_into(out: np.ndarray, tile: np.ndarray, offset: int, shape) -> np.ndarray:
    """layout.tiled(np, tile, shape, offset) written into `out` (host memory given)."""
    out = out[:math.prod(shape)]
    start = offset % tile.size
    head = min(tile.size - start, out.size)
    out[:head] = tile[start:start + head]
    for i in range(head, out.size, tile.size):
        out[i:i + tile.size] = tile[:out.size - i]
    return out.reshape(shape)


def build_pools(cfg, backend, layers: int, rng) -> tuple[list[PagedKV], tuple]:
    """Random K/V pools for each layer, sharing one page table; summaries built by prefill."""
    m, xp, lengths = cfg.model, _xp(backend), [cfg.length] * cfg.batch
    n = cfg.batch * cfg.pages
    tables = page_tables(lengths, cfg.page_size, n, rng)
    tile, scales = pool_tile(m, rng)
    tile = backend.asarray(tile)
    nan = to_storage(np.array([np.nan]), model.summary_dtype(m))
    shape = (n, m.kv_heads, cfg.page_size, m.head_dim)
    prefill = _device_plan(backend, append_plan(*tables, lengths, cfg.page_size))
    kvs = []
    # the NumPy fp32 path reads its float32 copies from the tile, not by a cast of every value,
    # and lends the memory of its last pool (backends/arena.py: fresh pages cost more)
    put_tiled, arena = getattr(backend, "put_tiled", None), getattr(backend, "pool_arena", None)
    for layer in range(layers):
        offsets = (ALIGN * 2 * layer, ALIGN * (2 * layer + 1))
        size = math.prod(shape)
        memory = None if arena is None else arena.take(2 * size * tile.itemsize)
        k, v = (tiled(xp, tile, shape, offset) if memory is None else
                _tiled_into(memory.view(tile.dtype)[i * size:(i + 1) * size], tile, offset, shape)
                for i, offset in enumerate(offsets))
        summ = xp.full((n, m.kv_heads, 2, m.head_dim), nan[0], dtype=nan.dtype)
        host = PagedKV(k, v, summ, *(backend.asarray(t) for t in tables), tuple(lengths),
                       cfg.page_size, m.dtype, model.kv_dtype(m), model.summary_dtype(m),
                       scales, scales)
        kv = put_tiled(host, tile, offsets) if put_tiled else backend.put(host)
        backend.summary(kv, prefill)
        kvs.append(_in_tier(cfg, backend, kv))
    return kvs, tables


def _in_tier(cfg, backend, kv: PagedKV) -> PagedKV:
    """kv where cfg's tier keeps it: on a GPU with kv_tier host, K and V (and summaries with
    summary_tier host) move to mapped pinned host memory, which the same kernels then read
    over the link; on the CPU the host is the host and nothing moves."""
    if tier.kv_tier(cfg) == "hbm" or not backend.is_gpu:
        return kv
    from questprof.backends.host_tier import host_tier

    return host_tier(kv, summaries=tier.summary_tier(cfg) == "host")


class PoolCache:
    """The pools of the last configuration built, for the next one that differs only in budget
    or mode (CPU sweeps run those in a row): building and summarising a pool is most of the
    CPU time of a configuration, and the timed stages leave a pool as they found it."""

    def __init__(self) -> None:
        self.key, self.value = None, None

    def get(self, cfg, backend, layers: int, build: Callable[[], tuple]) -> tuple:
        """build()'s value for cfg's pools: kept from the last call or built now."""
        key = (cfg.model, cfg.length, cfg.batch, cfg.page_size, cfg.seed, layers, id(backend),
               tier.kv_tier(cfg), tier.summary_tier(cfg))
        if key != self.key:
            self.key = self.value = None  # the old pools go before the new ones' memory check
            self.value, self.key = build(), key
        return self.value


class Workload:
    """`layers` prepared layers of one configuration on a backend, and each stage's launch.

    Pools, decode queries and the one-token decode plan; unless the budget covers every page,
    each layer's scores and selections too (top-K and sparse attention read them).
    Raises DoesNotFit before allocating when the pools would not fit in free memory.
    pools: a PoolCache whose pools this workload may take (and leaves its own in).
    """

    PEERS = ("torch-sdpa", "torch-naive", "torch-gather")

    def __init__(self, cfg, backend, layers: int, pools: PoolCache | None = None):
        check_cache(cfg.model, backend)

        def build() -> tuple:
            reason = fit_reason(cfg, backend, layers)
            if reason is not None:
                raise DoesNotFit(reason)
            rng = np.random.default_rng(cfg.seed)
            kvs, tables = build_pools(cfg, backend, layers, rng)
            return kvs, tables, rng.bit_generator.state

        self.cfg, self.backend = cfg, backend
        self.kvs, tables, state = build() if pools is None else pools.get(cfg, backend, layers,
                                                                          build)
        rng = np.random.default_rng(cfg.seed)
        rng.bit_generator.state = state  # the queries drawn as after a fresh build
        m = cfg.model
        self.q = backend.asarray(random_queries(rng, cfg.batch, m.q_heads, m.head_dim, m.dtype))
        self.plan = _device_plan(backend, append_plan(*tables, [1] * cfg.batch, cfg.page_size))
        self.scores, self.selections, self.union = [], [], None
        if not cfg.is_dense_budget:
            self.scores = [backend.estimate(self.q, kv, cfg.mode) for kv in self.kvs]
            self.selections = [backend.topk(s, kv, cfg.k_pages)
                               for s, kv in zip(self.scores, self.kvs)]
            if cfg.mode == "per-head" and m.group > 1:
                sel, count = (backend.to_host(a) for a in self.selections[0])
                self.union = union_pages(sel, count, m.group)
        self.topk_scores, self._torch = self.scores, None
        self.replay = None  # workload.replay.CacheReplay: attention and quest through a page cache
        backend.synchronize()

    @property
    def layers(self) -> int:
        return len(self.kvs)

    def work(self, stage: str):
        """Modelled bytes and FLOPs of `stage` (a kernel stage or 'quest') per layer."""
        if stage == "quest":
            return model.quest_work(self.cfg, self.union)
        return model.stage_work(self.cfg, self.union)[stage]

    def rotate_topk(self, calls: int) -> None:
        """Copies of the scores so that top-K, which reads only them, has a cold rotation of
        `calls` calls of its own (byte measurement)."""
        extra = max(self.layers, calls) - self.layers
        copies = []
        if extra:  # one tiled copy, not one copy per call (147,615 copies took 6.4 s of a sweep)
            xp = _xp(self.backend)
            stacked = xp.stack(self.scores)
            reps = (-(-extra // self.layers),) + (1,) * (stacked.ndim - 1)
            copies = list(xp.tile(stacked, reps)[:extra])
        self.topk_scores = list(self.scores) + copies

    def calls(self, stage: str) -> int:
        """Calls of `stage` in one cold pass (launch(0) .. launch(calls - 1))."""
        return len(self.topk_scores) if stage == "topk" else self.layers

    @property
    def quest_path(self) -> str:
        """How the backend runs the Quest step: its own pipeline's name, or 'composed'."""
        return getattr(self.backend, "quest_path", None) or "composed"

    def quest(self, layer: int):
        """One Quest step of a layer, estimate -> top-K -> sparse attention: the backend's own
        pipeline where it has one (fused or overlapped stages), else the three launches."""
        b, kv, cfg = self.backend, self.kvs[layer], self.cfg
        if hasattr(b, "quest"):
            return b.quest(self.q, kv, cfg.k_pages, cfg.mode)
        sel, count = b.topk(b.estimate(self.q, kv, cfg.mode), kv, cfg.k_pages)
        return b.attention(self.q, kv, sel, count)

    def launcher(self, stage: str) -> Callable[[int], object]:
        """launch(layer) of a stage, 'quest' or a peer; asynchronous, no synchronisation.
        Peers (torch) are built only when asked for; with a replay (workload/replay.py)
        attention and the Quest step run through its page caches."""
        b, cfg, kvs, q = self.backend, self.cfg, self.kvs, self.q
        if stage in self.PEERS:
            return self._peer(stage)
        if self.replay is not None and stage in ("attention", "quest"):
            return getattr(self.replay, stage)
        launches = {
            "summary": lambda l: b.summary(kvs[l], self.plan),
            "estimate": lambda l: b.estimate(q, kvs[l], cfg.mode),
            "topk": lambda l: b.topk(self.topk_scores[l], kvs[l % self.layers], cfg.k_pages),
            "attention": lambda l: b.attention(q, kvs[l], *self.selections[l]),
            "dense": lambda l: b.attention(q, kvs[l]),
            "quest": self.quest,
        }
        if stage not in launches:
            raise ValueError(f"unknown stage {stage!r}: expected one of {tuple(launches)}")
        return launches[stage]

    def _peer(self, name: str) -> Callable[[int], object]:
        cfg, m = self.cfg, self.cfg.model
        if name == "torch-gather":
            return peers.gathered_attention(cfg, self.kvs, self.q, self.selections)
        if self._torch is None:  # one contiguous cache per layer, shared by the torch peers
            self._torch = (peers.make_layers(self.layers, cfg.batch, m.kv_heads, cfg.length,
                                             m.head_dim, cfg.page_size, m.dtype, cfg.seed),
                           peers.random_query(cfg.batch, m.q_heads, m.head_dim, m.dtype,
                                              cfg.seed))
        caches, tq = self._torch
        if name == "torch-sdpa":
            return peers.sdpa_dense(caches, tq)
        return peers.naive_quest(caches, tq, cfg.k_pages, cfg.mode)
