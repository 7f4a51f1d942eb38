"""docs/ARCHITECTURE.md against the code: every module its layers table names exists, every module
of questprof/ is named there, and every file path it names anywhere is on disk."""

import re
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
FOLDERS = ("core", "backends", "measure", "workload", "fidelity", "serving", "report", "commands")


def layers_table() -> dict[str, list[str]]:
    """{layer: the backticked names of its modules cell} of the '## Layers' table."""
    section = DOC.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| ")]
    return {layer.strip(): re.findall(r"`([^`]+)`", cell) for layer, cell in rows[1:]}


def named_modules() -> set[str]:
    """Paths under questprof/ that the table names: 'core/config.py', a folder's bare
    'sweep_job' or 'metrics.py' within its layer, and globs ('fidelity*.py'); folders skipped."""
    named = set()
    for layer, names in layers_table().items():
        for name in names:
            if name.endswith("/") or not re.fullmatch(r"[\w/*]+(\.py)?", name):
                continue  # a folder, or a flag ('--budgets-file')
            if "/" not in name and layer in FOLDERS:
                name = f"{layer}/{name}"
            named.add(name if name.endswith(".py") else f"{name}.py")
    return named


ON_DISK = {p.relative_to(ROOT / "questprof").as_posix() for p in (ROOT / "questprof").rglob("*.py")
           if p.name != "__init__.py"}


def test_the_table_is_read():
    assert {"core", "backends", "commands", "cli"} <= layers_table().keys()
    assert {"core/config.py", "commands/sweep_job.py", "cli.py"} <= named_modules()


def test_every_module_the_table_names_exists():
    missing = {n for n in named_modules() if not any(fnmatch(p, n) for p in ON_DISK)}
    assert not missing, f"docs/ARCHITECTURE.md names modules that are gone: {sorted(missing)}"


def test_every_module_is_named_in_the_table():
    unnamed = {p for p in ON_DISK if not any(fnmatch(p, n) for n in named_modules())}
    assert not unnamed, f"modules docs/ARCHITECTURE.md's layers table does not name: {sorted(unnamed)}"


def test_every_path_the_page_names_exists():
    paths = {p for p in re.findall(r"`([\w./*-]+\.(?:py|cu|cuh|toml|md))`", DOC) if "/" in p}
    gone = {p for p in paths if not any(base.glob(p) for base in (ROOT, ROOT / "questprof"))}
    assert not gone, f"docs/ARCHITECTURE.md names files that are gone: {sorted(gone)}"
