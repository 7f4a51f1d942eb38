"""BenchArgs, BytesArgs and FidelityArgs: each command's arguments as one frozen record that the
command line builds (as SweepArgs is the sweep's). With no flag the command line passes the
record's defaults, and each flag reaches its own field."""

import dataclasses
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from questprof import results
from questprof.cli import app
from questprof.commands import bench
from questprof.commands import bytes as bytes_cmd
from questprof.commands.bench_args import BenchArgs
from questprof.commands.bytes_args import BytesArgs

# command -> (module whose function the command line calls, that function, its record)
COMMANDS = {"bench": (bench, "bench_command", BenchArgs),
            "bytes": (bytes_cmd, "bytes_command", BytesArgs)}
# every flag of each command away from its default, and the record it must make
GIVEN = {
    "bench": (["--quick", "--no-peers", "--no-graph", "--repeats", "3", "--cases", "my.toml"],
              BenchArgs(quick=True, peers=False, graph=False, repeats=3, cases=Path("my.toml"))),
    "bytes": (["--no-check-formula", "--scenario", "smoke", "--lengths", "2k", "--batch", "2",
               "--page-size", "32", "--budget", "512", "--mode", "shared-max", "--kv-dtype",
               "fp8", "--summary-dtype", "fp16", "--kv-scale", "head", "--tp", "2", "--source",
               "all", "--tolerance", "0.1", "--protocol", "flush"],
              BytesArgs(check_formula=False, scenario="smoke", lengths="2k", batch="2",
                        page_size="32", budget="512", mode="shared-max", kv_dtype="fp8",
                        summary_dtype="fp16", kv_scale="head", tp=2, source="all",
                        tolerance=0.1, protocol="flush")),
}


def passed(monkeypatch, command: str, flags: list[str]):
    """The record the command line hands its command function (which stops there)."""
    module, function, _ = COMMANDS[command]
    got = []

    def stop(args, *rest, **kwargs):
        got.append(args)
        raise typer.Exit(0)

    monkeypatch.setattr(module, function, stop)
    result = CliRunner().invoke(app, [command, *flags])
    assert result.exit_code == 0, result.output
    (args,) = got
    return args


@pytest.mark.parametrize("command", COMMANDS)
def test_no_flag_passes_the_records_defaults(monkeypatch, command):
    record = COMMANDS[command][2]
    args = passed(monkeypatch, command, [])
    assert type(args) is record and args == record()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(args, dataclasses.fields(args)[0].name, None)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_flag_reaches_its_field(monkeypatch, command):
    flags, want = GIVEN[command]
    defaults = COMMANDS[command][2]()
    moved = [f.name for f in dataclasses.fields(want)
             if getattr(want, f.name) == getattr(defaults, f.name)]
    assert moved == [], f"give these a flag here: {moved}"
    assert passed(monkeypatch, command, flags) == want


def test_bytes_judges_at_the_verdicts_tolerance_by_default():
    assert BytesArgs().tolerance == results.BYTES_TOLERANCE
