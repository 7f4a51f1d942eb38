"""tools/: the probes and benches that run on a GPU by hand. Without one, each still loads, names
its own path in its usage line and answers --help, so none can rot unseen."""

from __future__ import annotations

import sys

import pytest

from conftest import TOOLS, tool

NAMES = sorted(p.stem for p in TOOLS.glob("*.py"))


@pytest.mark.parametrize("name", NAMES)
def test_a_tool_loads_and_answers_help(name, monkeypatch, capsys):
    module = tool(name)
    assert f"tools/{name}.py" in module.__doc__
    monkeypatch.setattr(sys, "argv", [f"tools/{name}.py", "--help"])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_the_quest_step_table():
    """tools/quest_step_table.py: both steps, dense and SDPA, the plain read and their ratios."""
    table = tool("quest_step_table").table
    case = {"model": "mha-32h-d128", "length": 32768, "batch": 1, "budget": 2048,
            "mode": "per-head"}
    rows = [{**case, "stage": "quest", "impl": "ours", "median_ms": 0.032},
            {**case, "stage": "quest", "impl": "ours-persistent", "median_ms": 0.020,
             "same_read_ms": 0.0176},
            {**case, "stage": "dense", "impl": "ours", "median_ms": 0.128},
            {**case, "stage": "dense", "impl": "torch-sdpa", "median_ms": 0.1257},
            {**case, "stage": "quest", "impl": "ours-fused", "median_ms": None}]
    head, _, line = table(rows)
    assert head.startswith("| case | 3-kernel us | persistent us")
    assert line == ("| mha-32h-d128 32K B1 b2048 per-head | 32.0 | 20.0 | 128.0 | 125.7 | 17.60 "
                    "| 3.93 | 6.29 | 1.60 | 0.88 |")
