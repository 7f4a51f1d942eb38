"""A Workload's sparse attention through an HBM page cache, replaying a selection sequence with
step-to-step reuse (core/reuse_trace.py) over the host tier: each layer's pool gets a cache of C
pages per (request, KV head) (backends/page_cache_*.py), the same trace, warmed by one pass
through it. A timed `attention` call is one decode step: the cache's step (hits, misses fetched
over the link) and sparse attention over the HBM slots; `quest` runs the estimate and top-K
first (their time counts; their selection yields to the trace's, the only source of reuse).

The counts of a timed window (`begin` .. `fields`) are the device's; beside them the same steps
replayed by core/page_cache.LRUPages (the rule's Python definition): the miss rate the byte
model takes (core/tier.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from questprof.backends.page_cache_numpy import NumpyPageCache
from questprof.core import model
from questprof.core.config import ConfigError
from questprof.core.page_cache import LRUPages
from questprof.core.reuse_trace import Trace, check, load, overlap, synthetic

REPLAYED = ("attention", "quest")  # the stages a replay times through the cache


@dataclass(frozen=True)
class Replay:
    """Where the replayed selections come from: a synthetic trace keeping `overlap` of each
    step's pages, or a trace file (core/reuse_trace.save); `steps` and `seed` for the former."""

    overlap: float | None = None
    trace: str | None = None
    steps: int = 64
    seed: int = 0

    @property
    def source(self) -> str:
        return f"trace {self.trace}" if self.trace else f"synthetic overlap {self.overlap}"


def check_replay(replay: Replay | None, cfg) -> None:
    """One line (ConfigError) for a replay this configuration cannot run."""
    if replay is None:
        return
    if not cfg.hbm_pages:
        raise ConfigError("--reuse-overlap / --reuse-trace replay selections through an HBM page "
                          "cache: add --kv-tier host --hbm-pages C")
    if cfg.mode == "per-head" and cfg.model.group > 1:
        raise ConfigError("--hbm-pages with --mode per-head: the page cache serves one page set per "
                          "KV head (the shared modes); per-head's union of G selections is not built")
    if (replay.overlap is None) == (replay.trace is None):
        raise ConfigError("give one of --reuse-overlap R and --reuse-trace FILE")
    if replay.overlap is not None and not 0.0 <= replay.overlap <= 1.0:  # NaN too
        raise ConfigError(f"--reuse-overlap {replay.overlap}: the share of a step's pages the "
                          "next step keeps, 0..1")
    if replay.trace is None and replay.steps < 2:
        raise ConfigError(f"--reuse-steps {replay.steps}: a synthetic trace needs at least 2")


def trace_for(replay: Replay, cfg) -> Trace:
    """The configuration's trace; ConfigError in one line for a file of another shape."""
    lengths = [cfg.length] * cfg.batch
    m = cfg.model
    try:
        if replay.trace is None:
            return synthetic(lengths, cfg.page_size, cfg.k_pages, m.kv_heads, replay.steps,
                             replay.overlap, replay.seed)
        trace = load(replay.trace)
        check(trace, lengths, cfg.page_size, cfg.k_pages, m.kv_heads)
        return trace
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _cache(backend, kv, sel, count, capacity: int):
    if backend.is_gpu:
        from questprof.backends.page_cache_cupy import CupyPageCache

        return CupyPageCache(kv, sel, count, capacity)
    return NumpyPageCache(kv, sel, count, capacity)


class Mirror:
    """The trace's steps replayed by LRUPages, one per (KV head, request): the reference counts."""

    def __init__(self, trace: Trace, capacity: int) -> None:
        self.trace, self.clock = trace, 0
        self.rules = [[LRUPages(capacity) for _ in range(trace.sel.shape[2])]
                      for _ in range(trace.sel.shape[1])]

    def advance(self, to: int) -> tuple[int, int]:
        """Run the steps up to `to`: (hits, misses) of them."""
        hits = misses = 0
        for t in range(self.clock, to):
            sel = self.trace.sel[t % self.trace.steps]
            for h, row in enumerate(self.rules):
                for b, rule in enumerate(row):
                    chosen = sel[h, b][sel[h, b] >= 0]
                    missed = rule.read(chosen)
                    hits, misses = hits + len(chosen) - missed, misses + missed
        self.clock = max(self.clock, to)
        return hits, misses


class CacheReplay:
    """The page caches of a Workload's layers and their launches (module text)."""

    def __init__(self, work, replay: Replay) -> None:
        cfg, b = work.cfg, work.backend
        check_replay(replay, cfg)
        self.work, self.replay, self.trace = work, replay, trace_for(replay, cfg)
        sel, count = b.asarray(self.trace.sel), b.asarray(self.trace.count)
        self.caches = [_cache(b, kv, sel, count, cfg.hbm_pages) for kv in work.kvs]
        for _ in range(self.trace.steps):  # warm: one pass through the trace
            for cache in self.caches:
                cache.step()
        self.mirror = Mirror(self.trace, cfg.hbm_pages)
        self.begin()

    def attention(self, layer: int):
        """One decode step of a layer: the cache's step, then attention over its slots."""
        view, slot_sel, count = self.caches[layer].step()
        return self.work.backend.attention(self.work.q, view, slot_sel, count)

    def quest(self, layer: int):
        """Estimate and top-K (timed, their selection unused), then attention()."""
        b, cfg = self.work.backend, self.work.cfg
        kv = self.work.kvs[layer]
        b.topk(b.estimate(self.work.q, kv, cfg.mode), kv, cfg.k_pages)
        return self.attention(layer)

    def begin(self) -> None:
        """Start a counted window: the mirror catches up with the steps run, counts go to 0."""
        self.work.backend.synchronize()
        self.mirror.advance(self.caches[0].totals()[2])
        for cache in self.caches:
            cache.reset_counts()

    def fields(self) -> dict:
        """Row fields of the window since begin(): the device's counts (every layer), the
        replayed miss rate of the same steps, and the misses' link bytes per layer and step."""
        self.work.backend.synchronize()
        got = [cache.totals() for cache in self.caches]
        hits, misses = sum(g[0] for g in got), sum(g[1] for g in got)
        steps = got[0][2] - self.mirror.clock
        ref_hits, ref_misses = self.mirror.advance(got[0][2])
        m = self.work.cfg.model
        page = 2 * self.work.cfg.page_size * model.vector_bytes(m)  # K and V of one KV head
        calls = max(steps * len(self.caches), 1)
        return {"cache_steps": steps, "cache_hits": hits, "cache_misses": misses,
                "cache_miss_rate": misses / (hits + misses) if hits + misses else None,
                "replayed_miss_rate": ref_misses / (ref_hits + ref_misses)
                if ref_hits + ref_misses else None,
                "cache_link_bytes": misses * page / calls, "reuse_source": self.replay.source,
                "reuse_overlap": overlap(self.trace)}
