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
