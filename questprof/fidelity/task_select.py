"""Every selector in the task's decode loop: the rows of one decode, one (selector, budget)
setting each, answered free-running and, when asked, teacher-forced.

Quest's rows select through the page index (task.SettingsHook, the backend's stages); every other
selector of questprof.core.selectors runs its NumPy float64 reference here, one row at a time
over that row's own keys (its prompt's prefilled prefix and the tokens it decoded), with the same
views as the metrics (evaluate_selectors.py: seed 1000 * layer + step for `order:random`). A
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
from questprof.core.selection import View, box_summary, fp8_outward
from questprof.fidelity.host_index import stored

QUEST = "quest"


class RowSelectors:
    """Per-row selection of the non-Quest settings; state per (row, layer), steps per layer.

    The rows of a prompt share its prefilled keys: they are converted to float64 once per
    prompt and layer call (each row writes only its own tokens after them), and the min/max
    summaries of the prefix's whole boxes are kept for the decode (a row summarises only its
    tail), so that a row's View costs its own tokens, not the prompt's."""

    def __init__(self, cache, selectors: list) -> None:
        self.cache = cache
        self.parsed = {s: registry.parse(s) for s in set(selectors) if s != QUEST}
        self.states: dict = {}
        self.steps: dict = {}
        self.boxes: dict = {}  # (layer, prompt, width) -> min/max of the prefix's whole boxes

    def _bounds(self, keys: np.ndarray, layer: int, prompt: int, prefix: int):
        """box_bounds(q, width, fp8) of keys [Hkv, L, d] for View: the prefix's whole boxes kept
        (and their FP8 rounding while the tail does not raise a KV head's amax, which would
        change its scale), the tail's summarised per row; bounds summed by a float64 matmul."""
        def box_bounds(q: np.ndarray, width: int, fp8: bool) -> np.ndarray:
            whole = prefix // width
            key = (layer, prompt, width)
            if key not in self.boxes:
                summ = box_summary(keys[:, :whole * width], width)
                amax = np.abs(summ).max(axis=(0, 2, 3))
                self.boxes[key] = (summ, amax, fp8_outward(summ, amax))
            head, amax, rounded = self.boxes[key]
            tail = box_summary(keys[:, whole * width:], width)
            if fp8:
                most = np.maximum(amax, np.abs(tail).max(axis=(0, 2, 3)))
                rounded = rounded if (most == amax).all() else fp8_outward(head, most)
                summ = np.concatenate([rounded, fp8_outward(tail, most)])
            else:
                summ = np.concatenate([head, tail])
            return matmul_bound(q, summ)
        return box_bounds

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
        start = prefix.shape[2]
        for j in range(prompts):
            keys = np.empty((prefix.shape[1], start + own.shape[2], prefix.shape[3]))
            keys[:, :start] = stored(prefix[j], index.dtype)
            bounds = self._bounds(keys, layer, j, start)
            for i, (name, k) in enumerate(settings):
                if name == QUEST:
                    continue
                row = i * prompts + j
                keys[:, start:] = stored(own[row], index.dtype)
                view = View(stored(q[row], index.dtype), keys, index.page_size, scaling,
                            seed=1000 * layer + step, box_bounds=bounds)
                state = self.states.setdefault((row, layer), self.parsed[name].start())
                pages[row] = self.parsed[name].select(view, k, state).mask


def matmul_bound(q: np.ndarray, summ: np.ndarray) -> np.ndarray:
    """U [Hq, n] = q+ . max + q- . min for q [Hq, d] over summaries [n, Hkv, 2, d] (the terms
    of reference.estimate, summed by a matmul, as host_index does)."""
    kv_heads = summ.shape[1]
    q = q.reshape(kv_heads, -1, q.shape[-1])                             # [Hkv, g, d]
    lo, hi = summ[:, :, 0].transpose(1, 2, 0), summ[:, :, 1].transpose(1, 2, 0)  # [Hkv, d, n]
    u = np.maximum(q, 0.0) @ hi + np.minimum(q, 0.0) @ lo
    return u.reshape(-1, summ.shape[0])


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
    return name != QUEST and not registry.parse(name).family.budgeted


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
