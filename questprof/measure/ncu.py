"""Per-kernel DRAM bytes through Nsight Compute, replaying one configuration in a child process.

    ncu --clock-control none --cache-control all --csv --print-units base
        --profile-from-start off --metrics dram__bytes_read.sum,dram__bytes_write.sum,
        gpu__time_duration.sum --kernel-name regex:<re> python3 -m questprof.measure.ncu <job>

The child builds the inputs, then brackets only the measured launches with cudaProfilerStart /
Stop, so setup kernels are never profiled. ncu flushes the caches before each kernel (cache
control all), so every kernel starts cold, as a decode layer does. On an H200 a 256 MiB read
kernel gave 268,445,952 B against 268,435,456 B (+0.004%).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from questprof import backends
from questprof.measure import ceilings

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
NCU_PATHS = ("/usr/local/cuda/bin/ncu",)

# ncu prints SI prefixes (1 Kbyte = 1000 bytes) unless --print-units base asks for plain bytes.
_BYTE_UNITS = {"byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
               "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 1024.0, "mib": 1024.0**2, "gib": 1024.0**3}
_TIME_UNITS = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9,
               "ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}


class NcuError(RuntimeError):
    """ncu failed or printed no metrics; the message holds its own output."""


@dataclass(frozen=True)
class KernelMetrics:
    """One profiled kernel launch: DRAM bytes read / written and its duration in ns."""

    id: int
    name: str
    read_bytes: float
    write_bytes: float
    duration_ns: float


def parse_value(value: str, unit: str) -> float:
    """A metric value as printed by ncu ('268,445,952' or '268.45' with 'Mbyte') in base units."""
    text = value.strip().replace(",", "")
    if not text or text.lower() == "n/a":
        return float("nan")
    scale = _BYTE_UNITS.get(unit.strip().lower()) or _TIME_UNITS.get(unit.strip().lower())
    if scale is None:
        if unit.strip():
            raise ValueError(f"unknown ncu unit {unit!r} for value {value!r}")
        scale = 1.0
    return float(text) * scale


def _table(text: str) -> list[dict]:
    """The CSV rows of ncu's output; the '==PROF==' lines and program output are skipped."""
    lines = text.splitlines()
    for start, line in enumerate(lines):
        if line.startswith('"ID"'):
            return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    return []


def parse_csv(text: str) -> list[KernelMetrics]:
    """Kernels of `ncu --csv` output, in launch order; bytes in B, duration in ns."""
    kernels: dict[int, dict] = {}
    for row in _table(text):
        if not row.get("ID", "").strip().isdigit():
            continue
        kid = int(row["ID"])
        name = row.get("Kernel Name") or row.get("Function Name") or ""
        entry = kernels.setdefault(kid, {"name": name})
        metric = row.get("Metric Name", "")
        if metric in METRICS:
            entry[metric] = parse_value(row.get("Metric Value", ""), row.get("Metric Unit", ""))
    nan = float("nan")
    return [KernelMetrics(k, e["name"], e.get(METRICS[0], nan), e.get(METRICS[1], nan),
                          e.get(METRICS[2], nan)) for k, e in sorted(kernels.items())]


def ncu_path() -> str | None:
    """Path of the ncu executable: $QUESTPROF_NCU, PATH, then /usr/local/cuda/bin."""
    found = os.environ.get("QUESTPROF_NCU") or shutil.which("ncu")
    return found or next((p for p in NCU_PATHS if os.access(p, os.X_OK)), None)


def available() -> tuple[bool, str | None]:
    """(True, None) when ncu and a CUDA device are there, else (False, why); never raises (a
    path lookup, and gpu_unavailable_reason, which says why rather than raising)."""
    if ncu_path() is None:
        return False, "ncu: Nsight Compute (ncu) is not on PATH nor in /usr/local/cuda/bin"
    reason = backends.gpu_unavailable_reason()
    return (False, f"ncu: {reason}") if reason else (True, None)


def command(job: dict, kernel_regex: str = ".", entry: str = "questprof.measure.ncu") -> list[str]:
    """The ncu command line that profiles `job` in a child Python running module `entry`
    (this module's `child` for a plain read; the caller names its own for other jobs)."""
    ncu = ncu_path()
    if ncu is None:
        raise NcuError(available()[1])
    return [ncu, "--clock-control", "none", "--cache-control", "all", "--csv",
            "--print-units", "base", "--profile-from-start", "off",
            "--metrics", ",".join(METRICS), "--kernel-name", f"regex:{kernel_regex}",
            sys.executable, "-m", entry, json.dumps(job)]


def profile(job: dict, kernel_regex: str = ".", timeout_s: float = 300,
            entry: str = "questprof.measure.ncu") -> list[KernelMetrics]:
    """Run `job` under ncu and return its profiled kernels (NcuError with ncu's text if none)."""
    proc = subprocess.run(command(job, kernel_regex, entry), capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    kernels = parse_csv(proc.stdout)
    if proc.returncode != 0 or not kernels:
        raise NcuError(f"ncu exited {proc.returncode} with {len(kernels)} kernels: "
                       f"{failure_text(proc.stderr + chr(10) + proc.stdout)}")
    return kernels


def failure_text(output: str) -> str:
    """What a failed ncu run says, short: ncu's ==ERROR== lines and the last line of the output
    (a child's Python exception), not the middle of a traceback."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("==ERROR==")]
    child = [line for line in lines if not line.startswith("==")]
    return " | ".join(dict.fromkeys(child[-1:] + errors[-2:]))[-400:] or "no output"


def split_by_marker(kernels: list[KernelMetrics], marker: str) -> list[list[KernelMetrics]]:
    """Kernels after each `marker` kernel up to the next one (a group per marked launch)."""
    groups: list[list[KernelMetrics]] = []
    for kernel in kernels:
        if kernel.name.split("(")[0].strip() == marker:
            groups.append([])
        elif groups:
            groups[-1].append(kernel)
    return groups


def profiler(on: bool) -> None:
    """cudaProfilerStart / Stop after a device synchronisation (ncu --profile-from-start off)."""
    import cupy

    cupy.cuda.Device().synchronize()
    (cupy.cuda.runtime.profilerStart if on else cupy.cuda.runtime.profilerStop)()


def child(job: dict) -> None:
    """Run one plain read inside ncu: {'kind': 'read', 'bytes': n}."""
    import cupy

    x = ceilings.random_buffer(int(job["bytes"]))
    sink = cupy.zeros(1, dtype=cupy.float32)
    ceilings.launch_read(x, sink)  # compile outside the profiled range
    profiler(True)
    ceilings.launch_read(x, sink)
    profiler(False)


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
