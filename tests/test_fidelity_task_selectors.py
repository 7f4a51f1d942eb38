"""Every selector in the task's decode loop: answers, state across steps, teacher forcing."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from questprof.backends import get_backend  # noqa: E402
from questprof.core import selectors as registry  # noqa: E402
from questprof.core.selection import View  # noqa: E402
from questprof.fidelity import rows  # noqa: E402
from questprof.fidelity.model_run import base_indexes, capture  # noqa: E402
from questprof.fidelity.models import LoadedModel  # noqa: E402
from questprof.fidelity.prompts import random_tokens  # noqa: E402
from questprof.fidelity.task_answers import Answer, first_divergence, forced_inputs  # noqa: E402
from questprof.fidelity.task_decode import decode_settings  # noqa: E402
from questprof.fidelity.task_selectors import RowSelectors  # noqa: E402

STEPS, PAGE = 4, 8
# every family; the dynamic ones (gap, top-p, bnb) may keep fewer pages than a full budget
EVERY = registry.EXAMPLES
KEEP_ALL = [n for n in EVERY if not n.startswith(("quest-gap", "quest-topp", "bnb"))]


@pytest.fixture(scope="module")
def tiny():
    """A random 3-layer Llama with GQA (6 q heads over 2 KV heads, head dim 16), 3 prompts."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=256)
    loaded = LoadedModel(transformers.LlamaForCausalLM(config).eval(), None, "tiny", 256)
    batch = [random_tokens(97, 69, seed=s) for s in (1, 2, 3)]  # 68 prefilled: a partial page
    got = capture(loaded, batch, STEPS, "random-tokens")
    base = base_indexes(got, get_backend("numpy"), PAGE, "fp32", 0)
    return loaded, batch, got, base


def _decode(tiny, settings, forced=False, dense_layers=1):
    loaded, batch, got, base = tiny
    return decode_settings(loaded, batch, got, base, settings, PAGE, "per-head", dense_layers,
                           forced)


def test_every_selector_over_every_page_answers_as_dense(tiny):
    _, _, got, _ = tiny
    out = _decode(tiny, [(name, 128) for name in KEEP_ALL])
    for name in KEEP_ALL:
        assert [a.tokens for a in out[name, 128]] == got.tokens, name
        assert all(a.first_divergence is None for a in out[name, 128])


def test_each_selector_at_a_small_budget_answers_as_it_does_alone(tiny):
    """Rows of one decode are independent: every selector with two budgets together equals
    each (selector, budget) decoded alone; stateful ones keep their own state per row."""
    settings = [(name, b) for name in EVERY for b in (16, 32)]
    together = _decode(tiny, settings)
    for setting in [("h2o", 16), ("tova", 32), ("order:random", 16), ("bnb:10", 16),
                    ("quest", 16), ("quest-gap:1", 32)]:
        alone = _decode(tiny, [setting])[setting]
        assert [a.tokens for a in alone] == [a.tokens for a in together[setting]], setting
    for setting, answers in together.items():
        assert [len(a.tokens) for a in answers] == [STEPS] * 3, setting


class _Layer:
    def __init__(self, prefix, own):
        self.prefix_k, self.keys = prefix, own


class _Cache:
    def __init__(self, layers):
        self.layers = layers


