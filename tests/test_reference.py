"""The float64 reference is the specification: hand examples from the paper's geometry and
property tests that any correct implementation of the stages must satisfy."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from questprof.core import layout, reference as ref


def _one_request(keys_per_page, page_size):
    """A float64 cache [pages, 1, S, d] holding the given keys page by page, and its tables."""
    d = len(keys_per_page[0][0])
    k = np.full((len(keys_per_page), 1, page_size, d), np.nan)
    for p, keys in enumerate(keys_per_page):
        k[p, 0, : len(keys)] = keys
    lengths = [sum(len(keys) for keys in keys_per_page)]
    indptr, indices, last = layout.page_tables(lengths, page_size, len(keys_per_page))
    return k, indptr, indices, last


def _prefill(k, indptr, indices, last, page_size):
    plan = layout.append_plan(indptr, indices, last, [int(np.asarray(last)[0]) + page_size * (len(indices) - 1)], page_size)
    return ref.summary(np.full((k.shape[0], k.shape[1], 2, k.shape[3]), np.nan), k, plan)


def test_hand_example_bound_is_tight_on_one_key():
    k, indptr, indices, last = _one_request([[(1, 4), (3, -2), (-1, 1)]], 3)
    summ = _prefill(k, indptr, indices, last, 3)
    q = np.array([[[2.0, -1.0]]])
    assert ref.estimate(q, summ, indptr, indices)[0, 0] == 8
    assert list(k[0, 0] @ q[0, 0]) == [-2, 8, -3]


def test_hand_example_same_box_loose_bound():
    k, indptr, indices, last = _one_request([[(3, 4), (-1, -2)]], 3)
    summ = _prefill(k, indptr, indices, last, 3)
    q = np.array([[[2.0, -1.0]]])
    assert ref.estimate(q, summ, indptr, indices)[0, 0] == 8
    assert (k[0, 0, :2] @ q[0, 0]).max() == 2


def test_hand_example_append_updates_only_the_tail_box():
    k, indptr, indices, last = _one_request([[(3, -2), (-1, 1), (1, 0)], [(1, 2), (0, 3)]], 3)
    summ = _prefill(k, indptr, indices, last, 3)
    assert list(ref.estimate(np.array([[[2.0, -1.0]]]), summ, indptr, indices)[0]) == [8, 0]
    k[1, 0, 2] = (-2, 5)
    last = np.array([3])
    summ = ref.summary(summ, k, layout.append_plan(indptr, indices, last, [1], 3))
    assert summ[1, 0].tolist() == [[-2, 2], [1, 5]]
    assert list(ref.estimate(np.array([[[0.0, 1.0]]]), summ, indptr, indices)[0]) == [1, 5]


def _random_case(rng, lengths, page_size, kv_heads=2, group=2, d=8, spare=3):
    kv = layout.random_paged_kv(rng, lengths, page_size, kv_heads, d, "fp32", spare_pages=spare,
                                tail_fill=np.nan)
    k, v = layout.from_storage(kv.k, "fp32"), layout.from_storage(kv.v, "fp32")
    plan = layout.append_plan(kv.kv_indptr, kv.kv_indices, kv.last_page_len, lengths, page_size)
    summ = ref.summary(layout.from_storage(kv.summary, "fp32"), k, plan)
    q = rng.standard_normal((len(lengths), kv_heads * group, d))
    return kv, k, v, summ, q


lengths_st = st.lists(st.integers(1, 70), min_size=1, max_size=4)
page_st = st.sampled_from([1, 2, 4, 8])


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, page_size=page_st, seed=st.integers(0, 2**31))
def test_estimate_bounds_every_true_score(lengths, page_size, seed):
    rng = np.random.default_rng(seed)
    kv, k, v, summ, q = _random_case(rng, lengths, page_size)
    u = ref.estimate(q, summ, kv.kv_indptr, kv.kv_indices, "per-head")
    for b, n in enumerate(lengths):
        for j in range(kv.kv_indptr[b], kv.kv_indptr[b + 1]):
            valid = page_size if j < kv.kv_indptr[b + 1] - 1 else kv.last_page_len[b]
            for h in range(q.shape[1]):
                true = k[kv.kv_indices[j], h // 2, :valid] @ q[b, h]
                assert u[h, j] >= true.max() - 1e-12


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_st, page_size=page_st, seed=st.integers(0, 2**31),
       mode=st.sampled_from(ref.MODES))
def test_budget_of_every_page_is_dense(lengths, page_size, seed, mode):
    rng = np.random.default_rng(seed)
    kv, k, v, summ, q = _random_case(rng, lengths, page_size)
    scores = ref.estimate(q, summ, kv.kv_indptr, kv.kv_indices, mode)
    sel, count = ref.topk(scores, kv.kv_indptr, max(kv.pages()) + 1)
    sparse = ref.attention(q, k, v, kv.kv_indptr, kv.kv_indices, kv.last_page_len, sel, count)
    dense = ref.attention(q, k, v, kv.kv_indptr, kv.kv_indices, kv.last_page_len)
    np.testing.assert_allclose(sparse[0], dense[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(sparse[1], dense[1], rtol=0, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 70), min_size=2, max_size=4), page_size=page_st,
       seed=st.integers(0, 2**31), k_pages=st.integers(1, 6))
def test_output_ignores_page_order_and_neighbours(lengths, page_size, seed, k_pages):
    rng = np.random.default_rng(seed)
    kv, k, v, summ, q = _random_case(rng, lengths, page_size)
    scores = ref.estimate(q, summ, kv.kv_indptr, kv.kv_indices)
    sel, count = ref.topk(scores, kv.kv_indptr, k_pages)
    full = ref.attention(q, k, v, kv.kv_indptr, kv.kv_indices, kv.last_page_len, sel, count)
    # Relabel physical pages: same logical cache, other page ids.
    perm = rng.permutation(k.shape[0])
    inv = np.argsort(perm)
    moved = ref.attention(q, k[perm], v[perm], kv.kv_indptr, inv[kv.kv_indices], kv.last_page_len,
                          sel, count)
    np.testing.assert_allclose(moved[0], full[0], rtol=0, atol=1e-12)
    # The first request alone gives the same answer as inside the batch.
    pages0 = kv.kv_indptr[1]
    alone = ref.attention(q[:1], k, v, kv.kv_indptr[:2], kv.kv_indices[:pages0],
                          kv.last_page_len[:1], sel[:, :1], count[:1])
    np.testing.assert_allclose(alone[0][0], full[0][0], rtol=0, atol=1e-12)


def test_unused_tail_slots_change_nothing():
    rng = np.random.default_rng(7)
    kv, k, v, summ, q = _random_case(rng, [37, 5, 16], 16)
    base = ref.attention(q, k, v, kv.kv_indptr, kv.kv_indices, kv.last_page_len)
    for fill in (np.nan, 1e30, -1e30):
        k2, v2 = k.copy(), v.copy()
        for b, n in enumerate(kv.last_page_len):
            tail = kv.kv_indices[kv.kv_indptr[b + 1] - 1]
            k2[tail, :, n:], v2[tail, :, n:] = fill, fill
        plan = layout.append_plan(kv.kv_indptr, kv.kv_indices, kv.last_page_len, [37, 5, 16], 16)
        summ2 = ref.summary(summ, k2, plan)
        np.testing.assert_array_equal(summ2, summ)
        out = ref.attention(q, k2, v2, kv.kv_indptr, kv.kv_indices, kv.last_page_len)
        np.testing.assert_array_equal(out[0], base[0])


def test_decode_appends_equal_prefill_and_reused_page_is_reinitialised():
    rng = np.random.default_rng(3)
    S, n = 4, 11
    kv, k, v, summ, q = _random_case(rng, [n], S)
    step = np.full_like(summ, 7.0)  # stale values of a previous owner of the pages
    for length in range(1, n + 1):
        indptr, indices, last = kv.kv_indptr, kv.kv_indices[: layout.pages_for(length, S)], None
        last = np.array([length - (len(indices) - 1) * S])
        indptr = np.array([0, len(indices)])
        step = ref.summary(step, k, layout.append_plan(indptr, indices, last, [1], S))
    used = kv.kv_indices
    np.testing.assert_array_equal(step[used], summ[used])
    rebuilt = ref.summary(np.zeros_like(summ), k, layout.rebuild_plan(used[:1], [S]))
    np.testing.assert_array_equal(rebuilt[used[0]], summ[used[0]])


def test_topk_tail_ties_and_reservations():
    indptr = np.array([0, 6, 7])
    scores = np.array([[5.0, 1.0, 5.0, 9.0, 2.0, -4.0, 3.0]])
    sel, count = ref.topk(scores, indptr, 3)
    assert count.tolist() == [3, 1]
    assert sel[0, 0].tolist() == [0, 3, 5]  # tail 5 kept; 9 then the tie 5/5 goes to position 0
    assert sel[0, 1].tolist() == [0, -1, -1]
    sel, _ = ref.topk(scores, indptr, 4, sinks=1, window=2)
    assert sel[0, 0].tolist() == [0, 3, 4, 5]
    with pytest.raises(ValueError):
        ref.topk(scores, indptr, 2, sinks=1, window=2)


def test_shared_modes_reduce_over_the_group():
    rng = np.random.default_rng(11)
    kv, k, v, summ, q = _random_case(rng, [40, 9], 8, kv_heads=2, group=3)
    per = ref.estimate(q, summ, kv.kv_indptr, kv.kv_indices, "per-head").reshape(2, 3, -1)
    np.testing.assert_array_equal(ref.estimate(q, summ, kv.kv_indptr, kv.kv_indices, "shared-max"),
                                  per.max(axis=1))
    np.testing.assert_allclose(ref.estimate(q, summ, kv.kv_indptr, kv.kv_indices, "shared-mean"),
                               per.mean(axis=1), rtol=1e-15)
    with pytest.raises(ValueError):
        ref.estimate(q, summ, kv.kv_indptr, kv.kv_indices, "shared-min")
