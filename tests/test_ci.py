""".ci/run with stand-in python3, pip and chromium: its scratch virtualenv is gone after it ends,
and it exits with pytest's status."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parent.parent / ".ci" / "run"

# `python3 -m venv DIR` makes DIR/bin with an activate script, a pip that does nothing and a
# python whose `-m pytest` exits with $FAKE_PYTEST_STATUS.
FAKE_PYTHON3 = """#!/usr/bin/env bash
set -e
[ "$1 $2" = "-m venv" ] || exit 99
mkdir -p "$3/bin"
printf 'PATH="%s/bin:$PATH"\\n' "$3" > "$3/bin/activate"
printf '#!/usr/bin/env bash\\nexit 0\\n' > "$3/bin/pip"
printf '#!/usr/bin/env bash\\nexit "$FAKE_PYTEST_STATUS"\\n' > "$3/bin/python"
head -c 1000000 /dev/zero > "$3/bin/weight"
chmod +x "$3/bin/pip" "$3/bin/python"
"""


def _tool(folder: Path, name: str, text: str) -> None:
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("status", [0, 1, 3])
def test_ci_run_removes_its_virtualenv_and_keeps_the_status(tmp_path, status):
    tools, scratch = tmp_path / "bin", tmp_path / "tmp"
    tools.mkdir()
    scratch.mkdir()
    _tool(tools, "python3", FAKE_PYTHON3)
    _tool(tools, "chromium", "#!/usr/bin/env bash\nexit 0\n")
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "TMPDIR": str(scratch),
           "FAKE_PYTEST_STATUS": str(status)}
    done = subprocess.run(["bash", str(RUN)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == status, done.stderr
    assert list(scratch.iterdir()) == []
