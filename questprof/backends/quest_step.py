"""The Quest step as one persistent kernel (kernels/quest_step.cu): its launcher.

`quest_step` checks the shape against what is built (`launch_args.persistent_problem`), sizes one
resident wave of CTAs, the attention splits and the workspace, and launches on the current CuPy
stream without synchronising. Its state (ticket, counts, flags) is one per-device buffer that is
zeroed once and left at zero by every launch, so launches on one stream, CUDA-graph replays
included, share it (concurrent streams would not).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import cupy
import numpy as np

from questprof.backends import constants, variants
from questprof.backends import cupy as ops
from questprof.backends.launch_args import (DEFAULT_TUNING, STOPS, StepTuning, check_budget,
                                           check_kv, check_q, persistent_problem,
                                           persistent_ring_bytes, persistent_splits)
from questprof.backends.pdl import Launcher, PlainLaunch, _driver

_C = constants.load()
PS_THREADS, PS_CTAS_PER_SM = _C["PS_THREADS"], _C["PS_CTAS_PER_SM"]
PS_MAX_SPLIT_PAGES = _C["PS_MAX_SPLIT_PAGES"]
STAGE = "quest_step"  # the stage name its PDL launcher knows it by
_i32 = np.int32
_plain = PlainLaunch()
UNSCORED = _C["PS_UNSCORED"]  # a score not yet written (a signalling NaN's bits)
_SCORES: dict = {}
LINE = _C["PS_LINE"]  # int32 per line: the state's ticket and each ready flag own one


def step_launcher(pdl: bool = True) -> Launcher:
    """PDL launches of quest_step that release the next grid at once (its CTAs find room only as
    this grid's leave); plain launches where PDL is unavailable."""
    return Launcher(enabled=pdl, stages=(STAGE,), early=(STAGE,))


@functools.cache
def _blocks_per_sm(expression: str, defines: tuple[str, ...], smem: int, threads: int,
                   ctas: int) -> int:
    """Resident CTAs per SM of a build, as the driver computes them (cuda.bindings), at most
    `ctas` (what __launch_bounds__ and the shared memory are sized for); `ctas` where the driver
    cannot be asked. Any grid is correct: this only sizes the wave."""
    function = getattr(ops.load_kernel(STAGE, expression, defines), "kernel", None)
    if function is None:  # a stand-in for CuPy (tests/cupy_stub.py): no driver function to ask
        return ctas
    try:
        driver = _driver()
        err, blocks = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            driver.CUfunction(function.ptr), threads, smem)
    except ImportError:  # no cuda.bindings here
        return ctas
    except RuntimeError:  # cuda.bindings' words for a libcuda it cannot open or that lacks the call
        return ctas
    if err != driver.CUresult.CUDA_SUCCESS or blocks < 1:
        return ctas
    return min(ctas, int(blocks))


def _unscored(size: int) -> cupy.ndarray:
    """The step's per-device scores buffer, every word PS_UNSCORED (quest_step.cuh): a select
    ticket polls its row until the estimate has stored each score, then puts the word back, so a
    launch leaves it as it found it (launches on one stream share it, as they share the state)."""
    key = (cupy.cuda.Device().id, STAGE)
    if key not in _SCORES or _SCORES[key].size < size:
        _SCORES[key] = cupy.full(max(size, 1 << 16), UNSCORED, dtype=cupy.uint32).view(
            cupy.float32)
    return _SCORES[key][:size]


def quest_step(q, kv, k_pages: int, mode: str = "per-head", sinks: int = 0, window: int = 0,
               launch=_plain, grid: int | None = None, split_pages: int | None = None,
               tuning: StepTuning = DEFAULT_TUNING):
    """One Quest step in one kernel: (out [B, Hq, d], lse [B, Hq], sel [Hq, B, K], count [B]),
    the values of quest() in three kernels (sel, count bit for bit; out, lse bit for bit at the
    same split_pages, else within the dtype's tolerance). grid: CTAs (default one resident wave);
    split_pages: pages per attention split (default launch_args.persistent_splits'); tuning: the
    build (StepTuning)."""
    return step_outputs(q, kv, k_pages, mode, sinks, window, launch, grid, split_pages,
                        tuning)[:4]


