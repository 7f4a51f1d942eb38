"""The selectors' kernel forms (backends/cupy_selectors.py) against the NumPy references of
core/selection.py and core/reference.py: boxes and FP8 summaries bit for bit, their estimate
within the fp32 tolerance, the dynamic budgets' selections and per-row counts exactly, the step
as its stages. CPU part: the registry's kernel rows and the byte model of the forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import TOL, full_plan, poison, rel_err
from questprof.core import model, reference, selection, selectors
from questprof.core.config import Config, ModelShape
from questprof.core.layout import (AppendPlan, from_storage, random_paged_kv, random_queries,
                                   summary_values)
from questprof.core.selectors import KernelForm

FP32 = TOL["fp32"]
MODES = ("per-head", "shared-max", "shared-mean")
# (form, q heads, KV heads, head dim, page size, dtype)
FORMS = [(KernelForm(boxes=2), 8, 2, 128, 16, "fp16"), (KernelForm(boxes=4), 4, 4, 64, 8, "bf16"),
         (KernelForm(boxes=2), 6, 2, 64, 32, "fp16"), (KernelForm(fp8=True), 8, 2, 128, 16, "fp16"),
         (KernelForm(fp8=True), 3, 1, 64, 8, "bf16"), (KernelForm(boxes=4), 32, 2, 64, 16, "fp16")]


def _lengths(s: int) -> list[int]:
    """Tails 1, S-1, S, S+1, a box partly filled, and a long request."""
    return [1, s - 1, s, s + 1, 3 * s + s // 2 + 1, 41 * s + 3]


def _plan(kv, span) -> AppendPlan:
    """Slots of tokens [a, e) = span(L) of every request, page by page (none when a == e)."""
    indptr, indices, s = np.asarray(kv.kv_indptr), np.asarray(kv.kv_indices), kv.page_size
    ids, first, end = [], [], []
    for b, n in enumerate(kv.lengths):
        a, e = span(n)
        for p in range(a // s, -(-e // s)) if e > a else ():
            ids.append(indices[indptr[b] + p])
            first.append(max(a, p * s) - p * s)
            end.append(min(e, (p + 1) * s) - p * s)
    as32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
    return AppendPlan(as32(ids), as32(first), as32(end))


def _prefill_then_append(kv, last: int = 3) -> tuple[AppendPlan, AppendPlan]:
    """Plans of the first L - last tokens (at least one) and of the rest."""
    cut = lambda n: max(1, n - last)  # noqa: E731
    return _plan(kv, lambda n: (0, cut(n))), _plan(kv, lambda n: (cut(n), n))


def _keys(kv) -> np.ndarray:
    return from_storage(kv.k, kv.dtype)


def _want_boxes(kv, boxes: int, scale=None) -> tuple[np.ndarray, np.ndarray]:
    """(float64 [N, Hkv, boxes, 2, d] NaN where empty, holds-keys mask [N, boxes])."""
    keys, s = _keys(kv), kv.page_size
    want = np.full(kv.k.shape[:2] + (boxes, 2, kv.head_dim), np.nan)
    holds = np.zeros((kv.num_pages, boxes), dtype=bool)
    indptr, indices = np.asarray(kv.kv_indptr), np.asarray(kv.kv_indices)
    for b, n in enumerate(kv.lengths):
        for p in range(indptr[b + 1] - indptr[b]):
            page, valid = indices[indptr[b] + p], min(s, n - p * s)
            got = selection.box_summary(keys[page, :, :valid], s // boxes, scale is not None,
                                        scale)
            want[page, :, : len(got)] = got.transpose(1, 0, 2, 3)
            holds[page, : len(got)] = True
    return want, holds


def _device(gpu, kv, form, plan):
    from questprof.backends import cupy_selectors as forms
    dev = gpu.put(kv)
    return dev, forms.summaries(dev, form, plan)


def _got_summary(gpu, fs) -> np.ndarray:
    values = from_storage(gpu.to_host(fs.summary), fs.dtype)
    if fs.scale is not None:
        values = values * gpu.to_host(fs.scale).astype(np.float64)[:, None, None]
    return values.reshape(values.shape[:2] + (fs.form.boxes, 2, -1))


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(FORMS)))
def test_summary_forms_bit_for_bit(gpu, rng, case):
    """Boxes and FP8 summaries, built at once and by prefill + append, equal the reference."""
    from questprof.backends import cupy_selectors as forms
    form, _, kvh, d, s, dtype = FORMS[case]
    kv = random_paged_kv(rng, _lengths(s), s, kvh, d, dtype, spare_pages=2, tail_fill=np.nan)
    poison()
    dev, fs = _device(gpu, kv, form, full_plan(kv))
    scale = None if fs.scale is None else gpu.to_host(fs.scale).astype(np.float64)
    want, holds = _want_boxes(kv, form.boxes, scale)
    got = _got_summary(gpu, fs)
    np.testing.assert_array_equal(got[holds[:, None, :].repeat(kvh, 1)],
                                  want[holds[:, None, :].repeat(kvh, 1)])
    prefill, append = _prefill_then_append(kv)
    staged = forms.summaries(dev, form, prefill)  # the same pool: the same scale
    forms.summary(dev, staged, append)
    stepped = _got_summary(gpu, staged)
    np.testing.assert_array_equal(stepped[holds[:, None, :].repeat(kvh, 1)],
                                  want[holds[:, None, :].repeat(kvh, 1)])


def _want_scores(q, kv, want, holds, mode) -> np.ndarray:
    """Reference scores [Hs, nnz]: per q head the largest bound of the boxes holding keys, then
    the mode's reduction over the group."""
    indptr, indices = np.asarray(kv.kv_indptr), np.asarray(kv.kv_indices)
    q64 = from_storage(q, kv.dtype)
    per_box = [reference.estimate(q64, np.nan_to_num(want[:, :, c]), indptr, indices)
               for c in range(want.shape[2])]
    u = np.stack(per_box)  # [boxes, Hq, nnz]
    u = np.where(holds[indices].T[:, None, :], u, -np.inf).max(axis=0)
    if mode == "per-head":
        return u
    u = u.reshape(kv.kv_heads, -1, u.shape[1])
    return u.max(axis=1) if mode == "shared-max" else u.mean(axis=1)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(FORMS)))
