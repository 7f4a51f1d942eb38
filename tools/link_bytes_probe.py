"""Which counters count the bytes that cross the host link (issue 33: measured link bytes).

Runs two regions of known link traffic on the GPU, each in its own CUPTI PM-sampling window:
a pinned host-to-device copy and a kernel reading mapped pinned host memory in place
(zero-copy), `--mib` each, `--repeats` times. For every candidate metric (the names given, or
those of `ncu --query-metrics --chip <chip>` that hold "pcie") it prints whether PM sampling
configures with it and, if so, its sum over each window against the known bytes. Each metric
runs in a fresh process (--one): a collector configured twice completes no sample after the
second configure (H200, 2026-12-02, notes/BYTES.md), and the collector is made before CuPy
touches the GPU (torch's context first, as measure/cupti.py does).

    python3 tools/link_bytes_probe.py [--mib 256] [--repeats 8] [--metrics a,b,...]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time

import numpy as np

from questprof.measure import cupti as qcupti
from questprof.measure.ceilings import launch_read

GUESSES = ("pcie__read_bytes.sum", "pcie__write_bytes.sum", "pcie__rx_bytes.sum",
           "pcie__tx_bytes.sum")


def ncu_pcie_metrics(chip: str = "gh100") -> list[str]:
    """Metric names holding 'pcie' that ncu lists for `chip` (empty when ncu is missing)."""
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    try:
        out = subprocess.run([ncu, "--query-metrics", "--chip", chip], capture_output=True,
                             text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    names = [line.split()[0] for line in out.splitlines() if "pcie" in line.lower() and line.split()]
    return [n for n in names if n.startswith("pcie")]


def window(collector, run, interval_ns: int = 100_000) -> list[float]:
    """Each metric's sum over a PM-sampling window around run(), first sample left out."""
    import cupy

    pad = 5 * interval_ns * 1e-9
    opened = time.perf_counter()
    collector.start()
    try:
        time.sleep(pad)
        run()
        cupy.cuda.Device().synchronize()
        time.sleep(pad)
    finally:
        collector.stop()
    data = collector.decode(max_samples=qcupti.decode_samples(time.perf_counter() - opened,
                                                              interval_ns))
    samples = list(data)[1:]
    width = len(samples[0].metric_values) if samples else 0
    return [sum(s.metric_values[i] for s in samples) for i in range(width)]


def probe(name: str, mib: int, repeats: int) -> None:
    """One metric in this process: configure, then a copy window and a zero-copy window."""
    import cupy

    from questprof.backends.host_tier import MappedHost, mapped_empty

    collector = qcupti._collector()  # torch's context, then the collector, then CuPy's arrays
    try:
        collector.configure(metrics=[name], hardware_buffer_size=qcupti.HW_BUFFER,
                            sampling_interval=100_000)
    except Exception as exc:  # deliberately any: a metric PM sampling refuses is the answer
        print(f"{name}: not configurable ({type(exc).__name__}: {str(exc)[:120]})")
        return
    nbytes = mib << 20
    host = MappedHost(nbytes)
    host.host_view((nbytes // 4,), np.float32)[:] = 1.0
    dst = cupy.empty(nbytes // 4, dtype=cupy.float32)
    mapped = mapped_empty((nbytes // 4,), np.float32)
    mapped[...] = dst
    sink = cupy.zeros(1, dtype=cupy.float32)

    def copies():
        for _ in range(repeats):
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr, host.ptr, nbytes,
                                          cupy.cuda.runtime.memcpyHostToDevice,
                                          cupy.cuda.get_current_stream().ptr)

    def zero_copy():
        for _ in range(repeats):
            launch_read(mapped, sink)

    sums = [window(collector, run) for run in (copies, zero_copy)]
    if not all(sums):
        print(f"{name}: configured, but a window held no completed sample")
        return
    known = nbytes * repeats
    got = [s[0] for s in sums]
    print(f"{name}: copy {got[0]:.4g} B ({got[0] / known:.4f} of {known}), zero-copy "
          f"{got[1]:.4g} B ({got[1] / known:.4f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--metrics", default="")
    parser.add_argument("--one", default="", help="probe this one metric in this process")
    args = parser.parse_args()
    if args.one:
        probe(args.one, args.mib, args.repeats)
        return
    names = [m for m in args.metrics.split(",") if m] or sorted(set(ncu_pcie_metrics()) | set(GUESSES))
    print(f"candidates ({len(names)}): {', '.join(names)}", flush=True)
    for name in names:  # a fresh process each (module docstring)
        subprocess.run([sys.executable, __file__, "--one", name, "--mib", str(args.mib),
                        "--repeats", str(args.repeats)], check=False)


if __name__ == "__main__":
    main()
