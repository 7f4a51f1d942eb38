"""Hooks on a transformers model's own attention: record decode q/k/v, or attend over Quest's pages.

transformers (>= 5) calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query,
key, value, attention_mask, scaling=..., ...)` from each attention module after RoPE and the
cache update: query [B, Hq, n, d], key and value [B, Hkv, L, d] hold the whole cache. We register
one function under our name that hands decode calls (n == 1) to the active hook (the Recorder
here, the task's SettingsHook in task_decode.py) and lets everything else, and whatever the hook
declines, run the model's own sdpa path.
"""

from __future__ import annotations

import inspect

import torch


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
    """Records each layer's decode queries [B, Hq, d] per step and its latest cache
    [B, Hkv, L, d] (a batch of prompts of equal length), where the model runs."""

    def __init__(self, layers: int) -> None:
        self.queries = [[] for _ in range(layers)]
        self.keys, self.values = [None] * layers, [None] * layers
        self.scaling = None

    def __call__(self, module, query, key, value):
        layer = module.layer_idx
        self.queries[layer].append(query[:, :, 0].detach().float().clone())
        self.keys[layer], self.values[layer] = key.detach(), value.detach()
        self.scaling = float(module.scaling)
        return None  # the model's own attention computes the output

    def tensors(self) -> tuple[torch.Tensor, list, list]:
        """queries [B, layers, steps, Hq, d] float32, and each layer's keys and values
        [B, Hkv, L, d] (views of the model's cache, its dtype), on the model's device."""
        q = torch.stack([torch.stack(steps, dim=1) for steps in self.queries], dim=1)
        return q, list(self.keys), list(self.values)


def with_room(cache, room: int):
    """`cache` (a DynamicCache) with each layer's keys and values in buffers with room for
    `room` more tokens, so decode steps write in place: transformers' DynamicLayer concatenates
    the whole cache at every step (1.9 GB a step for 20 SmolLM2 prompts of 2K tokens)."""
    from transformers.cache_utils import DynamicLayer

    class RoomyLayer(DynamicLayer):
        """A DynamicLayer whose keys and values are views of preallocated buffers."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()
            self.device, self.is_initialized, self.filled = keys.device, True, keys.shape[-2]
            shape = (*keys.shape[:-2], self.filled + room, keys.shape[-1])
            self.room_k, self.room_v = keys.new_empty(shape), values.new_empty(shape)
            self.room_k[..., : self.filled, :], self.room_v[..., : self.filled, :] = keys, values
            self._view()

        def _view(self) -> None:
            self.keys = self.room_k[..., : self.filled, :]
            self.values = self.room_v[..., : self.filled, :]

        def update(self, key_states, value_states, *args, **kwargs):
            end = self.filled + key_states.shape[-2]
            if end > self.room_k.shape[-2]:  # beyond the room: grow as DynamicLayer does
                self.__class__ = DynamicLayer
                return self.update(key_states, value_states)
            self.room_k[..., self.filled:end, :] = key_states
            self.room_v[..., self.filled:end, :] = value_states
            self.filled = end
            self._view()
            return self.keys, self.values

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)  # checks the sign; keys and values become views
            self.filled = self.keys.shape[-2]

    cache.layers = [RoomyLayer(layer.keys, layer.values) for layer in cache.layers]
    return cache


def _cache_kw(model) -> str:
    """The forward keyword of the KV cache: 'cache' (transformers >= 5.2x) or 'past_key_values'."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def prefill(model, ids: torch.Tensor, cache=None):
    """Run the prompts' ids [B, n] (after `cache`'s tokens, when given); returns the cache
    (logits of the last position only)."""
    kw = {_cache_kw(model): cache} if cache is not None else {}
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw)
    return getattr(out, "cache", None) or out.past_key_values


def decode(model, cache, tokens, steps: int, forced=None) -> list[list[int]]:
    """Greedy decode of a batch: feed `tokens` [B] (one per prompt), then each row's argmax,
    `steps` times; returns the new tokens per prompt. forced [B, steps] (teacher forcing):
    where >= 0, the id fed after each step instead of the row's argmax."""
    kw = _cache_kw(model)
    device = next(model.parameters()).device
    ids = torch.tensor([[int(t)] for t in tokens], device=device)
    out = []
    for step in range(steps):
        logits = model(input_ids=ids, use_cache=True, **{kw: cache}).logits
        ids = logits[:, -1].argmax(dim=-1, keepdim=True)
        out.append(ids[:, 0].tolist())
        if forced is not None:
            fed = forced[:, step:step + 1].to(device)
            ids = torch.where(fed >= 0, fed, ids)
    return [list(row) for row in zip(*out)]
