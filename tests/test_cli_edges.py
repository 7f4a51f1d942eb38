"""Rough edges of the command line found by trying it as a new user would."""

from __future__ import annotations

import re

import pytest

from typer.testing import CliRunner

from questprof import console
from questprof.cli import app


def run(*args, **kwargs):
    return CliRunner().invoke(app, [str(a) for a in args], **kwargs)


def test_sweep_help_shows_defaults():
    """'[default: ...]' in a help string used to be eaten as Rich markup."""
    text = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", run("sweep", "--help").output))
    for default in ("[default: longchat-7b]", "[default: auto]", "[default: --graph]",
                    "[default: 2048]"):
        assert default in text, default


def test_progress_without_a_terminal_prints_lines(monkeypatch):
    """Redirected to a file, a long sweep printed nothing until it ended."""
    clock = iter(range(0, 1000, 4))  # each update 4 s after the one before
    monkeypatch.setattr(console.time, "monotonic", lambda: float(next(clock)))
    lines = []
    monkeypatch.setattr(console.err, "print", lambda text, **kw: lines.append(text))
    ticker = console.Ticker("grid", 10, live=False)
    with ticker:
        for done in range(1, 11):
            ticker.update(done, f"row {done}")
    assert 2 <= len(lines) <= 5  # every ~10 s and the last, not one per row
    assert lines[-1].startswith("grid: 10/10 rows") and "rows/s" in lines[-1] and "ETA" in lines[-1]


def test_sweep_says_what_it_will_run_before_it_runs(tmp_path, monkeypatch):
    """`questprof sweep` with no arguments started 168 configurations without a word."""
    from questprof.commands import sweep_job

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_job, "_grid", stop)
    result = run("sweep", "--backend", "numpy", "--out", tmp_path / "o")
    assert result.exit_code == 130
    assert "sweep longchat-7b: 168 configurations on the numpy-fp32 backend, about" in result.stderr
    assert "min" in result.stderr


def test_bad_byte_source_is_one_line(tmp_path):
    result = run("sweep", "--scenario", "smoke", "--bytes", "perf", "--out", tmp_path / "o")
    assert result.exit_code == 2 and "--bytes 'perf'" in result.stderr
    result = run("sweep", "--scenario", "smoke", "--bytes", "cupti", "--backend", "numpy",
                 "--out", tmp_path / "o")
    assert result.exit_code == 2 and "pip install -e '.[cuda13,torch]'" in result.stderr
    assert "Traceback" not in result.output


def test_sweep_with_fidelity_joins_fidelity_rows_to_the_speed_rows(tmp_path):
    """sweep --fidelity measures synthetic-cache fidelity at the grid's page sizes and budgets
    into the same results directory, and the report shows the speed-fidelity frontier."""
    import pytest

    pytest.importorskip("torch")
    from questprof import results

    out = tmp_path / "run"
    result = run("sweep", "--scenario", "smoke", "--lengths", "2k,4k", "--budget", "256,1024",
                 "--backend", "numpy", "--fidelity", "--out", out)
    assert result.exit_code == 0, result.output
    df, meta = results.load(out)
    fid = df[df["stage"] == "fidelity"]
    assert len(fid) and set(fid["budget"]) == {256, 1024} and set(fid["page_size"]) == {16}
    assert fid["mass_recall"].between(0, 1).all()
    assert meta["fidelity"]["source"] == "synthetic"
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "Speed against fidelity" in html


def test_resume_does_not_add_the_rows_beside_the_grid_twice(tmp_path):
    """--resume of a finished sweep with --fidelity used to measure fidelity again (48 -> 96)."""
    import pytest

    pytest.importorskip("torch")
    from questprof import results

    out = tmp_path / "run"
    args = ("sweep", "--scenario", "smoke", "--lengths", "2k", "--budget", "256",
            "--backend", "numpy", "--fidelity", "--out", out)
    assert run(*args).exit_code == 0
    first = len(results.read_rows(out))
    again = run("sweep", "--resume", out)
    assert again.exit_code == 0, again.output
    assert len(results.read_rows(out)) == first


@pytest.mark.parametrize("args,said", [
    (("sweep", "--hbm-pages", "1.5"), "sweep: Invalid value for '--hbm-pages'"),
    (("bench", "--repeats", "x"), "bench: Invalid value for '--repeats'"),
    (("sweep", "--bogus"), "sweep: No such option: --bogus"),
    (("fidelity", "--lengths"), "fidelity: Option '--lengths' requires an argument"),
])
def test_a_bad_option_value_is_one_line_and_exit_2(args, said):
    """Click's parse errors (a value of the wrong type, an unknown option, a missing value)
    as every other bad input: one 'error:' line on stderr, exit 2, no usage box."""
    result = run(*args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], lines
    assert "╭" not in result.output


@pytest.mark.parametrize("tolerance", ["-1", "0", "nan"])
def test_bytes_refuses_a_tolerance_that_judges_nothing(tolerance):
    """A tolerance of -1 or NaN passed to the verdict (every row then failed, or passed); it is
    one line before any measurement now."""
    result = run("bytes", "--scenario", "smoke", "--lengths", "2k", "--tolerance", tolerance)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"--tolerance {float(tolerance)}" in lines[0], lines


def test_the_bare_command_still_prints_its_help():
    result = run()
    assert "Usage" in result.output and "sweep" in result.output
