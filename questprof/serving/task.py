"""The passkey task answered through transformers' serving loop, prompt by prompt beside the
fidelity task's Quest loop on the same prompts and settings.

The fidelity task (fidelity/model_run.py, task_decode.py) prefills each prompt but its last
token densely and feeds that token as the first decode step, so every answer token, the first
included, comes from a query Quest serves. transformers' loop prefills the whole prompt and
takes the first token from the prefill. To give Quest the same first query here, each request
runs alone (one request per batch) with `max_batch_tokens` = prompt length - 1: the prompt is
prefilled in two chunks, the last of one token, which QuestPaged answers as a decode step (one
query over the request's cache). Everything else is the fidelity task's: page size, budget in
whole pages with the tail page in, the first layers dense, per-head selection, greedy tokens,
the cache in fp32 and its summaries in float64 (NumPy reference backend), the same count of
tokens per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from questprof.backends import get_backend
from questprof.core.selectors import QUEST
from questprof.fidelity.model_run import base_indexes, capture, task_answers
from questprof.fidelity.prompts import Prompt, answered
from questprof.serving.loop import LoopSettings, Request, serve
from questprof.serving.paged_attention import Policy


@dataclass(frozen=True)
class Answer:
    """One prompt's greedy tokens and whether they hold its key."""

    tokens: tuple[int, ...]
    correct: bool | None


@dataclass(frozen=True)
class Compared:
    """Answers per prompt: the fidelity task's dense and Quest, the serving loop's per policy
    ({policy name: [Answer]}); `served` {policy name: (loop.Served list, StepLog)}."""

    prompts: list[Prompt]
    dense: list[Answer]
    quest: list[Answer]
    serving: dict
    served: dict

    def same(self, name: str, against: str = QUEST) -> list[bool]:
        """Per prompt: the serving loop's `name` tokens equal the fidelity task's."""
        want = self.quest if against == QUEST else self.dense
        return [a.tokens == b.tokens for a, b in zip(self.serving[name], want)]


def fidelity_answers(loaded, prompts: list[Prompt], policy: Policy, steps: int):
    """(dense, Quest) answers of the fidelity task: one capture of the prompts, the Quest loop
    at policy's page size, budget and dense layers (NumPy reference, fp32, per-head)."""
    captured = capture(loaded, prompts, steps, "passkey")
    base = base_indexes(captured, get_backend("numpy"), policy.page_size, "fp32",
                        policy.dense_layers)
    got = task_answers(loaded, prompts, captured, base, [policy.budget], policy.page_size,
                       "per-head", policy.dense_layers)[policy.budget]
    dense = [Answer(tuple(t), answered(loaded.tokenizer, p, t))
             for p, t in zip(prompts, captured.tokens)]
    return dense, [Answer(tuple(t), ok) for t, ok in got]


def served_answers(loaded, prompts: list[Prompt], policy: Policy, steps: int, engine=None):
    """(answers, loop.Served list, StepLog) of the prompts through transformers' loop, one
    request per batch, the last prompt token a one-token prefill chunk (see the module)."""
    length = len(prompts[0].ids)
    if {len(p.ids) for p in prompts} != {length}:
        raise ValueError("the prompts of one comparison must have one length")
    requests = [Request(tuple(p.ids), steps) for p in prompts]
    blocks = -(-(length + steps) // policy.page_size) + 2
    settings = LoopSettings(policy.page_size, 1, blocks, length - 1)
    served, log = serve(loaded.model, requests, policy, settings, engine)
    answers = [Answer(s.tokens, answered(loaded.tokenizer, p, s.tokens))
               for p, s in zip(prompts, served)]
    return answers, served, log


def compare(loaded, prompts: list[Prompt], policies: list[Policy], steps: int,
            engine=None) -> Compared:
    """The fidelity task's answers (at the first Quest policy's settings) and the serving
    loop's under each policy, on the same prompts."""
    quest = next(p for p in policies if p.name != "dense")
    dense, sparse = fidelity_answers(loaded, prompts, quest, steps)
    serving, served = {}, {}
    for policy in policies:
        answers, runs, log = served_answers(loaded, prompts, policy, steps, engine)
        serving[policy.name], served[policy.name] = answers, (runs, log)
    return Compared(prompts, dense, sparse, serving, served)
