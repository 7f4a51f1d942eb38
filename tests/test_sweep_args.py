"""SweepArgs: the sweep's arguments as one typed, frozen object, through meta.json and --resume."""

import dataclasses
import json
import shutil

import pytest
from typer.testing import CliRunner

from questprof import ROOT, results
from questprof.cli import app
from questprof.commands import sweep
from questprof.commands.sweep_args import SweepArgs, resolve_args

FAST = ["--repeats", "2", "--warmup", "0", "--backend", "numpy"]
# meta.json's 'args' keys, in order, as the committed examples hold them (before SweepArgs)
META_KEYS = ["scenario", "lengths", "batch", "page_size", "budget", "mode", "backend", "layers",
             "repeats", "warmup", "graph", "bytes_source", "peers", "e2e", "e2e_budget",
             "e2e_page_size", "gpus", "fidelity", "fidelity_model", "kv_dtype", "summary_dtype",
             "kv_scale", "tp", "e2e_on", "budgets_file", "kv_tier", "summary_tier",
             "hbm_pages", "reuse_overlap", "reuse_trace", "reuse_steps"]


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_defaults_in_one_place_and_frozen():
    args = SweepArgs()
    assert (args.scenario, args.backend, args.graph, args.bytes_source) == (
        "longchat-7b", "auto", True, "auto")
    assert (args.e2e_budget, args.e2e_page_size, args.gpus, args.fidelity) == (2048, 16, 1, None)
    assert args.lengths is None and args.e2e is None and args.peers is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.gpus = 2
    assert list(args.as_dict()) == META_KEYS


def test_options_left_out_take_their_defaults_and_are_not_given():
    args = SweepArgs.from_options(scenario="smoke", lengths=None, gpus=3, peers=False, e2e=None)
    assert args.given == {"scenario", "gpus", "peers"}
    assert (args.scenario, args.gpus, args.peers, args.lengths, args.graph) == (
        "smoke", 3, False, None, True)
    with pytest.raises(TypeError):  # an option the dataclass does not know is a bug, not ignored
        SweepArgs.from_options(tensor_parallel=2)


def test_sweep_args_round_trip_through_meta_json(tmp_path):
    out = tmp_path / "run"
    result = run("sweep", "--scenario", "smoke", "--lengths", "2k", "--budget", "256",
                 "--no-peers", "--bytes", "none", "--out", out, *FAST)
    assert result.exit_code == 0, result.output
    saved = json.loads((out / results.META).read_text(encoding="utf-8"))["args"]
    assert list(saved) == META_KEYS
    args = SweepArgs.from_meta(saved)
    assert args == SweepArgs(scenario="smoke", lengths="2k", budget="256", backend="numpy",
                             repeats=2, warmup=0, bytes_source="none", peers=False,
                             e2e_on=False)
    assert SweepArgs.from_meta(json.loads(json.dumps(args.as_dict()))) == args


