"""Every selector in the task's decode loop: the rows of one decode, one (selector, budget)
setting each, answered free-running and, when asked, teacher-forced.

Quest's rows select through the page index (task.SettingsHook, the backend's stages); every other
selector of questprof.core.selectors runs its NumPy float64 reference here, one row at a time
over that row's own keys (its prompt's prefilled prefix and the tokens it decoded), with the same
views as the metrics (fidelity/selectors.py: seed 1000 * layer + step for `order:random`). A
stateful selector (h2o, tova) keeps one state per (row, layer) for the whole decode: a page it
evicted at one step is gone at every later step of that row.

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
from questprof.core.selection import View
from questprof.fidelity.select import stored

QUEST = "quest"


class RowSelectors:
    """Per-row selection of the non-Quest settings; state per (row, layer), steps per layer."""

    def __init__(self, cache, selectors: list) -> None:
        self.cache = cache
        self.parsed = {s: registry.parse(s) for s in set(selectors) if s != QUEST}
        self.states: dict = {}
        self.steps: dict = {}

    def fill(self, layer: int, q: np.ndarray, settings: list, pages: np.ndarray, index,
             scaling: float) -> None:
        """Fill pages [R, Hq, P] of the non-Quest rows for queries q [R, Hq, d] of `layer`."""
        if not self.parsed:
            return
        step = self.steps.get(layer, 0)
        self.steps[layer] = step + 1
        held = self.cache.layers[layer]
        prompts = len(q) // len(settings)
        prefix = held.prefix_k.detach().float().cpu().numpy()        # [P, Hkv, L0, d]
        own = held.keys.detach().float().cpu().numpy()               # [R, Hkv, t, d]
        for i, (name, k) in enumerate(settings):
            if name == QUEST:
                continue
            for j in range(prompts):
                row = i * prompts + j
                keys = stored(np.concatenate([prefix[j], own[row]], axis=1), index.dtype)
                view = View(stored(q[row], index.dtype), keys, index.page_size, scaling,
                            seed=1000 * layer + step)
                state = self.states.setdefault((row, layer), self.parsed[name].start())
                pages[row] = self.parsed[name].select(view, k, state).mask


@dataclass(frozen=True)
class Answer:
    """One prompt's answer under one setting: the tokens (free-running), whether they hold the
    key, the first step whose token differs from dense (None: none within the steps), and the
    share of teacher-forced steps whose argmax equals dense's (None when not run)."""

    tokens: list
    correct: bool | None
    first_divergence: int | None
    forced_match: float | None = None


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
