"""Where the cache lives: HBM bytes and link bytes of every stage, per tier (the one formula).

A configuration's `kv_tier` puts the K and V pages in HBM or in host memory reached over the
host link (PCIe); its `summary_tier` does the same for the page summaries (host summaries need
a host cache: summaries of a cache in HBM held on the host would cross the link to choose pages
that are already on the GPU). `hbm_pages` C > 0 keeps a cache of C pages per (request, KV
head) in HBM, least recently selected out: only its misses cross the link, at `miss_rate`.

Per stage (bytes per layer, whole batch; core.model.stage_work's read, unmodelled, write):
- summary (decode append): the new key crosses when the cache is on the host, the old
  min/max and the new ones when the summaries are;
- estimate: the summaries (T_index) cross when they live on the host;
- topk: HBM only;
- attention: the chosen pages (T_selected) cross times the miss rate; hits are read from the
  HBM page cache. `fetch` says how the misses arrive: `zero-copy` (attention reads mapped host
  memory in place: no HBM bytes for them) or `gather` (the copy engine writes them to an HBM
  staging pool that attention then reads: 2x their bytes in HBM). Zero-copy under per-head
  selection moves every q head's own K pages (G x K per KV head), not their union: in HBM the
  group's q heads share pages through L2, over the link they did not (measured on the H200,
  2026-12-02: model.per_head_kv_read);
- dense: every page crosses (a cache of C < P pages under a scan of all P pages hits nothing).

Every link byte is a read by the GPU except the summary append's new min/max written back to
host summaries (`link_write`): what a PCIe read counter sees is `link_read` (measure/link.py).

So link rho (Quest's link bytes over dense's) = K/P x miss rate, + M_s/M / S when the summaries
are on the host too. Scores, selections, q and outputs stay in HBM.
"""

from __future__ import annotations

from dataclasses import dataclass

from questprof.core import model

TIERS = ("hbm", "host")
FETCHES = ("zero-copy", "gather")
# Why the peers (torch SDPA, FlashInfer) have no rows over the host tier: they read caches of
# their own in HBM, so beside our host-tier rows they would compare HBM with the link.
PEERS_REASON = ("the peers read their own caches in HBM; over the host tier only our kernels "
                "read host memory (dense over the host tier is our dense row)")
NO_REUSE = 1.0  # the miss rate where nothing is measured: random pools have no step-to-step reuse


@dataclass(frozen=True)
class TierBytes:
    """Bytes of one stage per layer (whole batch): `hbm` read + written in HBM (`hbm_read` of
    them read: what a DRAM read counter sees), `link` over the host link (host to GPU reads and
    GPU to host writes), `link_write` the writes among them."""

    stage: str
    hbm: float
    link: float
    link_write: float = 0.0
    hbm_read: float | None = None

    @property
    def link_read(self) -> float:
        """The bytes the GPU reads from host memory (what a PCIe read counter sees)."""
        return self.link - self.link_write


def kv_tier(cfg) -> str:
    """The configuration's KV tier ('hbm' for configurations made before tiers existed)."""
    return getattr(cfg, "kv_tier", "hbm")


def summary_tier(cfg) -> str:
    """The configuration's summary tier ('hbm' by default)."""
    return getattr(cfg, "summary_tier", "hbm")


def check_miss_rate(miss_rate: float) -> float:
    """miss_rate if it lies in 0..1, else ValueError."""
    if not 0.0 <= miss_rate <= 1.0:
        raise ValueError(f"miss rate {miss_rate} is outside 0..1")
    return float(miss_rate)


def _split(work: model.StageWork, on_link: float, extra_read: float = 0.0,
           written: float = 0.0, replaces: float | None = None) -> TierBytes:
    """A stage whose `on_link` bytes cross the link (`written` of them GPU to host) in place of
    `replaces` of its HBM bytes (on_link unless said); the rest stay in HBM, where a staging
    copy adds `extra_read` bytes written and as many read again."""
    replaced = on_link if replaces is None else replaces
    return TierBytes(work.stage, work.total_bytes - replaced + 2 * extra_read, on_link, written,
                     work.total_read - (replaced - written) + extra_read)


