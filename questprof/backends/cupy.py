"""The CuPy backend: the Quest stages as CUDA kernels from kernels/*.cu (RawModule, NVRTC).

Three layers per kernel: `load_kernel` (cached module of one template instance), a launcher named
after the stage (checks shapes and dtypes once, launch_args.check_call; allocates outputs,
computes the grid, launches its params struct, backends/params.py, on the current CuPy stream
without synchronising) and `CupyBackend`, the protocol in backends/base.py. `run_<stage>` is a
launcher after its checks, which the Quest step and the selectors' forms call once checked.
Launch constants (threads, ring depth, blocks per SM) come from kernels/constants.cuh through
backends/constants.py, the same numbers the kernels are compiled with. `quest` chains estimate,
top-K and attention with programmatic dependent launch (backends/pdl.py) where it is available.
"""

from __future__ import annotations

import contextlib
import functools

import cupy
import numpy as np

from questprof import KERNELS_DIR
from questprof.backends import constants, params, pdl, variants
from questprof.backends.launch_args import NO_RULE, TopkRule, attention_rows, check_call, check_kv
from questprof.backends.pdl import Launcher, PlainLaunch
from questprof.backends.replay import Called, Recorder, Replay
from questprof.core.fp8 import E4M3
from questprof.core.layout import AppendPlan, PagedKV
from questprof.core.stages import MODES

_C = constants.load()
GROUPS, HEAD_DIMS, PAGE_SIZES = variants.GROUPS, variants.HEAD_DIMS, variants.PAGE_SIZES
ATT_WARPS = _C["ATT_WARPS"]
SUM_THREADS = _C["SUM_THREADS"]  # summary.cu's CTA (its __launch_bounds__)
TK_SMEM_LIMIT = 200 * 1024  # rows up to 51200 pages keep their keys in shared memory
# Stages of quest() whose kernels release the next grid right after their own grid_wait; the
# others let it launch as they end. H200, us per layer (MHA 32K-2048 / 128K-4096 / 32K B8): plain
# launches 33.2 / 67.6 / 148.5; PDL releasing early in all three 36.0 / 73.5 / 150.9; in top-K
# only (attention loads q and its row plan while top-K selects) 32.0 / 66.5 / 146.1.
QUEST_EARLY_RELEASE = ("topk",)
_plain = PlainLaunch()


@functools.cache
def _module(stage: str, expression: str, defines: tuple[str, ...] = ()) -> cupy.RawModule:
    """RawModule of kernels/<stage>.cu holding one kernel instance; errors name the real file."""
    source = (KERNELS_DIR / f"{stage}.cu").read_text(encoding="utf-8")
    code = f'#line 1 "kernels/{stage}.cu"\n{source}'
    options = ("-std=c++17", f"-I{KERNELS_DIR}", *(f"-D{d}" for d in defines))
    return cupy.RawModule(code=code, options=options, name_expressions=(expression,))


@functools.cache
def load_kernel(stage: str, expression: str, defines: tuple[str, ...] = ()) -> cupy.RawKernel:
    """The kernel `expression` (a template instance or extern "C" name) of kernels/<stage>.cu,
    built with the preprocessor `defines` ("NAME=VALUE")."""
    return _module(stage, expression, defines).get_function(expression)


@functools.cache
def _registers(stage: str, expression: str, defines: tuple[str, ...] = ()) -> int:
    """Registers per thread of a loaded kernel (asked of the driver once)."""
    return int(load_kernel(stage, expression, defines).num_regs)


@functools.cache
def _sm_count() -> int:
    return int(cupy.cuda.Device().attributes["MultiProcessorCount"])


@functools.cache
def _smem_per_sm() -> int:
    attrs = cupy.cuda.Device().attributes
    return int(attrs.get("MaxSharedMemoryPerMultiprocessor", variants.SMEM_PER_SM))


def _device_int32(x):
    return x if isinstance(x, cupy.ndarray) else cupy.asarray(np.asarray(x, dtype=np.int32))


def summary(kv: PagedKV, plan: AppendPlan, launch=_plain) -> None:
    """Apply `plan` to kv.summary [N, Hkv, 2, d] in place (slots [first, end) of each page)."""
    _, kv_tag, summary_tag = check_kv(kv)
    if len(plan) == 0:
        return
    if not isinstance(plan.end, cupy.ndarray):
        first, end = np.asarray(plan.first), np.asarray(plan.end)
        if (first < 0).any() or (end > kv.page_size).any() or (first >= end).any():
            raise ValueError(f"plan slots must satisfy 0 <= first < end <= {kv.page_size}")
    run_summary(kv, kv.summary, (kv_tag, summary_tag), plan, launch=launch)


