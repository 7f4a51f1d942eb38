"""The benchmark's bookkeeping (no GPU): same-bytes ceilings, bounds and goals from rows."""

from __future__ import annotations

import pytest

from questprof import bench


def _row(stage, us, length=32768, backend="cupy", read=1000, unmodelled=24, ratio=None):
    return {"model": bench.MHA.name, "batch": 1, "length": length, "stage": stage,
            "backend": backend, "median_ms": us * 1e-3, "read_bytes": read,
            "unmodelled_bytes": unmodelled, "ratio": ratio, "bandwidth_gbs": None,
            "page_size": 16, "budget": 2048, "mode": "per-head", "method": "cuda-graph"}


def _rows():
    return [_row("estimate", 11.0, read=2000), _row("topk", 7.0, read=None, unmodelled=None),
            _row("attention", 13.0, read=3000), _row("dense", 128.0, read=50000),
            _row("quest", 31.0, read=5000), _row("dense", 124.0, backend="torch-sdpa")]


def test_same_bytes_only_on_our_streaming_stages():
    rows, asked = _rows(), []

    def read_ms(n):
        asked.append(n)
        return n * 4e-6  # 4 ns per byte: 2024 B -> 8.096 us

    bench.add_same_bytes(rows, read_ms)
    marked = {r["stage"]: r for r in rows if "same_read_ms" in r}
    assert set(marked) == {"estimate", "attention", "dense"}
    assert marked["dense"]["backend"] == "cupy"
    assert sorted(asked) == [2024, 3024, 50024]  # modelled + unmodelled bytes
    est = marked["estimate"]
    assert est["same_ratio"] == pytest.approx(2024 * 4e-6 / 11.0e-3)


def test_same_bytes_unknown_leaves_the_row_alone():
    rows = _rows()
    bench.add_same_bytes(rows, lambda n: None)  # below the ladder's first rung
    assert not any("same_ratio" in r for r in rows)
    assert "same-B" in bench.format_table(rows)


def test_bounds_sum_plain_reads_and_our_topk():
    rows = _rows()
    bench.add_same_bytes(rows, lambda n: {2024: 9e-3, 3024: 9.5e-3}.get(n, 1.0))
    bounds = {what: (us, ratio) for what, us, ratio in bench.same_bytes_bounds(rows)}
    assert bounds["estimate 32K / plain read of its bytes"] == pytest.approx((9.0, 9 / 11))
    quest_us, speedup = bounds["quest 32K at plain reads + our top-K (speedup)"]
    assert quest_us == pytest.approx(9.0 + 7.0 + 9.5)
    assert speedup == pytest.approx(128.0 / 25.5)
    assert bounds["estimate 128K / plain read of its bytes"] == (None, None)
    assert not any(what.startswith("quest 128K") for what in bounds)
    text = bench.format_bounds(rows)
    assert "n/a" in text and "25.5" in text


def test_goals_compare_with_targets():
    rows = _rows()
    rows[0]["ratio"], rows[3]["ratio"] = 0.86, 0.91
    goals = {g: (value, met) for g, value, _, met in bench.goals(rows)}
    assert goals["estimate 32K / read BW"] == (0.86, True)
    assert goals["dense 32K / read BW"] == (0.91, True)
    value, met = goals["dense 32K / torch SDPA time"]
    assert value == pytest.approx(128 / 124) and met is False
    value, met = goals["quest speedup vs dense 32K"]
    assert value == pytest.approx(128 / 31) and met is False
    assert goals["dense 128K / read BW"] == (None, None)
