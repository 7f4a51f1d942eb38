"""Every selector beyond plain Quest in the task's decode loop: the selection step of the rows
that task_decode.py decodes, one (selector, budget) setting each.

Quest's rows select through the page index (task_decode.SettingsHook, the backend's stages);
every other selector of questprof.core.selectors runs its NumPy float64 reference here, one row
at a time over that row's own keys (its prompt's prefilled prefix and the tokens it decoded),
with the same views as the metrics (evaluate_selectors.py: seed 1000 * layer + step for
`order:random`). A stateful selector (h2o, tova) keeps one state per (row, layer) for the whole
decode: a page it evicted at one step is gone at every later step of that row.
"""

from __future__ import annotations

import numpy as np

from questprof.core import selectors as registry
from questprof.core.selection import View, box_summary, fp8_outward
from questprof.fidelity.host_index import stored



class RowSelectors:
    """Per-row selection of the non-Quest settings; state per (row, layer), steps per layer.

    The rows of a prompt share its prefilled keys: they are converted to float64 once per
    prompt and layer call (each row writes only its own tokens after them), and the min/max
    summaries of the prefix's whole boxes are kept for the decode (a row summarises only its
    tail), so that a row's View costs its own tokens, not the prompt's."""

    def __init__(self, cache, selectors: list) -> None:
        self.cache = cache
        self.parsed = {s: registry.parse(s) for s in set(selectors) if s != registry.QUEST}
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
                if name == registry.QUEST:
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
