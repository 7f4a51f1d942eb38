"""Range syntax, validation, scenario files and grid expansion."""

import dataclasses

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from questprof.core import config, scenarios
from questprof.core.config import ConfigError, ModelShape, parse_sizes
from questprof.core.scenarios import expand, load_scenario

K = 1024


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def test_doubling_range():
    assert parse_sizes("2k..128k") == [2 * K * 2**i for i in range(7)]
    assert parse_sizes("512..4096", "budgets") == [512, 1024, 2048, 4096]


def test_explicit_steps():
    assert parse_sizes("2k..32k*4") == [2 * K, 8 * K, 32 * K]
    assert parse_sizes("1k..8k+1k") == [i * K for i in range(1, 9)]
    assert parse_sizes("1K..2M*1024") == [K, 1024 * K]  # 2M is not reached: ranges never overshoot


def test_lists_units_and_dedup():
    assert parse_sizes("4k,16k,100000") == [4 * K, 16 * K, 100000]
    assert parse_sizes("100000, 3 , 1k..4k, 2k") == [3, K, 2 * K, 4 * K, 100000]
    assert parse_sizes("1m") == [K * K]
    assert parse_sizes("7") == [7]
    assert parse_sizes("5..5") == [5]


@pytest.mark.parametrize("text, needle", [
    ("128k..2k", "128k..2k"),
    ("2x..4k", "2x"),
    ("0..4k", "0..4k"),
    ("0", "0"),
    ("-4k", "-4k"),
    ("1k..8k*1", "*1"),
    ("1k..8k+0", "+0"),
    ("", "empty"),
    ("   ", "empty"),
    ("4k,,8k", "4k,,8k"),
    ("1..1m+1", "1..1m+1"),
    ("4.5k", "4.5k"),
])
def test_range_errors_name_the_bad_text(text, needle):
    assert needle in one_line_error(parse_sizes, text, "lengths")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10**6), min_size=1, max_size=8))
def test_lists_roundtrip(values):
    assert parse_sizes(",".join(map(str, values))) == sorted(set(values))


@settings(max_examples=200, deadline=None)
@given(start=st.integers(1, 5000), span=st.integers(0, 50_000), step=st.integers(1, 3000))
def test_additive_range_matches_python_range(start, span, step):
    assume(span // step < config.MAX_VALUES)
    assert parse_sizes(f"{start}..{start + span}+{step}") == list(range(start, start + span + 1, step))


def test_page_size_validation():
    for s in (8, 16, 32, 64, 128):
        assert config.validate_page_size(s) == s
    message = one_line_error(config.validate_page_size, 12)
    assert message == ("page size 12 is not supported: expected a power of two among "
                       "8, 16, 32, 64, 128")
    for bad in (0, 4, 256, 24):
        one_line_error(config.validate_page_size, bad)


def test_budget_validation():
    assert config.validate_budget(4096, 16) == 4096
    message = one_line_error(config.validate_budget, 20, 16)
    assert message == "budget 20 tokens is not a whole number of 16-token pages"
    one_line_error(config.validate_budget, 0, 16)
    one_line_error(config.validate_budget, 8, 16)


@pytest.mark.parametrize("changes, needle", [
    ({"kv_heads": 3}, "kv_heads"),
    ({"head_dim": 112}, "head_dim 112 is not supported: the kernels take 64, 80, 96, 128, 192, "
                        "256 (nearest: 96)"),
    ({"head_dim": 512}, "(nearest: 256)"),
    ({"dtype": "fp8"}, "dtype"),
    ({"layers": "32"}, "layers"),
    ({"dense_layers": 40}, "dense_layers"),
])
def test_model_shape_validation(changes, needle):
    fields = dict(name="m", layers=32, q_heads=32, kv_heads=8, head_dim=128, dtype="bf16")
    assert needle in one_line_error(ModelShape, **{**fields, **changes})


@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(28, 4, 128), (32, 32, 96), (16, 8, 256),
                                                      (9, 3, 64), (71, 1, 64), (128, 8, 80)])
def test_model_shapes_of_every_group_and_head_dim(q_heads, kv_heads, head_dim):
    """Groups 7, 1, 2, 3, 71 (multi-query), 16 and head dims 80-256 are kernel shapes now."""
    shape = ModelShape("m", 2, q_heads, kv_heads, head_dim, "bf16")
    assert shape.group == q_heads // kv_heads


def test_config_validates_its_point():
    shape = ModelShape("m", 2, 4, 2, 64, "fp16")
    assert "budget 20" in one_line_error(config.Config, shape, 4096, 1, 16, 20)
    assert "page size 12" in one_line_error(config.Config, shape, 4096, 1, 12, 1536)
    assert "mode" in one_line_error(config.Config, shape, 4096, 1, 16, 1024, "shared-min")


@pytest.mark.parametrize("name", ["longchat-7b", "llama3-8b", "smoke"])
def test_shipped_scenarios_load(name):
    scenario = load_scenario(name)
    assert name in scenarios.list_scenarios()
    assert scenario.name == name and scenario.model.name == name
    assert expand(scenario)


def test_shipped_scenario_contents():
    longchat = load_scenario("longchat-7b")
    assert (longchat.model.layers, longchat.model.q_heads, longchat.model.kv_heads) == (32, 32, 32)
    assert longchat.grid.lengths == tuple(2 * K * 2**i for i in range(7))
    assert longchat.grid.batches == (1, 8) and longchat.grid.page_sizes == (8, 16, 32)
    assert longchat.grid.budgets == (512, 1024, 2048, 4096)
    llama = load_scenario("llama3-8b")
    assert llama.model.kv_heads == 8 and llama.model.dtype == "bf16"
    assert set(llama.grid.modes) == {"per-head", "shared-max", "shared-mean"}
    smoke = load_scenario("smoke")
    assert len(expand(smoke)) == 4 and smoke.model.head_dim == 64


