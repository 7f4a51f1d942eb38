"""FlashInfer's rows compute what ours do (GPU, and flashinfer-python installed; else skipped):
its dense decode, its decode over our selections, its top-K and its Quest step against the
float64 reference on small random pools, and each of them captured in a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest

from questprof.core import reference
from questprof.core.config import Config, ModelShape
from questprof.core.layout import from_storage
from questprof.workload import flashinfer as fi

from conftest import TOL, rel_err

pytestmark = pytest.mark.gpu
LAYER = 1  # not the first: each layer's own pages and cache
CASES = {  # q heads, KV heads, mode, dtype, length (page 16, budget 128: 8 pages of 40)
    "mha": (4, 4, "per-head", "fp16", 640),
    "gqa": (8, 2, "per-head", "fp16", 640),
    "shared": (8, 2, "shared-max", "fp16", 640),
    "bf16": (8, 2, "per-head", "bf16", 640),
    "partial-tail": (8, 2, "per-head", "fp16", 637),
}


@pytest.fixture(params=list(CASES))
def case(gpu, request):
    """(workload of 2 layers, B 2, its FlashInfer peer, host float64 inputs of LAYER)."""
    pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    from questprof.workload.pools import Workload

    q_heads, kv_heads, mode, dtype, length = CASES[request.param]
    cfg = Config(ModelShape("t", 2, q_heads, kv_heads, 128, dtype), length, 2, 16, 128, mode)
    work = Workload(cfg, gpu, layers=2)
    kv, host = work.kvs[LAYER], gpu.to_host
    f = lambda x: from_storage(host(x), dtype)  # noqa: E731
    inputs = (f(work.q), f(kv.k), f(kv.v), host(kv.kv_indptr), host(kv.kv_indices),
              host(kv.last_page_len))
    yield work, fi.FlashInferPeer(work), inputs
    gpu.synchronize()


def _np(out) -> np.ndarray:
    import torch

    torch.cuda.synchronize()
    return out.float().cpu().numpy() if out.is_floating_point() else out.cpu().numpy()


def _plain_topk(scores, batch: int, k: int):
    """(sel [Hs, B, K], count [B]): the K best positions by score alone (no tail forced in)."""
    rows = scores.reshape(scores.shape[0], batch, -1)
    return np.sort(np.argsort(-rows, axis=-1, kind="stable")[..., :k], axis=-1).astype(
        np.int32), np.full(batch, k, dtype=np.int32)


def test_dense_is_the_reference(case):
    work, peer, inputs = case
    out = _np(peer.launcher("dense")(LAYER))
    assert rel_err(out, reference.attention(*inputs)[0]) < TOL[work.cfg.model.dtype]


def test_attention_over_our_selection_is_the_reference(case):
    work, peer, inputs = case
    sel, count = (work.backend.to_host(a) for a in work.selections[LAYER])
    out = fi.request_order(peer.launcher("attention")(LAYER), work.cfg.batch)
    want = reference.attention(*inputs, sel, count)[0]
    assert rel_err(_np(out), want) < TOL[work.cfg.model.dtype]


def test_topk_picks_the_best_pages_of_each_row(case):
    """Its top-K over our scores: the K best pages by score of each (head, request), as pages
    of the per-head view (exact: random scores have no ties)."""
    work, peer, inputs = case
    scores = work.backend.to_host(work.scores[LAYER])
    sel, _ = _plain_topk(scores, work.cfg.batch, work.cfg.k_pages)
    heads = sel.shape[0]
    table = fi.row_tables(inputs[3], inputs[4], work.cfg.model.kv_heads, heads)
    want = np.take_along_axis(table, sel.reshape(heads * work.cfg.batch, -1), 1)
    got = _np(peer.launcher("topk")(LAYER))
    assert np.array_equal(np.sort(got, axis=1), np.sort(want, axis=1))


def test_quest_is_the_reference_over_its_own_selection(case):
    work, peer, inputs = case
    if work.cfg.length % work.cfg.page_size:
        with pytest.raises(fi.Unavailable, match="whole pages"):
            peer.launcher("quest")
        return
    sel, count = _plain_topk(work.backend.to_host(work.scores[LAYER]), work.cfg.batch,
                             work.cfg.k_pages)
    out = fi.request_order(peer.launcher("quest")(LAYER), work.cfg.batch)
    want = reference.attention(*inputs, sel, count)[0]
    assert rel_err(_np(out), want) < TOL[work.cfg.model.dtype]


def test_every_row_is_captured_and_replayed_as_a_cuda_graph(case):
    """bench and sweep time a graph of each pass: the Quest step's replay (its decode reads
    the top-K output whose address the graph holds) still gives the reference."""
    import cupy

    from questprof.measure.timing import _Streams, capture, time_layers

    work, peer, inputs = case
    stages = [s for s in fi.STAGES if s != "quest" or not work.cfg.length % work.cfg.page_size]
    for stage in stages:
        t = time_layers(work.backend, peer.launcher(stage), 2, 1, 2, graph=True, uses_torch=True)
        assert t.method == "cuda-graph" and t.note is None, (stage, t.note)
    if "quest" not in stages:
        return
    run, got, stream = peer.launcher("quest"), {}, cupy.cuda.Stream(non_blocking=True)
    with _Streams(stream, True):
        run(LAYER)
        stream.synchronize()
        replay = capture(lambda: got.setdefault("out", run(LAYER)), stream, True)
        replay()
        stream.synchronize()
    sel, count = _plain_topk(work.backend.to_host(work.scores[LAYER]), work.cfg.batch,
                             work.cfg.k_pages)
    want = reference.attention(*inputs, sel, count)[0]
    out = fi.request_order(got["out"], work.cfg.batch)
    assert rel_err(_np(out), want) < TOL[work.cfg.model.dtype]


def test_a_group_its_decode_is_not_built_for_is_refused_in_one_line(gpu):
    """FlashInfer's CUDA-core decode is built for groups 1, 2, 3, 4, 8: a group of 16 fails,
    and the row's reason is its own message on one line."""
    pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    import flashinfer
    import torch

    cuda = torch.device("cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(fi.WORKSPACE_BYTES, dtype=torch.uint8, device=cuda), "HND")
    k = torch.randn(4, 1, 16, 128, dtype=torch.float16, device=cuda)
    ints = lambda *x: torch.tensor(x, dtype=torch.int32, device=cuda)  # noqa: E731
    with pytest.raises(Exception) as err:
        wrapper.plan(ints(0, 4), ints(0, 1, 2, 3), ints(16), 16, 1, 128, 16,
                     q_data_type=torch.float16)
        wrapper.run(torch.randn(1, 16, 128, dtype=torch.float16, device=cuda), (k, k))
        torch.cuda.synchronize()
    why = fi.refusal(err.value)
    assert "\n" not in why and "16" in why, why
