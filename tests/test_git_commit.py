"""meta.json's git_commit names the project's own checkout, never a repository around a copy."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from questprof import ROOT

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", "-c", "user.name=questprof", "-c", "user.email=q@example.com",
                           "-c", "init.defaultBranch=main", *args], cwd=cwd, check=True,
                          capture_output=True, text=True)
    return done.stdout.strip()


def copy_project(dest: Path) -> Path:
    """The package and pyproject.toml, as a copy of the tree would hold them."""
    shutil.copytree(ROOT / "questprof", dest / "questprof",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def commit_all(repo: Path, message: str) -> str:
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def recorded(project: Path, call: str = "git_fields", **env: str):
    """machine.git_fields() (or git_commit()) as the copy at `project` records it, in its own
    process."""
    environ = {k: v for k, v in os.environ.items()
               if k != "QUESTPROF_GIT_COMMIT" and not k.startswith("GIT_")}
    code = f"import json; from questprof.core import machine; print(json.dumps(machine.{call}()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=project, check=True, text=True,
                          capture_output=True, env={**environ, "PYTHONPATH": str(project), **env})
    return json.loads(done.stdout)


def test_a_copy_inside_another_repository_records_no_commit_and_says_why(tmp_path):
    """A copy under another checkout recorded that outer repository's commit with +dirty."""
    outer = tmp_path / "outer"
    project = copy_project(outer / "copies" / "questprof")
    (outer / "README").write_text("another project\n")
    outer_head = commit_all(outer, "outer")
    with open(project / "pyproject.toml", "a", encoding="utf-8") as f:  # the outer one: dirty
        f.write("\n")
    assert git(project, "rev-parse", "HEAD") == outer_head  # what git alone would name
    assert recorded(project, "git_commit") is None
    got = recorded(project)
    assert got["git_commit"] is None and outer_head[:7] not in json.dumps(got)
    assert "is not the top of a git checkout" in got["git_commit_reason"]
    assert f"outer repository {outer.resolve()}" in got["git_commit_reason"]


def test_the_project_checkout_records_its_head_and_dirty(tmp_path):
    project = copy_project(tmp_path / "project")
    head = commit_all(project, "project")
    assert recorded(project) == {"git_commit": head, "git_commit_reason": None}
    assert recorded(project, "git_commit") == head
    with open(project / "pyproject.toml", "a", encoding="utf-8") as f:
        f.write("\n")
    assert recorded(project)["git_commit"] == f"{head}+dirty"


def test_outside_any_checkout_no_commit_and_why(tmp_path):
    project = copy_project(tmp_path / "plain")
    got = recorded(project, GIT_CEILING_DIRECTORIES=str(tmp_path))
    assert got["git_commit"] is None and "is not in a git checkout" in got["git_commit_reason"]


def test_a_named_commit_wins(tmp_path):
    project = copy_project(tmp_path / "named")
    assert recorded(project, QUESTPROF_GIT_COMMIT="abc1234") == {
        "git_commit": "abc1234", "git_commit_reason": None}
