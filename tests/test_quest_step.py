"""The Quest step as one persistent kernel (kernels/quest_step.cu): the three-kernel step's scores'
selection bit for bit, its outputs within the dtype's tolerance of the three-kernel step's and of
the float64 reference (its warps each run a split of their own), the same bits launch after
launch, any grid size (the waits cannot deadlock), and CUDA-graph replays without a memset. CPU:
what it is built for."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TOL, make_case, poison, rel_err
from questprof.backends import launch_args
from questprof.core import reference
from questprof.core.layout import PagedKV, from_storage, random_queries, to_storage

gpu_only = pytest.mark.gpu


def _check(gpu, kv, q, k_pages, sinks=0, window=0, launches=2, **step):
    """quest_step against estimate -> topk -> attention: selection and count bit for bit; out and
    lse within the tolerance of the three-kernel step's and of the float64 reference (the step's
    warps each run a split of their own, so its sums round in another order). Each launch after
    the first runs on the state the one before left, and gives the same bits."""
    from questprof.backends import cupy as ops
    from questprof.backends.quest_step import quest_step

    dev_kv, dev_q = gpu.put(kv), gpu.asarray(q)
    scores = ops.estimate(dev_q, dev_kv)
    sel, count = ops.topk(scores, dev_kv, k_pages, sinks, window)
    want = [gpu.to_host(x) for x in (*ops.attention(dev_q, dev_kv, sel, count), sel, count)]
    first = None
    for _ in range(launches):
        poison()
        got = [gpu.to_host(x) for x in quest_step(dev_q, dev_kv, k_pages, "per-head", sinks,
                                                   window, **step)]
        np.testing.assert_array_equal(got[2], want[2])
        np.testing.assert_array_equal(got[3], want[3])
        for g, f in zip(got, first or got):
            np.testing.assert_array_equal(g, f)
        first = got
    f = lambda x: from_storage(x, kv.dtype)  # noqa: E731
    ref_out, ref_lse = reference.attention(f(q), f(kv.k), f(kv.v), kv.kv_indptr, kv.kv_indices,
                                           kv.last_page_len, want[2], want[3])
    assert rel_err(f(got[0]), ref_out) < TOL[kv.dtype]
    assert rel_err(f(got[0]), f(want[0])) < TOL[kv.dtype]
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(got[1]), finite)
    assert rel_err(got[1][finite], ref_lse[finite]) < 1e-5
    return got


@gpu_only
@pytest.mark.parametrize("pages,k_pages,heads", [(2048, 128, 4), (8192, 256, 2)])
def test_long_rows_of_32k_and_128k(gpu, rng, pages, k_pages, heads):
    """The benchmark's rows (2048 pages, budget 128; 8192, budget 256) at fewer heads."""
    kv = make_case(rng, [16 * pages - 5], 16, heads, 128, "fp16")
    _check(gpu, kv, random_queries(rng, 1, heads, 128, "fp16"), k_pages)


@gpu_only
@pytest.mark.parametrize("dtype,d,s", [("fp16", 128, 16), ("bf16", 64, 8)])
@pytest.mark.parametrize("k_pages", [1, 5, 64])
def test_tails_one_page_and_one_token_rows(gpu, rng, dtype, d, s, k_pages):
    """One-token request, tails 1, S-1, S, S+1, one page, rows long enough to split; K = 1 keeps
    the tail page alone."""
    lengths = [1, s - 1, s, s + 1, 37 * s + 3, 300 * s + 5]
    kv = make_case(rng, lengths, s, 4, d, dtype, spare_pages=5)
    _check(gpu, kv, random_queries(rng, len(lengths), 4, d, dtype), k_pages)


@gpu_only
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (6, 2)])
def test_gqa_per_head(gpu, rng, q_heads, kv_heads):
    """4 and 3 (masked on the tile of 4) q heads per KV head, each its own selection and row."""
    kv = make_case(rng, [16 * 500 + 9, 16 * 3, 1, 16 * 90 + 15], 16, kv_heads, 128, "fp16",
                   spare_pages=5)
    _check(gpu, kv, random_queries(rng, 4, q_heads, 128, "fp16"), 32)


