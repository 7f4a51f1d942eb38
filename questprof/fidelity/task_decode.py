"""The task (passkey, multikey, aggregate) with each selector in the decode loop: every
selector and budget of a page size in one decode.

The rows of one decode are `copies` settings x P prompts (row = setting * P + prompt). They
share the prompts' prefilled cache, kept once ([P, Hkv, L0, d]); only the tokens each row
decodes are its own. Attention of a row is a softmax over its prompt's prefix and its own
tokens, computed so that all settings' queries of a prompt read the prefix's keys and values
once (the task reads the cache once per page size, not once per budget). Layers below
`dense_layers` attend to every token; the others to the pages their setting keeps: Quest's
top-K chosen by page_index.page_index over all its rows at once, every other selector's by its
reference per row (task_selectors.RowSelectors). What a decode runs, feeds and answers:
task_answers.py.
"""

from __future__ import annotations

import numpy as np
import torch

from questprof.core.selectors import QUEST
from questprof.fidelity.device import as_tensor
from questprof.fidelity.hooks import active, decode
from questprof.fidelity.metrics import selection_mask
from questprof.fidelity.metrics_device import selection_masks
from questprof.fidelity.prompts import answered
from questprof.fidelity.task_answers import answers, decoded, forced_inputs, stand_in
from questprof.fidelity.task_selectors import RowSelectors


def shared_cache(cache, prompts: int, copies: int, prefix: int, room: int):
    """A cache of `copies` x `prompts` rows over the first `prefix` tokens of `cache` (a
    prefilled DynamicCache of the prompts), with room for `room` decoded tokens per row."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class SharedLayer(DynamicLayer):
        """keys/values: the rows' own tokens [R, Hkv, t, d]; prefix_k/_v: [P, Hkv, L0, d]."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()
            self.prefix_k, self.prefix_v = keys[..., :prefix, :], values[..., :prefix, :]
            shape = (copies * prompts, keys.shape[1], room, keys.shape[-1])
            self.own_k, self.own_v = keys.new_empty(shape), values.new_empty(shape)
            self.device, self.is_initialized, self.filled = keys.device, True, 0
            self._view()

        def _view(self) -> None:
            self.keys = self.own_k[..., : self.filled, :]
            self.values = self.own_v[..., : self.filled, :]

        def update(self, key_states, value_states, *args, **kwargs):
            end = self.filled + key_states.shape[-2]
            self.own_k[..., self.filled:end, :] = key_states
            self.own_v[..., self.filled:end, :] = value_states
            self.filled = end
            self._view()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return prefix + self.filled

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return prefix + self.filled + query_length, 0

    out = DynamicCache()
    out.layers = [SharedLayer(layer.keys, layer.values) for layer in cache.layers]
    return out


