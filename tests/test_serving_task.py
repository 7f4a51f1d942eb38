"""The passkey task through transformers' serving loop gives the fidelity task's Quest answers,
prompt by prompt (serving/task.py): SmolLM2-135M, 3 prompts of 256 tokens, page 16, a 4-page
budget (a quarter of the pages: some keys are lost, so a wrong answer must match too)."""

from __future__ import annotations

import pytest

from questprof.serving.paged_attention import Policy

LENGTH, PROMPTS, STEPS, SIZE, BUDGET, DENSE = 256, 3, 8, 16, 64, 2


@pytest.fixture(scope="module")
def compared(smollm2_model):
    from questprof.fidelity.prompts import passkeys, spread_depths
    from questprof.serving.task import compare
    prompts = passkeys(smollm2_model.tokenizer, LENGTH, spread_depths(PROMPTS), seed=0)
    policies = [Policy(name, SIZE, BUDGET, DENSE) for name in ("dense", "quest")]
    return compare(smollm2_model, prompts, policies, STEPS)


def test_serving_quest_answers_are_the_fidelity_tasks(compared):
    assert compared.same("quest") == [True] * PROMPTS
    assert [a.correct for a in compared.serving["quest"]] == [a.correct for a in compared.quest]
    assert compared.same("dense", against="dense") == [True] * PROMPTS


def test_every_answer_token_came_from_a_quest_query(compared, smollm2_model):
    """The last prompt token is a one-token chunk: STEPS Quest queries per prompt and layer."""
    runs, log = compared.served["quest"]
    layers = smollm2_model.model.config.num_hidden_layers
    assert log.selections == PROMPTS * STEPS * (layers - DENSE)
    assert [len(s.tokens) for s in runs] == [STEPS] * PROMPTS
