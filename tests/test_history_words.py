"""History is dated: no tracked text counts work sessions, which a reader cannot place; a
measurement names its date and commit instead. CUPTI and pytest sessions are other words."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
# "session 5", "Session 4 (...)", "since session 3", "this session's runs", "next session"...
SESSION_MARK = re.compile(r"\bsessions? \d|\b(?:since|this|next|last|previous|earlier) session\b",
                          re.IGNORECASE)
NOT_TEXT = (".html", ".parquet", ".jsonl", ".png", ".svg", ".gguf", ".safetensors", ".cubin")


def _tracked_text() -> dict[str, str]:
    """{path: text} of the tracked text files (binary, HTML and row files left out)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if done.returncode != 0:
        pytest.skip("git ls-files failed here")
    texts = {}
    for name in filter(None, done.stdout.decode().split("\0")):
        path = ROOT / name
        if path.suffix.lower() in NOT_TEXT or not path.is_file() or path.resolve() == HERE:
            continue
        data = path.read_bytes()
        if b"\0" not in data:
            texts[name] = data.decode("utf-8", errors="replace")
    return texts


@pytest.mark.parametrize("text,flagged", [
    ("## v5 top-K (session 2, 2026-11-29)", True),
    ("## Session 4 (2026-11-29): the remaining gaps", True),
    ("and (since session 3) gpu_read_bytes_max", True),
    ("this session's runs give 7.2-7.4 us", True),
    ("adds an empty request (to run next session).", True),
    ("a real CUPTI PM-sampling session before any timing", False),
    ("the CUDA session of the collector session", False),
    ('@pytest.fixture(scope="session")', False),
])
def test_the_pattern_tells_time_markers_from_technical_sessions(text, flagged):
    assert bool(SESSION_MARK.search(text)) == flagged


def test_no_tracked_text_counts_sessions():
    hits = [f"{name}:{number}: {line.strip()}"
            for name, text in _tracked_text().items()
            for number, line in enumerate(text.splitlines(), 1) if SESSION_MARK.search(line)]
    assert not hits, "date and commit instead of a session number:\n" + "\n".join(hits)