def run_summary(kv: PagedKV, summ, tags: tuple[str, str], plan: AppendPlan, summ_scale=None,
                boxes: int = 1, launch=_plain) -> None:
    """summary.cu over `plan` into summ (storage tag tags[1] of cache tag tags[0]); the caller
    has checked kv and the plan (summary above, cupy_selectors.summary)."""
    page_ids, first, end = (_device_int32(x) for x in (plan.page_ids, plan.first, plan.end))
    p = params.pack(params.SUMMARY, cache=params.paged_cache(kv), summ=summ,
                    summ_scale=summ_scale, page_ids=page_ids, first=first, end=end)
    nhd = str(kv.layout == "NHD").lower()  # token-major pages, read in place
    kernel = load_kernel("summary",
                         f"summary_kernel<{tags[0]}, {tags[1]}, {kv.head_dim}, {boxes}, {nhd}>")
    launch(kernel, (len(plan),), (SUM_THREADS,), (p,), stage="summary")


def run_estimate(q, kv: PagedKV, cache, summ, tags: tuple[str, str], mode: str, group: int,
                 summ_scale=None, boxes: int = 1, launch=_plain):
    """Scores [Hs, nnz] float32 of summaries `summ` ([N, Hkv, (boxes,) 2, d], storage tag
    tags[1] under queries of tag tags[0]; `summ_scale` float32 [Hkv] for E4M3 summaries): the
    estimate of plain Quest and of the selectors' forms, after the caller's checks
    (launch_args.check_call); `cache` is params.paged_cache(kv)."""
    nnz, d, m = int(kv.kv_indices.size), kv.head_dim, MODES.index(mode)
    scores = cupy.empty((q.shape[1] if mode == "per-head" else kv.kv_heads, nnz),
                        dtype=cupy.float32)
    nt = variants.estimate_ntiles(group)
    expr = f"estimate_kernel<{tags[0]}, {tags[1]}, {d}, {nt}, {boxes}>"
    blocks = variants.estimate_blocks(nnz, kv.kv_heads, boxes, group, _sm_count())
    smem = variants.estimate_shared_bytes(d, group, tags[1])
    kernel = load_kernel("estimate", expr, launch.defines("estimate"))
    kernel.max_dynamic_shared_size_bytes = smem
    p = params.pack(params.ESTIMATE, cache=cache, summ=summ, summ_scale=summ_scale,
                    scores=scores, nnz=nnz, group=group, mode=m,
                    box_tokens=kv.page_size // boxes)
    launch(kernel, (blocks,), (variants.EST_WARPS * 32,), (p, q), shared_mem=smem,
           stage="estimate")  # q beside the struct: kernels/estimate.cu says why
    return scores


def estimate(q, kv: PagedKV, mode: str = "per-head", launch=_plain):
    """Scores U_p(q) [Hs, nnz] float32 (Hs = Hq per-head, Hkv for the shared modes)."""
    c = check_call(kv, q, mode)
    return run_estimate(q, kv, params.paged_cache(kv), kv.summary, (c.tags[0], c.tags[2]), mode,
                        c.group, _summary_scale(kv), launch=launch)


def _summary_scale(kv: PagedKV):
    """The scale of E4M3 summaries (an FP8 cache's k_scale), None otherwise."""
    return kv.k_scale if kv.is_fp8 else None


def topk(scores, kv: PagedKV, k_pages: int, sinks: int = 0, window: int = 0, launch=_plain,
         rule: TopkRule = NO_RULE):
    """(sel [Hs, B, K] int32 ascending positions, -1 padded; count [B] int32, or [Hs, B] for a
    dynamic budget `rule`: the pages of each row it keeps of the K best)."""
    check_call(kv, scores=scores, budget=(k_pages, sinks, window), cache=False)
    return run_topk(scores, kv, params.paged_cache(kv), k_pages, sinks, window, launch, rule)


def run_topk(scores, kv: PagedKV, cache, k_pages: int, sinks: int = 0, window: int = 0,
             launch=_plain, rule: TopkRule = NO_RULE):
    """topk above after the caller's checks (launch_args.check_call: scores, budget, and a
    dynamic rule's, which it returns)."""
    heads, batch = int(scores.shape[0]), kv.batch
    sel = cupy.empty((heads, batch, k_pages), dtype=cupy.int32)
    count = cupy.empty((heads, batch) if rule.code else batch, dtype=cupy.int32)
    pages = max(kv.pages())
    threads, regs = variants.topk_form(heads * batch, pages, _sm_count())
    keys = 0 if threads * regs >= pages else pages * 4  # in registers, or in shared memory
    cached = 0 < keys <= TK_SMEM_LIMIT
    smem = max(keys if cached else 0, rule.shared_bytes(k_pages))
    kernel = load_kernel("topk", f"topk_kernel<{threads}, {regs}>", launch.defines("topk"))
    kernel.max_dynamic_shared_size_bytes = smem
    p = params.pack(params.TOPK, cache=cache, scores=cupy.ascontiguousarray(scores), sel=sel,
                    count=count, nnz=int(kv.kv_indices.size), k_pages=k_pages, sinks=sinks,
                    window=window, cached=int(cached), rule=rule.code, param=rule.param,
                    scaling=rule.scaling)
    launch(kernel, (batch, heads), (threads,), (p,), shared_mem=smem, stage="topk")
    return sel, count


def attention(q, kv: PagedKV, sel=None, count=None, launch=_plain):
    """(out [B, Hq, d] storage dtype, lse [B, Hq] float32); dense over all pages when sel is None.

    count is [B] or [Hs, B]; a (request, head) with no selected page gets out 0 and lse -inf.
    """
    c = check_call(kv, q)
    return run_attention(q, kv, params.paged_cache(kv), c.tags, c.group, sel, count, launch)


def run_attention(q, kv: PagedKV, cache, tags, group: int, sel=None, count=None, launch=_plain):
    """attention above after the caller's checks of q and kv (launch_args.check_call; tags its
    tags); the selection is checked here, where the rows are planned (attention_rows)."""
    q_heads = int(q.shape[1])
    plan, per_q, row_pages, k_sel = attention_rows(q_heads, group, kv, sel, count)
    d, G, s = kv.head_dim, plan.tile, kv.page_size
    rows = kv.batch * kv.kv_heads * plan.chunks
    run = variants.attention_launch(rows, max(row_pages, 1), d, G, s, kv.kv_dtype, _sm_count(),
                                    sel is None, _smem_per_sm())
    out = cupy.empty(q.shape, dtype=q.dtype)
    lse = cupy.empty((kv.batch, q_heads), dtype=cupy.float32)
    ws_o = ws_lse = row_done = None
    if run.splits > 1:
        ws_o = cupy.empty((rows, run.splits, G, d), dtype=cupy.float32)
        ws_lse = cupy.empty((rows, run.splits, G), dtype=cupy.float32)
        row_done = _counts("splits_done", rows)
    if kv.layout == "NHD":  # token-major pages: built with the page size at launch, own ring
        run = variants.token_major_launch(run, G)
    expr = (f"attention_kernel<{tags[0]}, {tags[1]}, {d}, {run.page}, {G}, {run.stages}, "
            f"{str(kv.layout == 'NHD').lower()}>")
    defines = launch.defines("attention")
    kernel = load_kernel("attention", expr, defines)
    shared = variants.held_ring(run, rows, _sm_count(), _registers("attention", expr, defines),
                                d, G, kv.kv_dtype, _smem_per_sm())
    # never lowered: a graph captured with a held (larger) launch may replay after a smaller one
    kernel.max_dynamic_shared_size_bytes = max(kernel.max_dynamic_shared_size_bytes, shared)
    p = params.pack(params.ATTENTION, cache=cache, q=q, sel=sel,
                    count=None if sel is None else count, out=out, lse=lse, ws_o=ws_o,
                    ws_lse=ws_lse, row_done=row_done, q_heads=q_heads, chunks=plan.chunks,
                    chunk_size=plan.chunk_size, sel_per_q=per_q, k_sel=k_sel,
                    count_per_head=int(sel is not None and count.ndim == 2),
                    pages_per_split=run.pages_per_split, merge=int(run.merge == "wide"),
                    scale_log2=params.scale_log2(d))
    launch(kernel, (run.splits, rows), (ATT_WARPS * 32,), (p,), shared_mem=shared,
           stage="attention")
    return out, lse


def quest(q, kv: PagedKV, k_pages: int, mode: str = "per-head", sinks: int = 0, window: int = 0,
          launch=_plain):
    """One Quest decode step, estimate -> top-K -> sparse attention: (out [B, Hq, d], lse [B, Hq]).

    Every check runs once, then the three launches share one PagedCache. With a PDL `Launcher`,
    each kernel starts while the one before drains, reading only the step's inputs (page tables,
    q) before its grid_wait. Two other implementations were measured and left the code, slower
    everywhere on an H200 (notes/KERNELS.md): estimate and top-K as one kernel, and attention
    whose CTAs selected their own rows' pages (two launches).
    """
    c = check_call(kv, q, mode, budget=(k_pages, sinks, window))
    cache = params.paged_cache(kv)
    scores = run_estimate(q, kv, cache, kv.summary, (c.tags[0], c.tags[2]), mode, c.group,
                          _summary_scale(kv), launch=launch)
    sel, count = run_topk(scores, kv, cache, k_pages, sinks, window, launch=launch)
    return run_attention(q, kv, cache, c.tags, c.group, sel, count, launch=launch)


_COUNTS: dict[tuple[int, str], cupy.ndarray] = {}
_OUTGROWN: list[cupy.ndarray] = []  # counters a larger call replaced: a replay may hold them


def _counts(name: str, size: int) -> cupy.ndarray:
    """Per-device int32 counters `name` (attention's splits done per row): zeroed once and left
    at zero by every launch, so launches on one stream share them (concurrent streams would
    not). Outgrown ones are kept, never freed: a recorded launch (backends/replay.py) holds
    their address."""
    key = (cupy.cuda.Device().id, name)
    if key not in _COUNTS or _COUNTS[key].size < size:  # from the default pool, not a recording's
        if key in _COUNTS:
            _OUTGROWN.append(_COUNTS[key])
        with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
            _COUNTS[key] = cupy.zeros(max(size, 1 << 16), dtype=cupy.int32)
    return _COUNTS[key]


class CupyBackend:
    """Every stage as a CUDA kernel; launches are asynchronous on the current CuPy stream.

    `quest_path` says how `quest` launches: 'pdl' (programmatic dependent launch through
    cuda.bindings) or 'plain: <why not>' (ordinary launches), then ', 3 kernels'.
    """

    name = "cupy"
    is_gpu = True
    kv_dtypes = ("fp16", "bf16", E4M3)  # caches it runs (FP8: fp16 or e4m3 summaries)

    def __init__(self, pdl: bool = True) -> None:
        self.fallback_reason: str | None = None
        self._launch = Launcher(enabled=pdl, early=QUEST_EARLY_RELEASE)
        self._plain = _plain  # the single stages' launcher (a Recorder while recording)
        self._pool = None  # the recordings' memory pool (backends/replay.py)
        _counts("splits_done", 1)  # now, not inside a CUDA-graph capture

    @property
    def launch(self):
        """The launcher quest() uses (PDL where available): for the selectors' forms
        (backends/cupy_selectors.py) to run their step the same way."""
        return self._launch

    @property
    def quest_path(self) -> str:
        return f"{self._launch.path}, 3 kernels"

    def put(self, host_kv: PagedKV) -> PagedKV:
        return host_kv.with_arrays(cupy.asarray)

    def asarray(self, host_array):
        return cupy.asarray(host_array)

    def to_host(self, array):
        return cupy.asnumpy(array)

    def synchronize(self) -> None:
        cupy.cuda.get_current_stream().synchronize()

    def summary(self, kv: PagedKV, plan: AppendPlan) -> None:
        summary(kv, plan, launch=self._plain)

    def estimate(self, q, kv: PagedKV, mode: str = "per-head"):
        return estimate(q, kv, mode, launch=self._plain)

    def topk(self, scores, kv: PagedKV, k_pages: int, sinks: int = 0, window: int = 0):
        return topk(scores, kv, k_pages, sinks, window, launch=self._plain)

    def attention(self, q, kv: PagedKV, sel=None, count=None):
        return attention(q, kv, sel, count, launch=self._plain)

    def quest(self, q, kv: PagedKV, k_pages: int, mode: str = "per-head", sinks: int = 0,
              window: int = 0):
        return quest(q, kv, k_pages, mode, sinks, window, launch=self._launch)

    @contextlib.contextmanager
    def recording(self):
        """Every launch of this backend inside the block runs and is kept (the list it yields,
        in order), its temporaries from the recordings' own memory pool (backends/replay.py)."""
        if self._pool is None:
            self._pool = cupy.cuda.MemoryPool()
        kept: list = []
        saved = self._launch, self._plain
        self._launch, self._plain = Recorder(self._launch, kept), Recorder(self._plain, kept)
        try:
            with cupy.cuda.using_allocator(self._pool.malloc):
                yield kept
        finally:
            self._launch, self._plain = saved

    def replay(self, launches: list, moved: dict[str, int]) -> Replay:
        """`launches` (a recording's) made again with the pointers `moved` names moved."""
        return Replay(launches, moved, _prepared)


def _prepared(launch):
    """One recorded launch ready to make again: through the driver (pdl.Prepared), or CuPy's
    kernel call where cuda.bindings is missing."""
    if pdl.driver_or_none() is None:
        return Called(launch)
    return pdl.Prepared(launch.kernel, launch.grid, launch.block, launch.args, launch.shared_mem,
                        launch.pdl)
