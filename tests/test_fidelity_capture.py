"""Capture through the model's own attention, Quest in the decode loop, the safetensors layout."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from questprof.backends import get_backend  # noqa: E402
from questprof.core.config import ConfigError  # noqa: E402
from questprof.fidelity.capture import Capture, load_capture, save_capture  # noqa: E402
from questprof.fidelity.metrics import dense_attention  # noqa: E402
from questprof.fidelity.model_run import base_indexes, capture, task_answers  # noqa: E402
from questprof.fidelity.models import LoadedModel  # noqa: E402
from questprof.fidelity.prompts import random_tokens  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def tiny():
    """A randomly initialised 2-layer Llama with GQA (4 q heads, 2 KV heads, head dim 16)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    return LoadedModel(model, None, "tiny-llama", 256)


def _attention_inputs_of_o_proj(model):
    """Record the input of each layer's o_proj (the attention output) at decode steps."""
    seen = {i: [] for i in range(model.config.num_hidden_layers)}
    handles = []
    for i, layer in enumerate(model.model.layers):
        def hook(module, args, i=i):
            if args[0].shape[1] == 1:
                seen[i].append(args[0][0, 0].detach().clone())
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(hook))
    return seen, handles


def test_hooked_q_k_reproduce_the_models_attention(tiny):
    seen, handles = _attention_inputs_of_o_proj(tiny.model)
    try:
        got = capture(tiny, [random_tokens(97, 40, seed=1)], STEPS, "random-tokens")
    finally:
        for h in handles:
            h.remove()
    cap = got.captures[0]
    assert cap.queries.shape == (2, STEPS, 4, 16) and cap.keys.shape == (2, 2, 42, 16)
    for layer in range(2):
        for step in range(STEPS):
            n = cap.step_length(step)
            ours = dense_attention(cap.queries[layer, step], cap.keys[layer, :, :n],
                                   cap.values[layer, :, :n], cap.scaling).out
            model = seen[layer][step].reshape(4, 16).double()
            torch.testing.assert_close(torch.from_numpy(ours), model, rtol=1e-4, atol=1e-5)


def _answers(tiny, batch, got, page_size, budget, mode, dense_layers=0):
    base = base_indexes(got, get_backend("numpy"), page_size, "fp32", dense_layers)
    return task_answers(tiny, batch, got, base, [budget], page_size, mode, dense_layers)[budget]


def test_quest_over_every_page_answers_like_dense(tiny):
    batch = [random_tokens(97, 50, seed=s) for s in (2, 3, 4)]
    got = capture(tiny, batch, STEPS, "random-tokens")
    answers = _answers(tiny, batch, got, 16, 64, "per-head")
    assert [a[0] for a in answers] == got.tokens
    # a one-page budget changes attention in every layer: the run still completes
    small = _answers(tiny, batch, got, 8, 8, "shared-max")
    assert [len(a[0]) for a in small] == [STEPS] * 3


def test_a_prompt_does_not_depend_on_its_batch(tiny):
    """Captures and Quest answers of a prompt alone equal those of the same prompt in a batch."""
    batch = [random_tokens(97, 61, seed=s) for s in (5, 6, 7)]
    together = capture(tiny, batch, STEPS, "random-tokens")
    alone = capture(tiny, batch[1:2], STEPS, "random-tokens")
    for name in ("queries", "keys", "values"):
        np.testing.assert_allclose(getattr(together.captures[1], name),
                                   getattr(alone.captures[0], name), rtol=1e-4, atol=1e-5)
    assert together.tokens[1] == alone.tokens[0]
    small = _answers(tiny, batch, together, 8, 16, "per-head")
    assert small[1][0] == _answers(tiny, batch[1:2], alone, 8, 16, "per-head")[0][0]


def _capture(rng) -> Capture:
    q = rng.standard_normal((3, 2, 6, 64)).astype(np.float32)
    k = rng.standard_normal((3, 2, 77, 64)).astype(np.float32)
    v = rng.standard_normal((3, 2, 77, 64)).astype(np.float32)
    return Capture(q, k, v, 0.125, "mine-70b", "cache", {"prompt": "x"})


def test_safetensors_round_trip(tmp_path):
    cap = _capture(np.random.default_rng(0))
    back = load_capture(save_capture(tmp_path / "c.safetensors", cap))
    for name in ("queries", "keys", "values"):
        np.testing.assert_array_equal(getattr(back, name), getattr(cap, name))
    assert (back.scaling, back.model, back.info) == (0.125, "mine-70b", {"prompt": "x"})
    assert back.step_length(0) == 76 and back.step_length(1) == 77


def test_missing_tensor_and_missing_file_are_config_errors(tmp_path):
    from safetensors.numpy import save_file
    cap = _capture(np.random.default_rng(1))
    path = save_capture(tmp_path / "c.safetensors", cap)
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if n != "layers.2.value"}
        meta = f.metadata()
    save_file(tensors, str(tmp_path / "broken.safetensors"), metadata=meta)
    with pytest.raises(ConfigError, match="layers.2.value"):
        load_capture(tmp_path / "broken.safetensors")
    with pytest.raises(ConfigError, match="not found"):
        load_capture(tmp_path / "absent.safetensors")


def test_prompts_sharing_a_prefix_prefill_it_once_and_capture_as_alone(tiny):
    """Rows that share their first tokens (passkey prompts before the key line) go through the
    shared-prefix prefill; each row's capture equals the prompt's alone."""
    from questprof.fidelity.model_run import shared_prefixes
    from questprof.fidelity.prompts import Prompt
    rng = np.random.default_rng(8)
    common = [int(t) for t in rng.integers(0, 97, 70)]
    batch = [Prompt(tuple(common[:k] + [int(t) for t in rng.integers(0, 97, 70 - k)]), "", "x")
             for k in (60, 50, 45, 1)]
    base, shared = shared_prefixes(torch.tensor([p.ids[:-1] for p in batch]))
    assert shared[base] == 69 and int(shared.sum()) - 69 >= 50 + 45 + 1  # the shared path
    together = capture(tiny, batch, STEPS, "random-tokens")
    for i, prompt in enumerate(batch):
        alone = capture(tiny, [prompt], STEPS, "random-tokens")
        for name in ("queries", "keys", "values"):
            np.testing.assert_allclose(getattr(together.captures[i], name),
                                       getattr(alone.captures[0], name), rtol=1e-4, atol=1e-5)
        assert together.tokens[i] == alone.tokens[0]


def test_budgets_decoded_together_answer_as_each_alone(tiny):
    """Every budget of a page size decodes in one batch over the shared prefix; each answers as
    it does alone, and a budget covering every page answers as dense attention."""
    batch = [random_tokens(97, 53, seed=s) for s in (9, 10, 11)]
    got = capture(tiny, batch, STEPS, "random-tokens")
    base = base_indexes(got, get_backend("numpy"), 8, "fp32", 1)
    together = task_answers(tiny, batch, got, base, [8, 16, 64], 8, "shared-max", 1)
    for budget in (8, 16, 64):
        alone = task_answers(tiny, batch, got, base, [budget], 8, "shared-max", 1)[budget]
        assert [a[0] for a in together[budget]] == [a[0] for a in alone]
    assert [a[0] for a in together[64]] == got.tokens