SWEEP_METAS = [p for p in sorted(ROOT.glob("reports/**/meta.json"))
               if "args" in json.loads(p.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("path", SWEEP_METAS, ids=lambda p: p.parent.name)
def test_committed_examples_args_still_load(path):
    saved = json.loads(path.read_text(encoding="utf-8"))["args"]
    args = SweepArgs.from_meta(saved)
    known = {f.name for f in dataclasses.fields(SweepArgs)}
    for key, value in saved.items():  # e2e_default of older runs is left out
        if key in known and value is not None:
            assert getattr(args, key) == value


def old_style(meta_path) -> dict:
    """meta.json's args as an older run wrote them: no bytes_source, peers, fidelity nor e2e_on;
    e2e_default instead."""
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    meta["args"] = {k: v for k, v in meta["args"].items()
                    if k not in ("bytes_source", "peers", "fidelity", "e2e_on")}
    meta["args"]["e2e_default"] = False
    meta_path.write_text(json.dumps(meta), encoding="utf-8")
    return meta["args"]


def test_an_old_style_args_dict_still_resumes(tmp_path, monkeypatch):
    out, real, calls = tmp_path / "run", sweep.time_layers, []

    def interrupt_on_fourth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "time_layers", interrupt_on_fourth)
    first = run("sweep", "--scenario", "smoke", "--lengths", "2k,4k", "--budget", "256",
                "--out", out, *FAST)
    assert first.exit_code == 130, first.output
    monkeypatch.setattr(sweep, "time_layers", real)
    saved = old_style(out / results.META)
    resumed = resolve_args(out, SweepArgs.from_options(e2e_budget=512, graph=True))
    assert (resumed.scenario, resumed.lengths, resumed.budget, resumed.repeats) == (
        "smoke", "2k,4k", "256", saved["repeats"])
    assert resumed.e2e_budget == 512 and resumed.bytes_source == "auto"  # given; a default
    result = run("sweep", "--resume", out)
    assert result.exit_code == 0, result.output
    rows = results.read_rows(out)
    assert len(rows) == 2 * len(sweep.ROW_STAGES) and {r["length"] for r in rows} == {2048, 4096}
    args = json.loads((out / results.META).read_text(encoding="utf-8"))["args"]
    assert list(args) == META_KEYS and args["scenario"] == "smoke" and args["repeats"] == 2


@pytest.mark.parametrize("args, said", [
    (["--scenario", "llama3-8b", "--lengths", "2k"], "--scenario llama3-8b: {out} holds a "
     "sweep of smoke"),
    (["--lengths", "2k"], "--lengths 2k: {out} holds lengths 2k,4k"),
    (["--tp", "2"], "--tp 2: {out} holds a run with tp 1"),
    (["--kv-dtype", "fp8"], "--kv-dtype fp8: {out} holds a run with kv dtype fp16"),
    (["--summary-dtype", "fp16", "--kv-dtype", "fp8"], "--kv-dtype fp8: {out} holds"),
    (["--budget", "512"], "--budget 512: {out} holds budget 256"),
    (["--repeats", "5"], "--repeats 5: {out} holds a run with --repeats 2"),
    (["--no-graph"], "--no-graph: {out} holds a run with --graph"),
    (["--kv-tier", "host"], "--kv-tier host: {out} holds a run with kv tier hbm"),
    (["--summary-tier", "host"], "--summary-tier host with --kv-tier hbm"),
    (["--out", "elsewhere"], "--out elsewhere: a resume continues in its own directory, {out}"),
])
def test_a_resume_that_contradicts_its_directory_is_one_line_and_writes_nothing(
        smoke_run, tmp_path, args, said):
    """--resume smokeA --scenario llama3-8b once added 432 llama3-8b rows to 30 smoke rows."""
    out = shutil.copytree(smoke_run, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = run("sweep", "--resume", out, *args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and said.format(out=out) in line, line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_resume_given_its_own_arguments_again_goes_on(smoke_run, tmp_path):
    """Arguments that mean what the first run's meant (2k..4k is 2k,4k; the scenario by name
    or path) are no contradiction, and what joins the grid may be added."""
    out = shutil.copytree(smoke_run, tmp_path / "run")
    result = run("sweep", "--resume", out, "--lengths", "2k..4k", "--scenario",
                 ROOT / "scenarios" / "smoke.toml", "--budget", "256", "--no-fidelity",
                 *FAST)
    assert result.exit_code == 0, result.output
    assert len(results.read_rows(out)) == 2 * len(sweep.ROW_STAGES)


def test_a_resume_times_on_the_backend_of_its_rows(smoke_run, tmp_path):
    """GPU rows resumed on a machine without a GPU would mix kernel and CPU times."""
    out = shutil.copytree(smoke_run, tmp_path / "run")
    meta = json.loads((out / results.META).read_text(encoding="utf-8"))
    (out / results.META).write_text(json.dumps({**meta, "backend": "cupy"}), encoding="utf-8")
    result = run("sweep", "--resume", out)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "its rows were timed on the cupy backend, this run would time numpy-fp32" in \
        result.stderr
