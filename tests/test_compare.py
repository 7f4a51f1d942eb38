"""`questprof compare`: verdicts of B against A, rows that match only on the same work, CPU runs."""

import json

import pytest
from typer.testing import CliRunner

from questprof import results
from questprof.cli import app
from questprof.commands import compare as compare_mod
from questprof.core.config import ConfigError
from questprof.results import ResultsWriter

# llama3-8b's shape: one GPU of tp 1 attends 32 q heads over 8 KV heads, one of tp 2 16 over 4
SHAPE = {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16", "kv_dtype": "bf16",
         "summary_dtype": "bf16", "kv_scale": "", "tp": 1, "backend": "cupy"}


def row(stage="dense", length=4096, median=1.0, spread=0.02, status="ok", **extra):
    base = {"model": "m", **SHAPE, "length": length, "batch": 1, "page_size": 16,
            "budget": 1024, "mode": "per-head", "stage": stage, "status": status,
            "median_ms": median, "p20_ms": median - spread, "p80_ms": median + spread,
            "p95_ms": median + 2 * spread, "config_key": f"L={length}", "reason": None}
    return {**base, **extra}


def compare(a, b, threshold=0.05):
    return compare_mod.compare(a, b, threshold)


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def write_run(path, rows):
    with ResultsWriter(path) as writer:
        for r in rows:
            writer.append(r)
    return path


def test_compare_verdicts(tmp_path):
    a = write_run(tmp_path / "a", [row(length=n) for n in (1, 2, 3, 4, 5)])
    b = write_run(tmp_path / "b", [
        row(length=1, median=1.01),                 # within noise
        row(length=2, median=1.5),                  # clearly slower
        row(length=3, median=0.5, spread=0.01),     # clearly faster
        row(length=4, median=1.5, spread=0.6),      # slower median, spread wider than that
        row(length=5, status="skipped"),
    ])
    table = compare(a, b, threshold=0.05).set_index("length")
    assert table["verdict"].to_dict() == {1: "SAME", 2: "SLOWER", 3: "FASTER", 4: "NOISY",
                                          5: "MISSING"}
    assert table.loc[2, "ratio"] == pytest.approx(1.5)
    loose = compare(a, b, threshold=0.6).set_index("length")
    assert loose.loc[2, "verdict"] == "SAME"
    with pytest.raises(ConfigError):
        compare(a, b, threshold=-1)


def test_compare_calls_wide_spreads_noisy(tmp_path):
    """Two back-to-back CPU runs differ by more than the threshold with spreads wider still:
    NOISY, not SLOWER or FASTER, and a note says why."""
    a = write_run(tmp_path / "a", [row(length=1, spread=0.3), row(length=2), row(length=3)])
    b = write_run(tmp_path / "b", [
        row(length=1, median=1.5, spread=0.05),   # A's spread is 60% of its median
        row(length=2, median=0.6, spread=0.2),    # B's spread is 67% of its median
        row(length=3, median=2.0),                # tight on both sides: a real change
    ])
    table = compare(a, b, threshold=0.05)
    assert list(table["verdict"]) == ["NOISY", "NOISY", "SLOWER"]
    assert table.attrs["notes"][0].startswith("2 of 3 rows are too noisy to judge")
    assert compare(a, b, threshold=0.7).attrs["notes"] == []


def test_compare_with_too_few_repeats_judges_nothing(tmp_path):
    a = write_run(tmp_path / "a", [row(length=1)])
    b = write_run(tmp_path / "b", [row(length=1, median=2.0)])
    (tmp_path / "b" / results.META).write_text(json.dumps({"timing": {"repeats": 3}}))
    table = compare(a, b)
    assert list(table["verdict"]) == ["NOISY"]
    assert "timed 3 passes" in table.attrs["notes"][0] and "--repeats 5" in table.attrs["notes"][0]


def test_compare_keeps_implementations_apart(tmp_path):
    a = write_run(tmp_path / "a", [row(), {**row(median=2.0), "impl": "torch-sdpa"}])
    b = write_run(tmp_path / "b", [row(), {**row(median=4.0), "impl": "torch-sdpa"}])
    table = compare(a, b).set_index("impl")
    assert len(table) == 2 and table.loc["ours", "verdict"] == "SAME"
    assert table.loc["torch-sdpa", "verdict"] == "SLOWER"


def test_a_run_of_no_timed_stage_is_refused(tmp_path):
    """A fidelity or serve directory against a sweep listed every row MISSING and exited 0."""
    a = write_run(tmp_path / "a", [row()])
    b = write_run(tmp_path / "b", [{**row(), "stage": "fidelity"}])
    for first, second in ((a, b), (b, a)):
        with pytest.raises(ConfigError, match=f"{b} holds no timed stage rows"):
            compare(first, second)


def test_compare_reports_configurations_of_one_side(tmp_path):
    a = write_run(tmp_path / "a", [row(length=1)])
    b = write_run(tmp_path / "b", [row(length=2)])
    assert list(compare(a, b)["verdict"]) == ["MISSING", "MISSING"]




def test_faster_is_the_mirror_of_slower(tmp_path):
    """A threshold t decides B/A above 1 + t or below 1 / (1 + t): 2x either way at t = 1."""
    a = write_run(tmp_path / "a", [row(length=n, spread=0.01) for n in (1, 2, 3)])
    b = write_run(tmp_path / "b", [row(length=1, median=2.1, spread=0.01),
                                   row(length=2, median=0.45, spread=0.01),
                                   row(length=3, median=0.55, spread=0.01)])
    table = compare(a, b, threshold=1.0).set_index("length")
    assert table["verdict"].to_dict() == {1: "SLOWER", 2: "FASTER", 3: "SAME"}


