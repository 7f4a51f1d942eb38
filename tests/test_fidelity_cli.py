"""`questprof fidelity` through Typer's CliRunner: results and report on disk, one-line errors."""

import numpy as np
import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from questprof import results  # noqa: E402
from questprof.cli import app  # noqa: E402
from questprof.fidelity.capture import Capture, save_capture  # noqa: E402

KEYS = ("scenario", "model", "layers", "q_heads", "kv_heads", "head_dim", "dtype", "length",
        "batch", "page_size", "budget", "k_pages", "pages", "mode", "stage", "layer", "head",
        "step", "source", "backend", "status", "reason")
METRICS = ("mass_recall", "oracle_mass", "top10_recall", "page_recall", "output_rel_error",
           "bound_slack")


def run(*args):
    return CliRunner().invoke(app, ["fidelity", *[str(a) for a in args]])


def assert_one_line_error(result, text: str):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert text in lines[0], lines[0]


def test_synthetic_smoke_writes_rows_and_report(tmp_path):
    out = tmp_path / "run"
    result = run("--source", "synthetic", "--scenario", "smoke", "--lengths", "1k",
                 "--steps", "2", "--out", out)
    assert result.exit_code == 0, result.output
    df, meta = results.load(out)
    for column in KEYS + METRICS:
        assert column in df.columns, column
    fid = df[df["stage"] == "fidelity"]
    assert set(fid["source"]) == {"synthetic-random", "synthetic-drift"}
    assert set(fid["page_size"]) == {8, 16, 32} and set(fid["budget"]) == {64, 128, 256, 512, 1024}
    heads = fid[fid["head"].notna()]
    assert len(heads) == 2 * 15 * 2 * 4  # sources x settings x layers x q heads
    assert (heads["oracle_mass"] >= heads["mass_recall"] - 1e-9).all()
    html = (out / "report.html").read_text()
    assert "Fidelity" in html and "fidelity-table" in html and "Fidelity floor" in html
    assert meta["min_recall"] == 0.9


def test_cache_source_reads_a_user_capture(tmp_path):
    rng = np.random.default_rng(7)
    cap = Capture(rng.standard_normal((2, 3, 4, 64), dtype=np.float32),
                  rng.standard_normal((2, 2, 300, 64), dtype=np.float32),
                  rng.standard_normal((2, 2, 300, 64), dtype=np.float32), 0.125, "mine", "cache")
    path = save_capture(tmp_path / "mine.safetensors", cap)
    result = run("--source", "cache", path, "--page-size", "16", "--budget", "64,512",
                 "--dense-layers", "0", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    df, _ = results.load(tmp_path / "run")
    full = df[(df["budget"] == 512) & df["head"].notna()]
    assert np.allclose(full["mass_recall"], 1.0) and set(df["model"]) == {"mine"}


@pytest.mark.parametrize("args,text", [
    (("--source", "passkey", "--model", "/nonexistent/model.gguf"), "not found"),
    (("--source", "cache", "/nonexistent/c.safetensors"), "not found"),
    (("--source", "cache"), "needs the capture file"),
    (("--depths", "0.5,2"), "--depths"),
    (("--source", "elsewhere"), "--source"),
    (("--page-size", "12"), "page size 12"),
    (("--page-size", "32", "--budget", "48"), "not a whole number"),
    (("--mode", "per-group"), "per-group"),
    (("--min-recall", "1.5"), "--min-recall"),
])
def test_bad_input_is_one_line_and_exit_2(args, text, tmp_path):
    assert_one_line_error(run(*args, "--out", tmp_path / "x"), text)


def test_cache_file_with_missing_tensors_exits_2(tmp_path):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)
    save_file({"layers.0.query": rng.standard_normal((1, 4, 64), dtype=np.float32)},
              str(tmp_path / "bad.safetensors"), metadata={"layers": "1", "head_dim": "64"})
    result = run("--source", "cache", tmp_path / "bad.safetensors", "--out", tmp_path / "x")
    assert_one_line_error(result, "layers.0.key")
    assert not (tmp_path / "x").exists()


def test_gguf_of_an_unknown_architecture_exits_2(tmp_path):
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "questprof-none")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run("--source", "passkey", "--model", path, "--out", tmp_path / "x")
    assert_one_line_error(result, "questprof-none")


def test_prompt_longer_than_the_context_exits_2(tmp_path):
    pytest.importorskip("transformers")
    result = run("--source", "passkey", "--model", "random:smollm2-135m", "--lengths", "9000",
                 "--out", tmp_path / "x")
    assert_one_line_error(result, "context of 8192")