def test_estimate_forms_against_reference(gpu, rng, case):
    """Every mode's scores within the fp32 tolerance of the float64 reference over the kernel's
    own summaries (checked bit for bit above); boxes past a tail page's last token count not."""
    from questprof.backends import cupy_selectors as forms
    form, qh, kvh, d, s, dtype = FORMS[case]
    kv = random_paged_kv(rng, _lengths(s), s, kvh, d, dtype, spare_pages=2, tail_fill=np.nan)
    q = random_queries(rng, kv.batch, qh, d, dtype)
    dev, fs = _device(gpu, kv, form, full_plan(kv))
    scale = None if fs.scale is None else gpu.to_host(fs.scale).astype(np.float64)
    want, holds = _want_boxes(kv, form.boxes, scale)
    for mode in MODES:
        got = gpu.to_host(forms.estimate(gpu.asarray(q), dev, fs, mode))
        assert np.isfinite(got).all()
        assert rel_err(got, _want_scores(q, kv, want, holds, mode)) < FP32, mode


def _rule_rows(scores, indptr, k, form, scaling) -> tuple[np.ndarray, np.ndarray]:
    """Reference (sel [Hs, B, K], count [Hs, B]) of a dynamic rule on float32 scores."""
    heads, batch = scores.shape[0], len(indptr) - 1
    sel = np.full((heads, batch, k), -1, dtype=np.int32)
    count = np.zeros((heads, batch), dtype=np.int32)
    pages_of = selection.gap_pages if form.rule == "gap" else selection.top_p_pages
    for b in range(batch):
        u = scores[:, indptr[b]:indptr[b + 1]].astype(np.float64)
        n = pages_of(u, k, form.param, scaling)
        order = np.argsort(-u[:, :-1], axis=1, kind="stable")
        for h in range(heads):
            chosen = np.sort(np.append(order[h, : n[h]], u.shape[1] - 1))
            sel[h, b, : len(chosen)], count[h, b] = chosen, len(chosen)
    return sel, count


RULES = [KernelForm(rule="gap", param=t) for t in (0.0, 0.3, 2.0)] + [
    KernelForm(rule="topp", param=p) for p in (0.3, 0.9, 0.99)]


