"""The house rules of questprof/, read from the source: no import cycle, layers import only
downwards. Imports inside functions count: they run too."""

import ast
import functools
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
TREES = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in MODULES.items()}


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
    tree = TREES[module]
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
    assert "questprof.commands.sweep_job" in GRAPH["questprof.cli"]  # imported inside sweep()
    assert "questprof.report.frames" in GRAPH["questprof.report.document"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert sorted(cycles(GRAPH)) == sorted(KNOWN_CYCLES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_layers_import_only_downwards(module):
    upward = {t for t in GRAPH[module] if layer(t) > layer(module)}
    assert upward == KNOWN_UPWARD.get(module, set()), (
        f"{module} (layer {layer(module)}) imports higher layers: {sorted(upward)}")


# What a function may import where it runs rather than at its module's top: an optional extra,
# or a base package too heavy for every start of the CLI. One place, one reason each.
LAZY = {
    "cupy": "optional extra (.[cuda12] / .[cuda13]); a CPU machine has none",
    "cupyx": "CuPy's, as cupy",
    "torch": "optional extra (.[torch]); its own 1-2 s import",
    "flashinfer": "optional extra (.[flashinfer]); JIT-compiles on first use",
    "transformers": "optional extra (.[fidelity])",
    "accelerate": "optional extra (.[fidelity])",
    "gguf": "optional extra (.[fidelity])",
    "safetensors": "optional extra (.[fidelity])",
    "cupti": "optional extra (cupti-python, .[cuda13])",
    "cuda": "optional extra (cuda-bindings, .[cuda13])",
    "pynvml": "nvidia-ml-py: a base dependency, but NVML's callers say 'no pynvml' in one line",
    "pandas": "base, but 0.5 s to import: `questprof --help` would take about twice as long",
    "pyarrow": "base, 0.1 s to import, read through pandas",
    "plotly": "base, but only report/document.py draws; the rest of report/ loads without it",
    "questprof.commands.sweep_job": "the sweep's machinery (workload, measure, the float32 "
                                    "path: 25 modules), a fifth of `questprof --help`'s time",
}
# backends/ is another branch's work in progress: its imports are not held to LAZY yet.
LAZY_UNCHECKED = ("questprof.backends",)


def _top_level(tree: ast.Module) -> list[ast.AST]:
    """Import statements that run when the module loads (module level, in if / try included)."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return out


def _reaches(module: str, node: ast.AST) -> tuple[set[str], set[str]]:
    """(questprof modules an import statement loads, parent packages included; other packages)."""
    ours, others = set(), set()
    for name in _targets(module, node):
        if name.split(".")[0] != "questprof":
            others.add(name.split(".")[0])
        elif (found := _resolve(name)) is not None:
            parts = found.split(".")
            ours |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & MODULES.keys()
    return ours, others


@functools.cache
def _loads(module: str) -> frozenset[str]:
    """LAZY packages that loading `module` imports, through questprof's module-level imports."""
    found = set()
    for node in _top_level(TREES[module]):
        ours, others = _reaches(module, node)
        found |= (others | ours) & LAZY.keys()
        found = found.union(*(_loads(m) for m in ours - {module}))
    return frozenset(found)


def lazy_packages(modules) -> set[str]:
    """LAZY packages that loading every module of `modules` imports."""
    return set().union(*map(_loads, modules))


def function_imports(module: str) -> list[str]:
    """'line: statement' of each import inside a function that LAZY does not explain: a LAZY
    package, or a questprof module that loads one the importing module does not already load."""
    tree, top = TREES[module], set(map(id, _top_level(TREES[module])))
    own = lazy_packages([module])
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
            ours, others = _reaches(module, node)
            if not ((others | ours) & LAZY.keys() or lazy_packages(ours) - own):
                bad.append(f"{node.lineno}: {ast.unparse(node)}")
    return bad


def test_function_imports_reader_tells_heavy_from_light():
    assert function_imports("questprof.report") == []  # document (plotly) loads on demand
    assert lazy_packages(["questprof.report.document"]) >= {"plotly"}
    assert "pandas" not in lazy_packages(["questprof.cli"])  # `questprof --help` stays light


@pytest.mark.parametrize("module", [m for m in sorted(MODULES) if not m.startswith(LAZY_UNCHECKED)])
def test_imports_inside_functions_only_for_lazy_packages(module):
    assert function_imports(module) == [], (
        f"{module}: move these imports to the top, or name the package in LAZY with its reason")
