"""Fidelity metrics: hand-checked cases, invariants on seeded random caches, the page index."""

import math

import numpy as np
import pytest

from questprof.backends import get_backend
from questprof.fidelity.evaluate import FidelityGrid, evaluate
from questprof.fidelity.metrics import (METRICS, dense_attention, head_metrics, page_stats,
                                        selection_mask, stale_mask)
from questprof.fidelity.page_index import PageIndex
from questprof.fidelity.synthetic import synthetic_capture

SIZES = (8, 16, 32)


def _index(m, name):
    return METRICS.index(name)


def test_hand_checked_one_head():
    # weights proportional to [1, 1, 3, 1]: page 0 holds 2/6 of the mass, page 1 holds 4/6
    q = np.array([[1.0]])
    k = np.array([[[0.0], [0.0], [math.log(3.0)], [0.0]]])
    v = np.array([[[1.0], [1.0], [0.0], [0.0]]])
    stats = page_stats(dense_attention(q, k, v, scaling=1.0), page_size=2)
    mask = np.array([[True, False]])
    bound = np.array([[5.0, 5.0]])
    got = head_metrics(stats, mask, bound, stale_mask(mask, 2))
    assert got["mass_recall"].item() == pytest.approx(1 / 3)
    assert got["oracle_mass"].item() == pytest.approx(2 / 3)
    assert got["page_recall"].item() == 0.0
    assert got["top10_recall"].item() == pytest.approx(0.5)  # 2 of the 4 tokens
    # o_dense = 2/6 = 1/3, o_sel = 1: relative error 2
    assert got["output_rel_error"].item() == pytest.approx(2.0)
    assert got["bound_slack"].item() == pytest.approx(5.0)  # U = 5, max q.k on page 0 = 0
    assert got["stale_mass_recall"].item() == pytest.approx(1.0)  # + the tail page


def test_selection_mask_expands_shared_selection_to_the_group():
    sel = np.array([[0, 2, -1], [1, 3, -1]])
    mask = selection_mask(sel, 2, q_heads=4, pages=4)
    assert mask.tolist() == [[True, False, True, False]] * 2 + [[False, True, False, True]] * 2


@pytest.fixture(scope="module")
def numpy_backend():
    return get_backend("numpy")


@pytest.mark.parametrize("kind", ["random", "drift"])
def test_budget_covering_every_page_is_dense(kind, numpy_backend):
    cap = synthetic_capture(kind, 3, layers=1, q_heads=4, kv_heads=2, head_dim=64,
                            length=301, steps=3)
    out = evaluate(cap, numpy_backend, FidelityGrid(SIZES, (512,), ("per-head", "shared-mean")))
    for m in out.values():
        assert np.allclose(m[:, :, _index(m, "mass_recall")], 1.0)
        assert np.allclose(m[:, :, _index(m, "page_recall")], 1.0)
        assert np.allclose(m[:, :, _index(m, "top10_recall")], 1.0)
        assert np.all(m[:, :, _index(m, "output_rel_error")] < 1e-9)


@pytest.mark.parametrize("seed,length", [(0, 257), (1, 512), (2, 1000)])
def test_invariants_on_random_caches(seed, length, numpy_backend):
    cap = synthetic_capture("random", seed, layers=2, q_heads=6, kv_heads=2, head_dim=64,
                            length=length, steps=2)
    out = evaluate(cap, numpy_backend, FidelityGrid(SIZES, (64, 128), ("per-head", "shared-max"),
                                                    "fp16"))
    for m in out.values():
        mass, oracle = m[:, :, _index(m, "mass_recall")], m[:, :, _index(m, "oracle_mass")]
        assert np.all(oracle >= mass - 1e-9)
        assert np.all((mass > 0) & (mass <= 1 + 1e-9))
        # U_p(q) bounds max q.k; the backend's scores are float32 (|q.k| < 1e3 here)
        assert np.all(m[:, :, _index(m, "bound_slack")] >= -1e-3)
        for name in ("top10_recall", "page_recall"):
            assert np.all((m[:, :, _index(m, name)] >= 0) & (m[:, :, _index(m, name)] <= 1))


def test_more_budget_never_loses_mass_per_head(numpy_backend):
    cap = synthetic_capture("drift", 5, layers=1, q_heads=4, kv_heads=4, head_dim=64,
                            length=1024, steps=2)
    out = evaluate(cap, numpy_backend, FidelityGrid((16,), (64, 128, 256)))
    masses = [out[(16, b, "per-head")][:, :, 0] for b in (64, 128, 256)]
    assert np.all(masses[1] >= masses[0] - 1e-12) and np.all(masses[2] >= masses[1] - 1e-12)


def test_drift_hurts_a_stale_selection_not_quest(numpy_backend):
    cap = synthetic_capture("drift", 0, layers=2, q_heads=4, kv_heads=2, head_dim=64,
                            length=4096, steps=6)
    m = evaluate(cap, numpy_backend, FidelityGrid((16,), (512,)))[(16, 512, "per-head")]
    last = m[:, -1]
    quest, stale = (last[:, _index(m, n)].mean() for n in ("mass_recall", "stale_mass_recall"))
    assert quest > 2 * stale
    first = m[:, 0]
    assert np.allclose(first[:, _index(m, "mass_recall")], first[:, _index(m, "stale_mass_recall")])


@pytest.mark.parametrize("length,extra", [(15, 1), (16, 3), (100, 17)])
def test_page_index_appends_like_a_prefill(length, extra, numpy_backend):
    rng = np.random.default_rng(length)
    keys = rng.standard_normal((1, 2, length + extra, 64)).astype(np.float32)  # one request
    grown = PageIndex(numpy_backend, keys[:, :, :length], 16, "fp32", length + extra)
    for i in range(length, length + extra):
        grown.append(keys[:, :, i:i + 1])
    whole = PageIndex(numpy_backend, keys, 16, "fp32", length + extra)
    pages = whole.pages
    assert grown.pages == pages
    np.testing.assert_array_equal(grown.kv.summary[:pages], whole.kv.summary[:pages])
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    np.testing.assert_array_equal(grown.scores(q, "per-head"), whole.scores(q, "per-head"))


def test_one_thread_sets_and_restores_numpy_blas_threads():
    from questprof.fidelity.threads import _openblas, one_thread
    blas = _openblas()
    if blas is None:
        pytest.skip("NumPy's BLAS here is not OpenBLAS")
    before = blas[0]()
    with one_thread():
        assert blas[0]() == 1
    assert blas[0]() == before
