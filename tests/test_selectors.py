"""The selector registry and its NumPy reference: every entry, against brute force and Quest."""

import re
import types
from pathlib import Path

import numpy as np
import pytest

from questprof.core import model, reference
from questprof.core.config import ConfigError
from questprof.core.selection import View
from questprof.core.selectors import EXAMPLES, FAMILIES, name_list, parse, parse_list

FIDELITY_DOC = Path(__file__).resolve().parents[1] / "docs" / "FIDELITY.md"

PAGE = 8
LENGTHS = (1, PAGE - 1, PAGE, PAGE + 1, 13 * PAGE + 3)  # tail lengths 1, S-1, S, S+1; many pages


def _view(length: int, seed: int = 0, q_heads: int = 6, kv_heads: int = 2, d: int = 16,
          page: int = PAGE) -> View:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((kv_heads, length, d))
    keys[:, : length // 2] += 0.5 * rng.standard_normal((kv_heads, 1, d))  # pages unlike
    return View(rng.standard_normal((q_heads, d)), keys, page, d ** -0.5, seed)


def test_every_family_has_an_example_name():
    assert {parse(n).family.name for n in EXAMPLES} == set(FAMILIES)
    assert [s.name for s in parse_list("all")] == list(EXAMPLES)


def test_the_name_list_is_the_table_and_unknown_names_are_told_it():
    """The names the CLI's help and the errors show come from FAMILIES, in its order."""
    written = name_list().split(", ")
    assert [w.partition(":")[0] for w in written] == list(FAMILIES)
    kernels = name_list(kernel=True).split(", ")
    assert [k.partition(":")[0] for k in kernels] == [
        n for n, f in FAMILIES.items() if f.kernel is not None]
    with pytest.raises(ConfigError, match=re.escape(name_list())):
        parse("quest-nope")


def test_the_docs_table_holds_every_family_once():
    """docs/FIDELITY.md's selector table: one row per FAMILIES entry, in the table's order."""
    lines = FIDELITY_DOC.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| name | what it keeps"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    families = []
    for row in rows:
        names = re.findall(r"`([^`]+)`", row.split("|")[1])
        families.append({n.partition(":")[0] for n in names})
    assert all(len(f) == 1 for f in families)
    assert [f.pop() for f in families] == list(FAMILIES)


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("length", LENGTHS)
def test_every_selector_selects_within_its_budget(name, length):
    sel = parse(name)
    view, k = _view(length), 3
    out = sel.select(view, k, sel.start())
    assert out.mask.shape == (6, view.pages) and out.mask.dtype == bool
    assert (out.mask.sum(axis=1) >= 1).all()
    if sel.family.name != "bnb":
        assert (out.mask.sum(axis=1) <= min(k, view.pages)).all()
    if sel.family.name not in ("oracle", "bnb"):
        assert out.mask[:, -1].all(), "the tail page (the newest token) is always read"
    np.testing.assert_array_equal(out.pages_read, out.mask.sum(axis=1))
    rho = sel.rho(PAGE, out.pages_read.mean(), view.pages)
    assert 0 < rho <= 1 + 4 / PAGE


@pytest.mark.parametrize("length", LENGTHS)
def test_quest_equals_the_reference_selection(length):
    """Pages scattered in a pool through a page table, summaries by the reference's stage."""
    view, k = _view(length, seed=3), 4
    kv_heads, d = view.keys.shape[0], view.d
    rng = np.random.default_rng(1)
    where = rng.permutation(view.pages + 3)[: view.pages]
    pool = rng.standard_normal((view.pages + 3, kv_heads, PAGE, d))
    padded = np.pad(view.keys, ((0, 0), (0, view.pages * PAGE - length), (0, 0)))
    pool[where] = padded.reshape(kv_heads, view.pages, PAGE, d).transpose(1, 0, 2, 3)
    plan = types.SimpleNamespace(page_ids=where, first=np.zeros(view.pages, int), end=view.valid)
    summ = reference.summary(np.zeros((len(pool), kv_heads, 2, d)), pool, plan)
    indptr = np.array([0, view.pages])
    scores = reference.estimate(view.q[None], summ, indptr, where)
    sel, count = reference.topk(scores, indptr, k)
    want = np.zeros_like(view.page_max, dtype=bool)
    np.put_along_axis(want, sel[:, 0, : count[0]].astype(int), True, axis=1)
    np.testing.assert_array_equal(parse("quest").select(view, k).mask, want)


@pytest.mark.parametrize("seed", range(4))
def test_oracle_keeps_at_least_the_mass_of_quest(seed):
    view = _view(200, seed)
    mass = view.mass()
    for k in (1, 3, 8):
        quest = (mass * parse("quest").select(view, k).mask).sum(axis=1)
        oracle = (mass * parse("oracle").select(view, k).mask).sum(axis=1)
        assert (oracle >= quest - 1e-12).all()


def test_bounds_hold_and_boxes_tighten_them():
    view = _view(150, seed=5)
    exact = view.page_max
    quest, fp8 = view.bound(), view.bound(fp8=True)
    assert (quest >= exact - 1e-9).all() and (fp8 >= quest - 1e-9).all()
    previous = quest
    for c in (2, 4, PAGE):
        tighter = view.bound(boxes=c)
        assert (tighter <= previous + 1e-9).all() and (tighter >= exact - 1e-9).all()
        previous = tighter
    np.testing.assert_allclose(view.bound(boxes=PAGE), exact, rtol=1e-12, atol=1e-12)


def test_boxes_of_single_tokens_rank_pages_by_their_exact_maxima():
    view, k = _view(150, seed=6), 5
    sel, count = reference.topk(view.page_max, np.array([0, view.pages]), k)
    want = np.zeros_like(view.page_max, dtype=bool)
    np.put_along_axis(want, sel[:, 0, : count[0]].astype(int), True, axis=1)
    np.testing.assert_array_equal(parse(f"quest-boxes:{PAGE}").select(view, k).mask, want)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("r", (1, 10, 64))
def test_branch_and_bound_reads_the_exact_top_r_tokens(seed, r):
    view = _view(160 + 7 * seed, seed, d=8)  # d = 8: bounds tight enough to stop early
    out = parse(f"bnb:{r}").select(view, 1)
    tokens = np.repeat(out.mask, PAGE, axis=1)[:, : view.length]
    top = np.argsort(-view.qk, axis=1)[:, : min(r, view.length)]
    assert np.take_along_axis(tokens, top, axis=1).all()
    unread = (view.mass() * ~out.mask).sum(axis=1)
    assert ((0 <= out.eps) & (out.eps <= 1) & (unread <= out.eps + 1e-12)).all()
    assert (out.pages_read <= view.pages).all()


def test_branch_and_bound_stops_early_on_a_peaked_query():
    view = _view(400, seed=2, d=8)
    view.keys[:, 37] = view.q.reshape(2, 3, 8).sum(axis=1) * 4  # one token far above the rest
    out = parse("bnb:1").select(view, 1)
    assert (out.pages_read < view.pages).all()


def _steps(selector: str, k: int, steps: int = 12):
    """Masks of a stateful selector over a sequence whose keys grow by one token a step."""
    rng = np.random.default_rng(9)
    keys = rng.standard_normal((2, 100 + steps, 16))
    sel, masks = parse(selector), []
    state = sel.start()
    for step in range(steps):
        view = View(rng.standard_normal((6, 16)), keys[:, : 100 + step], PAGE, 0.25)
        masks.append(sel.select(view, k, state).mask)
    return masks


@pytest.mark.parametrize("name", ("h2o", "tova"))
def test_an_evicted_page_never_comes_back(name):
    masks = _steps(name, 4)
    for before, after in zip(masks, masks[1:]):
        old = before.shape[1]
        evicted = ~before
        evicted[:, -1] = False  # the tail of the earlier step is still filling
        assert not (after[:, :old] & evicted).any()
        assert (after.sum(axis=1) <= 4).all()


def test_dynamic_budgets_grow_with_their_threshold():
    view = _view(300, seed=4)
    for family, params in (("quest-gap", (0.0, 0.05, 0.2, 1.0, 5.0)),
                           ("quest-topp", (0.1, 0.5, 0.9, 0.99, 1.0))):
        counts = [parse(f"{family}:{p}").select(view, 20).pages_read for p in params]
        for small, large in zip(counts, counts[1:]):
            assert (small <= large).all(), family
        assert (counts[-1] <= 20).all()


@pytest.mark.parametrize("bad, words", [
    ("nope", "unknown selector 'nope'"), ("quest:2", "takes no parameter"),
    ("bnb", "needs a parameter: bnb:R"), ("bnb:0", "whole number of tokens"),
    ("quest-topp:1.5", "mass p in (0, 1]"), ("quest-gap:-1", "gap t >= 0"),
    ("order:sideways", "position or random"), ("quest-boxes:x", "boxes c >= 1")])
def test_bad_names_are_one_clear_line(bad, words):
    with pytest.raises(ConfigError) as err:
        parse_list(f"quest,{bad}")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_boxes_must_divide_the_page_size():
    with pytest.raises(ConfigError, match="3 boxes do not divide the page size 8"):
        parse("quest-boxes:3").select(_view(40), 2)


def test_bytes_of_each_selector_from_the_byte_model():
    pages, k = 64, 8
    quest = parse("quest").rho(16, k, pages)
    assert quest == pytest.approx(model.rho(16, k, pages))
    assert parse("quest-fp8").rho(16, k, pages) == pytest.approx(0.5 / 16 + k / pages)
    assert parse("quest-boxes:4").rho(16, k, pages) == pytest.approx(4 / 16 + k / pages)
    assert parse("streaming").rho(16, k, pages) == pytest.approx(k / pages)
    assert parse("quest-fp8").rho(16, k, pages, "fp32") == pytest.approx(0.25 / 16 + k / pages)
