"""Hooks on a transformers model's own attention: record decode q/k/v, or attend over Quest's pages.

transformers (>= 5) calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query,
key, value, attention_mask, scaling=..., ...)` from each attention module after RoPE and the
cache update: query [B, Hq, n, d], key and value [B, Hkv, L, d] hold the whole cache. We register
one function under our name that hands decode calls (n == 1) to the active hook and lets
everything else, and whatever the hook declines, run the model's own sdpa path.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from questprof.fidelity.metrics import selection_mask
from questprof.fidelity.select import PageIndex

ATTENTION = "questprof_fidelity"
_ACTIVE: list = []  # the hook fed by decode calls; a stack so hooks nest in tests


def _attention(module, query, key, value, attention_mask, **kwargs):
    """Our registered attention function: the active hook for decode queries, else sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if _ACTIVE and query.shape[2] == 1:
        out = _ACTIVE[-1](module, query, key, value)
        if out is not None:
            return out, None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def install(model) -> None:
    """Route `model`'s attention through `_attention` (same masks as sdpa)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(ATTENTION)


class active:
    """Context manager: `hook` receives decode attention calls inside the block."""

    def __init__(self, hook) -> None:
        self.hook = hook

    def __enter__(self):
        _ACTIVE.append(self.hook)
        return self.hook

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self.hook)


class Recorder:
    """Records each layer's decode queries [Hq, d] per step and its latest cache [Hkv, L, d]."""

    def __init__(self, layers: int) -> None:
        self.queries = [[] for _ in range(layers)]
        self.keys, self.values = [None] * layers, [None] * layers
        self.scaling = None

    def __call__(self, module, query, key, value):
        layer = module.layer_idx
        self.queries[layer].append(query[0, :, 0].detach().float().cpu())
        self.keys[layer], self.values[layer] = key[0].detach(), value[0].detach()
        self.scaling = float(module.scaling)
        return None  # the model's own attention computes the output

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """queries [layers, steps, Hq, d], keys and values [layers, Hkv, L, d], float32."""
        q = torch.stack([torch.stack(steps) for steps in self.queries])
        k, v = (torch.stack([x.float().cpu() for x in xs]) for xs in (self.keys, self.values))
        return q.numpy(), k.numpy(), v.numpy()


class QuestHook:
    """Decode attention over Quest's pages (backend selection) in layers >= dense_layers."""

    def __init__(self, backend, page_size: int, budget: int, mode: str, dtype: str,
                 dense_layers: int, capacity: int) -> None:
        self.backend, self.page_size, self.k_pages = backend, page_size, budget // page_size
        self.mode, self.dtype, self.dense_layers = mode, dtype, dense_layers
        self.capacity = capacity
        self.indexes: dict[int, PageIndex] = {}

    def _index(self, layer: int, keys: np.ndarray) -> PageIndex:
        index = self.indexes.get(layer)
        if index is None:
            index = self.indexes[layer] = PageIndex(self.backend, keys, self.page_size,
                                                    self.dtype, self.capacity)
        elif keys.shape[1] > index.length:
            index.append(keys[:, index.length:])
        return index

    def __call__(self, module, query, key, value):
        if module.layer_idx < self.dense_layers:
            return None
        index = self._index(module.layer_idx, key[0].detach().float().cpu().numpy())
        q = query[0, :, 0].detach().float().cpu().numpy()
        sel, count = index.select(index.scores(q, self.mode), self.k_pages)
        pages = selection_mask(sel, count, q.shape[0], index.pages)
        tokens = torch.from_numpy(np.repeat(pages, self.page_size, axis=1)[:, : key.shape[2]])
        group = query.shape[1] // key.shape[1]
        k, v = (x.repeat_interleave(group, dim=1) for x in (key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            query, k, v, attn_mask=tokens[None, :, None, :].to(query.device), scale=module.scaling)
        return out.transpose(1, 2).contiguous()


def _cache_kw(model) -> str:
    """The forward keyword of the KV cache: 'cache' (transformers >= 5.2x) or 'past_key_values'."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def prefill(model, ids: torch.Tensor):
    """Run the prompt ids [1, n]; returns the cache (logits of the last position only)."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return getattr(out, "cache", None) or out.past_key_values


def decode(model, cache, token: int, steps: int) -> list[int]:
    """Greedy decode: feed `token`, then each argmax, `steps` times; returns the new tokens."""
    kw, out_tokens = _cache_kw(model), []
    device = next(model.parameters()).device
    for _ in range(steps):
        ids = torch.tensor([[token]], device=device)
        logits = model(input_ids=ids, use_cache=True, **{kw: cache}).logits
        token = int(logits[0, -1].argmax())
        out_tokens.append(token)
    return out_tokens