@pytest.mark.gpu
@pytest.mark.parametrize("k_pages", [1, 2, 8, 64, 256])
def test_dynamic_topk_selections_and_counts_exact(gpu, rng, k_pages):
    """Per row the tail page and the rule's first n of the K best, ascending, -1 padded, and
    the count n + 1, equal to core.selection's rules on the same scores (ties included)."""
    from questprof.backends import cupy_selectors as forms
    s, d = 16, 64
    kv = random_paged_kv(rng, [1, 2 * s, 5 * s - 1, 40 * s, 300 * s + 1, 2000 * s], s, 1, d,
                         "fp16")
    kv = gpu.put(kv)
    nnz, indptr = int(kv.kv_indices.size), gpu.to_host(kv.kv_indptr)
    scores = (30 * rng.standard_normal((3, nnz))).astype(np.float32)
    scores[1] = np.round(scores[1] / 8) * 8  # ties, broken by position
    for form in RULES:
        sel, count = forms.topk(gpu.asarray(scores), kv, k_pages, form)
        want_sel, want_count = _rule_rows(scores, indptr, k_pages, form, 1 / math.sqrt(d))
        assert gpu.to_host(count).shape == (3, kv.batch)
        np.testing.assert_array_equal(gpu.to_host(count), want_count, err_msg=str(form))
        np.testing.assert_array_equal(gpu.to_host(sel), want_sel, err_msg=str(form))


STEPS = [(KernelForm(boxes=2), 8, 2, 128, 16, "fp16"), (KernelForm(fp8=True), 4, 4, 64, 8, "bf16"),
         (KernelForm(rule="topp", param=0.5), 8, 2, 128, 16, "bf16"),
         (KernelForm(rule="gap", param=0.05), 4, 4, 64, 16, "fp16")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(STEPS)))
def test_quest_step_of_a_form_is_its_stages(gpu, rng, case):
    """quest() of a form gives the bits of its three stages launched apart, and attention over
    each row's count is the reference's within the tolerance table."""
    from questprof.backends import cupy_selectors as forms
    form, qh, kvh, d, s, dtype = STEPS[case]
    kv = random_paged_kv(rng, [1, s + 1, 9 * s - 1, 70 * s], s, kvh, d, dtype, spare_pages=1,
                         tail_fill=np.nan)
    q = random_queries(rng, kv.batch, qh, d, dtype)
    dev, fs = _device(gpu, kv, form, full_plan(kv))
    dq, host = gpu.asarray(q), gpu.to_host
    for mode in ("per-head", "shared-mean"):
        out, lse = forms.quest(dq, dev, fs, 12, mode, launch=gpu.launch)
        sel, count = forms.topk(forms.estimate(dq, dev, fs, mode), dev, 12, form)
        c_out, c_lse = gpu.attention(dq, dev, sel, count)
        np.testing.assert_array_equal(host(out), host(c_out))
        np.testing.assert_array_equal(host(lse), host(c_lse))
        keys, values = _keys(kv), from_storage(kv.v, kv.dtype)
        want_out, want_lse = reference.attention(
            from_storage(q, dtype), keys, values, kv.kv_indptr, kv.kv_indices, kv.last_page_len,
            host(sel), host(count))
        assert rel_err(from_storage(host(out), dtype), want_out) < TOL[dtype]
        assert rel_err(host(lse), want_lse) < FP32


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["quest", "quest-boxes:2", "quest-gap:0.02", "quest-topp:0.6"])
def test_kernel_selection_is_the_selectors_reference(gpu, rng, name):
    """One request, MHA: the pages the kernels read are core.selectors' own selection (the
    float64 View) wherever the reference's margin (bound order, gaps, mass) is clear of fp32."""
    from questprof.backends import cupy_selectors as forms
    sel_ = selectors.parse(name)
    s, d, k = 16, 128, 24
    kv = random_paged_kv(rng, [61 * s + 5], s, 4, d, "fp16", tail_fill=np.nan)
    q = random_queries(rng, 1, 4, d, "fp16")
    dev, fs = _device(gpu, kv, sel_.kernel_form, full_plan(kv))
    sel, count = forms.topk(forms.estimate(gpu.asarray(q), dev, fs), dev, k, sel_.kernel_form)
    sel, count = gpu.to_host(sel), gpu.to_host(count)
    keys = _keys(kv)[np.asarray(kv.kv_indices)].transpose(1, 0, 2, 3).reshape(4, -1, d)
    view = selection.View(from_storage(q, "fp16")[0], keys[:, : kv.lengths[0]], s,
                          1 / math.sqrt(d))
    want = sel_.select(view, k).mask
    for h in np.flatnonzero(_clear(view, sel_, k)):
        got = np.zeros(view.pages, dtype=bool)
        got[sel[h, 0, : count[h, 0] if count.ndim == 2 else count[0]]] = True
        np.testing.assert_array_equal(got, want[h], err_msg=f"{name} head {h}")