@gpu_only
@pytest.mark.parametrize("grid", [1, 3])
def test_a_grid_of_one_or_three_ctas_does_not_deadlock(gpu, rng, grid):
    """Every ticket of a few CTAs: each waits only on tickets taken before its own."""
    lengths = [16 * 90 + 5, 3, 16 * 7, 16 * 33 + 1] + list(rng.integers(1, 40, size=12))
    kv = make_case(rng, lengths, 16, 4, 128, "fp16", spare_pages=5)
    _check(gpu, kv, random_queries(rng, len(lengths), 4, 128, "fp16"), 6, grid=grid)


@gpu_only
@pytest.mark.parametrize("queue_ctas", [0, 1, 1000])
def test_scores_are_left_unscored_and_any_queue_ctas(gpu, rng, queue_ctas):
    """Each select ticket puts its row back to PS_UNSCORED (the next launch polls it), also where
    every page is chosen; the estimate phase writes its own buffer, so steps after it still
    select; 0, 1 or all but one CTA start on the queue (1000: clamped to the grid less one)."""
    import cupy

    from questprof.backends.quest_step import UNSCORED, step_outputs

    kv = make_case(rng, [16 * 300 + 7, 5, 16 * 64], 16, 4, 128, "fp16", spare_pages=5)
    q = random_queries(rng, 3, 4, 128, "fp16")
    tuning = launch_args.StepTuning(queue_ctas=queue_ctas)
    first = _check(gpu, kv, q, 64, launches=1, tuning=tuning)
    dev_kv, dev_q = gpu.put(kv), gpu.asarray(q)
    estimate = step_outputs(dev_q, dev_kv, 64, tuning=tuning, stop="estimate")[4]
    assert not np.isnan(gpu.to_host(estimate)).any()
    *got, scores = step_outputs(dev_q, dev_kv, 64, tuning=tuning)
    np.testing.assert_array_equal(gpu.to_host(scores.view(cupy.uint32)), UNSCORED)
    for g, w in zip(got[:4], first):
        np.testing.assert_array_equal(gpu.to_host(g), w)


@gpu_only
def test_budget_over_every_page_is_dense(gpu, rng):
    from questprof.backends import cupy as ops
    from questprof.backends.quest_step import quest_step

    kv = make_case(rng, [16 * 40 + 3, 16 * 9], 16, 4, 128, "fp16")
    q = random_queries(rng, 2, 4, 128, "fp16")
    dev_kv, dev_q = gpu.put(kv), gpu.asarray(q)
    out, lse, _, count = (gpu.to_host(x) for x in quest_step(dev_q, dev_kv, 64))
    dense, dense_lse = (gpu.to_host(x) for x in ops.attention(dev_q, dev_kv))
    np.testing.assert_array_equal(count, [41, 9])
    assert rel_err(from_storage(out, "fp16"), from_storage(dense, "fp16")) < TOL["fp16"]
    assert rel_err(lse, dense_lse) < 1e-6


@gpu_only
def test_sinks_window_and_integer_ties(gpu, rng):
    """Reserved pages, and scores of small integers (ties go to the lower position)."""
    kv = make_case(rng, [16 * 700 + 9, 16 * 64], 16, 2, 64, "fp16")
    box = np.sort(rng.integers(-2, 3, size=kv.summary.shape), axis=2)  # min <= max, as summaries
    kv.summary[...] = to_storage(box.astype(np.float64), "fp16")
    q = to_storage(rng.integers(-1, 2, size=(2, 2, 64)).astype(np.float64), "fp16")
    _check(gpu, kv, q, 40, sinks=1, window=2)