def test_unknown_scenario_lists_the_available_ones():
    message = one_line_error(load_scenario, "no-such-model")
    assert "no-such-model" in message and "smoke" in message and "longchat-7b" in message
    assert "not found" in one_line_error(load_scenario, "/nonexistent/x.toml")


SMOKE_TEXT = (scenarios.SCENARIOS_DIR / "smoke.toml").read_text()


def write(tmp_path, text, name="mine.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_scenario_by_path(tmp_path):
    scenario = load_scenario(write(tmp_path, SMOKE_TEXT))
    assert scenario.name == "mine" and scenario.path == tmp_path / "mine.toml"
    assert load_scenario(str(tmp_path / "mine.toml")).model == scenario.model


@pytest.mark.parametrize("old, new, needle", [
    ("layers = 2\n", "", "model.layers"),                   # missing
    ("lengths = \"2k..16k\"\n", "", "grid.lengths"),        # missing
    ("layers = 2", "layers = \"2\"", "model.layers"),       # mistyped
    ("dtype = \"fp16\"", "dtype = 16", "model.dtype"),     # mistyped
    ("seed = 0", "seed = 0.5", "grid.seed"),                # mistyped
    ("modes = [\"per-head\"]", "modes = \"per-head\"", "grid.modes"),
    ("seed = 0", "seed = 0\nsead = 1", "grid.sead"),        # unknown
    ("budgets = \"1024\"", "budgets = \"1k..x\"", "grid.budgets"),
    ("budgets = \"1024\"", "budgets = true", "grid.budgets"),
    ("kv_heads = 2", "kv_heads = 3", "kv_heads"),
    ("modes = [\"per-head\"]", "modes = [\"best\"]", "best"),
    ("[grid]", "[grid", "not valid TOML"),
])
def test_bad_scenario_files_name_file_and_field(tmp_path, old, new, needle):
    assert old in SMOKE_TEXT
    path = write(tmp_path, SMOKE_TEXT.replace(old, new, 1))
    message = one_line_error(load_scenario, path)
    assert str(path) in message and needle in message


def test_toml_lists_and_integers_are_accepted(tmp_path):
    text = SMOKE_TEXT.replace('lengths = "2k..16k"', 'lengths = [4096, "8k..16k"]')
    text = text.replace('batch = "1"', "batch = 2")
    scenario = load_scenario(write(tmp_path, text))
    assert scenario.grid.lengths == (4 * K, 8 * K, 16 * K) and scenario.grid.batches == (2,)


def test_expand_uses_the_grid():
    scenario = load_scenario("longchat-7b")
    points = expand(scenario)
    assert len(points) == 7 * 2 * 3 * 4
    assert len({p.key() for p in points}) == len(points)
    assert {p.mode for p in points} == {"per-head"}
    dense = [p for p in points if p.is_dense_budget]
    assert dense and all(p.budget >= p.length for p in dense)  # kept: the model says dense


def test_expand_overrides():
    scenario = load_scenario("llama3-8b")
    points = expand(scenario, lengths="64k", batches=[4], page_sizes=[16], budgets="4096",
                    modes=["shared-max"])
    assert len(points) == 1
    point = points[0]
    assert (point.length, point.batch, point.page_size, point.budget, point.mode) == \
        (64 * K, 4, 16, 4096, "shared-max")
    assert (point.pages, point.k_pages) == (4096, 256)
    assert len(expand(scenario, lengths=[64 * K], batches=[1], page_sizes=[16])) == 4 * 3


def test_expand_collapses_modes_for_mha():
    scenario = load_scenario("longchat-7b")
    points = expand(scenario, modes=["shared-max", "per-head"], lengths=[4096], batches=[1])
    assert {p.mode for p in points} == {"per-head"}


@pytest.mark.parametrize("kwargs, needle", [
    ({"page_sizes": [12]}, "page size 12"),
    ({"page_sizes": [64], "budgets": [32]}, "budget 32 tokens"),
    ({"budgets": "20"}, "budget 20 tokens"),
    ({"lengths": []}, "empty lengths"),
    ({"lengths": "128k..2k"}, "128k..2k"),
    ({"modes": ["nope"]}, "nope"),
])
def test_expand_rejects_bad_overrides(kwargs, needle):
    assert needle in one_line_error(expand, load_scenario("llama3-8b"), **kwargs)


def test_config_as_dict_and_key():
    point = expand(load_scenario("smoke"), lengths=[5000])[0]
    row = point.as_dict()
    assert row["model"] == "smoke" and row["q_heads"] == 4 and row["length"] == 5000
    assert (row["pages"], row["k_pages"], row["mode"], row["seed"]) == (313, 64, "per-head", 0)
    assert set(row) >= {f.name for f in dataclasses.fields(ModelShape)} - {"name"}
    assert point.key() == dataclasses.replace(point).key()
    assert point.key() != dataclasses.replace(point, seed=1).key()
    assert point.pages == 313 and point.k_pages == 64 and not point.is_dense_budget


def test_expand_accepts_numpy_integers_and_refuses_floats():
    np = pytest.importorskip("numpy")
    scenario = load_scenario("smoke")
    assert expand(scenario, lengths=np.array([4096]))[0].length == 4096
    assert "whole numbers" in one_line_error(expand, scenario, lengths=[4096.5])
