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


@pytest.mark.parametrize("trace", [False, True])
def test_the_top_k_probe_builds_for_sm_90(trace, tmp_path):
    """tools/topk_latency.py compiles its own kernels around kernels/topk.cuh (the row select,
    the register form at every size it times, an empty kernel), traced (-DTK_TRACE, clock64
    stamps) and not: a change to topk.cuh that breaks the probe fails here, not on the GPU."""
    import subprocess

    from kernel_objects import _nvcc
    from questprof import KERNELS_DIR
    probe = tool("topk_latency")
    forms = {e for pages in (2048, 8192) for _, e, _ in probe.forms(pages)}
    source = probe.SOURCE + "".join(
        f"\ntemplate __global__ void {e}(const float*, int, int, int, int, int, int*);"
        for e in sorted(forms))
    path = tmp_path / "probe.cu"
    path.write_text(source, encoding="utf-8")
    built = subprocess.run([_nvcc(), "-std=c++17", "-arch=sm_90", "-cubin", f"-I{KERNELS_DIR}",
                            *(["-DTK_TRACE"] if trace else []), "-o",
                            str(tmp_path / "probe.cubin"), str(path)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
