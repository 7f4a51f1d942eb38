"""Which kernel variant serves a shape and a cache, from the tables of kernels/constants.cuh (no
CuPy here, so CI checks every rule on a CPU).

A group of g q heads per KV head runs on a tile of QP_GROUPS: the smallest tile >= g, the rows
past g masked (g 3 on 4, 5-7 on 8, 9-15 on 16); a group over the largest tile (multi-query, e.g.
Falcon-7B's 71) is cut into ceil(g / 16) near-equal chunks, one attention CTA row each.
Attention's shared memory and tile length follow kernels/attention_tile.cuh (Ring,
attention_ring_bytes); tests/test_kernels_compile.py compares them with what nvcc computes.
`Tuning`: launch choices read from QP_TUNE at each launch (splits, ring depth, the merge, top-K's
CTA size), so one process times variants side by side (tools/shapes_tuning.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace, fields

from questprof.backends import constants
from questprof.core.fp8 import E4M3

_C = constants.load()
GROUPS = _C["QP_GROUPS"]  # tiles: q heads per attention CTA / per estimate pass over a box
HEAD_DIMS = _C["QP_HEAD_DIMS"]
PAGE_SIZES = _C["QP_PAGE_SIZES"]
MEASURED_HEAD_DIMS, MEASURED_GROUPS = _C["QP_MEASURED_HEAD_DIMS"], _C["QP_MEASURED_GROUPS"]
MEASURED_PAGE_SIZES = _C["QP_MEASURED_PAGE_SIZES"]
BOXES, BOX_HEAD_DIMS = _C["QP_BOXES"], _C["QP_BOX_HEAD_DIMS"]  # quest-boxes:c builds
TK_THREAD_OPTIONS = _C["TK_THREAD_OPTIONS"]  # topk.cu's builds: threads
TK_REG_KEYS = _C["TK_REG_KEYS"]  # and keys per thread of the register form (0: shared memory)
EST_WARPS, EST_NTILES = _C["EST_WARPS"], _C["EST_NTILES"]  # estimate.cu's tensor-core build
EST_TILE_ROWS = 16  # rows (boxes of pages) of one mma tile of the estimate
ATT_WARPS, ATT_MAX_PAGES = _C["ATT_WARPS"], _C["ATT_MAX_PAGES"]
# Deeper attention rings (QP_TUNE stages=N), built at these head dims and tiles only
DEEP_STAGES, DEEP_HEAD_DIMS, DEEP_GROUPS = (_C[f"ATT_DEEP_{x}"] for x in ("STAGES", "HEAD_DIMS",
                                                                      "GROUPS"))
NHD_HEAD_DIMS = _C["ATT_NHD_HEAD_DIMS"]  # token-major pages: attention's and summary's builds
# Shared memory of sm_90 (H100, H200): per SM, and reserved by the driver per CTA; the launcher
# reads the device's own figure where it can (backends/cupy.py).
SMEM_PER_SM, SMEM_RESERVED = 228 * 1024, 1024
# 1 CTA per SM for dense rows of tile t (16-bit cache) that 2 per SM would cut into at least
# FEW_ROW_SPLITS[t] splits. H200, dense 32K B1, 2 -> 1: Qwen2.5-7B 39.4 -> 33.4 us, G 16 59.2
# -> 52.5; llama3-8b (tile 4) 43.2 -> 49.0, FP8 29.2 -> 30.7, so those keep 2 (commit 7e54a70).
# Tile 8 went back to 2 at 2b5e07e (tools/shapes_tuning.py, us, 1 -> 2 per SM): the 70B share
# 128K B8 154.4 -> 136.8, GPT-OSS-20B 32K B1 28.2 -> 25.3, Qwen2.5-7B 32K B1 28.7 -> 28.4 (8, 8
# and 4 rows: 33-66 splits); G 16 32K B1 kept 1 (51.2 against 55.3 at 2). Tile 8 over 1-2 rows
# (the 70B share at batch 1: 132-264 splits) takes 1 again: side by side on 2026-12-02
# (tools/shapes_tuning.py --tunes ctas, 2 -> 1 per SM) its dense 32K B1 24.7 -> 18.4 us, 128K B1
# 37.0 -> 33.7; 8K B1 the same launch; 4-8 rows of tile 8 keep 2 (the 70B share 128K B8 134.7 at
# 2 against 154.2 at 1, GPT-OSS-20B 32K B1 25.6 / 28.2, Qwen2.5-7B 32K B1 28.3 / 28.8).
FEW_ROW_SPLITS = {16: 32, 8: 128}
VEC = 8  # 16-bit values per 16-byte piece (kernels/common.cuh)
TAGS = {"fp16": "fp16", "bf16": "bf16", E4M3: "e4m3"}  # storage tags of kernels/common.cuh
# (queries, K / V cache, summaries) the kernels run: 16-bit caches with their own summaries, FP8
# (e4m3) caches under fp16 / bf16 queries with fp16 or FP8 summaries (core.layout's rule).
CACHES = (("fp16", "fp16", "fp16"), ("bf16", "bf16", "bf16"), ("fp16", E4M3, "fp16"),
          ("fp16", E4M3, E4M3), ("bf16", E4M3, "fp16"), ("bf16", E4M3, E4M3))
# quest-fp8: E4M3 summaries (a scale of their own per KV head) over a 16-bit cache
FP8_SUMMARY_CACHES = (("fp16", "fp16", E4M3), ("bf16", "bf16", E4M3))


@dataclass(frozen=True)
class GroupPlan:
    """How the g q heads of one KV head map onto kernel tiles."""

    tile: int        # G: the template's q heads (a QP_GROUPS entry)
    chunks: int      # attention CTA rows per KV head (1 unless g exceeds the largest tile)
    chunk_size: int  # q heads per chunk (the last chunk may hold fewer)


def plan_group(g: int) -> GroupPlan:
    """The tile and chunks of a group of g q heads per KV head."""
    if g < 1:
        raise ValueError(f"a group needs at least one q head, got {g}")
    chunks = -(-g // GROUPS[-1])
    size = -(-g // chunks)
    return GroupPlan(min(t for t in GROUPS if t >= size), chunks, size)


def shape_problem(head_dim: int, page_size: int | None = None) -> str | None:
    """Why the kernels cannot run this head dim / page size (None when they can)."""
    if head_dim not in HEAD_DIMS:
        near = min(HEAD_DIMS, key=lambda d: (abs(d - head_dim), d))
        return (f"head_dim {head_dim} is not built (the kernels take {_join(HEAD_DIMS)}; "
                f"nearest {near})")
    if page_size is not None and page_size not in PAGE_SIZES:
        return f"page size {page_size} is not built (the kernels take {_join(PAGE_SIZES)})"
    return None


def layout_problem(layout: str, dtype: str, kv_dtype: str, summary_dtype: str,
                   head_dim: int) -> str | None:
    """Why the kernels cannot read a cache of this layout (None when they can): token-major
    pages (NHD) are built for 16-bit caches with their own summaries at NHD_HEAD_DIMS."""
    if layout == "HND":
        return None
    if kv_dtype != dtype or summary_dtype != dtype or dtype not in ("fp16", "bf16"):
        return (f"token-major (NHD) pages are built for fp16 and bf16 caches with their own "
                f"summaries, not a {kv_dtype} cache with {summary_dtype} summaries")
    if head_dim not in NHD_HEAD_DIMS:
        return (f"token-major (NHD) pages are built at head dims {_join(NHD_HEAD_DIMS)}, "
                f"not {head_dim}")
    return None


def _join(values) -> str:
    return ", ".join(map(str, values))


def row_lanes(d: int) -> int:
    """Lanes holding one row of d values, 8 each: d / 8 rounded up to a power of two."""
    lanes = 1
    while lanes < d // VEC:
        lanes *= 2
    return lanes


def measured(d: int, tile: int) -> bool:
    """A variant kept as timed on the H200 (constants.cuh, measured_variant)."""
    return d in MEASURED_HEAD_DIMS and tile in MEASURED_GROUPS


def page_template(d: int, tile: int, page_size: int, kv: str = "fp16",
                  stages: int | None = None) -> int:
    """attention_kernel's S: the page size for measured variants (16-bit caches, the tile's own
    ring depth) at measured page sizes, else 0 (one build that takes the page size at launch)."""
    own = stages is None or stages == constants.per_group("ATT_STAGES", tile)
    fixed = kv != E4M3 and measured(d, tile) and page_size in MEASURED_PAGE_SIZES and own
    return page_size if fixed else 0


def boxes_built(d: int, c: int) -> bool:
    """c boxes per page are built at head dim d (constants.cuh, boxes_built): c 1 everywhere,
    else c of QP_BOXES at QP_BOX_HEAD_DIMS with c x row_lanes(d) <= 32 (one warp per page)."""
    return c == 1 or (c in BOXES and d in BOX_HEAD_DIMS and c * row_lanes(d) <= 32)


def estimate_ntiles(g: int) -> int:
    """NT of estimate_kernel for g q heads per KV head: n-tiles of 8 q heads that hold one chunk
    of the group (chunks of at most 16, plan_group)."""
    return -(-plan_group(g).chunk_size // 8)


def estimate_shared_bytes(d: int, g: int, summary: str) -> int:
    """Dynamic shared memory of an estimate_kernel block: over E4M3 summaries (`summary` a dtype
    or its storage tag) each of its EST_WARPS warps keeps q's B fragments, a 16-byte word per lane
    for each of d / 16 chunks and n-tile (estimate.cu's QHeads, STAGED); none over 16-bit ones."""
    staged = summary in (E4M3, TAGS[E4M3])
    return EST_WARPS * estimate_ntiles(g) * (d // (2 * VEC)) * 32 * 16 if staged else 0


def estimate_blocks(nnz: int, kv_heads: int, boxes: int, g: int, sms: int) -> int:
    """Blocks of estimate_kernel: a warp per unit of EST_TILE_ROWS rows x KV head, at most one
    resident wave (EST_NTILE_BLOCKS per SM), >= 1 for nnz 0."""
    units = -(-nnz * boxes // EST_TILE_ROWS) * kv_heads
    per_sm = _C["EST_NTILE_BLOCKS"][EST_NTILES.index(estimate_ntiles(g))]
    return max(1, min(-(-units // EST_WARPS), per_sm * sms))


def _pieces(d: int, kv: str) -> int:
    """16-byte pieces of a K / V row: d / 8 16-bit values, or d / 16 e4m3 codes."""
    return d // (2 * VEC) if kv == E4M3 else d // VEC


def uses_mma(d: int, tile: int, kv: str = "fp16") -> bool:
    """Tensor-core tile (MmaTile) or CUDA-core tile (CoreTile): attention_tile.cuh's Tile."""
    return tile >= 4 or row_lanes(d) != d // VEC or kv == E4M3


def tile_tokens(d: int, tile: int, kv: str = "fp16") -> int:
    """Tokens of one warp tile (Ring::TT): 32 at d 64, 16 at d 80 to 128, 8 at d 192 and 256;
    twice as many over an e4m3 cache (the same bytes)."""
    lanes = 1
    while lanes < _pieces(d, kv):
        lanes *= 2
    return constants.per_group("ATT_LOADS", tile) * 32 // lanes


def ring_bytes(d: int, tile: int, kv: str = "fp16", stages: int | None = None) -> int:
    """Dynamic shared memory of one attention CTA: ATT_WARPS rings of `stages` stages of K and V
    (None: the tile's ATT_STAGES)."""
    pieces = _pieces(d, kv)
    row_slots = pieces
    if uses_mma(d, tile, kv) and pieces != 4:  # swizzled rows: whole groups of 8 slots
        row_slots = -(-pieces // 8) * 8
    stage = 2 * tile_tokens(d, tile, kv) * row_slots * 16
    return ATT_WARPS * (stages or constants.per_group("ATT_STAGES", tile)) * stage


def static_bytes(d: int, tile: int, kv: str = "fp16") -> int:
    """Static shared memory of attention_kernel as ptxas counts it: a split's page ids and fills,
    the row-done flag, the warps' maxima and sums, and the measured builds' combine arrays (the
    others combine in their rings), rounded up to the ring's 128-byte alignment."""
    words = 2 * ATT_MAX_PAGES + 1 + 2 * ATT_WARPS * tile
    if kv != E4M3 and measured(d, tile):
        words += ATT_WARPS * tile * d
    return -(-4 * words // 128) * 128


SPLIT_RULES = ("ctas", "bytes", "tokens")
MERGES = ("auto", "old", "wide")  # attention's merge of a row's splits (attention_merge.cuh)
# auto: wide for rows of >= 16 splits, dense or sparse (H200, 32K B1: dense Qwen2.5-7B 33.4 ->
# 29.3 us at commit 7e54a70, FP8 29.5 -> 27.5; sparse shared-mean rows of 33-66 splits at
# 664813a: Qwen2.5-7B 12.5 -> 10.9, Llama-3.1-8B 10.7 -> 10.4; per-head rows of 8-9 splits lost
# 0.7-1.0 us with it, MHA 13.8 -> 14.8)
WIDE_MERGE_SPLITS = 16
STAGES = tuple(sorted(set(_C["ATT_STAGES"]) | set(DEEP_STAGES)))  # depths QP_TUNE may name


@dataclass(frozen=True)
class Tuning:
    """Launch choices that take no rebuild by hand. QP_TUNE="split=bytes,value=524288,stages=6"
    (any subset of the fields, comma-separated name=value); unset: the defaults below.

    split: how attention cuts a row's pages into splits: "ctas" (about `ctas` CTAs per SM over
    the grid), "bytes" (the ctas rule, but no split shorter than `value` bytes of K and V: fewer,
    longer splits for few rows and for FP8 caches, whose per-split cost is the same at half the
    bytes) or "tokens" (splits of `value` tokens). Every rule keeps each warp >= 2 tiles and a
    split <= ATT_MAX_PAGES pages.
    ctas: CTAs per SM the rule plans for; 0 = the default (`attention_ctas`). Never more than
    the CTAs whose shared memory fits on an SM.
    stages: depth of attention's per-warp rings; 0 = the tile's ATT_STAGES. A depth is built
    (ATT_DEEP_*) at head dim 128 for tiles 4, 8 and 16; elsewhere the tile's own depth is used.
    merge: a row's last split merges: "old" (dependent rounds of loads), "wide" (every lse, then
    float4 partials, independent loads) or "auto" (wide for dense rows of >= WIDE_MERGE_SPLITS).
    tk_threads: threads of a top-K CTA (one of TK_THREAD_OPTIONS); 0 = the rule of topk_threads.
    tk_keys: keys per thread of top-K's register form (one of TK_REG_KEYS; 0 = the shared-memory
    form); -1 = the rule of topk_form.
    """

    split: str = "ctas"
    ctas: int = 0
    value: int = 0
    stages: int = 0
    merge: str = "auto"
    tk_threads: int = 0
    tk_keys: int = -1

    def __post_init__(self) -> None:
        if self.split not in SPLIT_RULES:
            raise ValueError(f"QP_TUNE split={self.split!r}: expected one of {SPLIT_RULES}")
        if self.merge not in MERGES:
            raise ValueError(f"QP_TUNE merge={self.merge!r}: expected one of {MERGES}")
        if self.stages and self.stages not in STAGES:
            raise ValueError(f"QP_TUNE stages={self.stages}: expected one of {STAGES} "
                             "(0: the tile's own)")
        if self.tk_threads and self.tk_threads not in TK_THREAD_OPTIONS:
            raise ValueError(f"QP_TUNE tk_threads={self.tk_threads}: expected one of "
                             f"{TK_THREAD_OPTIONS} (0: by the rows)")
        if self.tk_keys != -1 and self.tk_keys not in TK_REG_KEYS:
            raise ValueError(f"QP_TUNE tk_keys={self.tk_keys}: expected one of {TK_REG_KEYS} "
                             "(0: keys in shared memory)")
        if self.ctas < 0 or self.value < 0 or (self.split != "ctas" and self.value < 1):
            raise ValueError(f"QP_TUNE: ctas must be >= 0 and value >= 1 for split "
                             f"{self.split!r} (got ctas={self.ctas}, value={self.value})")

    @property
    def name(self) -> str:
        """Short label of the choice, e.g. 'bytes 512K, stages 6'."""
        ctas = f"ctas {self.ctas}" if self.ctas else "ctas auto"
        split = (ctas if self.split == "ctas" else
                 f"{self.split} {_k(self.value)}" + (f" ({ctas})" if self.ctas else ""))
        return (split + (f", stages {self.stages}" if self.stages else "")
                + ("" if self.merge == "auto" else f", merge {self.merge}")
                + (f", top-K {self.tk_threads} threads" if self.tk_threads else "")
                + (f", top-K {self.tk_keys} keys per thread" if self.tk_keys >= 0 else ""))


def _k(n: int) -> str:
    return f"{n >> 10}K" if n >= 1024 and n % 1024 == 0 else str(n)


@functools.cache
def parse_tuning(text: str) -> Tuning:
    """Tuning of a QP_TUNE value ('' = the defaults); ValueError naming a bad item."""
    ints = {f.name for f in fields(Tuning) if f.type == "int"}
    kwargs: dict[str, str | int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or name not in {f.name for f in fields(Tuning)}:
            raise ValueError(f"QP_TUNE item {item!r}: expected name=value with name one of "
                             f"{tuple(f.name for f in fields(Tuning))}")
        value = value.strip()
        try:
            kwargs[name] = _size(value) if name in ints else value
        except ValueError:
            raise ValueError(f"QP_TUNE {name}={value!r}: expected a whole number") from None
    return Tuning(**kwargs)


def _size(text: str) -> int:
    """'524288', '512k' or '1m' (k = 1024)."""
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:].lower(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def current_tuning() -> Tuning:
    """The Tuning of QP_TUNE now (read at each launch, parsed once per value)."""
    return parse_tuning(os.environ.get("QP_TUNE", ""))


# Rows longer than TK_LONG_ROW pages run on the largest top-K CTA while they fit one wave of
# one CTA per SM; everything else on 512 threads. H200, 2026-12-01 at fd29eb7 (tools/
# topk_threads.py, us per layer at 256 / 512 / 1024 threads): 32 x 2048 pages 6.4 / 5.8 / 7.3;
# 32 x 8192 15.2 / 10.0 / 9.4; 128 x 8192 17.5 / 11.6 / 10.8; 256 x 8192 18.5 / 14.8 / 19.0;
# 512 x 8192 27.5 / 27.8 / 36.1.
TK_LONG_ROW = 4096


def topk_threads(rows: int, pages: int, sms: int, tuning: Tuning | None = None) -> int:
    """Threads of topk_kernel's CTA for `rows` rows of at most `pages` pages: QP_TUNE's
    tk_threads, else 1024 for rows over TK_LONG_ROW pages that fit one CTA per SM, else 512."""
    chosen = (tuning or current_tuning()).tk_threads
    if chosen:
        return chosen
    return TK_THREAD_OPTIONS[-1] if pages > TK_LONG_ROW and rows <= sms else TK_THREAD_OPTIONS[1]



# The register form of top-K: (threads, keys per thread), the first that holds the row, for rows
# that fit one wave of CTAs (rows <= SMs) and for rows over one wave; longer rows keep their keys
# in shared memory. H200, tools/topk_latency.py, us per launch in a graph, PDL (notes/KERNELS.md):
# at fe065b0 (2026-12-02) 32 x 2048 pages 3.55 against 5.06 (512 threads, keys in shared memory),
# 64 x 8192 8.08 against 9.94 (1024), 256 x 8192 13.23 against 14.66; at 0d8eeda 512 x 8192 23.33
# against 25.09 (512), and 224 x 2048 5.86 on 256 threads x 8 keys against 7.75 (shared memory,
# 512) and 8.20 (512 x 4 keys). Every form here ran in the gpu-marked suite (test_topk).
TK_ONE_WAVE_FORMS = ((512, 4), (512, 16))
TK_OVER_WAVE_FORMS = ((256, 8), (512, 16))


def topk_form(rows: int, pages: int, sms: int, tuning: Tuning | None = None) -> tuple[int, int]:
    """(threads, keys per thread) of topk_kernel for `rows` rows of at most `pages` pages: keys
    0 for the shared-memory form. QP_TUNE's tk_threads and tk_keys override the rule (tk_threads
    alone: the fewest keys of TK_REG_KEYS that hold the row); tk_keys=0 alone is the launch before
    the register form (topk_threads' CTA size)."""
    tuning = tuning or current_tuning()
    forms = TK_ONE_WAVE_FORMS if rows <= sms else TK_OVER_WAVE_FORMS
    form = next(((t, r) for t, r in forms if t * r >= pages), None)
    if tuning.tk_threads:
        threads = tuning.tk_threads
    elif form is not None and tuning.tk_keys != 0:
        threads = form[0]
    else:  # the shared-memory form, on the CTA size topk_threads gives it
        threads, form = topk_threads(rows, pages, sms, tuning), None
    if tuning.tk_keys >= 0:
        return threads, tuning.tk_keys
    if not tuning.tk_threads:
        return threads, form[1] if form else 0
    keys = [r for r in TK_REG_KEYS if r and threads * r >= pages]
    return threads, keys[0] if keys and form else 0


def token_major_launch(run: AttentionLaunch, tile: int) -> AttentionLaunch:
    """run for token-major (NHD) pages: their builds take the page size at launch and the tile's
    own ring (ATT_NHD_HEAD_DIMS); a deeper ring (QP_TUNE stages) is not built for them."""
    own = constants.per_group("ATT_STAGES", tile)
    if run.stages != own:
        raise ValueError(f"QP_TUNE stages={run.stages} is not built for token-major (NHD) pages "
                         f"(their ring: {own} stages)")
    return replace(run, page=0)


def attention_stages(d: int, tile: int, tuning: Tuning | None = None) -> int:
    """attention_kernel's NS: tuning.stages where that depth is built (ATT_DEEP_*, every cache),
    else the tile's ATT_STAGES."""
    own, want = constants.per_group("ATT_STAGES", tile), (tuning or current_tuning()).stages
    deep = want in DEEP_STAGES and d in DEEP_HEAD_DIMS and tile in DEEP_GROUPS
    return want if deep else own


def attention_ctas(rows: int, sms: int, kv: str = "fp16", dense: bool = True, fit: int = 2,
                   tuning: Tuning | None = None, tile: int = 1) -> int:
    """CTAs per SM the split rule plans for: QP_TUNE's ctas, else 1 for dense launches of few rows
    of a tile in FEW_ROW_SPLITS over a 16-bit cache, else 2; never more than `fit`,
    the CTAs whose shared memory fits on an SM (a plan for 2 where 1 fits would run 2 waves)."""
    t = tuning or current_tuning()
    few = (dense and kv != E4M3 and tile in FEW_ROW_SPLITS
           and 2 * sms // max(rows, 1) >= FEW_ROW_SPLITS[tile])
    return max(1, min(t.ctas or (1 if few else 2), fit))


def attention_splits(rows: int, row_pages: int, page_size: int, tile_tokens: int,
                     token_bytes: int, sms: int, tuning: Tuning | None = None,
                     ctas: int | None = None) -> tuple[int, int]:
    """(splits, pages per split) of attention rows of row_pages pages at about `ctas` CTAs per SM
    (None: attention_ctas of a dense 16-bit launch); token_bytes: K and V bytes of one token of
    one KV head. Floor, not ceil, of the CTAs (32 rows x 9 splits = 288 CTAs was 1.09 waves of
    264 and made dense 32K 195 us on an H200 against 160 us with one wave; 8 splits = 256 CTAs
    fit in one)."""
    t = tuning or current_tuning()
    min_pages = max(1, -(-2 * ATT_WARPS * tile_tokens // page_size))  # each warp >= 2 tiles
    want = max(1, (ctas or attention_ctas(rows, sms, tuning=t)) * sms // rows)
    per_split = -(-row_pages // want)
    if t.split == "bytes":
        per_split = max(per_split, -(-t.value // (page_size * token_bytes)))
    elif t.split == "tokens":
        per_split = -(-t.value // page_size)
    per_split = min(ATT_MAX_PAGES, max(min_pages, per_split))
    return -(-row_pages // per_split), per_split


@dataclass(frozen=True)
class AttentionLaunch:
    """How attention runs rows of one shape: the grid's splits, the kernel's ring and page size."""

    splits: int
    pages_per_split: int
    stages: int   # NS of each warp's ring
    ring: int     # dynamic shared memory bytes per CTA
    page: int     # the S template argument (0: page size at launch)
    ctas: int     # CTAs per SM the splits were planned for
    merge: str = "old"  # the merge the row's last split runs (MERGES)

    @property
    def name(self) -> str:
        """'splits x pages, N stages[, merge wide]': equal names, equal launches."""
        return (f"{self.splits} x {self.pages_per_split}, {self.stages} stages"
                + (", merge wide" if self.merge == "wide" else ""))


def merge_scratch(splits: int, d: int, tile: int) -> int:
    """Floats of ring the wide merge takes: attention_merge.cuh's WideMerge::scratch."""
    cols = tile * d // 4  # float4 columns; slices of the splits: max(1, threads // cols)
    return -(-(splits * tile + tile) // 4) * 4 + (max(1, ATT_WARPS * 32 // cols) - 1) * cols * 4


REGS_PER_SM, REG_WARP_UNIT = 65536, 256  # sm_90: registers per SM, allocated per warp in 256s


def register_fit(regs: int, threads: int) -> int:
    """CTAs of `threads` threads at `regs` registers each whose registers fit one SM."""
    per_warp = -(-regs * 32 // REG_WARP_UNIT) * REG_WARP_UNIT
    return REGS_PER_SM // (per_warp * -(-threads // 32)) if regs > 0 else 1 << 10


def held_ring(run: AttentionLaunch, rows: int, sms: int, regs: int, d: int, tile: int, kv: str,
              smem_per_sm: int = SMEM_PER_SM) -> int:
    """Dynamic shared memory of an attention launch of `rows` rows (its kernel at `regs`
    registers): run.ring, or, where more CTAs than run.ctas would fit an SM and the grid runs
    more than one wave of run.ctas per SM, the least that leaves run.ctas fitting, so the waves
    are the ones the splits were planned for. H200, 2026-12-02 (tools/residency_probe.py, us per
    layer, two calls): Llama-3.1-405B dense 128K B8, 1,024 CTAs of 164 registers ran 3 per SM
    (2.6 waves of 396) in 1,058.4 / 1,048.6 us, held at 2 (3.9 waves of 264) in 1,025.8 / 997.2;
    where registers already hold 2, the same padding gained nothing (FP8 128K B8 3.8% slower in
    the first call, 1.003 in the second: less L1), so it is not applied there."""
    fixed = static_bytes(d, tile, kv) + SMEM_RESERVED
    fits = min(register_fit(regs, ATT_WARPS * 32), smem_per_sm // (run.ring + fixed))
    if fits <= run.ctas or run.splits * rows <= run.ctas * sms:
        return run.ring
    return max(run.ring, smem_per_sm // (run.ctas + 1) + 1 - fixed)


def attention_launch(rows: int, row_pages: int, d: int, tile: int, page_size: int, kv: str,
                     sms: int, dense: bool = True, smem_per_sm: int = SMEM_PER_SM,
                     tuning: Tuning | None = None) -> AttentionLaunch:
    """The launch of `rows` attention rows of row_pages pages (backends/cupy.py, attention)."""
    t = tuning or current_tuning()
    stages = attention_stages(d, tile, t)
    ring = ring_bytes(d, tile, kv, stages)
    fit = smem_per_sm // (ring + static_bytes(d, tile, kv) + SMEM_RESERVED)
    ctas = attention_ctas(rows, sms, kv, dense, fit, t, tile)
    token_bytes = 2 * d * (1 if kv == E4M3 else 2)  # K and V of one token of one KV head
    splits, per_split = attention_splits(rows, row_pages, page_size, tile_tokens(d, tile, kv),
                                         token_bytes, sms, t, ctas)
    wanted = t.merge == "wide" or (t.merge == "auto" and splits >= WIDE_MERGE_SPLITS)
    wide = wanted and splits > 1 and 4 * merge_scratch(splits, d, tile) <= ring
    return AttentionLaunch(splits, per_split, stages, ring,
                           page_template(d, tile, page_size, kv, stages), ctas,
                           "wide" if wide else "old")