def step_outputs(q, kv, k_pages: int, mode: str = "per-head", sinks: int = 0, window: int = 0,
                 launch=_plain, grid: int | None = None, split_pages: int | None = None,
                 tuning: StepTuning = DEFAULT_TUNING, stop: str = "all", trace=None):
    """quest_step's (out, lse, sel, count) and the scores [Hq, nnz] float32 it selected from.
    stop: "all", or "estimate" / "select" to run only the estimate (and select) tickets (out,
    lse, and with "estimate" sel and count, are then left unwritten: tools/quest_step_probe.py
    times the phases). The scores are the selection's input only with stop "estimate": otherwise
    each select ticket has put its row back to UNSCORED. trace: None, or a StepTrace that gets
    the launch's timeline (tools/quest_step_probe.py)."""
    q_tag, _, _ = check_kv(kv)
    check_budget(k_pages, sinks, window)
    q_heads, g = check_q(q, kv)
    d, s, batch, nnz = kv.head_dim, kv.page_size, kv.batch, int(kv.kv_indices.size)
    problem = persistent_problem(q_heads, kv.kv_heads, d, kv.kv_dtype, kv.summary_dtype, mode,
                                 kv.dtype)
    if problem:
        raise ValueError(problem)
    if stop not in STOPS:
        raise ValueError(f"stop ({stop!r}) must be one of {', '.join(STOPS)}")
    smem = persistent_ring_bytes(d)
    tile = variants.plan_group(g).tile  # the estimate's; attention runs q heads on tile 1
    expression = f"quest_step_kernel<{q_tag}, {d}, {tile}>"
    defines = launch.defines(STAGE) + tuning.defines()
    kernel = ops.load_kernel(STAGE, expression, defines)
    kernel.max_dynamic_shared_size_bytes = smem
    per_sm = _blocks_per_sm(expression, defines, smem, tuning.threads, tuning.ctas_per_sm)
    wave = per_sm * ops._sm_count()
    rows, row_pages = batch * q_heads, max(1, min(k_pages, max(kv.pages())))
    if split_pages is None:
        tickets = max(1, round((grid or wave) * tuning.att_waves))
        splits, split_pages = persistent_splits(rows, row_pages, s, d, tickets)
    elif not 1 <= split_pages <= PS_MAX_SPLIT_PAGES:
        raise ValueError(f"split_pages {split_pages} must be in 1..{PS_MAX_SPLIT_PAGES}")
    else:
        splits = -(-row_pages // split_pages)
    grid = max(1, grid or wave)
    if trace is not None:
        trace.grid, trace.selects, trace.splits = grid, rows, splits
        trace.words = cupy.zeros(3 * grid + 3 * rows * (1 + splits), dtype=cupy.uint64)
    scores = (cupy.empty((q_heads, nnz), dtype=cupy.float32) if stop == "estimate"
              else _unscored(q_heads * nnz).reshape(q_heads, nnz))
    sel = cupy.empty((q_heads, batch, k_pages), dtype=cupy.int32)
    count = cupy.empty(batch, dtype=cupy.int32)
    out = cupy.empty(q.shape, dtype=q.dtype)
    lse = cupy.empty((batch, q_heads), dtype=cupy.float32)
    ws_o = ws_lse = ops._NULL
    if splits > 1:
        ws_o = cupy.empty((rows, splits, d), dtype=cupy.float32)
        ws_lse = cupy.empty((rows, splits), dtype=cupy.float32)
    state = ops._counts(STAGE, LINE * (1 + batch * q_heads) + batch * q_heads)
    launch(kernel, (grid,), (tuning.threads,), (
        q, kv.summary, kv.k, kv.v, kv.kv_indptr, kv.kv_indices, kv.last_page_len, scores, sel,
        count, out, lse, ws_o, ws_lse, state, _i32(batch), _i32(q_heads), _i32(kv.kv_heads),
        _i32(nnz), _i32(k_pages), _i32(sinks), _i32(window), _i32(splits), _i32(split_pages),
        _i32(s.bit_length() - 1), np.float32(math.log2(math.e) / math.sqrt(d)),
        _i32(STOPS[stop]), _i32(tuning.queue_ctas), ops._NULL if trace is None else trace.words),
        shared_mem=smem, stage=STAGE)
    return out, lse, sel, count, scores


@dataclass
class StepTrace:
    """A launch's timeline (Trace of quest_step.cuh), filled by step_outputs: words [3 x grid]
    (per CTA its start, the end of its estimate share, its end), then [3 x tickets] (per ticket its
    start, middle and end: `selects` select tickets, then selects x splits attention tickets);
    nanoseconds of the GPU's global timer."""

    grid: int = 0
    selects: int = 0
    splits: int = 0
    words: object = None
