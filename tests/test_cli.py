"""The command line through Typer's CliRunner: exit codes, one-line errors, files on disk."""

import json
import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from questprof import SCENARIOS_DIR, results
from questprof.commands import sweep
from questprof.cli import app

FAST = ["--repeats", "2", "--warmup", "0"]


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_one_line_error(result):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_help():
    result = run("--help")
    assert result.exit_code == 0
    for command in ("sweep", "doctor", "report", "compare", "bench", "bytes"):
        assert command in result.output


def test_smoke_sweep_without_gpu_leaves_results_and_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    result = run("sweep", "--scenario", "smoke", "--lengths", "2k..16k")
    assert result.exit_code == 0, result.output
    assert time.perf_counter() - start < 60
    (out_dir,) = (tmp_path / "reports").iterdir()
    assert out_dir.name.startswith("smoke-")
    for name in ("results.parquet", "meta.json", "report.html"):
        assert (out_dir / name).is_file(), name
    df, meta = results.load(out_dir)
    if meta["backend"] == "numpy":
        assert "No usable GPU" in result.stderr
        assert "times are CPU times, not GPU kernel times" in result.stderr
    assert len(df) == 4 * len(sweep.ROW_STAGES) and set(df["status"]) == {"ok"}
    assert meta["finished"] and meta["scenario"] == "smoke" and "machine" in meta
    assert "speedup" in result.stdout


BAD_INPUTS = [
    ["--lengths", "128k..2k"],
    ["--lengths", "2x..4k"],
    ["--lengths", "0..4k"],
    ["--page-size", "0"],
    ["--page-size", "12"],
    ["--budget", "0"],
    ["--budget", "20", "--page-size", "16"],
    ["--batch", "0"],
    ["--mode", "per-layer"],
    ["--backend", "tpu"],
    ["--layers", "0"],
    ["--repeats", "0"],
    ["--lengths", "100000000000000000000000"],  # reached pyarrow's int64 as a traceback
    ["--budget", "4294967296"],
]


@pytest.mark.parametrize("args", BAD_INPUTS, ids=lambda a: " ".join(a))
def test_bad_input_is_one_line_and_status_2(args, tmp_path):
    assert_one_line_error(run("sweep", "--scenario", "smoke", "--out", tmp_path / "o", *args))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("seed", ["-1", "99999999999999999999"])
def test_a_scenario_seed_numpy_cannot_take_is_one_line(seed, tmp_path):
    """A negative seed failed in NumPy's generator, one past int64 in pyarrow, as tracebacks."""
    text = (Path(__file__).parent.parent / "scenarios" / "smoke.toml").read_text()
    path = tmp_path / "s.toml"
    path.write_text(text.replace("seed = 0", f"seed = {seed}", 1))
    said = assert_one_line_error(run("sweep", "--scenario", path, "--backend", "numpy",
                                     "--out", tmp_path / "o", *FAST))
    assert "grid.seed" in said


@pytest.mark.parametrize("command", [
    ["fidelity", "--source", "synthetic", "--scenario", "smoke", "--lengths", "1k"],
    ["reuse"], ["serve"]])
def test_a_negative_seed_is_one_line(command, tmp_path):
    assert "--seed" in assert_one_line_error(run(*command, "--seed", "-1",
                                                 "--out", tmp_path / "o"))


def test_unknown_scenario(tmp_path):
    line = assert_one_line_error(run("sweep", "--scenario", "no-such-scenario"))
    assert "no-such-scenario" in line and "smoke" in line


