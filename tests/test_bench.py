"""The benchmark's bookkeeping (no GPU): cases and goals from scenarios/bench.toml, speedups
against the fastest dense, goals from rows."""

from __future__ import annotations

import pytest

from questprof.commands import bench
from questprof.core.config import ConfigError

MHA = "mha-32h-d128"


def _row(stage, us, impl="ours", length=32768, ratio=None):
    return {"model": MHA, "batch": 1, "length": length, "stage": stage, "impl": impl,
            "median_ms": us * 1e-3, "ratio": ratio, "page_size": 16, "budget": 2048,
            "mode": "per-head"}


def _rows():
    return [_row("estimate", 11.0), _row("topk", 7.0), _row("attention", 13.0),
            _row("dense", 128.0, ratio=0.91), _row("quest", 31.0),
            _row("dense", 124.0, "torch-sdpa"), _row("quest", 200.0, "torch-naive")]


def test_bench_file_has_the_issue_cases_and_goals():
    cases, goals = bench.load_bench()
    assert {(c.model.name, c.length, c.batch) for c in cases} >= {
        (MHA, 32768, 1), (MHA, 131072, 1), (MHA, 32768, 8), ("llama3-8b", 32768, 1)}
    assert {c.mode for c in cases if c.model.name == "llama3-8b"} == {
        "per-head", "shared-max", "shared-mean"}
    quick, _ = bench.load_bench(quick=True)
    assert {(c.length, c.batch) for c in quick} == {(32768, 1), (131072, 1)}
    assert {g["metric"] for g in goals} >= {"speedup", "dense_sdpa"}


