"""The Quest step as one call, quest(q, kv, k_pages, mode): equal to estimate, topk and attention
composed, and to the float64 reference of each stage on the selection it makes."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TOL, make_case, poison, rel_err
from questprof.backends.numpy import NumpyBackend
from questprof.core import reference
from questprof.core.layout import from_storage, random_queries
from questprof.core.stages import MODES

STAGES = ("estimate", "topk", "attention")  # backends.pdl.STAGES (needs CuPy)

on_gpu = pytest.mark.gpu


def _case(rng, lengths, s, q_heads, kv_heads, d, dtype):
    kv = make_case(rng, lengths, s, kv_heads, d, dtype, spare_pages=5)
    return kv, random_queries(rng, len(lengths), q_heads, d, dtype)


def _reference_step(kv, q, scores, k_pages, mode, sinks=0, window=0):
    """The float64 reference of each stage: estimate against `scores`' precision, then top-K and
    attention on the float32 scores the backend computed (near-ties rank the same way)."""
    f = lambda x: from_storage(x, kv.dtype)  # noqa: E731
    want_scores = reference.estimate(f(q), f(kv.summary), kv.kv_indptr, kv.kv_indices, mode)
    assert rel_err(scores, want_scores) < 1e-5
    sel, count = reference.topk(scores, kv.kv_indptr, k_pages, sinks, window)
    out, lse = reference.attention(f(q), f(kv.k), f(kv.v), kv.kv_indptr, kv.kv_indices,
                                   kv.last_page_len, sel, count)
    return (sel, count), (out, lse)


def _check_against_reference(backend, kv, q, k_pages, mode, sinks=0, window=0):
    """quest() = the composed stages exactly, and = the reference within the dtype's tolerance."""
    dev_kv, dev_q = backend.put(kv), backend.asarray(q)
    if backend.is_gpu:
        poison()
    out, lse = backend.quest(dev_q, dev_kv, k_pages, mode, sinks, window)
    scores = backend.estimate(dev_q, dev_kv, mode)
    sel, count = backend.topk(scores, dev_kv, k_pages, sinks, window)
    c_out, c_lse = backend.attention(dev_q, dev_kv, sel, count)
    host = backend.to_host
    np.testing.assert_array_equal(host(out), host(c_out))
    np.testing.assert_array_equal(host(lse), host(c_lse))
    (want_sel, want_count), (want_out, want_lse) = _reference_step(
        kv, q, host(scores), k_pages, mode, sinks, window)
    np.testing.assert_array_equal(host(sel), want_sel)
    np.testing.assert_array_equal(host(count), want_count)
    assert rel_err(from_storage(host(out), kv.dtype), want_out) < TOL[kv.dtype]
    assert rel_err(host(lse), want_lse) < 1e-5


# ---- every backend: the NumPy one here, the CuPy one under the gpu marker ----

def test_numpy_quest_is_the_composed_reference(rng):
    kv, q = _case(rng, [1, 15, 16, 17, 16 * 40 + 3], 16, 8, 2, 64, "fp16")
    for mode in MODES:
        _check_against_reference(NumpyBackend(), kv, q, 4, mode)


def test_numpy_quest_path_and_sinks_window(rng):
    backend = NumpyBackend()
    assert backend.quest_path == "composed"
    kv, q = _case(rng, [16 * 30 + 1, 9], 16, 4, 4, 64, "bf16")
    _check_against_reference(backend, kv, q, 8, "per-head", sinks=1, window=2)


def test_numpy_quest_with_budget_over_all_pages_is_dense(rng):
    backend = NumpyBackend()
    kv, q = _case(rng, [16 * 5 + 2, 3], 16, 4, 2, 64, "fp16")
    out, lse = backend.quest(q, kv, 64, "shared-max")
    dense, dense_lse = backend.attention(q, kv)
    assert rel_err(from_storage(out, "fp16"), from_storage(dense, "fp16")) < 1e-3
    assert rel_err(lse, dense_lse) < 1e-6


# ---- the CuPy pipeline (PDL where cuda.bindings and the driver allow it) ----

@on_gpu
def test_quest_path_is_reported(gpu, rng):
    """'pdl' where cuda.bindings imports and the GPU is sm_90 or newer, else 'plain: <why>';
    then the step's form."""
    import importlib.util

    import cupy

    kv, q = _case(rng, [16 * 20 + 1], 16, 4, 4, 128, "fp16")
    gpu.quest(gpu.asarray(q), gpu.put(kv), 4)
    pdl_here = (importlib.util.find_spec("cuda.bindings") is not None
                and int(cupy.cuda.Device().compute_capability) >= 90)
    path, form = gpu.quest_path.rsplit(", ", 1)
    assert path == "pdl" if pdl_here else path.startswith("plain: ")
    assert form == "3 kernels"


