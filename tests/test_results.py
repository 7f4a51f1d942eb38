"""Results on disk: crash-safe rows, parquet on exit, resume keys, compare verdicts."""

import json

import pandas as pd
import pytest

from questprof import results
from questprof.core.config import ConfigError
from questprof.results import ResultsWriter


def row(stage="dense", length=4096, median=1.0, spread=0.02, status="ok", **extra):
    base = {"model": "m", "dtype": "fp16", "length": length, "batch": 1, "page_size": 16,
            "budget": 1024, "mode": "per-head", "stage": stage, "status": status,
            "median_ms": median, "p20_ms": median - spread, "p80_ms": median + spread,
            "p95_ms": median + 2 * spread, "config_key": f"L={length}", "reason": None}
    return {**base, **extra}


def test_rows_reach_disk_before_close(tmp_path):
    writer = ResultsWriter(tmp_path, {"scenario": "s"})
    writer.append(row("summary"))
    writer.append(row("dense"))
    lines = (tmp_path / results.ROWS).read_text().splitlines()
    assert [json.loads(line)["stage"] for line in lines] == ["summary", "dense"]
    assert json.loads((tmp_path / results.META).read_text())["scenario"] == "s"
    writer.close()
    df = pd.read_parquet(tmp_path / results.PARQUET)
    assert list(df["stage"]) == ["summary", "dense"]
    assert list(df.columns[: len(results.COLUMNS)]) == list(results.COLUMNS)
    assert json.loads((tmp_path / results.META).read_text())["finished"]


def test_parquet_written_when_the_run_dies(tmp_path):
    with pytest.raises(RuntimeError):
        with ResultsWriter(tmp_path) as writer:
            writer.append(row("summary"))
            raise RuntimeError("boom")
    df, meta = results.load(tmp_path)
    assert len(pd.read_parquet(tmp_path / results.PARQUET)) == 1 and len(df) == 1
    assert meta["finished"] is None


def test_torn_last_line_is_dropped(tmp_path):
    with ResultsWriter(tmp_path) as writer:
        writer.append(row("summary"))
    with open(tmp_path / results.ROWS, "a") as f:
        f.write('{"stage": "dense", "len')
    assert len(results.read_rows(tmp_path)) == 1


def test_done_keys_and_appending_a_resumed_run(tmp_path):
    with ResultsWriter(tmp_path) as writer:
        writer.append(row("summary", status="skipped"))
    with ResultsWriter(tmp_path) as writer:
        writer.append(row("dense"))
    assert results.done_keys(tmp_path) == {("L=4096", "summary", "ours"), ("L=4096", "dense", "ours")}
    assert len(results.load(tmp_path)[0]) == 2


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        results.load(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="not a results directory"):
        results.load(tmp_path)


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
    table = results.compare(a, b, threshold=0.05).set_index("length")
    assert table["verdict"].to_dict() == {1: "SAME", 2: "SLOWER", 3: "FASTER", 4: "NOISY",
                                          5: "MISSING"}
    assert table.loc[2, "ratio"] == pytest.approx(1.5)
    loose = results.compare(a, b, threshold=0.6).set_index("length")
    assert loose.loc[2, "verdict"] == "SAME"
    with pytest.raises(ConfigError):
        results.compare(a, b, threshold=-1)


def test_compare_calls_wide_spreads_noisy(tmp_path):
    """Two back-to-back CPU runs differ by more than the threshold with spreads wider still:
    NOISY, not SLOWER or FASTER, and a note says why."""
    a = write_run(tmp_path / "a", [row(length=1, spread=0.3), row(length=2), row(length=3)])
    b = write_run(tmp_path / "b", [
        row(length=1, median=1.5, spread=0.05),   # A's spread is 60% of its median
        row(length=2, median=0.6, spread=0.2),    # B's spread is 67% of its median
        row(length=3, median=2.0),                # tight on both sides: a real change
    ])
    table = results.compare(a, b, threshold=0.05)
    assert list(table["verdict"]) == ["NOISY", "NOISY", "SLOWER"]
    assert table.attrs["note"].startswith("2 of 3 rows are too noisy to judge")
    assert results.compare(a, b, threshold=0.7).attrs["note"] is None


def test_compare_with_too_few_repeats_judges_nothing(tmp_path):
    a = write_run(tmp_path / "a", [row(length=1)])
    b = write_run(tmp_path / "b", [row(length=1, median=2.0)])
    (tmp_path / "b" / results.META).write_text(json.dumps({"timing": {"repeats": 3}}))
    table = results.compare(a, b)
    assert list(table["verdict"]) == ["NOISY"]
    assert "timed 3 passes" in table.attrs["note"] and "--repeats 5" in table.attrs["note"]


def test_compare_keeps_implementations_apart(tmp_path):
    a = write_run(tmp_path / "a", [row(), {**row(median=2.0), "impl": "torch-sdpa"}])
    b = write_run(tmp_path / "b", [row(), {**row(median=4.0), "impl": "torch-sdpa"}])
    table = results.compare(a, b).set_index("impl")
    assert len(table) == 2 and table.loc["ours", "verdict"] == "SAME"
    assert table.loc["torch-sdpa", "verdict"] == "SLOWER"


def test_compare_reports_configurations_of_one_side(tmp_path):
    a = write_run(tmp_path / "a", [row(length=1)])
    b = write_run(tmp_path / "b", [row(length=2)])
    assert list(results.compare(a, b)["verdict"]) == ["MISSING", "MISSING"]


def test_summary_table():
    df = results.frame([row("dense", median=4.0), row("quest", median=1.0, rho_formula=0.3),
                        row("dense", length=512, median=2.0), row("quest", length=512, median=2.0),
                        row("dense", length=8192, status="skipped", reason="needs 9 GiB"),
                        row("quest", length=8192, status="skipped", reason="needs 9 GiB")])
    from questprof.report.frames import summary_table

    table = summary_table(df).set_index("length")
    assert table.loc[4096, "speedup"] == pytest.approx(4.0)
    assert table.loc[4096, "dense_impl"] == "ours"
    assert table.loc[512, "note"].startswith("quest = dense")
    assert 8192 not in table.index  # skipped configurations have their own table


def test_summary_table_takes_the_fastest_dense():
    from questprof.report.frames import summary_table

    sdpa = {**row("dense", median=3.0), "impl": "torch-sdpa"}
    df = results.frame([row("dense", median=4.0), sdpa, row("quest", median=1.0)])
    table = summary_table(df).set_index("length")
    assert table.loc[4096, "speedup"] == pytest.approx(3.0)
    assert table.loc[4096, "dense_impl"] == "torch-sdpa"


def test_appending_to_a_directory_kept_without_rows_jsonl_keeps_its_rows(tmp_path):
    """Committed examples keep results.parquet only; adding rows to one (fidelity --out, e2e)
    must not rewrite the parquet from the new rows alone."""
    with ResultsWriter(tmp_path, {"scenario": "t"}) as writer:
        writer.append({"stage": "dense", "length": 2048, "median_ms": 0.5})
        writer.append({"stage": "passkey", "length": 8192, "passkey_keys": ["12345", "67890"]})
    (tmp_path / results.ROWS).unlink()
    results.append_rows(tmp_path, [{"stage": "quest", "length": 2048, "median_ms": 0.1}], more=1)
    df, meta = results.load(tmp_path)
    assert sorted(df["stage"]) == ["dense", "passkey", "quest"] and meta["more"] == 1
    assert list(df[df["stage"] == "passkey"]["passkey_keys"].iloc[0]) == ["12345", "67890"]
    assert len(pd.read_parquet(tmp_path / results.PARQUET)) == 3