def test_a_case_naming_an_unknown_model_is_refused(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text('[[case]]\nmodel = "nope"\nlength = 1\nbatch = 1\npage_size = 16\n'
                    'budget = 16\n')
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        bench.load_bench(path)


def test_speedup_is_against_the_fastest_dense_of_the_case():
    rows = _rows()
    bench.add_speedups(rows)
    ours = next(r for r in rows if r["stage"] == "quest" and r["impl"] == "ours")
    assert ours["speedup"] == pytest.approx(124 / 31) and ours["dense_impl"] == "torch-sdpa"
    rows = [r for r in _rows() if r["impl"] != "torch-sdpa"]
    bench.add_speedups(rows)
    ours = next(r for r in rows if r["stage"] == "quest" and r["impl"] == "ours")
    assert ours["speedup"] == pytest.approx(128 / 31) and ours["dense_impl"] == "ours"


def test_goals_compare_with_targets():
    rows = _rows()
    bench.add_speedups(rows)
    case = {"model": MHA, "length": 32768, "batch": 1}
    goal_list = [{"metric": "speedup", "case": case, "target": ">= 5.5"},
                 {"metric": "dense_sdpa", "case": case, "target": "<= 1.00"},
                 {"metric": "ratio", "stage": "dense", "case": case, "target": ">= 0.90"},
                 {"metric": "us", "stage": "topk", "case": case, "target": "<= 10"},
                 {"metric": "us", "stage": "topk", "case": {**case, "length": 131072},
                  "target": "<= 10"}]
    got = [(value, met) for _, value, _, met in bench.goals(rows, goal_list)]
    assert got[0][0] == pytest.approx(124 / 31) and got[0][1] is False
    assert got[1][0] == pytest.approx(128 / 124) and got[1][1] is False
    assert got[2] == (0.91, True)
    assert got[3][0] == pytest.approx(7.0) and got[3][1] is True
    assert got[4] == (None, None)  # no such row: not judged


def test_overlap_gain_is_the_sum_of_stages_over_the_pipeline():
    rows = _rows()
    bench.add_speedups(rows)
    ours = next(r for r in rows if r["stage"] == "quest" and r["impl"] == "ours")
    assert ours["stages_sum_ms"] == pytest.approx((11 + 7 + 13) * 1e-3)
    assert ours["overlap_gain"] == pytest.approx(31 / 31)
    naive = next(r for r in rows if r["impl"] == "torch-naive")
    assert "overlap_gain" not in naive


@pytest.mark.parametrize("text, word", [
    ("[[case]\nmodel = 1", "bench.toml"),                      # not TOML
    ('[models.m]\nlayers = 4\nq_heads = 1\nkv_heads = 1\nhead_dim = 64\ndtype = "fp16"\n'
     '[[case]]\nmodel = "m"\nlength = 1\n', "missing field 'batch'"),
    ('[[goal]]\nmetric = "dense_over"\ncase = { model = "m" }\ntarget = "<= 0.55"\n',
     "missing field 'over'"),
    ('[[goal]]\nmetric = "dense_over"\nover = "x"\ncase = { model = "m" }\ntarget = "<= 1"\n',
     "unknown model 'x'"),
    ('[[goal]]\nmetric = "us"\ncase = { model = "m" }\n', "missing field 'target'"),
])
def test_a_broken_bench_file_is_a_config_error(tmp_path, text, word):
    path = tmp_path / "bench.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=word):
        bench.load_bench(path)


def test_the_short_shapes_bench_is_a_subset_of_the_bench():
    """tests/fixtures/bench-shapes.toml (issue 24's shapes at 32K B1, for a short GPU session)
    holds cases of scenarios/bench.toml with the same model shapes."""
    from pathlib import Path

    short, _ = bench.load_bench(Path(__file__).parent / "fixtures" / "bench-shapes.toml")
    full, _ = bench.load_bench()
    assert len(short) == 7 and set(short) <= set(full)
    assert {c.model.head_dim for c in short} == {96, 128, 256}
    assert any(c.model.is_fp8 for c in short) and max(c.model.group for c in short) == 16


def test_goals_judge_the_quest_step_speedup_and_its_plain_read():
    """Issue 21's goals on our Quest step: its speedup over the fastest dense and its same_ratio
    (a plain cold read of its bytes / its time), each judged against the target."""
    rows = _rows()
    rows[next(i for i, r in enumerate(rows) if r["stage"] == "quest")]["same_ratio"] = 0.55
    bench.add_speedups(rows)
    case = {"model": MHA, "length": 32768, "batch": 1}
    goal_list = [{"metric": "speedup", "case": case, "target": ">= 5.5"},
                 {"metric": "same_ratio", "stage": "quest", "case": case, "target": ">= 0.80"}]
    (name, value, _, met), (_, ratio, _, ratio_met) = bench.goals(rows, goal_list)
    assert name == "speedup mha-32h-d128 32K B1"
    assert value == pytest.approx(124 / 31) and met is False
    assert ratio == 0.55 and ratio_met is False


def test_the_bench_file_judges_the_batch_one_step():
    _, goals = bench.load_bench()
    mha = [(g["metric"], g["case"]["length"]) for g in goals
           if g["case"].get("model") == "mha-32h-d128" and g["case"].get("batch") == 1]
    assert {("speedup", 32768), ("speedup", 131072), ("same_ratio", 32768)} <= set(mha)
    assert not [g for g in goals if g.get("impl", "ours").startswith("ours-")]


def test_a_selector_without_a_kernel_is_refused_naming_those_with_one():
    from questprof.commands.bench_selectors import check
    from questprof.core.selectors import FAMILIES, name_list

    check(["quest", "quest-fp8", "quest-boxes:4", "quest-gap:1", "quest-topp:0.9"])
    with pytest.raises(ConfigError, match="'h2o' has no kernel form") as err:
        check(["quest", "h2o"])
    assert str(err.value).endswith(f"kernels run {name_list(kernel=True)}")
    assert [n for n, f in FAMILIES.items() if f.kernel is not None and n not in str(err.value)
            ] == []


def test_dense_over_is_our_dense_against_another_models_at_the_same_case():
    """FP8's goal: our dense time of one model over our dense time of another at the same case."""
    rows = [_row("dense", 27.5), {**_row("dense", 41.0), "model": "other"},
            {**_row("dense", 20.0, "torch-sdpa"), "model": "other"}]
    goal = {"metric": "dense_over", "over": "other", "target": "<= 0.55",
            "case": {"model": MHA, "length": 32768, "batch": 1}}
    ((_, value, _, met),) = bench.goals(rows, [goal])
    assert value == pytest.approx(27.5 / 41.0) and met is False
    assert bench.goals(rows[:1], [goal])[0][1] is None  # no row of the other model: not judged


def test_the_gqa_bench_is_a_subset_of_the_bench():
    """tests/fixtures/bench-gqa.toml (issue 30's cases for one short GPU call) holds cases of
    scenarios/bench.toml with the same model shapes, and every goal of issue 30 names a case the
    bench runs."""
    from pathlib import Path

    short, _ = bench.load_bench(Path(__file__).parent / "fixtures" / "bench-gqa.toml")
    full, goals = bench.load_bench()
    assert set(short) <= set(full)
    keys = [c.key() for c in full]
    for goal in goals:
        case = goal["case"]
        assert any(all(k.get(f) == v for f, v in case.items())
                   for k in ({"model": c.model.name, "length": c.length, "batch": c.batch,
                              "budget": c.budget, "mode": c.mode} for c in full)), case
    assert keys
