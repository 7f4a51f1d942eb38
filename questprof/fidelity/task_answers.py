"""The answers of one task decode (task_decode.py): which settings it runs, what it feeds, and
each prompt's answer under each setting, free-running and, when asked, teacher-forced.

Free-running rows feed their own argmax, so the first step at which a row's token differs from
the dense answer's is where its answer starts to diverge (`first_divergence`). Teacher-forced rows
(the same settings again) are fed the dense answer's tokens: the share of steps at which their
argmax equals dense's says how often selection alone changes the next token, without the drift
of an answer that already went its own way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from questprof.core import selectors as registry


@dataclass(frozen=True)
class Answer:
    """One prompt's answer under one setting: the tokens (free-running), whether they hold the
    key, the first step whose token differs from dense (None: none within the steps), and the
    share of teacher-forced steps whose argmax equals dense's (None when not run)."""

    tokens: list
    correct: bool | None
    first_divergence: int | None
    forced_match: float | None = None


def _budget_free(name: str) -> bool:
    return name != registry.QUEST and not registry.parse(name).family.budgeted


def decoded(settings: list) -> list:
    """The (selector, budget) settings a decode runs: each once, and a selector whose selection
    ignores the budget (bnb) at its first budget only: its other budgets would answer alike."""
    out, seen = [], set()
    for name, budget in settings:
        key = name if _budget_free(name) else (name, budget)
        if key not in seen:
            seen.add(key)
            out.append((name, budget))
    return out


def stand_in(setting: tuple, ran: list) -> tuple:
    """The setting of `ran` (decoded) that answers for `setting`."""
    if setting in ran or not _budget_free(setting[0]):
        return setting
    return next(s for s in ran if s[0] == setting[0])


def first_divergence(tokens, dense) -> int | None:
    """The first step at which `tokens` differ from `dense` (None: they agree throughout)."""
    for step, (a, b) in enumerate(zip(tokens, dense)):
        if int(a) != int(b):
            return step
    return None


def forced_inputs(dense: list[list[int]], copies: int, forced: bool) -> torch.Tensor | None:
    """[2 * copies * P, steps] ids fed after each step: -1 (the row's own argmax) for the free
    rows, the dense answer's tokens for the teacher-forced rows; None when not forced."""
    if not forced:
        return None
    answer = torch.tensor(dense, dtype=torch.long)                   # [P, steps]
    own = torch.full((copies * len(dense), answer.shape[1]), -1, dtype=torch.long)
    return torch.cat([own, answer.repeat(copies, 1)])


def answers(tokens: list[list[int]], dense: list[list[int]], settings: list, correct,
            forced: bool) -> dict:
    """{setting: [Answer per prompt]} from the decoded rows (settings x prompts, then the
    teacher-forced copy of them when `forced`); correct(prompt index, tokens) -> bool | None."""
    prompts, copies = len(dense), len(settings)
    out = {}
    for i, setting in enumerate(settings):
        got = []
        for j in range(prompts):
            own = tokens[i * prompts + j]
            match = None
            if forced:
                fed = tokens[(copies + i) * prompts + j]
                match = float(np.mean([int(a) == int(b) for a, b in zip(fed, dense[j])]))
            got.append(Answer(own, correct(j, own), first_divergence(own, dense[j]), match))
        out[setting] = got
    return out
