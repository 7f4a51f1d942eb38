"""Shapes from where users keep them: a Hugging Face config.json (file or model folder), --tp
head-parallel splits, the cache options, and one clear line for everything refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from questprof.cli import app
from questprof.core import model
from questprof.core.config import ConfigError
from questprof.core.scenarios import HF_GRID, ShapeOptions, load_scenario

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY = FIXTURES / "hf-tiny-gqa"
BASE = json.loads((TINY / "config.json").read_text())


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def write(tmp_path, **changes) -> Path:
    """A config.json of the tiny model with `changes` (None deletes a field)."""
    data = {**BASE, **changes}
    path = tmp_path / "my-model" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return path


def test_sweep_on_a_config_json_runs_on_the_cpu(tmp_path):
    result = run("sweep", "--scenario", TINY / "config.json", "--lengths", "2k",
                 "--backend", "numpy", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "a config.json holds no grid" in result.stderr and "LlamaForCausalLM" in result.stderr
    assert (tmp_path / "run" / "report.html").is_file()
    # only the defaults it uses: --lengths was given
    (note,) = [line for line in result.stderr.splitlines() if "holds no grid" in line]
    assert "batch 1,8, page size 16" in note and "lengths" not in note, note


def test_a_config_json_given_every_grid_value_says_no_default_grid(tmp_path):
    result = run("sweep", "--scenario", TINY, "--lengths", "2k", "--batch", "1", "--page-size",
                 "16", "--budget", "512", "--mode", "per-head", "--backend", "numpy", "--out",
                 tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "holds no grid" not in result.stderr and "LlamaForCausalLM" in result.stderr


def test_tp_says_the_shape_of_one_gpu_on_the_console_and_in_meta_json(tmp_path):
    """With --tp 2 neither the console nor the report stated the per-GPU shape."""
    from questprof import results

    out = tmp_path / "run"
    result = run("sweep", "--scenario", "llama3-8b", "--tp", 2, "--lengths", "2k", "--batch", 1,
                 "--page-size", 16, "--budget", 512, "--mode", "per-head", "--backend", "numpy",
                 "--out", out)
    assert result.exit_code == 0, result.output
    assert "model llama3-8b: 32 layers, 16 q / 4 KV heads of 128 dims per GPU of tensor " \
        "parallelism 2, bf16" in result.stderr
    df, meta = results.load(out)
    shape = meta["shape"]
    assert (shape["q_heads"], shape["kv_heads"], shape["tp"]) == (16, 4, 2)
    assert "per GPU of tensor parallelism 2" in shape["text"]
    from questprof.report import write_report  # the report says it too, under the command

    html = write_report(df, meta, tmp_path / "r").read_text(encoding="utf-8")
    assert "Shape timed: 32 layers, 16 q / 4 KV heads of 128 dims per GPU of tensor " \
        "parallelism 2" in html


def test_a_model_folder_and_its_config_json_give_one_shape():
    folder, file = load_scenario(TINY), load_scenario(TINY / "config.json")
    assert folder.model == file.model and folder.grid == HF_GRID
    m = folder.model
    assert (m.name, m.layers, m.q_heads, m.kv_heads, m.head_dim, m.dtype) == \
        ("hf-tiny-gqa", 4, 8, 2, 64, "bf16")
    assert (m.intermediate, m.vocab, m.dense_layers, m.tp) == (1024, 1000, 2, 1)


def test_head_dim_nesting_dtypes_and_experts(tmp_path):
    m = load_scenario(write(tmp_path, head_dim=128, hidden_size=384)).model
    assert m.head_dim == 128  # an explicit head_dim wins over hidden / heads (Gemma, Qwen3)
    m = load_scenario(write(tmp_path, torch_dtype="float32")).model
    assert m.dtype == "fp16"  # vLLM's dtype="auto" serves float32 checkpoints in fp16 ...
    m = load_scenario(write(tmp_path, torch_dtype="float32", model_type="gemma2")).model
    assert m.dtype == "bf16"  # ... and Gemma 2 in bf16
    text = {k: BASE[k] for k in ("num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "hidden_size")}
    nested = write(tmp_path, num_hidden_layers=None, num_attention_heads=None,
                   text_config={**text, "torch_dtype": "float32"})
    assert load_scenario(nested).model.dtype == "bf16"  # the top level's dtype wins
    moe = load_scenario(write(tmp_path, num_experts_per_tok=4, num_local_experts=32)).model
    assert moe.intermediate == 4 * 1024
    mqa = load_scenario(write(tmp_path, num_key_value_heads=None, multi_query=True)).model
    assert mqa.kv_heads == 1
    mha = load_scenario(write(tmp_path, num_key_value_heads=None)).model
    assert mha.kv_heads == 8


@pytest.mark.parametrize("changes, words", [
    ({"num_hidden_layers": None}, "missing field num_hidden_layers"),
    ({"torch_dtype": None}, "missing field torch_dtype"),
    ({"num_key_value_heads": 3}, "not a whole multiple of 3 key-value heads"),
    ({"num_key_value_heads": 16}, "not a whole multiple of 16"),
    ({"hidden_size": 500}, "hidden_size 500 is not a multiple of 8"),
    ({"dtype": "float16"}, "torch_dtype 'bfloat16' and dtype 'float16' disagree"),
    ({"multi_query": True}, "multi_query is true but num_kv_heads is 2"),
    ({"torch_dtype": "int8"}, "torch_dtype 'int8'"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"layer_types": ["full_attention", "linear_attention"] * 2},
     "linear_attention layers, which are not attention over a KV cache; the nearest supported "
     "shape is its 2 attention layers alone"),
])
def test_missing_contradictory_and_unsupported_fields_are_one_line(tmp_path, changes, words):
    path = write(tmp_path, **changes)
    line = one_line_error(run("sweep", "--scenario", path, "--backend", "numpy",
                              "--out", tmp_path / "o"))
    assert str(path) in line and words in line, line
    assert not (tmp_path / "o").exists()


def test_the_fixture_missing_a_field_is_one_line(tmp_path):
    line = one_line_error(run("sweep", "--scenario", FIXTURES / "hf-missing-layers",
                              "--backend", "numpy", "--out", tmp_path / "o"))
    assert "missing field num_hidden_layers" in line


def test_multi_head_latent_attention_names_the_nearest_shape(tmp_path):
    """A config shaped like DeepSeek-V2-Lite's: MLA is refused before any work."""
    line = one_line_error(run("sweep", "--scenario", FIXTURES / "hf-mla" / "config.json",
                              "--backend", "numpy", "--out", tmp_path / "o"))
    assert "multi-head latent attention (kv_lora_rank 512)" in line
    assert "576-wide latent KV head for all 16 q heads" in line
    assert "nearest supported shape is 16 q heads over 1 KV head" in line


