"""The compiled objects of every kernels/*.cu (nvcc, sm_90, every variant): a session fixture the
compile and launcher tests share (tests/conftest.py imports it)."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess

import pytest

from questprof import KERNELS_DIR
from questprof.backends import variants

SOURCES = sorted(p.name for p in KERNELS_DIR.glob("*.cu"))
# Sources whose variants come from kernels/instantiate.cuh build one head dim per nvcc process
# (QP_INSTANTIATE_HEAD_DIM), the processes spread over the CPUs: the same variants, each once.
SPLIT = {s for s in SOURCES if "instantiate.cuh" in (KERNELS_DIR / s).read_text(encoding="utf-8")}


def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.fail("nvcc is not on PATH: CI must compile kernels/*.cu (install the CUDA toolkit)")
    return nvcc


@pytest.fixture(scope="session")
def objects(tmp_path_factory):
    """Every source compiled with QP_INSTANTIATE_ALL (split by head dim where it can be, all parts
    at once over the CPUs): name -> [(CompletedProcess, object, command), ...]."""
    out, nvcc = tmp_path_factory.mktemp("kernels"), _nvcc()

    def build(part: tuple[str, int]):
        source, dim = part
        obj = out / f"{source}.{dim}.o"
        cmd = [nvcc, "-arch=sm_90", "-std=c++17", f"-I{KERNELS_DIR}", "-DQP_INSTANTIATE_ALL",
               f"-DQP_INSTANTIATE_HEAD_DIM={dim}", "-Werror", "all-warnings", "-Xptxas", "-v", "-c",
               str(KERNELS_DIR / source), "-o", str(obj)]
        return source, (subprocess.run(cmd, capture_output=True, text=True), obj, cmd)

    parts = [(s, d) for s in SOURCES for d in (variants.HEAD_DIMS if s in SPLIT else (0,))]
    built: dict[str, list] = {s: [] for s in SOURCES}
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        for source, result in pool.map(build, parts):
            built[source].append(result)
    return built.__getitem__
