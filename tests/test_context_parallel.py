"""Context-parallel Quest equals single-device Quest: simulated ranks and real gloo ranks."""

import numpy as np
import pytest

from questprof.core import sharding as cp
from questprof.core import layout, reference as ref
from questprof.backends.numpy import NumpyBackend


def _case(seed, lengths, page_size=8, kv_heads=2, q_heads=4, d=16):
    rng = np.random.default_rng(seed)
    kv = layout.random_paged_kv(rng, lengths, page_size, kv_heads, d, "fp32", spare_pages=5,
                                tail_fill=np.nan)
    NumpyBackend().summary(kv, layout.append_plan(kv.kv_indptr, kv.kv_indices, kv.last_page_len,
                                                  kv.lengths, page_size))
    return kv, layout.random_queries(rng, len(lengths), q_heads, d, "fp32")


def _single(kv, q, k_pages, mode):
    backend = NumpyBackend()
    sel, count = backend.topk(backend.estimate(q, kv, mode), kv, k_pages)
    out, lse = backend.attention(q, kv, sel, count)
    return out, lse, sel, count


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("mode", ref.MODES)
def test_exact_global_topk_and_merge_equal_single_device(world, mode):
    kv, q = _case(world, [100, 7, 1, 33], 8)
    out, lse, sel, count = _single(kv, q, 4, mode)
    out2, lse2, sel2, count2 = cp.simulate(NumpyBackend(), q, kv, 4, world, mode)
    np.testing.assert_array_equal(sel2, sel)
    np.testing.assert_array_equal(count2, count)
    np.testing.assert_allclose(out2, out, rtol=0, atol=1e-6)
    np.testing.assert_allclose(lse2, lse, rtol=0, atol=1e-5)


def test_shards_cover_every_page_once():
    pages = np.array([1, 5, 16, 17])
    shards = [cp.shard_bounds(pages, 3, r) for r in range(3)]
    assert (shards[0].lo == 0).all() and (shards[-1].hi == pages).all()
    for a, b in zip(shards, shards[1:]):
        assert (a.hi == b.lo).all()


def test_merge_ignores_empty_partials():
    out = np.stack([np.ones((1, 2, 4)), np.zeros((1, 2, 4))]).astype(np.float32)
    lse = np.array([[[0.5, 1.0]], [[-np.inf, -np.inf]]], dtype=np.float32)
    merged, mlse = cp.merge(out, lse, "fp32")
    np.testing.assert_array_equal(merged, np.ones((1, 2, 4)))
    np.testing.assert_array_equal(mlse, lse[0])


def test_cheap_variant_misses_are_counted():
    kv, q = _case(5, [200, 64], 8, kv_heads=2, q_heads=2)
    backend = NumpyBackend()
    _, _, sel, count = _single(kv, q, 8, "per-head")
    shards = [cp.shard_bounds(kv.pages(), 4, r) for r in range(4)]
    scores = []
    for s in shards:
        part = cp.local_kv(kv, s)
        scores.append((backend.estimate(q, part), part.kv_indptr))
    kept = cp.local_only(scores, shards, kv.pages(), 8)
    rate = cp.miss_rate(sel, count, kept)
    assert 0.0 <= rate < 1.0
    assert cp.miss_rate(sel, count, [[set(range(p)) for p in kv.pages()]] * 2) == 0.0


@pytest.mark.parametrize("mode", ref.MODES)
def test_held_work_splits_the_single_device_reads(mode):
    """Ranks' summary pages and selected tokens add up to one device's; one device's tokens are
    the valid tokens of the union of each KV head's picks."""
    kv, q = _case(4, [100, 7, 1, 33], 8, kv_heads=2, q_heads=4)
    _, _, sel, count = _single(kv, q, 4, mode)
    whole = cp.held_work(kv, cp.shard_bounds(kv.pages(), 1, 0), sel, count, 2)
    parts = [cp.held_work(kv, cp.shard_bounds(kv.pages(), 3, r), sel, count, 2) for r in range(3)]
    assert tuple(map(sum, zip(*parts))) == whole
    assert whole[0] == sum(kv.pages()) * 2
    group, want = sel.shape[0] // 2, 0
    for b, pages in enumerate(kv.pages()):
        for h in range(2):
            for p in set(sel[h * group:(h + 1) * group, b, :count[b]].ravel().tolist()):
                want += kv.last_page_len[b] if p == pages - 1 else kv.page_size
    assert whole[1] == want


def test_gloo_ranks_equal_single_device():
    torch = pytest.importorskip("torch", reason="torch (CPU) is installed by .ci/run")
    assert torch.distributed.is_available()
    from questprof.commands import context_parallel as distributed

    cfg = dict(length=300, batch=2, page_size=16, kv_heads=2, q_heads=4, head_dim=16, dtype="fp32")
    results = distributed.launch(2, cfg, k_pages=5, seed=3, dist_backend="gloo", steps=2)
    kv, q = distributed._build(cfg, 3)
    out, lse, sel, count = _single(kv, q, 5, "per-head")
    for rank, out2, lse2, sel2, samples in results:
        np.testing.assert_array_equal(sel2, sel)
        np.testing.assert_allclose(out2, out, rtol=0, atol=1e-6)
        assert {"gather_candidates", "gather_partials"} <= set(samples[0])
    host = distributed.host_figures(cfg, 3, 2, 5, "per-head", results[0][3])
    assert host["single_read_bytes"] / 2 <= host["gpu_read_bytes_max"] < host["single_read_bytes"]


@pytest.mark.gpu
def test_nccl_ranks_equal_single_gpu(gpu):
    """Two GPUs over NCCL pick exactly the single-GPU page sets and match its output (fp16)."""
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs for NCCL ranks")
    from questprof.commands import context_parallel as distributed

    cfg = dict(length=20000, batch=2, page_size=16, kv_heads=8, q_heads=32, head_dim=128,
               dtype="fp16")
    results = distributed.launch(2, cfg, k_pages=64, seed=5, dist_backend="nccl", steps=2)
    kv, q = distributed._build(cfg, 5)
    whole, qd = gpu.put(kv), gpu.asarray(q)
    sel, count = gpu.topk(gpu.estimate(qd, whole, "per-head"), whole, 64)
    want = gpu.to_host(gpu.attention(qd, whole, sel, count)[0]).astype(np.float64)
    for _, out, _, sel2, _ in results:
        np.testing.assert_array_equal(sel2, gpu.to_host(sel))
        err = np.linalg.norm(out.astype(np.float64) - want) / np.linalg.norm(want)
        assert err < 1e-3
