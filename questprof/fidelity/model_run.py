"""A real model's decode attention: capture every decode step, and the passkey task under Quest.

The prompt's last token is fed as the first decode step (the rest is prefilled, dense), so
every answer token, the first included, comes from a decode query that Quest would serve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from questprof.core.config import ConfigError
from questprof.fidelity.capture import Capture
from questprof.fidelity.hooks import QuestHook, Recorder, active, decode, install, prefill
from questprof.fidelity.models import LoadedModel
from questprof.fidelity.prompts import Prompt, answered


@dataclass
class Captured:
    """A capture with the dense answer and the prefilled cache (prompt minus its last token)."""

    capture: Capture
    tokens: list[int]
    cache: object
    prefix: int


def check_fits(loaded: LoadedModel, prompt: Prompt, steps: int) -> None:
    """ConfigError when the prompt plus the decode steps exceed the model's context."""
    need = len(prompt.ids) + steps - 1
    if loaded.context and need > loaded.context:
        raise ConfigError(f"prompt of {len(prompt.ids)} tokens + {steps} decode steps exceeds "
                          f"{loaded.name}'s context of {loaded.context} tokens")


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def capture(loaded: LoadedModel, prompt: Prompt, steps: int, source: str) -> Captured:
    """Prefill, then `steps` greedy decode steps with every layer's q, k, v recorded."""
    check_fits(loaded, prompt, steps)
    model = loaded.model
    install(model)
    ids = torch.tensor([prompt.ids[:-1]], device=_device(model))
    cache = prefill(model, ids)
    recorder = Recorder(model.config.num_hidden_layers)
    with active(recorder):
        tokens = decode(model, cache, prompt.ids[-1], steps)
    q, k, v = recorder.arrays()
    text = loaded.tokenizer.decode(tokens) if loaded.tokenizer is not None else ""
    info = {"prompt": prompt.label, "answer": prompt.answer, "generated": text,
            "dense_correct": answered(loaded.tokenizer, prompt, tokens)}
    cap = Capture(q, k, v, recorder.scaling, loaded.name, source, info).check()
    return Captured(cap, tokens, cache, ids.shape[1])


def _crop(cache, keep: int) -> None:
    """Drop the decoded tokens from the cache: keep the first `keep` (transformers 5 crops by
    a negative count of tokens to remove; a positive argument raises)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


@torch.inference_mode()
def quest_answer(loaded: LoadedModel, prompt: Prompt, captured: Captured, backend, page_size: int,
                 budget: int, mode: str, dense_layers: int,
                 dtype: str) -> tuple[list[int], bool | None]:
    """Greedy answer with Quest attention in layers >= dense_layers; (tokens, correct)."""
    steps = captured.capture.steps
    _crop(captured.cache, captured.prefix)
    hook = QuestHook(backend, page_size, budget, mode, dtype, dense_layers,
                     captured.prefix + steps)
    with active(hook):
        tokens = decode(loaded.model, captured.cache, prompt.ids[-1], steps)
    return tokens, answered(loaded.tokenizer, prompt, tokens)
