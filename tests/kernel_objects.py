"""The compiled objects of every kernels/*.cu (nvcc, sm_90, every variant): session fixtures the
compile and launcher tests share (tests/conftest.py imports them).

The builds start in the background at a session's first test when any collected test asks for
`objects`, and run beside the CPU tests, which use one CPU; tests/conftest.py runs the tests that
wait for the builds last. Each build is device code only (`-cubin`: what NVRTC builds for CuPy,
every variant through cicc and ptxas for sm_90, ptxas's report (-v) read by the resource checks),
without the host compile of `-c`: 270 against 301 CPU seconds for all parts (2-core CPU machine
at a load of 4-6, 2026-12-01)."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from questprof import KERNELS_DIR
from questprof.backends import variants

SOURCES = sorted(p.name for p in KERNELS_DIR.glob("*.cu"))
# Sources whose variants come from kernels/instantiate.cuh build one head dim per nvcc process
# (QP_INSTANTIATE_HEAD_DIM), the processes spread over the CPUs: the same variants, each once.
# One process per source took as long in all (265 against 259 CPU seconds at a load of 1-2: the
# headers parse in under a second per part) but makes attention.cu one job of 130 s; parts spread
# over more CPUs.
SPLIT = {s for s in SOURCES if "instantiate.cuh" in (KERNELS_DIR / s).read_text(encoding="utf-8")}
PARTS = [(s, d) for s in SOURCES for d in (variants.HEAD_DIMS if s in SPLIT else (0,))]
# The builds run at the lowest priority: the tests' own process keeps its CPU and the builds take
# what it leaves. At the same priority two nvcc beside it left pytest 2/3 of a CPU: the suite took
# 357 s with 403 CPU-s of work, 176 of them nvcc's (2-core machine, 2026-12-02); niced, 156 s.
# Each build is a process group of its own, not a session: Linux schedules each session as one
# group (autogroup) and weighs a process's nice within its group only (niced sessions: 202 s).
NICE = ("nice", "-n", "19") if shutil.which("nice") else ()
GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.fail("nvcc is not on PATH: CI must compile kernels/*.cu (install the CUDA toolkit)")
    return nvcc


def host_program(tmp_path: Path, headers: tuple[str, ...], lines: list[str]) -> str:
    """What a host program prints that nvcc builds from `lines` (the body of main) after
    including <cstddef>, <cstdio> and `headers` of kernels/: the kernels' own numbers (struct
    layouts, launch constants, ring and scratch sizes) for the tests to hold the Python to."""
    src = tmp_path / "host.cu"
    includes = "".join(f'#include "{h}"\n' for h in headers)
    src.write_text("#include <cstddef>\n#include <cstdio>\n" + includes + "int main() {\n"
                   + "\n".join(lines) + "\n}\n")
    exe = tmp_path / "host"
    build = subprocess.run([_nvcc(), "-std=c++17", f"-I{KERNELS_DIR}", str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout


class Builds:
    """Every part of PARTS compiled with QP_INSTANTIATE_ALL by nvcc processes over the CPUs,
    started at once; calling it with a source waits for that source's parts."""

    def __init__(self, nvcc: str, out: Path):
        self._nvcc, self._out, self._running, self._lock = nvcc, out, set(), threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2)
        self._parts = {s: [] for s in SOURCES}
        for part in PARTS:
            self._parts[part[0]].append(self._pool.submit(self._build, *part))

    def _build(self, source: str, dim: int):
        obj = self._out / f"{source}.{dim}.cubin"
        cmd = [*NICE, self._nvcc, "-arch=sm_90", "-std=c++17", f"-I{KERNELS_DIR}",
               "-DQP_INSTANTIATE_ALL", f"-DQP_INSTANTIATE_HEAD_DIM={dim}", "-Werror",
               "all-warnings", "-Xptxas", "-v", "-cubin", str(KERNELS_DIR / source), "-o",
               str(obj)]
        # a process group of its own, so that close() ends nvcc together with its cicc or ptxas
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              **GROUP) as proc:
            with self._lock:
                self._running.add(proc)
            stdout, stderr = proc.communicate()
            with self._lock:
                self._running.discard(proc)
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), obj, cmd

    def __call__(self, source: str) -> list:
        """[(CompletedProcess, object, command), ...] of the source's parts."""
        return [future.result() for future in self._parts[source]]

    def close(self) -> None:
        """Drop the builds not started and end the running ones (a session cut short)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for proc in self._running:
                os.killpg(proc.pid, signal.SIGKILL)
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="session", autouse=True)
def kernel_builds(request, tmp_path_factory):
    """Starts the builds before the first test when a collected test asks for `objects`, so nvcc
    runs while the CPU tests do; without nvcc it starts nothing (`objects` then fails)."""
    wanted = any("objects" in item.fixturenames for item in request.session.items)
    nvcc = shutil.which("nvcc")
    builds = Builds(nvcc, tmp_path_factory.mktemp("kernels")) if wanted and nvcc else None
    yield builds
    if builds is not None:
        builds.close()


@pytest.fixture(scope="session")
def objects(kernel_builds):
    """Every source compiled with QP_INSTANTIATE_ALL (split by head dim where it can be, all parts
    at once over the CPUs): name -> [(CompletedProcess, object, command), ...]."""
    _nvcc()
    assert kernel_builds is not None, "the builds start only when a collected test asks for them"
    return kernel_builds