@gpu_only
def test_a_request_without_pages(gpu, rng):
    """A context-parallel shard can hold no page of a request: count 0, -1s, out 0, lse -inf."""
    kv = make_case(rng, [16 * 40 + 3, 16 * 9], 16, 2, 128, "fp16")
    empty = PagedKV(kv.k, kv.v, kv.summary, np.array([0, 41, 41, 50], dtype=np.int32),
                    kv.kv_indices, np.array([3, 16, 16], dtype=np.int32), (16 * 40 + 3, 0, 16 * 9),
                    16, "fp16")
    got = _check(gpu, empty, random_queries(rng, 3, 2, 128, "fp16"), 4)
    assert got[3][1] == 0 and (got[2][:, 1] == -1).all() and (got[0][1] == 0).all()


@gpu_only
def test_pdl_launches_give_the_same_bits(gpu, rng):
    from questprof.backends.quest_step import step_launcher

    kv = make_case(rng, [16 * 300 + 3, 17, 1], 16, 4, 128, "fp16")
    _check(gpu, kv, random_queries(rng, 3, 4, 128, "fp16"), 16, launch=step_launcher())


@gpu_only
def test_three_replays_of_a_captured_graph(gpu, rng):
    """Three layers' steps in one CUDA graph (PDL edges inside), replayed back to back: each
    replay runs on the state the one before left (no memset) and gives the eager result."""
    import cupy

    from questprof.backends.quest_step import quest_step, step_launcher

    launch = step_launcher()
    layers = [make_case(rng, [16 * 400 + 5, 33], 16, 8, 128, "fp16") for _ in range(3)]
    dev = [(gpu.put(kv), gpu.asarray(random_queries(rng, 2, 8, 128, "fp16"))) for kv in layers]
    run = lambda: [quest_step(q, kv, 32, launch=launch) for kv, q in dev]  # noqa: E731
    eager = [[gpu.to_host(x) for x in step] for step in run()]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        run()  # compile and fill the pool before the capture
        stream.synchronize()
        stream.begin_capture()
        outs = run()
        graph = stream.end_capture()
        for _ in range(3):
            for step in outs:
                for a in step:
                    a.fill(0)
            graph.launch(stream)
            stream.synchronize()
            for step, want in zip(outs, eager):
                for a, w in zip(step, want):
                    np.testing.assert_array_equal(gpu.to_host(a), w)


PROBE_BUILDS = [n for n in launch_args.TUNINGS if n != "default"]
# One entry per distinct build (lag is a launch argument) other than the default one, which the
# kernel objects already hold (tests/kernel_objects.py): what nvcc compiles below.
DISTINCT_BUILDS = list({d: n for n in PROBE_BUILDS
                        if (d := launch_args.TUNINGS[n].defines())}.values())


@gpu_only
@pytest.mark.parametrize("name", PROBE_BUILDS)
def test_each_probe_build_on_a_long_row_and_the_edges(gpu, rng, name):
    """Every build tools/quest_step_probe.py times (launch_args.TUNINGS), at KV heads a multiple
    of its block: a long row, then tails 1, S-1, S, S+1 and a one-token request on a grid of 3
    CTAs; its estimate-and-select phase gives the same selection."""
    from questprof.backends import cupy as ops
    from questprof.backends.quest_step import step_outputs

    tuning = launch_args.TUNINGS[name]
    heads = 4
    pages = 2048 if heads <= 8 else 512
    kv = make_case(rng, [16 * pages - 5], 16, heads, 128, "fp16")
    _check(gpu, kv, random_queries(rng, 1, heads, 128, "fp16"), 128, tuning=tuning, launches=1)
    lengths = [1, 15, 16, 17, 16 * 37 + 3, 16 * 300 + 5]
    kv = make_case(rng, lengths, 16, heads, 128, "fp16", spare_pages=5)
    q = random_queries(rng, len(lengths), heads, 128, "fp16")
    _check(gpu, kv, q, 5, tuning=tuning, grid=3)
    dev_kv, dev_q = gpu.put(kv), gpu.asarray(q)
    want = ops.topk(ops.estimate(dev_q, dev_kv), dev_kv, 5)
    got = step_outputs(dev_q, dev_kv, 5, tuning=tuning, stop="select")
    for g, w in zip(got[2:4], want):
        np.testing.assert_array_equal(gpu.to_host(g), gpu.to_host(w))


