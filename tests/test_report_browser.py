"""The report in a real browser: headless Chromium draws every figure with no console message.

CI installs Debian's chromium; without it this test fails under CI=true and skips elsewhere.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest
from test_report import META, synthetic

from questprof.report import write_report

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=10000"]  # virtual ms: every Plotly.newPlot has run by then


@pytest.fixture(scope="module")
def chromium() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    if os.environ.get("CI") == "true":
        pytest.fail(f"{CHROMIUM} is missing: CI must run `apt-get install -y chromium`")
    pytest.skip(f"{CHROMIUM} not installed (apt-get install -y chromium)")


def _run(chromium: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    command = [str(chromium), *FLAGS, f"--user-data-dir={tmp / 'profile'}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)


def rendered(dom: str) -> dict[str, int]:
    """svg.main-svg roots drawn after each figure div (up to the next) of a dumped DOM, by id.

    A root drawn before the first figure counts under '' (a plot drawn into the wrong element).
    """
    starts = [(m.start(), m.group(1)) for m in
              re.finditer(r'<div id="([^"]+)" class="plotly-graph-div[^"]*"', dom)]
    bounds = [(0, "")] + starts + [(len(dom), None)]
    return {name: dom.count('<svg class="main-svg"', start, end)
            for (start, name), (end, _) in zip(bounds, bounds[1:]) if name is not None}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    return write_report(synthetic(), META, tmp_path_factory.mktemp("browser") / "report.html")


def test_every_figure_renders_without_console_messages(chromium, report, tmp_path):
    static = re.findall(r'<div id="([^"]+)" class="plotly-graph-div"', report.read_text())
    done = _run(chromium, tmp_path, "--enable-logging=stderr", "--v=0", "--dump-dom",
                report.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    drawn = rendered(done.stdout)
    assert drawn.pop("") == 0, "a plot was drawn outside its figure div"
    assert sorted(drawn) == sorted(static) and len(static) == 10
    # Plotly draws the same few svg.main-svg roots in every figure (3 in plotly.js 4): a figure
    # with more holds a plot meant for another element, one with none failed to draw
    assert min(drawn.values()) >= 1 and len(set(drawn.values())) == 1, drawn
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line]
    assert console == []  # console.error and uncaught exceptions both land here


def test_screenshot(chromium, report, tmp_path):
    png = tmp_path / "report.png"
    done = _run(chromium, tmp_path, "--window-size=1400,3000", "--hide-scrollbars",
                f"--screenshot={png}", report.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000
