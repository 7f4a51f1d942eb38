"""Multi-key and aggregate prompts: where the evidence lies and what counts as right."""

import pytest

from questprof.fidelity import prompts_spread
from questprof.fidelity.prompts import answered


class Chars:
    """A tokenizer of one id per character (enough to place lines and check answers)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _text(prompt) -> str:
    return Chars().decode(prompt.ids)


@pytest.mark.parametrize("length", (600, 2048))
def test_multikey_holds_every_key_spread_and_asks_one_or_all(length):
    one, every = prompts_spread.multikeys(Chars(), length, seed=3)
    for prompt in (one, every):
        assert len(prompt.ids) == length  # one length, one batch
        text = _text(prompt)
        spots = [text.index(f"pass key of {n} is") for n in prompts_spread.NAMES[:4]]
        assert spots == sorted(spots) and spots[-1] - spots[0] > length // 3
    assert one.answer in _text(one) and "|" not in one.answer
    assert len(every.answer.split("|")) == 4
    assert all(k in _text(every) for k in every.answer.split("|"))


def test_answers_need_every_part():
    _, every = prompts_spread.multikeys(Chars(), 1000, seed=1)
    keys = every.answer.split("|")
    said = [ord(c) for c in " ".join(keys)]
    assert answered(Chars(), every, said)
    assert not answered(Chars(), every, [ord(c) for c in " ".join(keys[:-1])])


def test_aggregate_counts_lines_of_the_asked_colour_over_the_whole_prompt():
    for prompt in prompts_spread.aggregates(Chars(), 3000, seed=5):
        text = _text(prompt)
        colour = prompt.label.split()[-1]
        lines = [text.count(f"painted {c}.") for c in prompts_spread.COLOURS]
        assert sum(lines) == 8 and str(text.count(f"painted {colour}.")) == prompt.answer
        first, last = text.index("Item 1 "), text.index("Item 8 ")
        assert last - first > 3000 // 2
        assert text.endswith(f"The number of {colour} items is")