@pytest.mark.parametrize("name", ["shapes", "bench"])
def test_a_bench_file_is_no_scenario(name, tmp_path):
    """scenarios/shapes.toml and bench.toml hold bench cases: not offered as scenarios, and
    given as one, a line that names the command that runs them."""
    assert name not in assert_one_line_error(run("sweep", "--scenario", "no-such-scenario"))
    line = assert_one_line_error(run("sweep", "--scenario", name, "--out", tmp_path / "o"))
    assert f"{name}.toml is a bench file" in line and "questprof bench --cases" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, said", [
    (["--kv-dtype", "int8"], "--kv-dtype int8: model smoke: kv_dtype 'int8' is not supported"),
    (["--tp", "0"], "--tp 0 must be a whole number of GPUs, at least 1"),
    (["--tp", "3"], "--tp 3: model smoke's 4 q heads do not split evenly over 3 GPUs"),
    (["--kv-dtype", "fp8", "--summary-dtype", "fp32"], "--summary-dtype fp32: model smoke: "
     "fp32 summaries over a fp8_e4m3 cache are not supported"),
    (["--kv-dtype", "bf16", "--summary-dtype", "fp16"],  # each is fine alone: both named
     "--kv-dtype bf16 --summary-dtype fp16: model smoke: fp16 summaries over a bf16 cache"),
    (["--mode", ""], "unknown selection mode ''"),  # ran the scenario's modes before
])
def test_a_bad_shape_flag_is_named_not_the_scenario_file(args, said, tmp_path):
    line = assert_one_line_error(run("sweep", "--scenario", "smoke", "--out", tmp_path / "o",
                                     *args))
    assert said in line and "smoke.toml" not in line, line


SMOKE = SCENARIOS_DIR / "smoke.toml"


@pytest.mark.parametrize("edit, word", [
    (lambda t: t.replace("head_dim = 64\n", ""), "head_dim"),       # missing field
    (lambda t: t.replace("head_dim = 64", 'head_dim = "64"'), "head_dim"),  # mistyped value
    (lambda t: t.replace("kv_heads = 2", "kv_head = 2"), "kv_head"),  # misspelt name
])
def test_broken_scenario_file(tmp_path, edit, word):
    path = tmp_path / "broken.toml"
    path.write_text(edit(SMOKE.read_text()))
    line = assert_one_line_error(run("sweep", "--scenario", path))
    assert word in line and "broken.toml" in line


def test_ctrl_c_keeps_rows_and_resume_finishes(tmp_path, monkeypatch):
    out_dir = tmp_path / "run"
    real, calls = sweep.time_layers, []

    def interrupt_on_ninth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 9:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "time_layers", interrupt_on_ninth)
    result = run("sweep", "--scenario", "smoke", "--lengths", "2k,4k", "--out", out_dir, *FAST)
    assert result.exit_code == 130
    assert "interrupted" in result.stderr and "--resume" in result.stderr
    kept = results.read_rows(out_dir)
    assert len(kept) == 8  # 2k: 5 stages + the timed Quest pass; 4k: 2 rows, the 3rd interrupted
    assert (out_dir / results.PARQUET).is_file()
    monkeypatch.setattr(sweep, "time_layers", real)
    result = run("sweep", "--resume", out_dir)  # scenario and lengths come from meta.json
    assert result.exit_code == 0, result.output
    rows = results.read_rows(out_dir)
    assert len(rows) == 2 * len(sweep.ROW_STAGES)
    assert len({(r["config_key"], r["stage"]) for r in rows}) == len(rows)
    assert rows[:8] == kept