def test_a_folder_without_config_json_is_one_line(tmp_path):
    line = one_line_error(run("sweep", "--scenario", tmp_path, "--backend", "numpy"))
    assert "without a config.json" in line


@pytest.mark.parametrize("tp, heads", [(1, (8, 2)), (2, (4, 1)), (4, (2, 1)), (8, (1, 1))])
def test_tp_splits_heads_and_replicates_few_kv_heads(tp, heads):
    m = load_scenario(TINY, ShapeOptions(tp=tp)).model
    assert (m.q_heads, m.kv_heads, m.tp) == (*heads, tp)


def test_llama_70b_on_8_gpus_is_8_q_heads_over_1_kv_head():
    m = load_scenario("llama3.1-70b").model  # its scenario says tp = 8
    assert (m.q_heads, m.kv_heads, m.tp, m.group) == (8, 1, 8, 8)
    m = load_scenario("llama3.1-70b", ShapeOptions(tp=4)).model
    assert (m.q_heads, m.kv_heads, m.tp) == (16, 2, 4)
    full = load_scenario("llama3.1-70b", ShapeOptions(tp=1)).model
    one = m
    # a GPU reads its share of the weights: q/o and k/v of its heads, 1/tp of MLP and LM head
    assert model.weight_params(one) < model.weight_params(full) / 3.9