def test_runs_of_different_shapes_are_not_compared(tmp_path):
    """A tp 1 run of 32 q / 8 KV heads against a tp 2 run of 16 / 4 once gave FASTER and
    SLOWER rows and exit 1: no row of one times the work of the other."""
    a = write_run(tmp_path / "a", [row(length=n) for n in (1, 2)])
    b = write_run(tmp_path / "b", [row(length=n, median=0.5, q_heads=16, kv_heads=4, tp=2)
                                   for n in (1, 2)])
    with pytest.raises(ConfigError, match="q heads 32 against 16; KV heads 8 against 4; "
                                          "tp 1 against 2"):
        compare(a, b)
    result = run("compare", a, b, "--threshold", "0.3")
    assert result.exit_code == 2 and "Traceback" not in result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "q heads 32 against 16" in line
    # a column that a missing value made float says its whole numbers as such ("tp 1.0")
    c = write_run(tmp_path / "c", [row(length=1, tp=1), row(length=2, tp=None)])
    with pytest.raises(ConfigError, match="tp 1 against 2"):
        compare(c, b)


@pytest.mark.parametrize("cache, said", [
    ({"kv_dtype": "fp8_e4m3", "summary_dtype": "fp8_e4m3", "kv_scale": "tensor"},
     "KV cache bf16 against fp8_e4m3; summaries bf16 against fp8_e4m3; FP8 scales - against "
     "tensor"),
    ({"head_dim": 64}, "head dim 128 against 64"),
    ({"backend": "numpy-fp32"}, "backend cupy against numpy-fp32"),
])
def test_runs_of_different_caches_or_backends_are_not_compared(tmp_path, cache, said):
    """A bf16 run against an FP8 run once gave ratios of 102.9x."""
    a = write_run(tmp_path / "a", [row()])
    b = write_run(tmp_path / "b", [row(median=0.01, **cache)])
    with pytest.raises(ConfigError, match=said):
        compare(a, b)


def test_rows_match_only_on_the_same_shape(tmp_path):
    """Bench runs hold several shapes: the shared ones are judged, the others are MISSING."""
    a = write_run(tmp_path / "a", [row(), row(q_heads=64)])
    b = write_run(tmp_path / "b", [row(), row(kv_heads=4, q_heads=16)])
    table = compare(a, b)
    assert sorted(zip(table["q_heads"], table["verdict"])) == [
        (16, "MISSING"), (32, "SAME"), (64, "MISSING")]


def test_runs_before_fp8_caches_match_their_plain_cache(tmp_path):
    """Rows written before kv_dtype existed time the query dtype's cache."""
    old = {k: v for k, v in row().items() if k not in ("kv_dtype", "summary_dtype", "kv_scale")}
    a = write_run(tmp_path / "a", [old])
    b = write_run(tmp_path / "b", [row()])
    assert list(compare(a, b)["verdict"]) == ["SAME"]


def test_fidelity_rows_of_another_model_do_not_count(tmp_path):
    """A sweep's directory may hold SmolLM2's fidelity rows: they are not timed rows."""
    fid = {"stage": "fidelity", "model": "SmolLM2", "q_heads": 9, "kv_heads": 3, "head_dim": 64}
    a = write_run(tmp_path / "a", [row(), fid])
    b = write_run(tmp_path / "b", [row()])
    assert list(compare(a, b)["stage"]) == ["dense"]


def cpu_runs(tmp_path, ratios, spread=0.05):
    cpu = {"backend": "numpy-fp32"}
    a = write_run(tmp_path / "a", [row(length=n, spread=spread, **cpu)
                                   for n in range(len(ratios))])
    b = write_run(tmp_path / "b", [row(length=n, median=r, spread=spread * r, **cpu)
                                   for n, r in enumerate(ratios)])
    return a, b


def test_cpu_runs_are_judged_beyond_their_drift_and_say_so(tmp_path):
    """Two CPU runs of the same code (longchat-7b 4k..32k, 7 passes) gave 261 NOISY rows of
    288 at 5% and, at thresholds up to 0.8, SLOWER rows up to 1.6x: CPU times are judged
    beyond 2x only, and the first line says why."""
    a, b = cpu_runs(tmp_path, [1.0, 1.6, 0.6, 3.0])
    table = compare(a, b)
    assert list(table["verdict"]) == ["SAME", "SAME", "SAME", "SLOWER"]
    assert table.attrs["notes"][0].startswith("both runs were timed on the CPU (numpy-fp32)")
    assert "judging at 1.0" in table.attrs["notes"][0]
    result = run("compare", a, b)
    assert result.exit_code == 1
    assert result.stderr.startswith("both runs were timed on the CPU")
    assert compare(a, b, threshold=2.5).attrs["notes"] == []  # above 1.0: as given


def test_a_cpu_run_decides_rows_whose_spread_is_below_its_threshold(tmp_path):
    """Spreads of 20-40%, common on the shared CPU, no longer make every row NOISY."""
    a, b = cpu_runs(tmp_path, [1.1, 0.9], spread=0.15)
    assert list(compare(a, b)["verdict"]) == ["SAME", "SAME"]
