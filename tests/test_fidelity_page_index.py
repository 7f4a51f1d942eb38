"""The page index of fidelity: the vectorised host index against the NumPy backend's stages (the
float64 reference), batched over requests of equal length, growing by decode tokens."""

import numpy as np
import pytest

from questprof.backends import get_backend
from questprof.core import reference
from questprof.fidelity.host_index import HostIndex, topk
from questprof.fidelity.page_index import PageIndex, page_index


def _keys(rng, batch=3, kv_heads=2, length=77, d=16):
    return rng.standard_normal((batch, kv_heads, length, d)).astype(np.float32)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("page_size", [8, 16])
def test_host_index_selects_like_the_reference_backend(dtype, page_size):
    rng = np.random.default_rng(page_size)
    keys = _keys(rng)
    new = _keys(rng, length=page_size + 1)
    host = HostIndex(keys, page_size, dtype, 77 + page_size + 1)
    ref = PageIndex(get_backend("numpy"), keys, page_size, dtype, 77 + page_size + 1)
    for step in range(page_size + 2):
        if step:  # across a page boundary: a tail of 1, S - 1, S and S + 1 tokens on the way
            host.append(new[:, :, step - 1:step])
            ref.append(new[:, :, step - 1:step])
        assert host.length == ref.length and host.pages == ref.pages
        q = rng.standard_normal((3, 6, 16)).astype(np.float32)  # group of 3
        for mode in ("per-head", "shared-max", "shared-mean"):
            ours, theirs = host.scores(q, mode), ref.scores(q, mode)
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-5)
            ks = (1, 2, 5, host.pages, host.pages + 3)
            many = host.select_many(theirs, ks)
            for k in ks:
                a, b = host.select(theirs, k), ref.select(theirs, k)
                np.testing.assert_array_equal(a[0], b[0])
                np.testing.assert_array_equal(many[k][0], b[0])
                assert a[1] == b[1] == many[k][1]


def test_topk_breaks_ties_like_the_reference():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 4, (5, 2, 23)).astype(np.float32)  # many ties
    scores[0, 0, 3] = np.nan
    indptr = np.array([0, 23, 46])
    for k in (1, 3, 7, 23, 30):
        ours = topk(scores, k)
        want = reference.topk(scores.reshape(5, -1), indptr, k)
        np.testing.assert_array_equal(ours[0], want[0])
        assert ours[1] == int(want[1][0])


def test_copies_grow_apart():
    rng = np.random.default_rng(4)
    base = page_index(get_backend("numpy"), _keys(rng), 16, "fp32", 90)
    a, b = base.copy(), base.copy()
    a.append(_keys(rng, length=1))
    assert (base.length, a.length, b.length) == (77, 78, 77)
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    np.testing.assert_array_equal(base.scores(q, "per-head"), b.scores(q, "per-head"))


def test_one_request_of_one_token():
    rng = np.random.default_rng(5)
    keys = _keys(rng, batch=1, length=1)
    host = HostIndex(keys, 8, "fp32", 4)
    sel, count = host.select(host.scores(rng.standard_normal((1, 2, 16)), "per-head"), 4)
    assert count == 1 and sel.shape == (2, 1, 4) and (sel[:, 0, 0] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("q_heads", [2, 6])  # group 1 (built kernels) and 3 (SmolLM2's)
def test_cupy_index_selects_like_the_host_index(gpu, q_heads):
    """The batched index on the GPU kernels against the vectorised reference: fp16 keys, a
    decode step across a page boundary, several budgets, copies for the task."""
    rng = np.random.default_rng(q_heads)
    keys, new = _keys(rng, length=79, d=64), _keys(rng, length=3, d=64)  # a built head dim
    host = HostIndex(keys, 16, "fp16", 90)
    dev = page_index(gpu, keys, 16, "fp16", 90)
    for index in (host, dev):
        index.append(new[:, :, :2])
    for a, b in ((host, dev), (host.tiled(2), dev.tiled(2))):
        batch = a.batch
        q = rng.standard_normal((batch, q_heads, 64)).astype(np.float32)
        for mode in ("per-head", "shared-max", "shared-mean"):
            ours, theirs = a.scores(q, mode), b.to_host(b.scores(q, mode))
            np.testing.assert_allclose(a.to_host(ours), theirs, rtol=1e-5, atol=1e-4)
            got, want = a.select_many(ours, (1, 3, 6)), b.select_many(b.scores(q, mode), (1, 3, 6))
            for k in (1, 3, 6):
                np.testing.assert_array_equal(got[k][0], want[k][0])


def test_copies_for_the_task_select_like_the_reference():
    """tiled(k): k copies of every request, each growing apart (the task's rows)."""
    rng = np.random.default_rng(6)
    keys = _keys(rng, length=40)
    host = HostIndex(keys, 8, "fp32", 50).tiled(3)
    ref = PageIndex(get_backend("numpy"), keys, 8, "fp32", 50).tiled(3)
    assert host.batch == ref.batch == 9
    for _ in range(2):
        new = _keys(rng, batch=9, length=1)  # each copy appends its own token
        host.append(new)
        ref.append(new)
    q = rng.standard_normal((9, 4, 16)).astype(np.float32)
    for mode in ("per-head", "shared-mean"):
        theirs = ref.scores(q, mode)
        np.testing.assert_allclose(host.scores(q, mode), theirs, rtol=1e-6, atol=1e-5)
        for k in (1, 3, 6):
            np.testing.assert_array_equal(host.select(theirs, k)[0], ref.select(theirs, k)[0])