@pytest.mark.parametrize("tp, words", [
    (3, "tp 3: model hf-tiny-gqa's 8 q heads do not split evenly over 3 GPUs"),
    (16, "8 q heads do not split evenly over 16 GPUs"),
    (0, "tp 0 must be a whole number of GPUs"),
])
def test_a_tp_split_that_does_not_divide_is_one_line(tmp_path, tp, words):
    line = one_line_error(run("sweep", "--scenario", TINY, "--tp", tp, "--backend", "numpy",
                              "--out", tmp_path / "o"))
    assert words in line, line


def test_a_kv_split_that_does_not_divide_is_one_line(tmp_path):
    path = write(tmp_path, num_attention_heads=12, num_key_value_heads=3, hidden_size=768)
    line = one_line_error(run("sweep", "--scenario", path, "--tp", 2, "--backend", "numpy"))
    assert "3 KV heads neither split evenly over 2 GPUs nor replicate evenly" in line


def test_cache_options_on_a_config_json(tmp_path):
    m = load_scenario(TINY, ShapeOptions(kv_dtype="fp8", summary_dtype="fp16",
                                         kv_scale="head")).model
    assert (m.dtype, m.kv_dtype, m.summary_dtype, m.kv_scale) == ("bf16", "fp8_e4m3", "fp16",
                                                                  "head")
    assert load_scenario(TINY, ShapeOptions(kv_dtype="fp16")).model.dtype == "fp16"
    no_dtype = write(tmp_path, torch_dtype=None)
    assert load_scenario(no_dtype, ShapeOptions(kv_dtype="fp16")).model.dtype == "fp16"
    with pytest.raises(ConfigError, match="fp8_e4m3 summaries over a bf16 cache"):
        load_scenario(TINY, ShapeOptions(summary_dtype="fp8"))
    with pytest.raises(ConfigError, match="kv_scale 'head': an FP8 cache takes tensor or head"):
        load_scenario(TINY, ShapeOptions(kv_scale="head"))
    with pytest.raises(ConfigError, match="kv_dtype 'int8' is not supported"):
        load_scenario(TINY, ShapeOptions(kv_dtype="int8"))


# Published shapes (layers, q heads, KV heads, head dim, tp) of the shipped model scenarios
PUBLISHED = {"llama3.1-8b": (32, 32, 8, 128, 1), "llama3.1-70b": (80, 64, 8, 128, 8),
             "qwen2.5-7b": (28, 28, 4, 128, 1), "qwen2.5-14b": (48, 40, 8, 128, 1),
             "qwen3-8b": (36, 32, 8, 128, 1), "mistral-7b": (32, 32, 8, 128, 1),
             "gemma2-9b": (42, 16, 8, 256, 1), "phi3-mini": (32, 32, 32, 96, 1),
             "smollm2-135m": (30, 9, 3, 64, 1), "gpt-oss-20b": (24, 64, 8, 64, 1)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_scenarios_hold_published_shapes_and_name_their_source(name):
    import tomllib

    from questprof import SCENARIOS_DIR
    from questprof.core.config import HEAD_DIMS
    from questprof.core.scenarios import list_scenarios

    assert name in list_scenarios()
    data = tomllib.loads((SCENARIOS_DIR / f"{name}.toml").read_text())
    m = data["model"]
    assert (m["layers"], m["q_heads"], m["kv_heads"], m["head_dim"], m.get("tp", 1)) == \
        PUBLISHED[name]
    assert "config.json" in data["source"] and f"num_hidden_layers {m['layers']}" in \
        data["source"]
    if m["head_dim"] not in HEAD_DIMS:
        pytest.skip(f"head dim {m['head_dim']} waits for the kernels' wider head dims")
    scenario = load_scenario(name)
    assert scenario.source == data["source"]
    assert scenario.model.q_heads * scenario.model.tp == m["q_heads"]
