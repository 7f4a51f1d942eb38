"""The process Nsight Compute profiles for a byte check: `python -m questprof.workload.ncu_child
JOB`, JOB = {"config": Config.as_dict(), "stages": [stage or peer, ...]} (measure.ncu.profile).

Each stage runs once on one layer of a Workload, a marker kernel (the plain read) before each,
so the profiled kernels split into one group per stage (measure.ncu.split_by_marker).
"""

from __future__ import annotations

import json
import sys

from questprof.backends import get_backend
from questprof.core.config import config_from_dict
from questprof.measure import ceilings, ncu
from questprof.workload.pools import Workload


def replay(job: dict) -> None:
    """Run each stage of the job once, inside the profiled range, after a marker kernel."""
    import cupy

    work = Workload(config_from_dict(job["config"]), get_backend("cupy"), 1)
    marker, sink = ceilings.random_buffer(16), cupy.zeros(1, dtype=cupy.float32)
    launches = [work.launcher(s) for s in job["stages"]]
    for launch in launches:  # compile and allocate outside the profiled range
        launch(0)
    ncu.profiler(True)
    for launch in launches:
        ceilings.launch_read(marker, sink)
        launch(0)
    ncu.profiler(False)


if __name__ == "__main__":
    replay(json.loads(sys.argv[1]))