def _to_prefix(x: torch.Tensor, copies: int) -> torch.Tensor:
    """Rows [R, Hkv, g, ...] -> per prompt [P, Hkv, copies * g, ...] (R = copies * P)."""
    rows, kv_heads, group = x.shape[:3]
    x = x.reshape(copies, rows // copies, kv_heads, group, *x.shape[3:])
    x = x.movedim(0, 2)
    return x.reshape(rows // copies, kv_heads, copies * group, *x.shape[4:])


def _to_rows(x: torch.Tensor, copies: int) -> torch.Tensor:
    """The inverse of _to_prefix."""
    prompts, kv_heads, wide = x.shape[:3]
    x = x.reshape(prompts, kv_heads, copies, wide // copies, *x.shape[3:]).movedim(2, 0)
    return x.reshape(copies * prompts, kv_heads, wide // copies, *x.shape[4:])


def shared_attention(query, layer, keep, scaling: float, copies: int) -> torch.Tensor:
    """Decode attention of query [R, Hq, 1, d] over each row's prompt prefix (layer.prefix_k,
    _v [P, Hkv, L0, d]) and its own tokens (layer.keys, .values [R, Hkv, t, d]); keep: [R, Hq,
    L0 + t] bool or None (every token). Softmax in float32. Returns [R, 1, Hq, d]."""
    rows, q_heads, _, d = query.shape
    kv_heads = layer.prefix_k.shape[1]
    q = query.reshape(rows, kv_heads, q_heads // kv_heads, d)
    pre = torch.matmul(_to_prefix(q, copies), layer.prefix_k.transpose(-1, -2)).float()
    own = torch.matmul(q, layer.keys.transpose(-1, -2)).float()            # [R, Hkv, g, t]
    pre, own = pre * scaling, own * scaling
    if keep is not None:
        keep = keep.reshape(rows, kv_heads, -1, keep.shape[-1])
        length = pre.shape[-1]
        pre = pre.masked_fill(~_to_prefix(keep[..., :length], copies), -torch.inf)
        own = own.masked_fill(~keep[..., length:], -torch.inf)
    top = torch.maximum(_to_rows(pre.amax(dim=-1, keepdim=True), copies),
                        own.amax(dim=-1, keepdim=True))                     # [R, Hkv, g, 1]
    pre_w = torch.exp(pre - _to_prefix(top, copies))
    own_w = torch.exp(own - top)
    total = _to_rows(pre_w.sum(dim=-1, keepdim=True), copies) + own_w.sum(dim=-1, keepdim=True)
    out = (_to_rows(torch.matmul(pre_w.to(query.dtype), layer.prefix_v), copies)
           + torch.matmul(own_w.to(query.dtype), layer.values))
    return (out / total.to(out.dtype)).reshape(rows, 1, q_heads, d)


def indexed(settings: list) -> list[int]:
    """The settings whose rows the page index holds, in its row order: Quest's (the first
    setting alone when there is none: the index then only counts pages)."""
    return [i for i, (sel, _) in enumerate(settings) if sel == QUEST] or [0]


class SettingsHook:
    """Decode attention for the rows of `copies` settings of one page size (see the module).

    indexes: {layer: an index of the prefilled keys of the rows of indexed()} for layers >=
    dense_layers;
    settings: (selector, pages kept) per setting in row order, selector a core.selectors
    name ('quest' included). Quest rows select through the index (the backend's
    stages, all rows at once); the others run their NumPy reference per row (task_selectors),
    their state (h2o, tova evictions) kept per (row, layer) across the decode steps."""

    def __init__(self, cache, indexes: dict, settings: list, mode: str,
                 dense_layers: int) -> None:
        self.cache, self.indexes, self.mode, self.dense_layers = cache, indexes, mode, dense_layers
        self.settings = list(settings)
        self.others = RowSelectors(cache, [sel for sel, _ in self.settings])

    def _device_pages(self, index, query, key) -> torch.Tensor:
        """[R, Hq, P] bool on the model's device when every row is Quest's: the index appends
        and selects there and no mask crosses to the host (on an H200 the task of 20 prompts
        of 8K took 3.9 s this way, 2026-12-01)."""
        index.append(key[:, :, -1:].detach())
        q = query[:, :, 0].detach()
        rows, q_heads = q.shape[:2]
        k_pages = [k for _, k in self.settings]
        chosen = index.select_many(index.scores(q, self.mode), sorted(set(k_pages)), host=False)
        prompts = rows // len(k_pages)
        masks = []
        for i, k in enumerate(k_pages):
            sel, count = chosen[k]
            part = as_tensor(sel, query.device)[:, i * prompts:(i + 1) * prompts]
            masks.append(selection_masks(part, count, prompts * q_heads, index.pages))
        return torch.cat(masks).reshape(rows, q_heads, -1)

    def indexed(self) -> list[int]:
        return indexed(self.settings)

    def _quest(self, index, q, pages: np.ndarray, prompts: int) -> None:
        """Fill pages [R, Hq, P] of the Quest settings' rows from the index's top-K (q: the
        queries of the index's rows)."""
        held = [i for i in self.indexed() if self.settings[i][0] == QUEST]
        if not held:
            return
        chosen = index.select_many(index.scores(q, self.mode),
                                   sorted({self.settings[i][1] for i in held}))
        q_heads = q.shape[1]
        for at, i in enumerate(held):
            sel, count = chosen[self.settings[i][1]]
            part = sel[:, at * prompts:(at + 1) * prompts]
            flat = np.ascontiguousarray(part.transpose(1, 0, 2)).reshape(-1, part.shape[2])
            mask = selection_mask(flat, count, prompts * q_heads, index.pages)
            pages[i * prompts:(i + 1) * prompts] = mask.reshape(prompts, q_heads, -1)

    def _keep(self, layer: int, query, key, scaling: float) -> torch.Tensor:
        """[R, Hq, L] bool: the tokens of each row's selected pages."""
        index = self.indexes[layer]
        length = self.cache.layers[layer].get_seq_length()
        if all(sel == QUEST for sel, _ in self.settings):
            pages = self._device_pages(index, query, key)
            return pages.repeat_interleave(index.page_size, dim=2)[:, :, :length]
        q = query[:, :, 0].detach().float().cpu().numpy()
        rows, q_heads = q.shape[:2]
        prompts = rows // len(self.settings)
        mine = np.concatenate([np.arange(i * prompts, (i + 1) * prompts)
                               for i in self.indexed()])
        index.append(key[mine, :, -1:].detach().float().cpu().numpy())
        pages = np.zeros((rows, q_heads, index.pages), dtype=bool)
        self._quest(index, q[mine], pages, prompts)
        self.others.fill(layer, q, self.settings, pages, index, scaling)
        return torch.as_tensor(pages).repeat_interleave(index.page_size, dim=2)[:, :, :length]

    def __call__(self, module, query, key, value):
        layer = module.layer_idx
        keep = (None if layer < self.dense_layers
                else self._keep(layer, query, key, float(module.scaling)))
        if keep is not None:
            keep = keep.to(query.device)
        return shared_attention(query, self.cache.layers[layer], keep, module.scaling,
                                len(self.settings))


@torch.inference_mode()
def decode_settings(loaded, batch, captured, base: dict, settings: list, page_size: int,
                    mode: str, dense_layers: int, forced: bool = False) -> dict:
    """{(selector, budget): [task_answers.Answer per prompt]}: greedy answers with each setting's
    selection in layers >= dense_layers, every setting of `page_size` in one decode (Quest's
    rows in `mode`, the others per head); `forced` adds a teacher-forced copy of every row.
    base: model_run.base_indexes at this page size; captured: model_run.capture's."""
    steps, prompts = captured.steps, len(batch)
    every, settings = settings, decoded(settings)
    rows = [(name, budget // page_size) for name, budget in settings] * (2 if forced else 1)
    cache = shared_cache(captured.cache, prompts, len(rows), captured.prefix, steps)
    held = len(indexed(rows))  # Quest's rows only: 2.5 GB less for 2 prompts at 2K
    indexes = {layer: index.tiled(held) for layer, index in base.items() if layer >= dense_layers}
    hook = SettingsHook(cache, indexes, rows, mode, dense_layers)
    fed = forced_inputs(captured.tokens, len(settings), forced)
    with active(hook):
        tokens = decode(loaded.model, cache, [p.ids[-1] for p in batch] * len(rows), steps, fed)
    right = lambda j, got: answered(loaded.tokenizer, batch[j], got)  # noqa: E731
    got = answers(tokens, captured.tokens, list(settings), right, forced)
    return {s: got[stand_in(s, settings)] for s in every}