def test_fidelity_into_a_sweep_directory_draws_the_frontier(tmp_path):
    out = tmp_path / "sweep"
    sweep = CliRunner().invoke(app, ["sweep", "--scenario", "smoke", "--lengths", "2k",
                                     "--budget", "256,1024", "--out", str(out)])
    assert sweep.exit_code == 0, sweep.output
    scenario = results.load(out)[1]["scenario"]
    result = run("--source", "synthetic", "--lengths", "2k", "--steps", "2", "--page-size", "16",
                 "--budget", "256,1024", "--min-recall", "0.2", "--out", out)
    assert result.exit_code == 0, result.output
    df, meta = results.load(out)
    assert {"dense", "quest", "fidelity"} <= set(df["stage"])
    assert meta["scenario"] == scenario and meta["min_recall"] == 0.2
    html = (out / "report.html").read_text()
    assert "fig-fidelity-frontier" in html and "Recommended</b>: page 16" in html


def test_a_second_fidelity_run_into_the_same_directory_is_refused(tmp_path):
    """It appended its rows to the first run's; a sweep's directory is still joined (above)."""
    out = tmp_path / "run"
    first = run("--source", "synthetic", "--lengths", "1k", "--steps", "1", "--out", out)
    assert first.exit_code == 0, first.output
    before = (out / "rows.jsonl").read_bytes()
    again = run("--source", "synthetic", "--lengths", "1k", "--steps", "1", "--out", out)
    assert_one_line_error(again, "already holds a run's fidelity rows")
    assert (out / "rows.jsonl").read_bytes() == before


@pytest.mark.parametrize("args", [("--source", "synthetic"),
                                  ("--source", "passkey", "--model", "random:smoke")])
def test_dense_layers_that_leave_no_sparse_layer_are_refused(args, tmp_path):
    """smoke's model has 2 layers: --dense-layers 2 or more measured every layer, the dense ones
    included, as if sparse."""
    assert_one_line_error(run(*args, "--dense-layers", "2", "--out", tmp_path / "x"),
                          "--dense-layers 2: smoke has 2 layers, so none would be sparse")


def test_a_model_run_ends_with_its_phase_table(tmp_path):
    """Seconds per phase, last: what a GPU run shows of where its time went."""
    pytest.importorskip("transformers")
    out = tmp_path / "run"
    result = run("--source", "passkey", "--model", "random:smoke", "--lengths", "200",
                 "--prompts", "2", "--steps", "2", "--page-size", "8,16", "--budget", "32,64",
                 "--backend", "numpy", "--out", out)
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    table = lines[lines.index("phase      seconds"):]
    names = [line.split()[0] for line in table[1:]]
    assert names[:4] == ["backend", "load", "capture", "index"] and names[-1] == "total"
    assert {"metrics", "task", "rows", "write", "report"} <= set(names)
    assert all(float(line.split()[1]) >= 0 for line in table[1:])
    df = results.load(out)[0]
    assert len(df[df["layer"].isna() & df["step"].isna()]) == 4  # 2 page sizes x 2 budgets


def test_without_plotly_fidelity_keeps_its_rows_and_says_so_in_one_line(tmp_path, monkeypatch):
    """A machine without plotly (the H200 image): the fidelity run writes its rows and budgets
    and warns that report.html is not drawn, where its budgets table's module imported plotly
    (through report/html.py) and the run ended in ModuleNotFoundError after its rows."""
    import sys

    for name in [m for m in sys.modules if m == "questprof.report" or
                 m.startswith(("questprof.report.", "plotly"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "plotly", None)
    out = tmp_path / "run"
    result = run("--source", "synthetic", "--scenario", "smoke", "--lengths", "1k",
                 "--steps", "2", "--out", out)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and "plotly is not installed" in result.stderr
    assert results.read_rows(out) and not (out / "report.html").exists()


def test_a_synthetic_length_past_free_memory_is_one_line(tmp_path, monkeypatch):
    """--lengths 10m on the CPU machine was killed by the kernel (exit 137, no word); now the
    capture's size is weighed against free host memory first."""
    from questprof.commands import fidelity

    monkeypatch.setattr(fidelity, "host_free_bytes", lambda: 2**30)
    result = run("--source", "synthetic", "--scenario", "smoke", "--lengths", "2k,10m",
                 "--out", tmp_path / "run")
    assert_one_line_error(result, "GiB of host memory, 1.0 GiB is free")
    assert not (tmp_path / "run").exists()
