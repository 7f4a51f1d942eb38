"""A real model's fidelity run says how long it takes and shows it lives: the estimate, the
progress lines, the model's name, no tqdm bars."""

import time

import pytest
from typer.testing import CliRunner

from questprof.cli import app
from questprof.commands.fidelity_time import announcement
from questprof.fidelity import pace
from questprof.fidelity.evaluate import FidelityGrid
from questprof.fidelity.models import known_shape, model_name
from questprof.fidelity.pace import Pace, phase_seconds, shape_dims
from questprof.fidelity.runner import Request

GRID = FidelityGrid((8, 16, 32), (64, 128, 256, 512, 1024), ("per-head",), "fp32", ("quest",))


def test_the_estimate_reproduces_the_measured_default_run():
    """20 SmolLM2 prompts of 2k on the 2-core CPU at load 1.0 (1b88df1): load about 18-25 s,
    capture 93 s, metrics 35 s, task 42 s; the random 8k run on an H200 took 44.3 s."""
    dims = shape_dims(known_shape("smollm2"))
    cpu = phase_seconds(dims, Request("passkey", GRID, (2048,)), gpu=False)
    for phase, measured in {"load": 18, "capture": 93, "metrics": 35, "task": 42}.items():
        assert cpu[phase] == pytest.approx(measured, rel=0.1), phase
    gpu = phase_seconds(dims, Request("passkey", GRID, (8192,), model="random:smollm2-135m"),
                        gpu=True)
    assert sum(gpu.values()) == pytest.approx(44.3, rel=0.1)


def test_the_announcement_names_the_model_as_readme_does():
    """The rows said "SmolLM2-135M-Instruct.Q4_1" where README says SmolLM2-135M."""
    assert model_name("smollm2") == "SmolLM2-135M"
    line = announcement(Request("passkey", GRID, (2048,)), known_shape("smollm2"),
                        Pace(share=0.5), model_name("smollm2"))
    assert line.startswith("fidelity --source passkey on SmolLM2-135M: 20 prompts of 2k "
                           "tokens, 8 decode steps, page sizes 8, 16, 32 x budgets 64, 128, 256, "
                           "512, 1024, the task: "
                           "about 6.")  # 194 CPU-s at half a core
    assert "on the CPU at 0.50 of a core (load 36 s, capture 187 s" in line
    unknown = announcement(Request("passkey", GRID, (2048,), model="m.gguf"), None, Pace(), "m")
    assert unknown.endswith("the time is estimated once the model is loaded")


def test_a_heartbeat_logs_while_its_block_runs_and_stops_after():
    lines = []
    with pace.heartbeat(lines.append, "m 2k tokens: capture", 93.0, every=0.05):
        time.sleep(0.18)
    count = len(lines)
    time.sleep(0.12)
    assert count >= 2 and len(lines) == count
    assert lines[0] == "m 2k tokens: capture: 0 s of about 93 s"


def test_a_real_model_run_announces_and_shows_progress(tmp_path, monkeypatch):
    """`fidelity --source passkey` was silent for 138 s (load and capture) on the CPU."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    monkeypatch.setattr(pace, "PROGRESS_SECONDS", 0.01)
    result = CliRunner().invoke(app, [
        "fidelity", "--source", "passkey", "--model", "random:smoke", "--lengths", "1k",
        "--prompts", "2", "--steps", "2", "--page-size", "16", "--budget", "64",
        "--backend", "numpy", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("fidelity --source passkey on random:smoke: 2 prompts of 1k "
                               "tokens") and "about" in lines[0]
    assert any(line.startswith("random:smoke: load: ") for line in lines)
    assert any(line.startswith("random:smoke 1024 tokens: capture: ") for line in lines)


def test_the_gguf_loader_draws_no_tqdm_bar():
    """transformers' "Converting and de-quantizing GGUF tensors" bar cluttered the log."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from transformers import modeling_gguf_pytorch_utils as gguf

    from questprof.fidelity.models import _quiet_gguf

    with _quiet_gguf():
        assert gguf.tqdm(range(3), desc="Converting").disable
    assert not gguf.tqdm(range(3), disable=False).disable


def test_a_busy_machine_paces_the_estimate_by_its_load(monkeypatch):
    """A probe of this process saw 0.99 of a core where the run got 0.46 at a load of 3.4 on 2
    cores: the share is what the load leaves one thread (the sweep's rule)."""
    import os

    from questprof.backends.numpy import NumpyBackend
    from questprof.commands import fidelity_time

    monkeypatch.setattr(os, "getloadavg", lambda: (3.37, 4.4, 3.4))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert fidelity_time.pace_here(NumpyBackend()).share == pytest.approx(0.46, abs=0.01)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert fidelity_time.pace_here(NumpyBackend()).share == pytest.approx(1.0)
