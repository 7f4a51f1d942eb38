"""A real model's decode attention for a batch of prompts of equal length: capture every
decode step, and the passkey task with Quest in the decode loop.

The prompt's last token is fed as the first decode step (the rest is prefilled, dense), so
every answer token, the first included, comes from a decode query that Quest would serve.
Prompts run through the model together (one prefill of [B, n - 1] tokens, one decode of B
rows per step); each page size's summaries of the prefilled keys are built once per layer and
copied for each budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from questprof.core.config import ConfigError
from questprof.core.selectors import QUEST
from questprof.fidelity.capture import Capture, layer_names, raise_nonfinite
from questprof.fidelity.hooks import Recorder, active, decode, install, prefill, with_room
from questprof.fidelity.models import LoadedModel
from questprof.fidelity.prompts import Prompt, answered
from questprof.fidelity.page_index import page_index
from questprof.fidelity.task_decode import decode_settings


@dataclass
class Captured:
    """A batch of prompts' decode queries and caches, where the model ran: queries [B, layers,
    steps, Hq, d] float32, each layer's keys and values [B, Hkv, L, d] (the model's dtype);
    the dense answers, each prompt's info, and the prefilled cache (each prompt minus its
    last token, `prefix` tokens). `captures`: the same as host Captures, made when asked."""

    queries: torch.Tensor
    keys: list
    values: list
    scaling: float
    model: str
    source: str
    infos: list[dict]
    tokens: list[list[int]]
    cache: object
    prefix: int

    @property
    def layers(self) -> int:
        return int(self.queries.shape[1])

    @property
    def steps(self) -> int:
        return int(self.queries.shape[2])

    @property
    def q_heads(self) -> int:
        return int(self.queries.shape[3])

    @property
    def kv_heads(self) -> int:
        return int(self.keys[0].shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.keys[0].shape[3])

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2])

    def step_length(self, step: int) -> int:
        """Tokens that the queries of decode step `step` attend to (Capture.step_length)."""
        return self.length - self.steps + 1 + step

    def check(self, origin: str = "capture") -> "Captured":
        """Capture.check's finite test, counted on the device (one wait for all tensors)."""
        tensors = [(name, x) for layer in range(self.layers) for name, x in
                   zip(layer_names(layer), (self.queries[:, layer], self.keys[layer],
                                            self.values[layer]))]
        counts = torch.stack([(~torch.isfinite(x)).sum() for _, x in tensors]).tolist()
        raise_nonfinite([(name, c, x.numel()) for (name, x), c in zip(tensors, counts) if c],
                        origin)
        return self

    @cached_property
    def captures(self) -> list[Capture]:
        """One host Capture per prompt (float32 NumPy): the NumPy references' input."""
        q = self.queries.cpu().numpy()
        k, v = (torch.stack([x.float().cpu() for x in xs], dim=1).numpy()
                for xs in (self.keys, self.values))
        return [Capture(q[i], k[i], v[i], self.scaling, self.model, self.source, info)
                for i, info in enumerate(self.infos)]


def check_fits(loaded: LoadedModel, prompt: Prompt, steps: int) -> None:
    """ConfigError when the prompt plus the decode steps exceed the model's context."""
    need = len(prompt.ids) + steps - 1
    if loaded.context and need > loaded.context:
        raise ConfigError(f"prompt of {len(prompt.ids)} tokens + {steps} decode steps exceeds "
                          f"{loaded.name}'s context of {loaded.context} tokens")


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _check_batch(batch: list[Prompt]) -> int:
    sizes = {len(p.ids) for p in batch}
    if len(sizes) != 1:
        raise ValueError(f"prompts of one batch must have one length, got {sorted(sizes)}")
    return sizes.pop()


