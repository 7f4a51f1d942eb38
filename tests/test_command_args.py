"""BenchArgs, BytesArgs, FidelityArgs and ServeArgs: each command's arguments as one frozen record that the
command line builds (as SweepArgs is the sweep's). With no flag the command line passes the
record's defaults, each flag reaches its own field, and a default the help states in words is
the one the command applies."""

import dataclasses
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from questprof import results
from questprof.cli import app
from questprof.commands import bench, fidelity, serve
from questprof.commands import bytes as bytes_cmd
from questprof.commands.bench_args import BenchArgs
from questprof.commands.bytes_args import BytesArgs
from questprof.commands.fidelity_args import FidelityArgs
from questprof.commands.serve_args import ServeArgs
from questprof.fidelity.runner import PROMPTS

# command -> (module whose function the command line calls, that function, its record)
COMMANDS = {"bench": (bench, "bench_command", BenchArgs),
            "bytes": (bytes_cmd, "bytes_command", BytesArgs),
            "fidelity": (fidelity, "fidelity_command", FidelityArgs),
            "serve": (serve, "serve_command", ServeArgs)}
# every flag of each command away from its default, and the record it must make
GIVEN = {
    "bench": (["--quick", "--no-peers", "--no-graph", "--repeats", "3", "--cases", "my.toml",
               "--kv-tier", "host", "--summary-tier", "host", "--hbm-pages", "256"],
              BenchArgs(quick=True, peers=False, graph=False, repeats=3, cases=Path("my.toml"),
                        kv_tier="host", summary_tier="host", hbm_pages=256)),
    "bytes": (["--no-check-formula", "--scenario", "smoke", "--lengths", "2k", "--batch", "2",
               "--page-size", "32", "--budget", "512", "--mode", "shared-max", "--kv-dtype",
               "fp8", "--summary-dtype", "fp16", "--kv-scale", "head", "--tp", "2",
               "--kv-tier", "host", "--summary-tier", "host", "--hbm-pages", "64", "--source",
               "all", "--tolerance", "0.1", "--protocol", "flush"],
              BytesArgs(check_formula=False, scenario="smoke", lengths="2k", batch="2",
                        page_size="32", budget="512", mode="shared-max", kv_dtype="fp8",
                        summary_dtype="fp16", kv_scale="head", tp=2, kv_tier="host",
                        summary_tier="host", hbm_pages=64, source="all",
                        tolerance=0.1, protocol="flush")),
    "fidelity": (["capture.safetensors", "--source", "cache", "--scenario", "llama3-8b",
                  "--model", "m.gguf", "--lengths", "4k", "--page-size", "16", "--budget", "256",
                  "--mode", "shared-max", "--selector", "all", "--steps", "2", "--prompts", "3",
                  "--depths", "0.5", "--dense-layers", "1", "--dtype", "fp16", "--no-task",
                  "--teacher-forced", "--min-recall", "0.8", "--backend", "numpy", "--seed", "7"],
                 FidelityArgs(cache=Path("capture.safetensors"), source="cache",
                              scenario="llama3-8b", model="m.gguf", lengths="4k", page_size="16",
                              budget="256", mode="shared-max", selector="all", steps=2,
                              prompts=3, depths="0.5", dense_layers=1, dtype="fp16", task=False,
                              teacher_forced=True, min_recall=0.8, backend="numpy", seed=7)),
    "serve": (["--model", "c.json", "--trace", "t.jsonl", "--mix", "log-uniform", "--lengths",
               "1k..8k", "--requests", "3", "--output", "4", "--policy", "quest", "--page-size",
               "32", "--budget", "512", "--dense-layers", "1", "--concurrency", "1,4", "--sweep",
               "sweep-dir", "--num-blocks", "99", "--max-batch-tokens", "512", "--seed", "7",
               "--engine", "kernels", "--rounds", "3", "--cuda-graph"],
              ServeArgs(model="c.json", trace=Path("t.jsonl"), mix="log-uniform",
                        lengths="1k..8k", requests=3, output=4, policy="quest", page_size=32,
                        budget=512, dense_layers=1, concurrency="1,4", sweep=Path("sweep-dir"),
                        num_blocks=99, max_batch_tokens=512, seed=7, engine="kernels",
                        rounds=3, cuda_graph=True)),
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


def test_fidelity_help_states_the_defaults_make_request_applies():
    """prompts and lengths default to None in FidelityArgs; the help says what None means."""
    params = {p.name: p.help for p in typer.main.get_command(app).commands["fidelity"].params}
    assert f"[default: {PROMPTS}]" in params["prompts"]
    synthetic = fidelity.DEFAULT_LENGTHS["synthetic"]
    assert f"[default: 2k (synthetic: {synthetic})]" in params["lengths"]
    assert set(fidelity.DEFAULT_LENGTHS.values()) - {synthetic} == {"2k"}
    request = fidelity.make_request(FidelityArgs())
    assert request.prompts == PROMPTS and request.lengths == (2048, 4096)


def test_serve_help_states_the_loop_settings_serve_run_applies():
    """num_blocks and max_batch_tokens default to None; the help says what serve_run makes of it."""
    from questprof.commands.serve_run import PREFILL_CHUNK, _settings
    from questprof.serving.loop import Request
    params = {p.name: p.help for p in typer.main.get_command(app).commands["serve"].params}
    assert f"at most {PREFILL_CHUNK}]" in params["max_batch_tokens"]
    assert "enough for the --concurrency longest requests at once]" in params["num_blocks"]
    requests = [Request((1,) * 20000, 4), Request((1,) * 30, 2), Request((1,) * 900, 2)]
    got = _settings(ServeArgs(), 8, requests)
    assert got.max_batch_tokens == PREFILL_CHUNK
    assert got.num_blocks >= sum(-(-(len(r.prompt) + r.output) // 16) for r in requests)
    one = _settings(ServeArgs(), 1, requests).num_blocks  # the longest alone
    assert -(-20004 // 16) <= one < -(-20004 // 16) + -(-902 // 16)


def test_serve_refuses_a_cache_that_does_not_fit_in_one_line():
    """Cache pages past 90% of the GPU's (a CPU model: the host's) free memory: ConfigError
    naming the GiB and what to lower (transformers' allocation stopped with a traceback)."""
    import types

    import torch
    from questprof.commands.serve_run import check_memory
    from questprof.core.config import ConfigError
    config = types.SimpleNamespace(hidden_size=4096, num_attention_heads=32,
                                   num_key_value_heads=8, num_hidden_layers=32, head_dim=None)
    gpu = types.SimpleNamespace(device=torch.device("cuda", 0), config=config,
                                dtype=torch.bfloat16)
    per_page = 16 * 2 * 32 * 8 * 128 * 2  # 16 tokens of K and V, 32 layers, bf16: 2 MiB
    check_memory(gpu, 1000, 16, free_bytes=int(1000 * per_page / 0.9) + 1)
    with pytest.raises(ConfigError, match=r"65536 cache pages of 16 tokens take 128\.0 GiB.*"
                                          r"--num-blocks"):
        check_memory(gpu, 65536, 16, free_bytes=100 * 2**30)
    # on a CPU, the host's memory (a trace of a 10M-token prompt: transformers' MemoryError
    # traceback, then our line)
    cpu = types.SimpleNamespace(device=torch.device("cpu"), config=config, dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"of the host's 1\.0 GiB free"):
        check_memory(cpu, 65536, 16, free_bytes=2**30)
    check_memory(cpu, 100, 16, free_bytes=2**30)