def test_report_and_compare(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        assert run("sweep", "--scenario", "smoke", "--lengths", "2k", "--out", d,
                   "--repeats", "5", "--warmup", "0").exit_code == 0
    (a / "report.html").unlink()
    assert run("report", a).exit_code == 0 and (a / "report.html").is_file()
    same = run("compare", a, a)
    assert same.exit_code == 0 and "SLOWER" not in same.stdout
    # CPU times of two repeats are noisy: give both runs tight spreads, B ten times slower.
    for d, factor in ((a, 1), (b, 10)):
        rows = [{**r, "median_ms": 10.0 * factor, "p20_ms": 9.9 * factor, "p80_ms": 10.1 * factor}
                if r["status"] == "ok" else r for r in results.read_rows(a)]
        (d / results.ROWS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    slower = run("compare", a, b, "--threshold", "0.1")
    assert slower.exit_code == 1 and "SLOWER" in slower.stdout
    as_json = run("compare", a, b, "--json")
    assert {json.loads(line)["verdict"] for line in as_json.stdout.splitlines()} == {"SLOWER"}


def test_compare_of_two_cpu_runs_is_noisy_not_slower(tmp_path):
    """Two back-to-back CPU runs once gave 4 SLOWER, 14 FASTER and exit 1."""
    for d in ("a", "b"):
        assert run("sweep", "--scenario", "smoke", "--lengths", "2k,4k", "--backend", "numpy",
                   "--out", tmp_path / d).exit_code == 0
    result = run("compare", tmp_path / "a", tmp_path / "b")
    assert result.exit_code == 0, result.output
    assert "NOISY" in result.stdout and "SLOWER" not in result.stdout
    assert "FASTER" not in result.stdout


def test_without_plotly_a_run_keeps_its_rows_and_says_so_in_one_line(tmp_path, monkeypatch):
    """A machine without plotly (the H200 image): the sweep writes its results and warns that
    report.html is not drawn; `questprof report` then fails in one line, no traceback."""
    import sys

    for name in [m for m in sys.modules if m == "questprof.report" or
                 m.startswith(("questprof.report.", "plotly"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "plotly", None)
    out = tmp_path / "run"
    result = run("sweep", "--scenario", "smoke", "--lengths", "2k", "--out", out, *FAST)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and "plotly is not installed" in result.stderr
    assert results.read_rows(out) and not (out / "report.html").exists()
    assert "plotly is not installed" in assert_one_line_error(run("report", out))


def test_report_and_compare_bad_directories(tmp_path):
    assert_one_line_error(run("report", tmp_path / "nope"))
    assert_one_line_error(run("sweep", "--resume", tmp_path / "nope"))
    assert_one_line_error(run("compare", tmp_path, tmp_path))
    assert_one_line_error(run("compare", tmp_path, tmp_path, "--threshold", "-1"))


def test_doctor_lists_every_item():
    result = run("doctor")
    assert result.exit_code == 0
    for item in ("GPU", "driver", "CuPy", "CUPTI", "ncu", "NVML", "torch"):
        assert item in result.stdout


def test_doctor_tries_a_real_cupti_session(monkeypatch):
    """doctor runs a PM-sampling session in a child process and reports its failure text."""
    import subprocess

    from questprof.core import machine

    said = "CUPTI configure: CUPTI_ERROR_INVALID_PARAMETER (1): configure failed"
    children = []

    def child(args, **kwargs):
        children.append(args)
        return subprocess.CompletedProcess(args, 1, stdout=said + "\n", stderr="")

    monkeypatch.setattr(machine, "_dist_version", lambda *names: "13.4.0")
    monkeypatch.setattr(machine.subprocess, "run", child)
    status, detail = machine._probe(machine._doctor_cupti)
    assert status is None and detail == f"cupti-python 13.4.0: a PM-sampling session failed: {said}"
    assert children and children[0][1:] == ["-m", "questprof.measure.cupti"]


def test_doctor_without_gpu_names_the_install_command(monkeypatch):
    from questprof import console
    from questprof.core import machine

    def missing(why):
        def probe():
            raise machine.Missing(why)
        return probe

    monkeypatch.setattr(machine, "_cupy_version", missing("cupy not installed"))
    monkeypatch.setattr(machine, "_cupy_device", missing("no CuPy"))
    monkeypatch.setattr(machine, "_nvml_gpu", missing("no NVML"))
    rows = {item: (status, detail) for item, status, detail in machine.doctor_rows()}
    hint = f"; on a GPU machine: {console.INSTALL_GPU}"
    assert rows["CuPy"] == ("missing", "cupy not installed" + hint)
    assert rows["GPU"][0] == "missing" and rows["GPU"][1].endswith(console.INSTALL_GPU)
    assert machine.INSTALL_GPU == console.INSTALL_GPU


def _no_gpu():
    from questprof.backends import gpu_unavailable_reason

    return gpu_unavailable_reason() is not None




@pytest.mark.parametrize("args", [("doctor",), ("bench", "--quick"),
                                  ("bytes", "--scenario", "smoke", "--lengths", "4k",
                                   "--budget", "512")])
def test_without_gpu_doctor_bench_and_bytes_name_the_install_command(args):
    from questprof import console

    if not _no_gpu():
        pytest.skip("this machine has a GPU")
    result = run(*args)
    flat = re.sub(r"[\s│┃]", "", result.output)  # Rich wraps table cells at 80 columns
    assert re.sub(r"\s", "", console.INSTALL_GPU) in flat, result.output


def test_bytes_without_gpu_says_so_with_its_own_status():
    result = run("bytes", "--check-formula", "--scenario", "smoke", "--lengths", "4k",
                 "--budget", "512")
    assert result.exit_code == 3
    assert "no DRAM byte source" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("args", [
    ("bytes", "--source", "papi"),
    ("bytes", "--budget", "20"),
    ("bench",),
    ("sweep", "--scenario", "smoke", "--lengths", "4k", "--gpus", "2", "--backend", "numpy"),
    ("sweep", "--scenario", "smoke", "--lengths", "4k", "--e2e", "--e2e-budget", "20"),
])
def test_bytes_bench_and_extras_bad_input(args, tmp_path):
    result = run(*args, *(("--out", str(tmp_path / "o")) if args[0] == "sweep" else ()))
    assert_one_line_error(result)


@pytest.mark.parametrize("torch", ["absent", "cpu build"])
def test_peers_without_a_gpu_are_skipped_rows_with_the_reason(tmp_path, monkeypatch, torch):
    """`sweep --peers` without a GPU ended in a traceback: ModuleNotFoundError for torch, or a
    CPU torch's RuntimeError for torch.Generator(device="cuda")."""
    import sys

    if torch == "absent":
        monkeypatch.setitem(sys.modules, "torch", None)
    elif _no_gpu():
        pytest.importorskip("torch")
    if not _no_gpu():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "run"
    result = run("sweep", "--scenario", "smoke", "--lengths", "2k", "--peers", "--out", out,
                 *FAST)
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    said = [line for line in result.stderr.splitlines() if "peers' rows are skipped" in line]
    assert len(said) == 1 and "time GPU kernels" in said[0], result.stderr
    df, _ = results.load(out)
    peers = df[df["impl"] != "ours"]
    assert set(peers["impl"]) == {"torch-sdpa", "flashinfer"}
    assert set(peers["status"]) == {"skipped"} and peers["reason"].str.contains("GPU").all()
    assert set(df[df["impl"] == "ours"]["status"]) == {"ok"}


def test_sweep_with_e2e_adds_measured_steps(tmp_path):
    pytest.importorskip("torch")  # the end-to-end decoder is torch
    out_dir = tmp_path / "run"
    result = run("sweep", "--scenario", "smoke", "--lengths", "2k,4k", "--backend", "numpy",
                 "--e2e", "--e2e-budget", "512", "--out", str(out_dir))
    assert result.exit_code == 0, result.output
    df, meta = results.load(out_dir)
    e2e = df[df["stage"] == "e2e"]
    assert sorted(e2e["length"]) == [2048, 4096]
    assert (e2e["measured_speedup"] > 0).all() and meta["e2e"]["budget"] == 512
    assert "end-to-end decode step" in result.stdout


def test_version_and_the_page_size_help_from_the_built_table():
    from questprof import __version__
    from questprof.core.config import PAGE_SIZES

    result = run("--version")
    assert result.exit_code == 0 and result.stdout.startswith(f"questprof {__version__}")
    flat = re.sub(r"[│\s]+", " ", run("sweep", "--help").stdout)  # Rich wraps help in a box
    assert f"Page sizes in tokens: {', '.join(map(str, PAGE_SIZES))} " in flat


DAMAGE = {  # a results directory's file -> what a user (or a crash, or a sync tool) left there
    "meta not JSON": ("meta.json", b"{bad"),
    "meta a list": ("meta.json", b"[]"),
    "a row a list": ("rows.jsonl", b'[1, 2]\n'),
    "rows not UTF-8": ("rows.jsonl", b'{"stage": "dense"}\n\xff\xfe\n'),
    "a time as text": ("rows.jsonl", b'{"stage": "dense", "median_ms": "fast"}\n'),
    "meta a folder": ("meta.json", None),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_results_directory_is_one_line_for_report_compare_and_resume(
        damage, smoke_run, tmp_path):
    """Report, compare and --resume over a results directory whose meta.json or rows.jsonl is
    not what questprof wrote: one line naming the file, where each was a traceback (JSON,
    pyarrow, pandas or IsADirectoryError from deep inside)."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(smoke_run, bad)
    name, content = DAMAGE[damage]
    (bad / name).unlink()
    if content is None:
        (bad / name).mkdir()
    elif name == "rows.jsonl":
        (bad / name).write_bytes((smoke_run / name).read_bytes() + content)
    else:
        (bad / name).write_bytes(content)
    for args in (("report", bad), ("compare", smoke_run, bad), ("sweep", "--resume", bad)):
        assert name in assert_one_line_error(run(*args)), args


def test_a_damaged_parquet_table_is_one_line_for_report_and_compare(smoke_run, tmp_path):
    """A directory holding only results.parquet, two bytes of it: pyarrow's ArrowInvalid
    traceback before, one line naming the file now."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "results.parquet").write_bytes(b"PA")
    for args in (("report", bad), ("compare", smoke_run, bad)):
        assert "results.parquet is damaged" in assert_one_line_error(run(*args)), args


@pytest.mark.parametrize("rows", [b"", b"not json at all\n", b'{"a": 1}\n'])
def test_a_directory_of_no_result_rows_is_refused_by_report_and_compare(
        rows, smoke_run, tmp_path):
    """rows.jsonl empty, garbage, or rows of no stage: report wrote an empty page and exit 0,
    compare called every row MISSING; now one line each, and no report.html."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "rows.jsonl").write_bytes(rows)
    for args in (("report", bad), ("compare", smoke_run, bad)):
        assert "holds no result rows" in assert_one_line_error(run(*args)), args
    assert not (bad / "report.html").exists()


def test_ctrl_c_while_the_report_is_drawn_says_the_rows_are_kept(smoke_run, monkeypatch,
                                                                 capsys):
    """After the sweep's table, Ctrl-C in the drawing: exit 130 and no line said why."""
    import sys

    import typer

    from questprof.commands import render

    def stop(*_):
        raise KeyboardInterrupt

    import questprof.report  # noqa: F401  (render imports it at the call, from sys.modules,
    # where another test may have left a module other than the package's attribute)
    monkeypatch.setattr(sys.modules["questprof.report"], "write_report", stop)
    with pytest.raises(typer.Exit) as got:
        render.write_report(smoke_run)
    assert got.value.exit_code == 130
    said = " ".join(capsys.readouterr().err.split())
    assert f"every row is kept in {smoke_run}" in said and "questprof report" in said


def test_a_file_where_a_directory_belongs_and_the_reverse_are_named_as_such(tmp_path):
    """Each said 'not found' of a path that is there."""
    a_file = tmp_path / "rows.txt"
    a_file.write_text("x")
    for args, says in ((("report", a_file), "is a file: a results directory"),
                       (("sweep", "--resume", a_file), "is a file: a results directory"),
                       (("bench", "--cases", tmp_path, "--out", tmp_path / "o"),
                        "is a directory: name the .toml"),
                       (("sweep", "--scenario", "smoke", "--budgets-file", tmp_path),
                        "is a directory: name its budgets.toml")):
        assert says in assert_one_line_error(run(*args)), args


def test_a_fidelity_model_that_is_not_there_is_refused_before_the_sweep(tmp_path):
    """It ran the whole grid, then said 'fidelity not added' and exit 0."""
    out = tmp_path / "o"
    said = assert_one_line_error(run("sweep", "--scenario", "smoke", "--backend", "numpy",
                                     "--fidelity-model", tmp_path / "nope", "--out", out))
    assert "nope not found" in said and not out.exists()


def test_a_resume_without_the_first_runs_arguments_is_refused(smoke_run, tmp_path):
    """meta.json lost: --resume ran the default scenario's whole grid into the directory (its
    rows mixed with the smoke run's); now it refuses, and the rows stay as they were."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(smoke_run, bad)
    (bad / "meta.json").unlink()
    before = (bad / "rows.jsonl").read_bytes()
    assert "no sweep's arguments" in assert_one_line_error(run("sweep", "--resume", bad))
    assert (bad / "rows.jsonl").read_bytes() == before


def test_out_naming_a_file_is_one_line(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    result = run("sweep", "--scenario", "smoke", "--lengths", "2k", "--backend", "numpy",
                 "--out", path, *FAST)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    said = result.stderr.strip().splitlines()[-1]  # after the CPU banner, the run's one error
    assert said.startswith("error: ") and "a file, not a results directory" in said
    assert path.read_text() == "mine"


@pytest.mark.parametrize("command", [
    ("sweep", "--scenario", "smoke", "--lengths", "2k", "--backend", "numpy", *FAST),
    ("bench",), ("bytes", "--scenario", "smoke", "--lengths", "2k")])
def test_out_of_a_finished_run_is_refused_without_resume(smoke_run, command):
    """A new run into a directory of results appended its rows to the first run's (a sweep's
    report then drew both); now every command that writes results refuses it in one line, and
    the first run's rows stay as they were (fidelity and reuse join a sweep's directory: their
    own tests, tests/test_fidelity_cli.py and tests/test_reuse.py)."""
    before = (smoke_run / "rows.jsonl").read_bytes()
    said = assert_one_line_error(run(*command, "--out", smoke_run))
    assert f"--out {smoke_run} already holds a run's results" in said
    assert ("--resume" in said) == (command[0] == "sweep")
    assert (smoke_run / "rows.jsonl").read_bytes() == before


@pytest.mark.parametrize("command", [
    ("sweep", "--scenario", "smoke", "--lengths", "2k", "--backend", "numpy", *FAST),
    ("bench",), ("bytes", "--scenario", "smoke", "--lengths", "2k")])
def test_an_out_that_cannot_be_made_is_named_before_the_run(tmp_path, command):
    """--out under a file: a bare '[Errno 2]' line after the banner and the plan, naming no
    flag; now one line naming --out before anything runs."""
    (tmp_path / "file").write_text("x")
    got = run(*command, "--out", tmp_path / "file" / "run")
    said = assert_one_line_error(got)
    assert "--out" in said and "is a file, not a folder" in said
    assert "numpy" not in got.stdout.lower()  # no banner, no plan


def test_a_directory_of_a_run_that_wrote_no_row_takes_a_new_run(tmp_path):
    """A run that failed before its first row left meta.json alone (serve with a request the
    loop refused); the same --out was refused as holding a run's results."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "meta.json").write_text("{}")
    results.check_new_run(out)  # no error: nothing there to lose
    (out / "rows.jsonl").write_text("")
    results.check_new_run(out)
    (out / "rows.jsonl").write_text('{"stage": "dense"}\n')
    with pytest.raises(results.ConfigError, match="already holds a run's results"):
        results.check_new_run(out)


def test_reuse_refuses_negative_dense_layers_as_serve_and_fidelity_do(tmp_path):
    said = assert_one_line_error(run("reuse", "--dense-layers", "-1", "--out", tmp_path / "o"))
    assert "--dense-layers -1" in said
