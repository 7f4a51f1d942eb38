"""The house rules of questprof/, read from the source: no import cycle, layers import only
downwards. Imports inside functions count: they run too."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "questprof"
# Lowest first; a module may import its own layer and any layer below it. The package root
# (questprof/__init__.py: ROOT, KERNELS_DIR) sits under everything.
LAYERS = ("core", "backends", "measure", "workload", "fidelity", "serving", "results", "report",
          "console", "commands", ("cli", "__main__"))
# Known breaches, listed so that a new one fails at once and a mended one until struck off here.
KNOWN_UPWARD: dict[str, set[str]] = {}
KNOWN_CYCLES: list[list[str]] = []


def _name(path: Path) -> str:
    """questprof/core/config.py -> 'questprof.core.config'; a package's __init__ -> the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The most specific questprof module that `name` names ('questprof.report.fmt_x' -> report)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, node: ast.AST) -> list[str]:
    """Dotted names an import statement reaches (a from-import's names tried as submodules)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    return [f"{base}.{a.name}" for a in node.names] + [base]


def imports(module: str) -> set[str]:
    """questprof modules that `module` imports anywhere in its file (functions included)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = _targets(module, node)
            if isinstance(node, ast.ImportFrom):  # 'from a.b import c': c if a module, else a.b
                subs = [n for n in names[:-1] if n in MODULES]
                names = subs or names[-1:]
            found |= {t for t in map(_resolve, names) if t and t.startswith("questprof")}
    return found - {module}


GRAPH = {m: imports(m) for m in MODULES}


def layer(module: str) -> int:
    """Index of the module's layer in LAYERS; -1 for the package root."""
    if module == "questprof":
        return -1
    top = module.split(".")[1]
    for i, names in enumerate(LAYERS):
        if top == names or top in names:
            return i
    raise AssertionError(f"{module}: no layer for questprof/{top} (add it to LAYERS)")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_reader_sees_imports_inside_functions_and_relative_ones():
    assert "questprof.core.machine" in GRAPH["questprof.cli"]  # imported inside doctor()
    assert "questprof.report.frames" in GRAPH["questprof.report.document"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert sorted(cycles(GRAPH)) == sorted(KNOWN_CYCLES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_layers_import_only_downwards(module):
    upward = {t for t in GRAPH[module] if layer(t) > layer(module)}
    assert upward == KNOWN_UPWARD.get(module, set()), (
        f"{module} (layer {layer(module)}) imports higher layers: {sorted(upward)}")