def test_stateful_selectors_keep_their_evictions_across_steps():
    """RowSelectors over growing keys equals one selector state carried through the steps
    (the metrics' path), and an h2o / tova page once evicted never comes back."""
    rng = np.random.default_rng(7)
    prefix = torch.from_numpy(rng.standard_normal((1, 2, 61, 16)).astype(np.float32))
    settings = [("h2o", 2), ("tova", 3), ("quest-fp8", 2), ("quest-boxes:4", 3), ("bnb:10", 2),
                ("quest-topp:0.9", 3)]  # bounds from the kept prefix boxes: as from the keys
    own_all = torch.from_numpy(rng.standard_normal((6, 2, 6, 16)).astype(np.float32) * 3)
    queries = rng.standard_normal((6, 6, 6, 16)).astype(np.float32)
    index = type("Index", (), {"dtype": "fp32", "page_size": PAGE})()
    layer = _Layer(prefix[0:1], own_all[:, :, :0])
    rows_ = RowSelectors(_Cache([layer]), [s for s, _ in settings])
    ref = {name: registry.parse(name) for name, _ in settings}
    states = {name: ref[name].start() for name, _ in settings}
    before = {}
    for step in range(6):
        layer.keys = own_all[:, :, :step + 1]
        pages = np.zeros((6, 6, -(-(62 + step) // PAGE)), dtype=bool)
        rows_.fill(0, queries[step], settings, pages, index, 0.25)
        for row, (name, k) in enumerate(settings):
            keys = np.concatenate([prefix[0].numpy(), own_all[row, :, :step + 1].numpy()], 1)
            want = ref[name].select(View(queries[step][row], keys, PAGE, 0.25, seed=step), k,
                                    states[name]).mask
            np.testing.assert_array_equal(pages[row], want)
            if name in before and name in ("h2o", "tova"):  # pages kept now were kept before, or are new since
                old = before[name]
                assert not (pages[row, :, :old.shape[1] - 1] & ~old[:, :-1]).any()
            before[name] = pages[row]


def test_teacher_forced_rows_follow_dense_and_count_matches(tiny):
    _, _, got, _ = tiny
    out = _decode(tiny, [("quest", 128), ("streaming", 16)], forced=True)
    assert all(a.forced_match == 1.0 for a in out["quest", 128])
    small = out["streaming", 16]
    assert all(0.0 <= a.forced_match <= 1.0 for a in small)
    free = _decode(tiny, [("streaming", 16)])["streaming", 16]
    assert [a.tokens for a in free] == [a.tokens for a in small]  # forced rows apart
    fed = forced_inputs(got.tokens, 2, True)
    assert fed.shape == (4 * 3, STEPS) and (fed[:6] == -1).all()
    assert fed[6:9].tolist() == got.tokens


def test_divergence_fields_on_known_answers():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    answers = [Answer([1, 2], True, None, 1.0), Answer([9, 2], False, 0, 0.5),
               Answer([1, 7], False, 1, 0.5)]
    got = rows.divergence_fields(answers)
    assert got["dense_agreement"] == pytest.approx(1 / 3)
    assert got["first_divergence"] == "-|0|1"
    assert got["first_divergence_median"] == 0.5
    assert got["forced_match"] == pytest.approx(2 / 3, abs=1e-5)
    assert rows.divergence_fields([Answer([1], None, None)])["forced_match"] is None


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_topk_bound_equals_the_reference_topk(seed):
    """selection.topk_bound (all heads at once) picks what reference.topk picks, sinks and
    window included, also where bounds tie (rounded to a coarse grid)."""
    from questprof.core import reference, selection
    rng = np.random.default_rng(seed)
    length = int(rng.integers(9, 140))
    view = View(rng.standard_normal((6, 8)), rng.standard_normal((2, length, 8)), PAGE, 0.3)
    view._bounds[1, False] = np.round(view.bound(), 0 if seed % 2 else 6)  # ties when coarse
    for k, sinks, window in ((1, 0, 0), (3, 0, 0), (4, 1, 2), (50, 1, 2), (2, 1, 1)):
        got = selection.topk_bound(view, k, sinks=sinks, window=window).mask
        sel, count = reference.topk(view.bound(), np.array([0, view.pages]), k, sinks, window)
        want = np.zeros_like(got)
        np.put_along_axis(want, sel[:, 0, :count[0]].astype(np.int64), True, axis=1)
        np.testing.assert_array_equal(got, want)


def test_a_budget_free_selector_decodes_once_and_answers_every_budget(tiny):
    from questprof.fidelity.task_answers import decoded
    settings = [("bnb:10", 16), ("quest", 16), ("bnb:10", 32), ("quest", 32)]
    assert decoded(settings) == [("bnb:10", 16), ("quest", 16), ("quest", 32)]
    out = _decode(tiny, settings)
    assert set(out) == set(settings) and out["bnb:10", 32] == out["bnb:10", 16]
    alone = _decode(tiny, [("bnb:10", 32)])["bnb:10", 32]
    assert [a.tokens for a in alone] == [a.tokens for a in out["bnb:10", 32]]