@on_gpu
@pytest.mark.parametrize("dtype,d,s", [("fp16", 128, 16), ("bf16", 128, 8), ("fp16", 64, 32),
                                       ("bf16", 64, 64)])
@pytest.mark.parametrize("k_pages", [1, 5, 64])
def test_tails_ragged_mha(gpu, rng, dtype, d, s, k_pages):
    """One-token request, tails 1, S-1, S, S+1, one page, and rows long enough to split."""
    lengths = [1, s - 1, s, s + 1, 37 * s + 3, 300 * s + 5]
    kv, q = _case(rng, lengths, s, 4, 4, d, dtype)
    _check_against_reference(gpu, kv, q, k_pages, "per-head")


@on_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (8, 4), (16, 2), (32, 4)])
def test_gqa_modes(gpu, rng, mode, q_heads, kv_heads):
    kv, q = _case(rng, [16 * 500 + 9, 16 * 3, 1, 16 * 90 + 15], 16, q_heads, kv_heads, 128, "fp16")
    _check_against_reference(gpu, kv, q, 32, mode)


@on_gpu
@pytest.mark.parametrize("sinks,window", [(1, 0), (2, 3)])
def test_sinks_and_window(gpu, rng, sinks, window):
    kv, q = _case(rng, [16 * 200 + 7, 16 * 9, 5], 16, 4, 2, 128, "bf16")
    _check_against_reference(gpu, kv, q, 16, "shared-mean", sinks, window)


@on_gpu
def test_long_rows_batch_one(gpu, rng):
    """The benchmark's shape at a smaller head count: 2048 pages, budget 128 pages."""
    kv, q = _case(rng, [16 * 2048], 16, 4, 4, 128, "fp16")
    _check_against_reference(gpu, kv, q, 128, "per-head")


VARIANTS = [(STAGES, STAGES), (STAGES, ()), (STAGES, ("topk",)),
            (("topk", "attention"), ("topk", "attention")), ((), ())]


@on_gpu
@pytest.mark.parametrize("stages,early", VARIANTS)
def test_launch_variants_give_the_same_bits(rng, stages, early):
    """Every PDL variant (which stages carry the attribute, which release early) of the step =
    the step launched plain."""
    from questprof.backends import cupy as ops
    from questprof.backends.pdl import Launcher

    launch = Launcher(stages=stages, early=early)
    kv, q = _case(rng, [16 * 300 + 3, 17, 1], 16, 8, 2, 128, "fp16")
    dev_kv, dev_q = ops.CupyBackend().put(kv), ops.cupy.asarray(q)
    for mode in MODES:
        want = [ops.cupy.asnumpy(x) for x in ops.quest(dev_q, dev_kv, 16, mode)]
        got = [ops.cupy.asnumpy(x) for x in ops.quest(dev_q, dev_kv, 16, mode, launch=launch)]
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    plain = ops.CupyBackend(pdl=False)
    assert plain.quest_path.startswith("plain: ")


@on_gpu
def test_graph_capture_of_steps_equals_eager(gpu, rng):
    """Several steps captured in one CUDA graph (PDL edges inside) replay to the eager result
    (each replay needs the row counts attention's last splits left at zero)."""
    import cupy

    layers = [_case(rng, [16 * 400 + 5, 33], 16, 8, 8, 128, "fp16") for _ in range(3)]
    dev = [(gpu.put(kv), gpu.asarray(q)) for kv, q in layers]
    eager = [[gpu.to_host(x) for x in gpu.quest(q, kv, 32)] for kv, q in dev]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for kv, q in dev:  # compile and fill the pool before the capture
            gpu.quest(q, kv, 32)
        stream.synchronize()
        stream.begin_capture()
        outs = [gpu.quest(q, kv, 32) for kv, q in dev]
        graph = stream.end_capture()
        for _ in range(3):  # replays back to back: each must see the last one's counters reset
            for x in outs:
                for a in x:
                    a.fill(0)
            graph.launch(stream)
            stream.synchronize()
            for (out, lse), (want_out, want_lse) in zip(outs, eager):
                np.testing.assert_array_equal(gpu.to_host(out), want_out)
                np.testing.assert_array_equal(gpu.to_host(lse), want_lse)
