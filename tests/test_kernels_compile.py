"""Every kernels/*.cu compiles with nvcc for sm_90, every template variant instantiated (CI, no GPU)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from questprof import KERNELS_DIR

SOURCES = sorted(p.name for p in KERNELS_DIR.glob("*.cu"))


def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.fail("nvcc is not on PATH: CI must compile kernels/*.cu (install the CUDA toolkit)")
    return nvcc


def test_every_stage_has_a_kernel_file():
    assert {"summary.cu", "estimate.cu", "topk.cu", "attention.cu"} <= set(SOURCES)


@pytest.mark.parametrize("source", SOURCES)
def test_compiles_for_sm90(source, tmp_path):
    """QP_INSTANTIATE_ALL instantiates every variant, so real code is compiled, not only parsed."""
    cmd = [_nvcc(), "-arch=sm_90", "-std=c++17", f"-I{KERNELS_DIR}", "-DQP_INSTANTIATE_ALL",
           "-Werror", "all-warnings", "-c", str(KERNELS_DIR / source), "-o", str(tmp_path / "k.o")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"


def test_a_kernel_error_fails(tmp_path):
    """The check above catches errors inside template code once it is instantiated."""
    bad = tmp_path / "bad.cu"
    bad.write_text('#include "common.cuh"\ntemplate <int D> __global__ void k(float* x) '
                   '{ x[0] = undefined_name<D>; }\ntemplate __global__ void k<8>(float*);\n')
    cmd = [_nvcc(), "-arch=sm_90", "-std=c++17", f"-I{KERNELS_DIR}", "-c", str(bad),
           "-o", str(tmp_path / "bad.o")]
    assert subprocess.run(cmd, capture_output=True, text=True).returncode != 0
