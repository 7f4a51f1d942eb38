"""Every kernels/*.cu compiles with nvcc for sm_90, every template variant instantiated, and the
launcher's constants are the kernels' own (CI, no GPU)."""

from __future__ import annotations

import ast
import itertools
import re
import shutil
import subprocess

import pytest

from questprof import KERNELS_DIR, ROOT
from questprof.backends import constants

SOURCES = sorted(p.name for p in KERNELS_DIR.glob("*.cu"))
CUPY_BACKEND = ROOT / "questprof" / "backends" / "cupy.py"


def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.fail("nvcc is not on PATH: CI must compile kernels/*.cu (install the CUDA toolkit)")
    return nvcc


@pytest.fixture(scope="session")
def objects(tmp_path_factory):
    """Each source compiled once with QP_INSTANTIATE_ALL: name -> (CompletedProcess, object)."""
    out, built = tmp_path_factory.mktemp("kernels"), {}

    def build(source: str):
        if source not in built:
            obj = out / f"{source}.o"
            cmd = [_nvcc(), "-arch=sm_90", "-std=c++17", f"-I{KERNELS_DIR}",
                   "-DQP_INSTANTIATE_ALL", "-Werror", "all-warnings", "-c",
                   str(KERNELS_DIR / source), "-o", str(obj)]
            built[source] = (subprocess.run(cmd, capture_output=True, text=True), obj, cmd)
        return built[source]
    return build


def test_every_stage_has_a_kernel_file():
    assert {"summary.cu", "estimate.cu", "topk.cu", "attention.cu"} <= set(SOURCES)


@pytest.mark.parametrize("source", SOURCES)
def test_compiles_for_sm90(source, objects):
    """QP_INSTANTIATE_ALL instantiates every variant, so real code is compiled, not only parsed."""
    result, _, cmd = objects(source)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"


def test_late_release_build_compiles(tmp_path):
    """The QP_EARLY_RELEASE=0 build (dependents launch as a grid ends) of a PDL-aware kernel."""
    cmd = [_nvcc(), "-arch=sm_90", "-std=c++17", f"-I{KERNELS_DIR}", "-DQP_EARLY_RELEASE=0",
           "-Werror", "all-warnings", "-c", str(KERNELS_DIR / "topk.cu"), "-o",
           str(tmp_path / "topk.o")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_kernel_error_fails(tmp_path):
    """The check above catches errors inside template code once it is instantiated."""
    bad = tmp_path / "bad.cu"
    bad.write_text('#include "common.cuh"\ntemplate <int D> __global__ void k(float* x) '
                   '{ x[0] = undefined_name<D>; }\ntemplate __global__ void k<8>(float*);\n')
    cmd = [_nvcc(), "-arch=sm_90", "-std=c++17", f"-I{KERNELS_DIR}", "-c", str(bad),
           "-o", str(tmp_path / "bad.o")]
    assert subprocess.run(cmd, capture_output=True, text=True).returncode != 0


def test_constants_parse_as_the_compiler_reads_them(tmp_path):
    """A host program built by nvcc prints every constant; the parse must give the same values."""
    consts = constants.load()
    lines = []
    for name, value in consts.items():
        if isinstance(value, tuple):
            lines.append(f'for (int x : {name}) std::printf("{name} %d\\n", x);')
        else:
            lines.append(f'std::printf("{name} %d\\n", {name});')
    src = tmp_path / "print.cu"
    src.write_text('#include <cstdio>\n#include "constants.cuh"\nint main() {\n'
                   + "\n".join(lines) + "\n}\n")
    exe = tmp_path / "print"
    build = subprocess.run([_nvcc(), "-std=c++17", f"-I{KERNELS_DIR}", str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    printed: dict[str, list[int]] = {}
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    for line in run.stdout.splitlines():
        name, value = line.split()
        printed.setdefault(name, []).append(int(value))
    assert printed == {n: list(v) if isinstance(v, tuple) else [v] for n, v in consts.items()}


def test_constants_parser_rejects_other_forms():
    assert constants.parse("constexpr int A = 4;  // why\nconstexpr int B[] = {1, 2};") == {
        "A": 4, "B": (1, 2)}
    for text in ("constexpr int A = 2 * 4;", "constexpr int B[] = {N, 2};",
                 "constexpr int C[4] = {1, 2, 3, 4};"):
        with pytest.raises(ValueError):
            constants.parse(text)


def test_per_group_arrays_cover_every_group():
    consts = constants.load()
    groups = consts["QP_GROUPS"]
    for name in ("EST_BLOCKS_PER_SM", "ATT_LOADS", "ATT_STAGES"):
        assert len(consts[name]) == len(groups), name
    with pytest.raises(ValueError):
        constants.per_group("ATT_STAGES", 3)


def _module_assignments(path) -> dict[str, ast.expr]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out[name.id] = node.value
    return out


def test_cupy_backend_holds_no_copy_of_a_kernel_constant():
    """backends/cupy.py takes every constant of constants.cuh from backends/constants.py: no
    module-level name of it is bound to a literal, and no per-G table is written out again."""
    assigned = _module_assignments(CUPY_BACKEND)
    mirrored = set(constants.load()) | {"GROUPS", "HEAD_DIMS", "PAGE_SIZES"}
    for name, value in assigned.items():
        literals = [n for n in ast.walk(value) if isinstance(n, ast.Constant)
                    and isinstance(n.value, int) and not isinstance(n.value, bool)]
        if name in mirrored:
            assert not literals, f"cupy.py binds {name} to a literal: read it from constants.cuh"
    for gone in ("ATT_PIPE", "EST_BLOCKS_PER_SM"):
        assert gone not in assigned, f"cupy.py still defines {gone}"
    text = CUPY_BACKEND.read_text(encoding="utf-8")
    for name in ("EST_THREADS", "TK_THREADS", "ATT_WARPS", "ATT_LOADS", "ATT_STAGES",
                 "EST_BLOCKS_PER_SM"):
        assert name in text, f"cupy.py no longer uses {name}"


def _instances(obj, kernel: str) -> set[tuple[str, ...]]:
    """Template arguments of every instance of `kernel` in an object file (mangled names)."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not on PATH")
    symbols = subprocess.run([nm, str(obj)], capture_output=True, text=True, check=True).stdout
    pattern = re.compile(rf"_Z\d+{kernel}I4(fp16|bf16)((?:Li\d+E)+)")
    return {(m.group(1), *re.findall(r"Li(\d+)E", m.group(2))) for m in pattern.finditer(symbols)}


def test_instantiated_variants_are_the_constants(objects):
    """The variants CI builds (QP_INSTANTIATE_ALL) are exactly those the launcher may ask for."""
    consts = constants.load()
    dims, pages, groups = (tuple(str(x) for x in consts[n])
                           for n in ("QP_HEAD_DIMS", "QP_PAGE_SIZES", "QP_GROUPS"))
    result, obj, _ = objects("attention.cu")
    assert result.returncode == 0, result.stderr
    want = set(itertools.product(("fp16", "bf16"), dims, pages, groups))
    assert _instances(obj, "attention_kernel") == want
    result, obj, _ = objects("estimate.cu")
    assert result.returncode == 0, result.stderr
    want = set(itertools.product(("fp16", "bf16"), dims, groups, ("0", "1", "2")))
    assert _instances(obj, "estimate_kernel") == want
    result, obj, _ = objects("estimate_topk.cu")
    assert result.returncode == 0, result.stderr
    assert _instances(obj, "estimate_topk_kernel") == want
