"""Fidelity on the base install (no torch): synthetic caches run, a real model says what to
install in one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from questprof.cli import app

ROOT = Path(__file__).resolve().parents[1]
# a fresh interpreter where `pip install -e .` is all there is: the fidelity extras and torch
# cannot be imported (None in sys.modules makes `import torch` raise ImportError)
BASE_INSTALL = ("import runpy, sys\n"
                "for name in ('torch', 'transformers', 'safetensors', 'accelerate', 'gguf'):\n"
                "    sys.modules[name] = None\n"
                "sys.argv = ['questprof', *sys.argv[1:]]\n"
                "runpy.run_module('questprof', run_name='__main__')\n")


def run(*args):
    return CliRunner().invoke(app, ["fidelity", *[str(a) for a in args]])


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_synthetic_fidelity_runs_without_torch(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                  "")])}
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", BASE_INSTALL, "fidelity", "--source", "synthetic", "--scenario",
         "smoke", "--lengths", "1k", "--steps", "2", "--page-size", "16", "--budget", "64,128",
         "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert (out / "results.parquet").is_file() and (out / "report.html").is_file()


@pytest.mark.parametrize("source,install", [
    ("passkey", "pip install -e '.[torch,fidelity]'"),
    ("natural", "pip install -e '.[torch,fidelity]'"),
])
def test_a_real_model_without_torch_is_one_line_with_the_install(source, install, monkeypatch,
                                                                  tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)
    line = one_line_error(run("--source", source, "--out", tmp_path / "x"))
    assert "torch" in line and line.endswith(install), line
    assert not (tmp_path / "x").exists()


def test_a_capture_without_safetensors_names_the_fidelity_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    line = one_line_error(run("--source", "cache", tmp_path / "c.safetensors",
                              "--out", tmp_path / "x"))
    assert "safetensors" in line and line.endswith("pip install -e '.[fidelity]'"), line
