"""What machine a result came from, and what this machine can measure (`questprof doctor`).

Nothing here raises: every probe returns its value or the reason it is missing. GPU-only
modules (cupy, pynvml, cupti, torch, flashinfer) are imported inside the probes, never at
import time.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy

from questprof import ROOT

L2_BYTES_H200 = 60 * 1024 * 1024  # used when the L2 size cannot be read from the device
INSTALL_GPU = "pip install -e '.[cuda13,torch]'"  # what to do where no GPU stack is found
NEEDS_INSTALL = ("GPU", "CuPy", "CUPTI", "torch")  # missing items the extras install
CUPTI_PROBE_SECONDS = 120  # a probe process: imports, context, one configure (~2 s on an H200)


class Missing(Exception):
    """A probe's own reason, told without an exception type."""


def _reason(exc: BaseException) -> str:
    """One-line reason from an exception."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, Missing):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _probe(fn: Callable[[], object]) -> tuple[object, str | None]:
    """(value, None) or (None, reason) from calling fn."""
    try:
        return fn(), None
    except BaseException as exc:  # noqa: BLE001 - a probe must never take the caller down
        if isinstance(exc, KeyboardInterrupt):
            raise
        return None, _reason(exc)


def _dist_version(*names: str) -> str:
    """Installed version of the first of these distributions that is present."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise Missing(f"{' / '.join(names)} not installed")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml():
    """pynvml, initialised."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def _nvml_gpu() -> dict:
    """GPU name and driver version from NVML (device 0)."""
    nv = _nvml()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    return {"gpu": _text(nv.nvmlDeviceGetName(handle)),
            "driver": _text(nv.nvmlSystemGetDriverVersion())}


def _cupy_device() -> dict:
    """Device 0 as the CUDA runtime sees it (through CuPy)."""
    import cupy

    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(0)
    version = rt.runtimeGetVersion()
    return {"gpu": _text(props["name"]), "cuda": f"{version // 1000}.{version % 1000 // 10}",
            "sm_count": int(props["multiProcessorCount"]), "l2_bytes": int(props["l2CacheSize"]),
            "cupy": cupy.__version__}


def _torch_version() -> str:
    return _dist_version("torch")


def _cupy_version() -> str:
    return _dist_version("cupy-cuda13x", "cupy-cuda12x", "cupy")


def _numpy_version() -> str:
    return numpy.__version__


def machine_info() -> dict:
    """gpu, driver, cuda, cupy, torch, numpy, python, sm_count, l2_bytes (None when unknown),
    and `missing`: {item: reason} for every item that is None."""
    info = dict.fromkeys(("gpu", "driver", "cuda", "cupy", "torch", "numpy", "python",
                          "sm_count", "l2_bytes"))
    missing: dict[str, str] = {}
    nvml, nvml_why = _probe(_nvml_gpu)
    device, device_why = _probe(_cupy_device)
    for source in (nvml or {}, device or {}):
        info.update({k: v for k, v in source.items() if info.get(k) is None})
    if info["cupy"] is None:
        info["cupy"], _ = _probe(_cupy_version)
    info["torch"], torch_why = _probe(_torch_version)
    info["numpy"], numpy_why = _probe(_numpy_version)
    info["python"] = platform.python_version()
    why = {"gpu": device_why or nvml_why, "driver": nvml_why, "cuda": device_why,
           "cupy": device_why, "sm_count": device_why, "l2_bytes": device_why,
           "torch": torch_why, "numpy": numpy_why}
    for key, value in info.items():
        if value is None:
            missing[key] = why.get(key) or "unknown"
    info["missing"] = missing
    return info


def git_fields(root: Path = ROOT) -> dict[str, str | None]:
    """meta.json's {git_commit, git_commit_reason} of the project at `root` (the directory that
    holds pyproject.toml and the questprof package): its checkout's HEAD, '+dirty' when tracked
    files changed, or None and why. Only a checkout whose top is `root` counts: a copy of the
    tree inside another repository once recorded that repository's commit.
    QUESTPROF_GIT_COMMIT names the commit where the tree was copied without its history."""
    if os.environ.get("QUESTPROF_GIT_COMMIT"):
        return {"git_commit": os.environ["QUESTPROF_GIT_COMMIT"], "git_commit_reason": None}

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=10)
        if done.returncode != 0:
            raise Missing(done.stderr.strip() or f"git {args[0]}: exit {done.returncode}")
        return done.stdout.strip()

    top, why = _probe(lambda: git("rev-parse", "--show-toplevel"))
    if not top:
        return {"git_commit": None,
                "git_commit_reason": f"the project at {root} is not in a git checkout ({why})"}
    if Path(top).resolve() != Path(root).resolve():
        return {"git_commit": None,
                "git_commit_reason": f"the project at {root} is not the top of a git checkout "
                                     f"(outer repository {top})"}
    sha, why = _probe(lambda: git("rev-parse", "HEAD"))
    if not sha:
        return {"git_commit": None, "git_commit_reason": f"no commit at {root} ({why})"}
    dirty, _ = _probe(lambda: git("status", "--porcelain", "--untracked-files=no"))
    return {"git_commit": f"{sha}+dirty" if dirty else sha, "git_commit_reason": None}


def git_commit() -> str | None:
    """git_fields()'s commit alone: the project's HEAD ('+dirty'), or None."""
    return git_fields()["git_commit"]


def _doctor_gpu() -> str:
    nvml, nvml_why = _probe(_nvml_gpu)
    if nvml:
        return nvml["gpu"]
    device, device_why = _probe(_cupy_device)
    if device:
        return device["gpu"]
    raise Missing(f"no GPU seen by NVML ({nvml_why}) nor by CuPy ({device_why})")


def _doctor_cupy() -> str:
    version = _cupy_version()
    device, why = _probe(_cupy_device)
    if device is None:
        raise Missing(f"cupy {version} installed but no usable device ({why})")
    return f"cupy {device['cupy']}, CUDA runtime {device['cuda']}, {device['sm_count']} SMs"


def _doctor_cupti() -> str:
    """A real PM-sampling session (configure, start, stop, decode) in a fresh process.

    Fresh, because CUPTI allows one collector per process and configure failed on an H200 in
    every process where CuPy had created the context first (measure/cupti.py), as this
    process's CuPy probe does. By module name, so core imports nothing from measure/.
    """
    version = _dist_version("cupti-python")
    done = subprocess.run([sys.executable, "-m", "questprof.measure.cupti"], capture_output=True,
                          text=True, timeout=CUPTI_PROBE_SECONDS)
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    said = lines[-1] if lines else f"exit status {done.returncode}, no output"
    if done.returncode != 0:
        raise Missing(f"cupti-python {version}: a PM-sampling session failed: {said}")
    return f"cupti-python {version}: {said}"


def _doctor_ncu() -> str:
    path = shutil.which("ncu")
    if path is None:
        raise Missing("ncu is not on PATH (install Nsight Compute)")
    done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return f"{lines[-1].strip() if lines else 'version unknown'} ({path})"


def _doctor_nvml() -> str:
    nv = _nvml()
    return f"NVML {_text(nv.nvmlSystemGetNVMLVersion())}, {nv.nvmlDeviceGetCount()} device(s)"


def _doctor_torch() -> str:
    import torch

    cuda = torch.cuda.is_available()
    return f"torch {torch.__version__}, CUDA {'available' if cuda else 'not available'}"


def _doctor_flashinfer() -> str:
    """The optional FlashInfer peer: its version once it imports (kernels JIT-compile later)."""
    try:
        _dist_version("flashinfer-python")
    except Missing:
        raise Missing("flashinfer-python not installed (optional peer: "
                      "pip install -e '.[flashinfer]')") from None
    import flashinfer

    return f"flashinfer {flashinfer.__version__} (its kernels JIT-compile on first use)"


DOCTOR_PROBES: tuple[tuple[str, Callable[[], str]], ...] = (
    ("GPU", _doctor_gpu),
    ("driver", lambda: _nvml_gpu()["driver"]),
    ("CuPy", _doctor_cupy),
    ("CUPTI", _doctor_cupti),
    ("ncu", _doctor_ncu),
    ("NVML", _doctor_nvml),
    ("torch", _doctor_torch),
    ("FlashInfer", _doctor_flashinfer),
)


def doctor_rows() -> list[tuple[str, str, str]]:
    """(item, 'ok' | 'missing', version or reason) for each item questprof can use; a missing
    item that the CUDA extras install names the install command."""
    rows = []
    for item, probe in DOCTOR_PROBES:
        value, why = _probe(probe)
        if why is None:
            rows.append((item, "ok", str(value)))
            continue
        hint = f"; on a GPU machine: {INSTALL_GPU}" if item in NEEDS_INSTALL else ""
        rows.append((item, "missing", why + hint))
    return rows