@torch.inference_mode()
def capture(loaded: LoadedModel, batch: list[Prompt], steps: int, source: str) -> Captured:
    """Prefill the prompts, then `steps` greedy decode steps with every layer's q, k, v
    recorded; one Capture per prompt."""
    n = _check_batch(batch)
    for prompt in batch:
        check_fits(loaded, prompt, steps)
    model = loaded.model
    install(model)
    ids = torch.tensor([p.ids[:-1] for p in batch], device=_device(model))
    cache = with_room(prefill_shared(model, ids), steps)
    recorder = Recorder(model.config.num_hidden_layers)
    with active(recorder):
        tokens = decode(model, cache, [p.ids[-1] for p in batch], steps)
    infos = []
    for i, prompt in enumerate(batch):
        text = loaded.tokenizer.decode(tokens[i]) if loaded.tokenizer is not None else ""
        infos.append({"prompt": prompt.label, "answer": prompt.answer, "generated": text,
                      "dense_correct": answered(loaded.tokenizer, prompt, tokens[i])})
    return Captured(*recorder.tensors(), recorder.scaling, loaded.name, source, infos, tokens,
                    cache, n - 1).check()


def shared_prefixes(ids: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(base row, tokens each row shares with it from the start [B]) for ids [B, n]: the base
    is the row sharing the most tokens with the others."""
    same = (ids[:, None, :] == ids[None, :, :]).int().cumprod(dim=2).sum(dim=2)   # [B, B]
    base = int(same.sum(dim=1).argmax())
    return base, same[base]


SHARED_ENOUGH = 0.25  # prefill rows apart once their shared prefixes save this share of tokens


def prefill_shared(model, ids: torch.Tensor):
    """The cache of prompts ids [B, n] (all tokens): one prefill of [B, n] when the rows share
    little, else the row that shares most (the base) alone, then each other row's tokens after
    what it shares with the base, on a copy of the base's cache cut to that prefix. Passkey
    prompts on one filler stream share their tokens before the key line: about half of them."""
    from transformers import DynamicCache
    base, shared = shared_prefixes(ids)
    n = ids.shape[1]
    if ids.shape[0] == 1 or int(shared.sum()) - n < SHARED_ENOUGH * ids.numel():
        return prefill(model, ids)
    first = prefill(model, ids[base:base + 1])
    layers = [(layer.keys, layer.values) for layer in first.layers]
    rows = []
    for row in range(ids.shape[0]):
        keep = min(int(shared[row]), n - 1)  # at least one token of each row goes through
        cache = DynamicCache(ddp_cache_data=[(k[:, :, :keep], v[:, :, :keep]) for k, v in layers],
                             config=model.config)
        rows.append(prefill(model, ids[row:row + 1, keep:], cache) if row != base else first)
    stacked = [(torch.cat([r.layers[i].keys for r in rows]),
                torch.cat([r.layers[i].values for r in rows])) for i in range(len(layers))]
    return DynamicCache(ddp_cache_data=stacked, config=model.config)


def base_indexes(captured: Captured, backend, page_size: int, dtype: str,
                 dense_layers: int) -> dict:
    """{layer: index of the prefilled keys [B, Hkv, prefix, d]} for layers >= dense_layers
    (built where the backend runs: from the device's keys on a GPU)."""
    capacity = captured.prefix + captured.steps
    return {layer: page_index(backend, captured.keys[layer][:, :, :captured.prefix], page_size,
                              dtype, capacity)
            for layer in range(dense_layers, captured.layers)}


def task_answers(loaded: LoadedModel, batch: list[Prompt], captured: Captured, base: dict,
                 budgets: list[int], page_size: int, mode: str,
                 dense_layers: int) -> dict[int, list[tuple[list[int], bool | None]]]:
    """{budget: (tokens, correct) per prompt}: greedy answers with Quest attention in layers >=
    dense_layers, every budget of `page_size` in one decode (task_decode.decode_settings, which
    runs the other selectors too). base: base_indexes at this page size."""
    got = decode_settings(loaded, batch, captured, base, [(QUEST, b) for b in budgets],
                          page_size, mode, dense_layers)
    return {b: [(a.tokens, a.correct) for a in got[QUEST, b]] for b in budgets}
