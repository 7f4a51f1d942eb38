"""BenchArgs, BytesArgs and FidelityArgs: each command's arguments as one frozen record that the
command line builds (as SweepArgs is the sweep's). With no flag the command line passes the
record's defaults, and each flag reaches its own field."""

import dataclasses
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from questprof.cli import app
from questprof.commands import bench
from questprof.commands.bench_args import BenchArgs

# command -> (module whose function the command line calls, that function, its record)
COMMANDS = {"bench": (bench, "bench_command", BenchArgs)}
# every flag of each command away from its default, and the record it must make
GIVEN = {
    "bench": (["--quick", "--no-peers", "--no-graph", "--repeats", "3", "--cases", "my.toml"],
              BenchArgs(quick=True, peers=False, graph=False, repeats=3, cases=Path("my.toml"))),
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