def _attention_link(cfg, work: model.StageWork, miss: float, fetch: str) -> TierBytes:
    """Sparse attention over host pages: the misses cross the link, `gather` writes them to an
    HBM staging pool read again there; zero-copy under per-head selection moves each q head's
    own pages (model.per_head_kv_read: mapped host memory is not shared through L2 as HBM is)
    in place of the union it reads in HBM."""
    missed = work.read * miss
    if fetch == "gather":
        return _split(work, missed, extra_read=missed)
    if cfg.mode == "per-head" and cfg.model.group > 1:
        return _split(work, model.per_head_kv_read(cfg) * miss, replaces=missed)
    return _split(work, missed)


def tier_bytes(cfg, miss_rate: float = NO_REUSE, fetch: str = "gather",
               union_pages: float | None = None) -> dict[str, TierBytes]:
    """{stage: TierBytes} of every stage in core.stages.STAGES for cfg's tiers (module text)."""
    if fetch not in FETCHES:
        raise ValueError(f"unknown fetch {fetch!r}: expected one of {FETCHES}")
    miss = check_miss_rate(miss_rate) if getattr(cfg, "hbm_pages", 0) else NO_REUSE
    work = model.stage_work(cfg, union_pages)
    if kv_tier(cfg) == "hbm":
        return {s: TierBytes(s, w.total_bytes, 0.0, hbm_read=w.total_read)
                for s, w in work.items()}
    host_summaries = summary_tier(cfg) == "host"
    m, b = cfg.model, cfg.batch
    key = b * m.kv_heads * model.vector_bytes(m)
    summ = work["summary"]
    summary_link = key + ((summ.read - key) + summ.write if host_summaries else 0.0)
    est = work["estimate"]
    written = summ.write if host_summaries else 0.0  # the new min/max, back to host memory
    return {"summary": _split(summ, summary_link, written=written),
            "estimate": _split(est, est.read if host_summaries else 0.0),
            "topk": _split(work["topk"], 0.0),
            "attention": _attention_link(cfg, work["attention"], miss, fetch),
            "dense": _split(work["dense"], work["dense"].read)}


def quest_tier_bytes(cfg, miss_rate: float = NO_REUSE, fetch: str = "gather",
                     union_pages: float | None = None) -> TierBytes:
    """One Quest step (estimate + topk + attention) of a layer over cfg's tiers."""
    parts = tier_bytes(cfg, miss_rate, fetch, union_pages)
    steps = [parts[s] for s in ("estimate", "topk", "attention")]
    return TierBytes("quest", sum(p.hbm for p in steps), sum(p.link for p in steps),
                     sum(p.link_write for p in steps), sum(p.hbm_read for p in steps))


def link_rho(cfg, miss_rate: float = NO_REUSE, union_pages: float | None = None,
             fetch: str = "gather") -> float:
    """Quest's link bytes over dense's over the host tier: K/P x miss (+ M_s/M/S for host
    summaries), exact tokens (G x K/P for per-head zero-copy); 0 when the cache is in HBM."""
    if kv_tier(cfg) == "hbm":
        return 0.0
    quest = quest_tier_bytes(cfg, miss_rate, fetch, union_pages=union_pages)
    return quest.link / tier_bytes(cfg)["dense"].link


def link_seconds(link_bytes: float, ceiling_gbs: float) -> float:
    """Seconds `link_bytes` take at a link ceiling of `ceiling_gbs` GB/s (10^9 bytes)."""
    if ceiling_gbs <= 0:
        raise ValueError(f"link ceiling {ceiling_gbs} GB/s must be positive")
    return link_bytes / (ceiling_gbs * 1e9)


def tier_seconds(parts: TierBytes, link_gbs: float, hbm_gbs: float) -> float:
    """A stage's modelled seconds over the tiers: its link bytes at the link ceiling, then its
    HBM bytes at the HBM read ceiling (in sequence: a page cache's misses land before
    attention reads the slots)."""
    return link_seconds(parts.link, link_gbs) + link_seconds(parts.hbm, hbm_gbs)