# ---- CPU: what the persistent step is built for, and its launch plan ----

def test_persistent_problem_names_what_is_not_built():
    problem = launch_args.persistent_problem
    assert problem(32, 32, 128, "fp16", "fp16", "per-head") is None
    assert problem(32, 8, 64, "bf16", "bf16", "per-head", "bf16") is None
    assert problem(32, 32, 128, "fp16", "fp16", "shared-max") is None  # one q head per KV head
    assert "shared-mean at 4" in problem(32, 8, 128, "fp16", "fp16", "shared-mean")
    assert "not 96" in problem(32, 32, 96, "bf16", "bf16", "per-head")
    assert "not 16" in problem(128, 8, 128, "bf16", "bf16", "per-head")
    assert "not fp8_e4m3" in problem(32, 8, 128, "fp8_e4m3", "fp16", "per-head", "bf16")


def test_splits_of_the_benchmark_shapes():
    """32K MHA batch 1, 396 tickets (132 SMs x 3 CTAs): 128 chosen pages of 32 rows in 12 splits
    of 11; 128K: 12 of 22; three tickets per CTA of 132 x 2: 16 of 8; a split holds at least two
    tiles of each of the 4 warps, at most 128 pages."""
    assert launch_args.persistent_splits(32, 128, 16, 128, 396) == (12, 11)
    assert launch_args.persistent_splits(32, 256, 16, 128, 396) == (12, 22)
    assert launch_args.persistent_splits(32, 128, 16, 128, 792) == (16, 8)
    assert launch_args.persistent_splits(4, 3, 16, 128, 396) == (1, 8)  # a warp's two tiles
    assert launch_args.persistent_splits(1, 4096, 16, 128, 8) == (32, 128)
    assert launch_args.persistent_ring_bytes(128) == launch_args.persistent_ring_bytes(64) == 65536


def test_probe_builds_and_launches():
    """The default build takes no -D option; each probe entry differs from the others in its
    build or its launch arguments (queue CTAs, attention waves: no -D)."""
    tunings, default = launch_args.TUNINGS, launch_args.DEFAULT_TUNING
    assert tunings["default"].defines() == () and tunings["default"] == default
    launch = lambda t: (t.queue_ctas, t.att_waves)  # noqa: E731
    assert all(t.defines() or launch(t) != launch(default)
               for n, t in tunings.items() if n != "default")
    assert len({(t.defines(), launch(t)) for t in tunings.values()}) == len(tunings)
    assert tunings["threads-128x3"].defines() == ("QS_THREADS=128", "QS_CTAS=3")
    assert tunings["queue-0"].defines() == () and tunings["queue-0"].queue_ctas == 0


def test_probe_builds_compile(tmp_path):
    """Each probe build of the step (fp16, d 128, tile 1: what the probe times) compiles for
    sm_90 with nvcc, as CI compiles the default builds (tests/test_kernels_compile.py, which
    holds the probe's default build)."""
    import shutil
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from questprof import KERNELS_DIR

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.fail("nvcc is not on PATH: CI must compile kernels/*.cu (install the CUDA toolkit)")
    src = tmp_path / "probe.cu"
    src.write_text('#include "quest_step.cu"\n'
                   "void probe_build() { (void)&quest_step_kernel<fp16, 128, 1>; }\n")

    def build(name):
        defines = [f"-D{d}" for d in launch_args.TUNINGS[name].defines()]
        return name, subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", f"-I{KERNELS_DIR}",
                                     *defines, "-cubin", str(src), "-o",
                                     str(tmp_path / f"{name}.cubin")],
                                    capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, result in pool.map(build, DISTINCT_BUILDS):
            assert result.returncode == 0, (name, result.stderr)
