"""Prompts with attention worth measuring: passkey retrieval and natural text.

Passkey follows the Quest paper's test (from Landmark Attention / LongChat): an instruction,
filler sentences repeated to the wanted length, one line with a 5-digit key, and the question;
the model must generate the key. Prompts of one length have exactly the same number of tokens
(so they run through the model as one batch) and spread their keys over depths (fractions of
the filler before the key line) and over page offsets (the key line's first token modulo
ALIGN, so page boundaries fall everywhere across the line). Natural text comes from CPython's
own `pydoc_data.topics` (the help texts of the language reference), which every Python ships.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from questprof.core.config import ConfigError

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.\n")
FILLER = (" The grass is green. The sky is blue. The sun is yellow. Here we go."
          " There and back again.")
KEY_LINE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"
NATURAL_SOURCE = "CPython pydoc_data.topics (the language reference help texts)"
ALIGN = 32  # the largest page size measured by default: offsets mod 32 cover 8 and 16 too
OFFSET_STRIDE = 7  # prompt i's key starts at offset 7*i mod 32: 20 prompts, 20 offsets, odd step


@dataclass(frozen=True)
class Prompt:
    """Token ids [n] of a prompt, what answer counts as right ('' when none), and a label."""

    ids: tuple[int, ...]
    answer: str
    label: str


def _ids(tokenizer, text: str, special: bool = False) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=special)["input_ids"]]


def _cycle(unit: list[int], phase: int, count: int) -> list[int]:
    """`count` tokens of `unit` repeated, starting at token `phase` of it."""
    return [int(t) for t in np.resize(np.roll(np.asarray(unit), -phase), count)] if count else []


def spread_depths(count: int) -> tuple[float, ...]:
    """`count` depths at the middles of equal slices of 0..1 (0.025, 0.075, ... for 20)."""
    return tuple(round((i + 0.5) / count, 4) for i in range(count))


def passkey(tokenizer, length: int, depth: float, key: int, offset: int | None = None) -> Prompt:
    """A passkey prompt of exactly `length` tokens, the key line at about `depth` of the filler
    and, when `offset` is given, starting at a position = offset (mod ALIGN). The filler before
    the key ends at a sentence (its first sentence may start midway)."""
    head, unit = _ids(tokenizer, INTRO, special=True), _ids(tokenizer, FILLER)
    key_ids, question = _ids(tokenizer, KEY_LINE.format(key=key)), _ids(tokenizer, QUESTION)
    fill = length - len(head) - len(key_ids) - len(question)
    if fill < 1:
        raise ConfigError(f"a passkey prompt needs more than {length - fill} tokens; "
                          f"{length} asked")
    start = len(head) + int(round(depth * fill))
    if offset is not None:
        start += (offset - start) % ALIGN
        start -= ALIGN if start - len(head) > fill else 0
    before = min(max(start - len(head), 0), fill)
    ids = (head + _cycle(unit, (-before) % len(unit), before) + key_ids
           + _cycle(unit, 0, fill - before) + question)
    where = len(head) + before
    return Prompt(tuple(ids), str(key), f"passkey depth {before / fill:.2f} at token {where} "
                                        f"(offset {where % ALIGN}) key {key}")


def passkeys(tokenizer, length: int, depths, seed: int) -> list[Prompt]:
    """One passkey prompt per depth, page offsets spread, keys from a seeded generator."""
    rng = np.random.default_rng(seed + length)
    return [passkey(tokenizer, length, d, int(rng.integers(10000, 100000)),
                    (OFFSET_STRIDE * i) % ALIGN) for i, d in enumerate(depths)]


def natural(tokenizer, length: int, count: int = 1) -> list[Prompt]:
    """`count` windows of `length` tokens of CPython's pydoc topics, spread over the text
    (overlapping only when it is too short); the model continues each (no answer)."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = _ids(tokenizer, text, special=True)
    if len(ids) < length:
        raise ConfigError(f"natural text holds {len(ids)} tokens; {length} asked")
    stride = min(length, (len(ids) - length) // max(count - 1, 1))
    return [Prompt(tuple(ids[i * stride:i * stride + length]), "",
                   f"natural text (pydoc_data.topics) from token {i * stride}")
            for i in range(count)]


def random_tokens(vocab: int, length: int, seed: int) -> Prompt:
    """Random token ids, for a randomly initialised model that has no tokenizer."""
    rng = np.random.default_rng(seed)
    return Prompt(tuple(int(i) for i in rng.integers(0, vocab, length)), "", "random tokens")


def answered(tokenizer, prompt: Prompt, tokens) -> bool | None:
    """Whether the generated tokens contain the prompt's answer (None when it has none)."""
    if not prompt.answer or tokenizer is None:
        return None
    return prompt.answer in tokenizer.decode(list(tokens)).replace(" ", "")
