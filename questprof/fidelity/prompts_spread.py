"""Prompts whose evidence is spread over the filler, which one page cannot answer: several keys
among distractors (source `multikey`), and a count over items on many pages (`aggregate`).

Built like the passkey prompts (prompts.py: the same instruction and filler). `multikey`: k
named pass keys spread through the filler, asked for one of them (the others are distractors)
or for all of them in order (the answer 'k1|k2|...' counts as right when every key appears).
`aggregate`: lines naming an item's colour spread evenly over the filler (so over many pages),
and the question how many name a given colour. A 135M model may fail them with dense
attention: the rows report dense accuracy first, so that selection is not blamed for it.
"""

from __future__ import annotations

import numpy as np

from questprof.fidelity.prompts import FILLER, INTRO, Prompt

NAMES = ("Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi")
COLOURS = ("red", "purple", "orange", "white")  # none in the filler (green, blue, yellow)
KEY_LINE = " The pass key of {name} is {key}. Remember it."
ASK_ONE = "\nWhat is the pass key of {name}? The pass key of {name} is"
ASK_ALL = "\nWhat are the pass keys of {names}, in this order? They are"
ITEM_LINE = " Item {i} is painted {colour}."
ASK_COUNT = "\nHow many items are painted {colour}? The number of {colour} items is"


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _spread(tokenizer, length: int, lines: list[str], question: str) -> tuple[int, ...]:
    """Exactly `length` token ids (prompts of one length decode as one batch): INTRO, the
    filler with `lines` at evenly spaced depths, cut where the question must start, then the
    question."""
    asked = [int(i) for i in tokenizer(question, add_special_tokens=False)["input_ids"]]
    fixed = _count(tokenizer, INTRO + "".join(lines)) + len(asked)
    n = max((length - fixed) // _count(tokenizer, FILLER), 1)  # filler sentences that fit
    at = np.linspace(0, n, len(lines) + 2)[1:-1].round().astype(int)
    parts = [INTRO]
    for i in range(n + 2):  # two more, cut back below: no prompt falls short of `length`
        parts += [lines[j] for j in np.flatnonzero(at == i)] + [FILLER]
    body = [int(i) for i in tokenizer("".join(parts))["input_ids"]]
    return tuple(body[:length - len(asked)] + asked)


def multikey(tokenizer, length: int, keys: int, ask: str, seed: int) -> Prompt:
    """k = `keys` named 5-digit keys; ask 'one' (a seeded choice) or 'all'."""
    rng = np.random.default_rng(seed)
    names = list(NAMES[:keys])
    values = [int(v) for v in rng.integers(10000, 100000, keys)]
    lines = [KEY_LINE.format(name=n, key=v) for n, v in zip(names, values)]
    if ask == "one":
        pick = int(rng.integers(keys))
        question, answer = ASK_ONE.format(name=names[pick]), str(values[pick])
    else:
        question = ASK_ALL.format(names=", ".join(names))
        answer = "|".join(str(v) for v in values)
    ids = _spread(tokenizer, length, lines, question)
    return Prompt(ids, answer, f"multikey {keys} keys ask {ask}")


def aggregate(tokenizer, length: int, items: int, seed: int) -> Prompt:
    """`items` item lines of seeded colours; the answer: how many are the first line's colour."""
    rng = np.random.default_rng(seed)
    colours = [COLOURS[int(c)] for c in rng.integers(len(COLOURS), size=items)]
    lines = [ITEM_LINE.format(i=i + 1, colour=c) for i, c in enumerate(colours)]
    asked = colours[0]
    ids = _spread(tokenizer, length, lines, ASK_COUNT.format(colour=asked))
    return Prompt(ids, str(colours.count(asked)), f"aggregate {items} items {asked}")


def multikeys(tokenizer, length: int, seed: int, keys: int = 4) -> list[Prompt]:
    """One prompt asking for one key and one asking for all, seeded by length."""
    return [multikey(tokenizer, length, keys, ask, seed + length) for ask in ("one", "all")]


def aggregates(tokenizer, length: int, seed: int, items: int = 8) -> list[Prompt]:
    """Two counting prompts with different seeds."""
    return [aggregate(tokenizer, length, items, seed + length + i) for i in range(2)]
