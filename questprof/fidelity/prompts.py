"""Prompts with attention worth measuring: passkey retrieval and natural text.

Passkey follows the Quest paper's test (from Landmark Attention / LongChat): an instruction,
filler sentences repeated to the wanted length, one line with a 5-digit key at a chosen depth,
and the question; the model must generate the key. Natural text comes from CPython's own
`pydoc_data.topics` (the help texts of the language reference), which every Python ships.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.\n")
FILLER = (" The grass is green. The sky is blue. The sun is yellow. Here we go."
          " There and back again.")
KEY_LINE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"
NATURAL_SOURCE = "CPython pydoc_data.topics (the language reference help texts)"


@dataclass(frozen=True)
class Prompt:
    """Token ids [n] of a prompt, what answer counts as right ('' when none), and a label."""

    ids: tuple[int, ...]
    answer: str
    label: str


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def passkey(tokenizer, length: int, depth: float, key: int) -> Prompt:
    """A passkey prompt of at most `length` tokens, the key line at `depth` (0..1) of the filler."""
    per_filler = _count(tokenizer, FILLER)
    fixed = _count(tokenizer, INTRO + KEY_LINE.format(key=key) + QUESTION)
    n = max((length - fixed - 8) // per_filler, 1)
    before = int(round(n * depth))
    text = (INTRO + FILLER * before + KEY_LINE.format(key=key) + FILLER * (n - before) + QUESTION)
    ids = tokenizer(text)["input_ids"][:length]
    return Prompt(tuple(int(i) for i in ids), str(key), f"passkey depth {depth:.2f} key {key}")


def passkeys(tokenizer, length: int, depths, seed: int) -> list[Prompt]:
    """One passkey prompt per depth, keys drawn from a seeded generator."""
    rng = np.random.default_rng(seed + length)
    return [passkey(tokenizer, length, d, int(rng.integers(10000, 100000))) for d in depths]


def natural(tokenizer, length: int) -> Prompt:
    """`length` tokens of CPython's pydoc topics; the model continues the text (no answer)."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer(text)["input_ids"][:length]
    return Prompt(tuple(int(i) for i in ids), "", "natural text (pydoc_data.topics)")


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
