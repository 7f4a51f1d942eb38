"""Batched evaluation: prompts stacked as heads, shared page summaries, padded paging and one
ordering for all budgets give what the metrics give one query at a time on the reference."""

import numpy as np
import pytest

from questprof.backends import get_backend
from questprof.fidelity.evaluate import FidelityGrid, evaluate, evaluate_batch
from questprof.fidelity.metrics import (METRICS, dense_attention, head_metrics, page_stats,
                                        selection_mask, stale_mask)
from questprof.fidelity.page_index import PageIndex
from questprof.fidelity.synthetic import synthetic_capture

GRID = FidelityGrid((8, 16), (16, 32, 64), ("per-head", "shared-max"))


def _one_query(cap, layer, step, index, s, budget, mode, first_masks):
    """The metrics of one decode query the plain way: the reference backend's selection."""
    n = cap.step_length(step)
    q = cap.queries[layer, step]
    dense = dense_attention(q, cap.keys[layer, :, :n], cap.values[layer, :, :n], cap.scaling)
    stats = page_stats(dense, s)
    bound = index.backend.to_host(index.scores(q[None], "per-head"))
    sel, count = index.select(index.scores(q[None], mode), budget // s)
    mask = selection_mask(sel[:, 0], count, q.shape[0], index.pages)
    first = first_masks.setdefault((s, budget, mode), mask)
    values = head_metrics(stats, mask, bound, stale_mask(first, index.pages))
    return np.stack([np.asarray(values[m]) for m in METRICS])


def _plain(cap) -> dict:
    out = {k: np.full((cap.layers, cap.steps, len(METRICS), cap.q_heads), np.nan)
           for k in GRID.settings()}
    backend = get_backend("numpy")
    for layer in range(cap.layers):
        first = cap.step_length(0)
        indexes = {s: PageIndex(backend, cap.keys[None, layer, :, :first], s, "fp32",
                                cap.length) for s in GRID.page_sizes}
        masks = {}
        for step in range(cap.steps):
            for s, index in indexes.items():
                if step:
                    n = cap.step_length(step)
                    index.append(cap.keys[None, layer, :, n - 1:n])
                for key in [k for k in GRID.settings() if k[0] == s]:
                    out[key][layer, step] = _one_query(cap, layer, step, index, *key, masks)
    return out


def test_a_batch_equals_each_capture_the_plain_way():
    # 77 + 3 tokens: the decode steps cross a page boundary at S = 8 and S = 16
    caps = [synthetic_capture(kind, seed, 2, 6, 2, 16, 80, 3)
            for kind, seed in (("drift", 1), ("random", 2), ("random", 3))]
    batch = evaluate_batch(caps, get_backend("numpy"), GRID)
    for i, cap in enumerate(caps):
        want = _plain(cap)
        alone = evaluate(cap, get_backend("numpy"), GRID)
        for key in GRID.settings():
            np.testing.assert_allclose(batch[key][i], want[key], rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(alone[key], want[key], rtol=1e-9, atol=1e-12)


def test_starting_from_the_prefilled_summaries_changes_nothing():
    """The task's page summaries of the prefilled keys (one token short of the first step),
    copied for the metrics, give the metrics of indexes built from the first step's keys."""
    from questprof.fidelity.page_index import page_index
    caps = [synthetic_capture("random", seed, 2, 6, 2, 16, 80, 3) for seed in (4, 5)]
    backend, first = get_backend("numpy"), caps[0].step_length(0)
    bases = {s: {layer: page_index(backend, np.stack([c.keys[layer, :, :first - 1]
                                                      for c in caps]), s, "fp32", 80)
                 for layer in range(2)} for s in GRID.page_sizes}
    shared = evaluate_batch(caps, backend, GRID, bases=bases)
    fresh = evaluate_batch(caps, backend, GRID)
    for key in GRID.settings():
        np.testing.assert_array_equal(shared[key], fresh[key])
    assert bases[8][0].length == first - 1  # the metrics grew copies, not the bases


def test_prompts_in_chunks_give_the_rows_of_one_batch(monkeypatch):
    """A host too small for every prompt at once runs them in chunks: same rows."""
    pytest.importorskip("transformers")
    from questprof.fidelity import runner
    request = runner.Request("passkey", FidelityGrid((16,), (64, 128)), (300,), steps=2,
                             model="random:smoke", prompts=3, dense_layers=0)
    backend = get_backend("numpy")
    whole = list(runner.fidelity_rows(request, backend))
    monkeypatch.setattr(runner, "CHUNK_SHARE", 1e-9)  # one prompt per chunk
    chunked = list(runner.fidelity_rows(request, backend))
    assert len(whole) == len(chunked)
    for a, b in zip(whole, chunked):
        assert (a["layer"], a["head"], a["step"], a["budget"]) == \
            (b["layer"], b["head"], b["step"], b["budget"])
        assert a["mass_recall"] == pytest.approx(b["mass_recall"], abs=2e-4)
    setting = [r for r in whole if r["layer"] is None and r["step"] is None]
    assert len(setting) == 2 and {r["samples"] for r in setting} == {3}


def test_the_gpu_index_class_gives_the_host_results(monkeypatch):
    """PageIndex (what a GPU backend runs: the backend's own stages over one batched pool) in
    the whole path, here on the NumPy reference backend, against the vectorised host index."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from questprof.fidelity import evaluate as ev
    from questprof.fidelity import model_run
    from questprof.fidelity.models import LoadedModel
    from questprof.fidelity.page_index import PageIndex
    from questprof.fidelity.prompts import random_tokens
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=256)
    tiny = LoadedModel(transformers.LlamaForCausalLM(config).eval(), None, "tiny", 256)
    batch = [random_tokens(97, 45, seed=s) for s in (1, 2)]
    got = model_run.capture(tiny, batch, 3, "random-tokens")
    backend, grid = get_backend("numpy"), FidelityGrid((8,), (16, 64), ("per-head", "shared-mean"))

    def run():
        bases = {8: model_run.base_indexes(got, backend, 8, "fp32", 0)}
        metrics = ev.evaluate_batch(got.captures, backend, grid, bases=bases)
        answers = model_run.task_answers(tiny, batch, got, bases[8], [8, 16], 8, "per-head", 1)
        return metrics, answers

    host = run()
    make = lambda b, keys, s, dtype, cap: PageIndex(b, keys, s, dtype, cap)  # noqa: E731
    monkeypatch.setattr(model_run, "page_index", make)
    monkeypatch.setattr(ev, "page_index", make)
    pool = run()
    for key in grid.settings():
        np.testing.assert_allclose(pool[0][key], host[0][key], rtol=1e-9, atol=1e-12)
    assert pool[1] == host[1]
