"""Results on disk: crash-safe rows, parquet on exit, resume keys, the summary table."""

import json

import pandas as pd
import pytest

from questprof import results
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
