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
from questprof.backends import constants, variants
from questprof.core.fp8 import E4M3

from kernel_objects import SOURCES, _nvcc, host_program

CUPY_BACKEND = ROOT / "questprof" / "backends" / "cupy.py"
LAUNCHER = (CUPY_BACKEND, ROOT / "questprof" / "backends" / "variants.py")


def test_every_stage_has_a_kernel_file():
    assert {"summary.cu", "estimate.cu", "topk.cu", "attention.cu"} <= set(SOURCES)


@pytest.mark.parametrize("source", SOURCES)
def test_compiles_for_sm90(source, objects):
    """QP_INSTANTIATE_ALL instantiates every variant, so real code is compiled, not only parsed."""
    for result, _, cmd in objects(source):
        assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"


def test_late_release_build_compiles(tmp_path):
    """The QP_EARLY_RELEASE=0 build (dependents launch as a grid ends) of a PDL-aware kernel."""
    cmd = [_nvcc(), "-arch=sm_90", "-std=c++17", f"-I{KERNELS_DIR}", "-DQP_EARLY_RELEASE=0",
           "-Werror", "all-warnings", "-cubin", str(KERNELS_DIR / "topk.cu"), "-o",
           str(tmp_path / "topk.cubin")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_kernel_error_fails(tmp_path):
    """The check above catches errors inside template code once it is instantiated."""
    bad = tmp_path / "bad.cu"
    bad.write_text('#include "common.cuh"\ntemplate <int D> __global__ void k(float* x) '
                   '{ x[0] = undefined_name<D>; }\ntemplate __global__ void k<8>(float*);\n')
    cmd = [_nvcc(), "-arch=sm_90", "-std=c++17", f"-I{KERNELS_DIR}", "-cubin", str(bad),
           "-o", str(tmp_path / "bad.cubin")]
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
    printed: dict[str, list[int]] = {}
    for line in host_program(tmp_path, ("constants.cuh",), lines).splitlines():
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
    for name in ("ATT_LOADS", "ATT_STAGES"):
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
    """The launcher (backends/cupy.py, backends/variants.py) takes every constant of
    constants.cuh from backends/constants.py: no module-level name of it is bound to a literal,
    and no per-G table is written out again."""
    mirrored = set(constants.load()) | {"GROUPS", "HEAD_DIMS", "PAGE_SIZES"}
    for path in LAUNCHER:
        assigned = _module_assignments(path)
        for name, value in assigned.items():
            literals = [n for n in ast.walk(value) if isinstance(n, ast.Constant)
                        and isinstance(n.value, int) and not isinstance(n.value, bool)]
            if name in mirrored:
                assert not literals, f"{path.name} binds {name} to a literal: read constants.cuh"
        for gone in ("ATT_PIPE", "EST_BLOCKS_PER_SM"):
            assert gone not in assigned, f"{path.name} still defines {gone}"
    text = "".join(p.read_text(encoding="utf-8") for p in LAUNCHER)
    for name in ("TK_THREAD_OPTIONS", "TK_REG_KEYS", "ATT_WARPS", "ATT_LOADS", "ATT_STAGES",
                 "EST_WARPS", "EST_NTILES", "EST_NTILE_BLOCKS", "QP_MEASURED_HEAD_DIMS",
                 "QP_MEASURED_GROUPS", "SUM_THREADS"):
        assert name in text, f"the launcher no longer uses {name}"


def _instances(parts, kernel: str) -> set[tuple]:
    """Template arguments of every instance of `kernel` in a source's objects (mangled names):
    the storage tags (a tag repeated is a substitution, S0_, of the one before), then the integer
    (Li / Lin for a negative) and bool (Lb) arguments."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not on PATH")
    pattern = re.compile(rf"_Z\d+{kernel}I((?:4fp16|4bf16|4e4m3|S0_)*)((?:L[ib]n?\d+E)+)")
    found = set()
    for result, obj, _ in parts:
        assert result.returncode == 0, result.stderr
        symbols = subprocess.run([nm, str(obj)], capture_output=True, text=True, check=True).stdout
        for m in pattern.finditer(symbols):
            tags = []
            for tag in re.findall(r"4(fp16|bf16|e4m3)|S0_", m.group(1)):
                tags.append(tag or tags[-1])
            ints = [int(x.replace("n", "-")) for x in re.findall(r"L[ib](n?\d+)E", m.group(2))]
            found.add((*tags, *ints))
    return found


def test_instantiated_variants_are_the_constants(objects):
    """The variants CI builds (QP_INSTANTIATE_ALL) are exactly those the launcher may ask for
    (backends/variants.py over every cache, head dim, group 1-17, mode, page size and the
    estimate builds QP_TUNE can pick)."""
    tag, dims, groups = variants.TAGS, variants.HEAD_DIMS, range(1, variants.GROUPS[-1] + 2)
    pairs = {(q, kv) for q, kv, _ in variants.CACHES}
    depths = [variants.Tuning(stages=n) for n in (0, *variants.DEEP_STAGES)]  # QP_TUNE stages
    want = set()
    for (q, kv), d, t, s, tune in itertools.product(pairs, dims, variants.GROUPS,
                                                    variants.PAGE_SIZES, depths):
        ns = variants.attention_stages(d, t, tune)
        want.add((tag[q], tag[kv], d, variants.page_template(d, t, s, kv, ns), t, ns, 0))
    for q, d, t in itertools.product(("fp16", "bf16"), variants.NHD_HEAD_DIMS, variants.GROUPS):
        run = variants.attention_launch(8, 64, d, t, 16, q, 132)  # token-major pages (NHD)
        run = variants.token_major_launch(run, t)
        want.add((tag[q], tag[q], d, run.page, t, run.stages, 1))
    assert _instances(objects("attention.cu"), "attention_kernel") == want
    assert {x for x in want if x[3] == 0} and {x for x in want if x[3] == 64}
    assert {x[5] for x in want} == {*variants.DEEP_STAGES, *constants.load()["ATT_STAGES"]}
    summaries = {(q, summ) for q, _, summ in variants.CACHES + variants.FP8_SUMMARY_CACHES}
    boxed = [(q, c) for q, c in itertools.product(("fp16", "bf16"), variants.BOXES) if c > 1]
    want = {(tag[q], tag[summ], d, variants.estimate_ntiles(g), 1)
            for (q, summ), d, g in itertools.product(summaries, dims, groups)}
    want |= {(tag[q], tag[q], d, variants.estimate_ntiles(g), c)
             for (q, c), d, g in itertools.product(boxed, dims, groups)
             if variants.boxes_built(d, c)}
    assert {x[-1] for x in want} == set(variants.BOXES)
    assert {x[-2] for x in want} == set(variants.EST_NTILES)
    assert _instances(objects("estimate.cu"), "estimate_kernel") == want
    caches = variants.CACHES + variants.FP8_SUMMARY_CACHES
    want = {(tag[kv], tag[summ], d, 1, 0)
            for (_, kv, summ), d in itertools.product(caches, dims)}
    want |= {(tag[q], tag[q], d, c, 0) for (q, c), d in itertools.product(boxed, dims)
             if variants.boxes_built(d, c)}
    want |= {(tag[q], tag[q], d, 1, 1)
             for q, d in itertools.product(("fp16", "bf16"), variants.NHD_HEAD_DIMS)}
    assert _instances(objects("summary.cu"), "summary_kernel") == want
    assert _instances(objects("topk.cu"), "topk_kernel") == set(
        itertools.product(variants.TK_THREAD_OPTIONS, variants.TK_REG_KEYS))


def test_attention_shared_memory_and_tile_are_the_kernels(tmp_path):
    """variants.ring_bytes / tile_tokens (the launcher's) equal attention_tile.cuh's own numbers
    for 16-bit and FP8 caches, every head dim and tile, printed by a host program nvcc builds;
    each ring fits 2 CTAs per SM on an H200 (227 KiB per CTA at most, 228 KiB per SM)."""
    caches = {"fp16": "fp16", E4M3: "e4m3"}
    pairs = list(itertools.product(caches, variants.HEAD_DIMS, variants.GROUPS))
    lines = [f'std::printf("%d %d %d %d\\n", {d}, {g}, attention_ring_bytes<{caches[kv]}, {d}, '
             f'{g}>(), Tile<fp16, {caches[kv]}, {d}, {g}>::TT);' for kv, d, g in pairs]
    deep = list(itertools.product(caches, variants.DEEP_HEAD_DIMS, variants.DEEP_GROUPS,
                                  variants.DEEP_STAGES))  # the deeper rings: bytes only
    lines += [f'std::printf("%d\\n", attention_ring_bytes<{caches[kv]}, {d}, {g}, {n}>());'
              for kv, d, g, n in deep]
    printed = host_program(tmp_path, ("attention_tile.cuh",), lines).splitlines()
    got = [tuple(map(int, line.split()))[2:] for line in printed[:len(pairs)]]
    assert got == [(variants.ring_bytes(d, g, kv), variants.tile_tokens(d, g, kv))
                   for kv, d, g in pairs]
    assert max(ring for ring, _ in got) <= 96 * 1024
    assert [int(x) for x in printed[len(pairs):]] == [variants.ring_bytes(d, g, kv, n)
                                                       for kv, d, g, n in deep]


def _resources(parts) -> dict[str, tuple[int, int, int]]:
    """Instance (as the launcher names it, without spaces) -> (registers, static shared memory
    bytes, spill store bytes) from ptxas -v of a source's objects."""
    found = {}
    for result, _, _ in parts:
        entries = re.split(r"Compiling entry function '", result.stderr)[1:]
        names = subprocess.run(["c++filt"], input="\n".join(e.split("'")[0] for e in entries),
                               capture_output=True, text=True, check=True).stdout.splitlines()
        for name, entry in zip(names, entries):
            regs = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", entry)
            spill = re.search(r"(\d+) bytes spill stores", entry)
            key = re.sub(r"^void |\(.*$", "", name).replace(" ", "")
            found[key] = (int(regs.group(1)), int(regs.group(2)), int(spill.group(1)))
    return found


def test_attention_shared_memory_fits_and_is_the_launchers(objects):
    """Every attention build's static shared memory (ptxas) is variants.static_bytes, no build
    spills, and with its ring it fits a CTA (227 KiB) and the CTAs per SM the launcher plans:
    2 for every default depth (today's grids), 1 for the deeper rings."""
    res = {k: v for k, v in _resources(objects("attention.cu")).items()
           if k.startswith("attention_kernel<")}
    assert len(res) == len(_instances(objects("attention.cu"), "attention_kernel"))
    names = {v: k for k, v in variants.TAGS.items()}
    for key, (_, smem, spill) in res.items():
        _, kv, d, _, g, ns, _ = key.removeprefix("attention_kernel<").rstrip(">").split(",")
        d, g, ns, kv = int(d), int(g), int(ns), names[kv]
        assert spill == 0, key
        assert smem == variants.static_bytes(d, g, kv), key
        need = smem + variants.ring_bytes(d, g, kv, ns) + variants.SMEM_RESERVED
        assert need <= 227 * 1024 + variants.SMEM_RESERVED, key
        fit = variants.SMEM_PER_SM // need
        assert fit >= (2 if ns == constants.per_group("ATT_STAGES", g) else 1), key