def _clear(view, sel_, k: int, margin: float = 1e-5) -> np.ndarray:
    """Heads [Hq] whose selection no fp32 rounding of the bounds can change: scaled bounds
    apart by > margin, and for the dynamic rules gaps and masses clear of t and p."""
    form = sel_.kernel_form
    u = view.bound(form.boxes) * view.scaling
    v = -np.sort(-u[:, :-1], axis=1)[:, : k]
    gaps = v[:, :-1] - v[:, 1:]
    clear = np.abs(np.diff(np.sort(u, axis=1), axis=1)).min(axis=1) > margin
    if form.rule == "gap":
        clear &= np.abs(gaps - form.param).min(axis=1) > margin
    if form.rule == "topp":
        w = np.exp(u - u.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        cum = w[:, -1:] + np.cumsum(np.concatenate([np.zeros((len(w), 1)), -np.sort(-w[:, :-1])],
                                                   axis=1), axis=1)[:, :k]
        clear &= np.abs(cum - form.param).min(axis=1) > margin
    assert clear.sum() >= 2, "too few heads clear of fp32 rounding to compare"
    return clear


def test_registry_rows_name_their_kernel_forms():
    """quest, quest-fp8, quest-boxes:c and the dynamic budgets run on the kernels; the others
    are reference-only."""
    forms = {n: selectors.parse(n).kernel_form for n in selectors.EXAMPLES}
    assert forms["quest"] == KernelForm()
    assert forms["quest-fp8"] == KernelForm(fp8=True)
    assert forms["quest-boxes:4"] == KernelForm(boxes=4)
    assert forms["quest-gap:1"] == KernelForm(rule="gap", param=1.0)
    assert forms["quest-topp:0.9"] == KernelForm(rule="topp", param=0.9)
    assert {n for n, f in forms.items() if f is None} == {
        "quest+sink+window", "streaming", "h2o", "tova", "oracle", "order:position",
        "order:random", "bnb:10", "bnb:64"}


def test_rule_helpers_are_the_reference_rules(rng):
    """gap_pages / top_p_pages (what the kernels are held to) give gap / top_p's masks."""
    view = selection.View(rng.standard_normal((4, 64)), rng.standard_normal((2, 333, 64)), 16,
                          0.125)
    u = view.bound()
    for k in (1, 2, 7, 40):
        assert (selection.gap(view, k, 0.05).mask.sum(1) == selection.gap_pages(u, k, 0.05, 0.125)
                + 1).all()
        assert (selection.top_p(view, k, 0.7).mask.sum(1)
                == selection.top_p_pages(u, k, 0.7, 0.125) + 1).all()


@pytest.mark.parametrize("name", ["quest", "quest-fp8", "quest-boxes:2", "quest-topp:0.5"])
def test_form_work_bytes(name):
    """The estimate reads boxes x summaries (FP8: one byte an element, plus the scales);
    attention the pages read; plain Quest's form is core.model's own work."""
    shape = ModelShape("mha", 32, 32, 32, 128, "fp16")
    cfg = Config(shape, 32768, 1, 16, 2048, "per-head")
    base, form = model.stage_work(cfg), selectors.parse(name).kernel_form
    work = selectors.form_work(cfg, form, pages_read=None)
    summary_read = base["estimate"].read * form.boxes / (2 if form.fp8 else 1)
    assert work["estimate"].read == summary_read
    assert work["attention"] == base["attention"]
    if name == "quest":
        assert work["quest"] == model.quest_work(cfg)
    half = selectors.form_work(cfg, form, pages_read=cfg.k_pages / 2)
    assert half["attention"].read == pytest.approx(
        base["attention"].read * (cfg.k_pages / 2 - 1 + 1) / cfg.k_pages, rel=1e-9)
    assert half["quest"].read == half["estimate"].read + half["attention"].read
