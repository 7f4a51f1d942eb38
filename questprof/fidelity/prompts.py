"""Prompts with attention worth measuring: passkey retrieval and natural text.

Passkey follows the Quest paper's test (from Landmark Attention / LongChat): an instruction,
filler sentences repeated to the wanted length, one line with a 5-digit key, and the question;
the model must generate the key. Prompts of one length have exactly the same number of tokens
(so they run through the model as one batch) and spread their keys over depths (fractions of
the filler before the key line) and over page offsets (the key line's first token modulo
ALIGN, so page boundaries fall in many places across the line); they share one filler stream,
so every token before a prompt's key line is also in the others. Natural text comes from
CPython's own `pydoc_data.topics` (the help texts of the language reference), which every
Python ships.
"""

from __future__ import annotations

from dataclasses import dataclass
from pydoc_data.topics import topics

import numpy as np

from questprof.core.config import ConfigError

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.\n")
SENTENCES = (" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.",
             " There and back again.")
FILLER = "".join(SENTENCES)
KEY_LINE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"
NATURAL_SOURCE = "CPython pydoc_data.topics (the language reference help texts)"
ALIGN = 32  # the largest page size measured by default: offsets mod 32 cover 8 and 16 too
OFFSET_STRIDE = 7  # prompt i takes the (7 i mod n)-th of the n offsets a sentence start can have


@dataclass(frozen=True)
class Prompt:
    """Token ids [n] of a prompt, what answer counts as right ('' when none), and a label."""

    ids: tuple[int, ...]
    answer: str
    label: str


def _ids(tokenizer, text: str, special: bool = False) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=special)["input_ids"]]


def _cycle(unit: list[int], count: int) -> list[int]:
    """`count` tokens of `unit` repeated."""
    return [int(t) for t in np.resize(np.asarray(unit), count)] if count else []


def spread_depths(count: int) -> tuple[float, ...]:
    """`count` depths at the middles of equal slices of 0..1 (0.025, 0.075, ... for 20)."""
    return tuple(round((i + 0.5) / count, 4) for i in range(count))


class Passkeys:
    """Passkey prompts of exactly `length` tokens on one filler stream (so prompts share every
    token before their key line, and a model prefills that prefix once): the instruction, the
    filler, the key line at the start of a filler sentence, the rest of the filler, the question.
    """

    def __init__(self, tokenizer, length: int) -> None:
        self.tokenizer, self.length = tokenizer, length
        self.head = _ids(tokenizer, INTRO, special=True)
        pieces = [_ids(tokenizer, x) for x in SENTENCES]
        self.unit = _ids(tokenizer, FILLER)
        same = sum(pieces, []) == self.unit  # a tokenizer that merges across sentences: unit only
        self.starts = np.cumsum([0] + [len(p) for p in pieces[:-1]]) if same else np.zeros(1, int)
        self.question = _ids(tokenizer, QUESTION)

    def _fill(self, key_ids: list[int]) -> int:
        fill = self.length - len(self.head) - len(key_ids) - len(self.question)
        if fill < 1:
            raise ConfigError(f"a passkey prompt needs more than {self.length - fill} tokens; "
                              f"{self.length} asked")
        return fill

    def positions(self, fill: int) -> np.ndarray:
        """Sentence starts within a filler of `fill` tokens (where a key line may go)."""
        units = np.arange(fill // len(self.unit) + 1)[:, None] * len(self.unit)
        at = (units + self.starts[None, :]).ravel()
        return at[at <= fill]

    def prompt(self, depth: float, key: int, offset: int | None = None) -> Prompt:
        """The key line at the sentence start nearest `depth` of the filler among those whose
        first token sits at `offset` (mod ALIGN), when any does."""
        key_ids = _ids(self.tokenizer, KEY_LINE.format(key=key))
        fill = self._fill(key_ids)
        at = self.positions(fill)
        if offset is not None and ((len(self.head) + at) % ALIGN == offset).any():
            at = at[(len(self.head) + at) % ALIGN == offset]
        before = int(at[np.argmin(np.abs(at - depth * fill))])
        stream = _cycle(self.unit, fill)
        ids = self.head + stream[:before] + key_ids + stream[before:] + self.question
        where = len(self.head) + before
        return Prompt(tuple(ids), str(key), f"passkey depth {before / fill:.2f} at token "
                                            f"{where} (offset {where % ALIGN}) key {key}")

    def offsets(self) -> list[int]:
        """The offsets (mod ALIGN) a key line can start at, ascending."""
        fill = self._fill(_ids(self.tokenizer, KEY_LINE.format(key=10000)))
        return sorted({int(x) for x in (len(self.head) + self.positions(fill)) % ALIGN})


def passkey(tokenizer, length: int, depth: float, key: int) -> Prompt:
    """One passkey prompt of exactly `length` tokens, the key line near `depth` of the filler."""
    return Passkeys(tokenizer, length).prompt(depth, key)


def passkeys(tokenizer, length: int, depths, seed: int) -> list[Prompt]:
    """One passkey prompt per depth, keys from a seeded generator, the key line's first token
    spread over the offsets (mod ALIGN) a sentence start can take (20 of 32 with SmolLM2's
    tokens: page boundaries of 8, 16 and 32 tokens fall in many places across the line)."""
    maker = Passkeys(tokenizer, length)
    offsets = maker.offsets()
    rng = np.random.default_rng(seed + length)
    return [maker.prompt(d, int(rng.integers(10000, 100000)),
                         offsets[(OFFSET_STRIDE * i) % len(offsets)])
            for i, d in enumerate(depths)]


def natural(tokenizer, length: int, count: int = 1) -> list[Prompt]:
    """`count` windows of `length` tokens of CPython's pydoc topics, spread over the text
    (overlapping only when it is too short); the model continues each (no answer)."""
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
    text = tokenizer.decode(list(tokens)).replace(" ", "")
    return all(part in text for part in prompt.answer.split("|"))  # 'a|b': every part
