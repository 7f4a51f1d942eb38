"""The passkey task with Quest in the decode loop: every budget of a page size in one decode.

The rows of one decode are `copies` settings x P prompts (row = setting * P + prompt). They
share the prompts' prefilled cache, kept once ([P, Hkv, L0, d]); only the tokens each row
decodes are its own. Attention of a row is a softmax over its prompt's prefix and its own
tokens, computed so that all settings' queries of a prompt read the prefix's keys and values
once (the task reads the cache once per page size, not once per budget). Layers below
`dense_layers` attend to every token; the others to the pages their setting's top-K keeps,
chosen by select.page_index over all rows at once.
"""

from __future__ import annotations

import torch

from questprof.fidelity.device import as_tensor, selection_masks


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


class SettingsHook:
    """Decode attention for the rows of `copies` budgets of one page size (see the module).

    indexes: {layer: an index of the rows' prefilled keys} for layers >= dense_layers;
    k_pages: pages kept per setting, in row order."""

    def __init__(self, cache, indexes: dict, k_pages: list[int], mode: str,
                 dense_layers: int) -> None:
        self.cache, self.indexes, self.k_pages = cache, indexes, k_pages
        self.mode, self.dense_layers = mode, dense_layers

    def _keep(self, layer: int, query, key) -> torch.Tensor:
        """[R, Hq, L] bool on the model's device: the tokens of each row's selected pages."""
        index = self.indexes[layer]
        index.append(key[:, :, -1:].detach())
        q = query[:, :, 0].detach()
        rows, q_heads = q.shape[:2]
        chosen = index.select_many(index.scores(q, self.mode), sorted(set(self.k_pages)),
                                   host=False)
        prompts = rows // len(self.k_pages)
        masks = []
        for i, k in enumerate(self.k_pages):
            sel, count = chosen[k]
            part = as_tensor(sel, query.device)[:, i * prompts:(i + 1) * prompts]
            masks.append(selection_masks(part, count, prompts * q_heads, index.pages))
        pages = torch.cat(masks).reshape(rows, q_heads, -1)
        length = self.cache.layers[layer].get_seq_length()
        return pages.repeat_interleave(index.page_size, dim=2)[:, :, :length]

    def __call__(self, module, query, key, value):
        layer = module.layer_idx
        keep = None if layer < self.dense_layers else self._keep(layer, query, key)
        return shared_attention(query, self.cache.layers[layer], keep, module.scaling,
                                len(self.k_pages))
