"""`questprof bytes --check-formula`: measured DRAM bytes of every stage against model.py.

For each configuration and stage (summary, estimate, topk, attention, dense, quest) the CuPy
backend's launches are measured with CUPTI (primary), ncu (per kernel, cross-check) or NVML GPM
(whole device, calibrated), and compared with the modelled bytes; then measured rho (quest read
over dense read) against 1/S + K/P. A naive torch Quest (gather the chosen pages, then SDPA) is
measured too: its extra read + write of the gathered pages is named as an excess.

Two protocols keep every call cold, as in a real decode step. `rotate` (CUPTI's default): the
stage runs over enough layers, each with its own pools, that one pass reads >= 8x the 60 MiB
L2 of an H200 (top-K over copies of its scores), and the window's bytes are divided by the
calls. `flush` (NVML's): each call is followed by a 256 MiB read that evicts L2, and the same
loop without the stage is subtracted. Rows, verdicts and the table live in questprof.byterows.
"""

from __future__ import annotations

import math

from questprof import model
from questprof.byterows import (EXIT_FAIL, EXIT_OK, MIN_JUDGED_BYTES, TOLERANCE, CheckResult,
                                RhoRow, Row, agreement, judge, table, verdict)
from questprof.measure.workload import FLUSH_BYTES, Flush, Workload

SOURCES = ("cupti", "ncu", "nvml")
STAGES = ("summary", "estimate", "topk", "attention", "dense", "quest")
PROTOCOLS = ("rotate", "flush")
# A rotation pass >= 8x the 60 MiB L2: at 4x an H200 still served 1.3-2.5% of estimate's
# summaries from L2 (CUPTI below ncu's cold count); pools of 64 layers at most.
ROTATE_BYTES, MAX_LAYERS = 8 * 60 << 20, 64
CALIBRATION_BYTES = 2 << 30
TARGET_SECONDS = {"cupti": 0.03, "nvml": 0.3}  # GPM averages over its window: make it longer


def config_from_dict(data: dict):
    """A Config rebuilt from Config.as_dict() (for the ncu child process)."""
    import dataclasses

    from questprof.config import Config, ModelShape

    shape = {f.name: data["model" if f.name == "name" else f.name]
             for f in dataclasses.fields(ModelShape) if (f.name == "name" or f.name in data)}
    point = {f.name: data[f.name] for f in dataclasses.fields(Config)
             if f.name != "model" and f.name in data}
    return Config(ModelShape(**shape), **point)


def _repeats(fn, seconds: float) -> int:
    """Repetitions of `fn` (asynchronous) that fill about `seconds` of GPU time, 3..2000."""
    from questprof.measure.ceilings import median_ms

    return int(min(2000, max(3, math.ceil(seconds * 1e3 / median_ms(fn, repeats=3, warmup=1)))))


def _gpm_bytes(fn, repeats: int, full_scale_gbs: float) -> float:
    from questprof.measure import nvml

    def region():
        for _ in range(repeats):
            fn()
        import cupy
        cupy.cuda.Device().synchronize()

    return nvml.gpm_window(region).bytes(full_scale_gbs)


def rotation_layers(cfg, free_bytes: float) -> int:
    """Layers whose smallest judged input read from the pools (summaries for estimate, chosen
    pages for attention) makes a pass >= ROTATE_BYTES, as many as half the free memory holds.
    Top-K reads only scores: it rotates over copies of them (Workload.topk_calls)."""
    works = model.stage_work(cfg)
    reads = [works[s].read for s in ("estimate", "attention") if works[s].read >= MIN_JUDGED_BYTES]
    need = math.ceil(ROTATE_BYTES / max(min(reads, default=works["estimate"].read), 1))
    fit = int(0.5 * free_bytes // max(model.kv_pool_bytes(cfg), 1))
    return max(2, min(need, MAX_LAYERS, fit))


def _measure(source: str, work: Workload, stage: str, flush, full_scale: float | None,
             protocol: str = "rotate"):
    """(read, write) DRAM bytes of one call of `stage` per layer."""
    from questprof.measure import cupti

    launch, layers = work.launcher(stage), work.calls(stage)
    if source == "cupti" and protocol == "rotate":
        def rotation():
            for layer in range(layers):
                launch(layer)

        repeats = _repeats(rotation, TARGET_SECONDS[source])
        got = cupti.measure(rotation, repeats, TARGET_SECONDS[source])
        return got.read / layers, got.write / layers

    def with_stage():
        for layer in range(layers):
            launch(layer)
            flush()

    def without():
        for _ in range(layers):
            flush()

    repeats = _repeats(with_stage, TARGET_SECONDS[source])
    if source == "nvml":
        cupti.release()
        total = _gpm_bytes(with_stage, repeats, full_scale) - _gpm_bytes(without, repeats,
                                                                          full_scale)
        return total / (repeats * layers), None
    a = cupti.measure(with_stage, repeats, TARGET_SECONDS[source])
    b = cupti.measure(without, repeats, TARGET_SECONDS[source])
    return (a.read - b.read) / layers, (a.write - b.write) / layers


def ncu_stages(job: dict) -> None:
    """Child side of ncu: run each stage once on one layer, a marker kernel before each."""
    import cupy

    from questprof.backends import get_backend
    from questprof.measure import ceilings, ncu

    work = Workload(config_from_dict(job["config"]), get_backend("cupy"), layers=1)
    marker, sink = ceilings.random_buffer(16), cupy.zeros(1, dtype=cupy.float32)
    launches = [work.launcher(s) for s in job["stages"]]
    for launch in launches:  # compile and allocate outside the profiled range
        launch(0)
    ncu.profiler(True)
    for launch in launches:
        ceilings.launch_read(marker, sink)
        launch(0)
    ncu.profiler(False)


def _ncu_rows(cfg, stages) -> dict[str, tuple[float, float]]:
    """(read, write) per stage from one ncu child replaying `cfg`."""
    from questprof.measure import cupti, ncu

    cupti.release()
    job = {"kind": "stages", "config": cfg.as_dict(), "stages": list(stages)}
    groups = ncu.split_by_marker(ncu.profile(job), "ceilings_read")
    if len(groups) != len(stages):
        raise ncu.NcuError(f"ncu profiled {len(groups)} marked groups for {len(stages)} stages")
    return {s: (sum(k.read_bytes for k in g), sum(k.write_bytes for k in g))
            for s, g in zip(stages, groups)}


def label(cfg) -> str:
    """Short name of a configuration for rows and messages."""
    return (f"{cfg.model.name} L={cfg.length} B={cfg.batch} S={cfg.page_size} "
            f"budget={cfg.budget} {cfg.mode}")


def source_status(source: str) -> dict[str, str | None]:
    """Each asked source (cupti, ncu, nvml or all) -> None when usable, else why not."""
    from questprof.backends import gpu_unavailable_reason
    from questprof.measure import cupti, ncu, nvml

    asked = SOURCES if source == "all" else (source,)
    if any(s not in SOURCES for s in asked):
        raise ValueError(f"unknown byte source {source!r}: expected cupti, ncu, nvml or all")
    gpu = gpu_unavailable_reason()
    if gpu:  # every source measures the CuPy backend's kernels
        return {s: f"the CuPy backend cannot run: {gpu}" for s in asked}
    probes = {"cupti": cupti.available, "ncu": ncu.available, "nvml": nvml.gpm_available}
    return {s: probes[s]()[1] for s in asked}


def calibrate(sources, flush) -> tuple[list[Row], float | None]:
    """A read kernel of known bytes through each source (rows) and GPM's full scale (GB/s)."""
    from questprof.measure import ceilings, cupti, ncu, nvml

    x = flush.buf if CALIBRATION_BYTES == FLUSH_BYTES else ceilings.random_buffer(CALIBRATION_BYTES)
    read = lambda: ceilings.launch_read(x, flush.sink)  # noqa: E731
    rows, full_scale = [], None
    row = lambda s, r, w, n=CALIBRATION_BYTES, note="": Row(  # noqa: E731
        "read kernel", "calibration-read", s, n, 0, 0, r, w, note=note)
    if "cupti" in sources:
        got = cupti.measure(read, 20)
        rows.append(row("cupti", got.read, got.write))
    if "ncu" in sources:
        cupti.release()
        (k,) = ncu.profile({"kind": "read", "bytes": FLUSH_BYTES})
        rows.append(row("ncu", k.read_bytes, k.write_bytes, FLUSH_BYTES))
    if "nvml" in sources:
        cupti.release()
        repeats = _repeats(read, TARGET_SECONDS["nvml"])
        full_scale = nvml.calibrate_gpm(lambda: _sync_loop(read, repeats),
                                        repeats * CALIBRATION_BYTES)
        again = _gpm_bytes(read, repeats, full_scale) / repeats
        rows.append(row("nvml", again, None, note=f"GPM 100% = {full_scale:,.0f} GB/s here"))
    return rows, full_scale


def _sync_loop(fn, repeats: int) -> None:
    import cupy

    for _ in range(repeats):
        fn()
    cupy.cuda.Device().synchronize()


def measure_config(cfg, backend, source: str, flush, full_scale=None, naive=True,
                   protocol: str = "rotate"):
    """Rows and rho rows of every stage of `cfg` through one source."""
    import cupy

    rotate = source == "cupti" and protocol == "rotate"
    layers = {"ncu": 1}.get(source, 2)
    if rotate:
        layers = rotation_layers(cfg, cupy.cuda.runtime.memGetInfo()[0])
    scores = model.stage_work(cfg)["topk"].read
    topk_calls = min(math.ceil(ROTATE_BYTES / max(scores, 1)), 1024) if rotate else 1
    work = Workload(cfg, backend, layers=layers, topk_calls=topk_calls)
    union = work.union_pages()
    works = model.stage_work(cfg, union)
    works["quest"] = model.quest_work(cfg, union)
    stages = STAGES + (("naive",) if naive else ())
    got = _ncu_rows(cfg, stages) if source == "ncu" else {
        s: _measure(source, work, s, flush, full_scale, protocol) for s in stages}
    rows = [Row(label(cfg), s, source, works["attention" if s == "naive" else s].read,
                works["attention" if s == "naive" else s].unmodelled_read,
                works["attention" if s == "naive" else s].write, *got[s]) for s in stages]
    if rotate:
        _note_short_rotations(rows, work)
    if naive:
        _name_naive(rows[-1], work.gathered_bytes())
    if source == "nvml":  # GPM gives read + write together: no read rho
        return rows, []
    k = model.k_pages(cfg.budget, cfg.page_size, cfg.pages)
    unmodelled = sum(works[s].unmodelled_read for s in model.QUEST_STAGES)
    rho = RhoRow(label(cfg), source, sum(got[s][0] for s in model.QUEST_STAGES) / got["dense"][0],
                 model.rho(cfg.page_size, k, cfg.pages), model.quest_rho(cfg, union),
                 unmodelled / works["dense"].read)
    return rows, [rho]


def _note_short_rotations(rows: list[Row], work: Workload) -> None:
    """Name the rows whose cold rotation stayed under ROTATE_BYTES (pools capped by memory or
    MAX_LAYERS): part of their input may come from L2, so their read can fall short."""
    for row in rows:
        passed = work.calls(row.stage) * row.modelled_read
        if row.modelled_read >= MIN_JUDGED_BYTES and passed < ROTATE_BYTES:
            row.note = (f"rotation pass {passed / 2**20:,.0f} MiB < {ROTATE_BYTES / 2**20:,.0f} "
                        "MiB: part may come from L2")


def _name_naive(row: Row, gathered: float) -> None:
    extra_read = row.measured_read - row.modelled_read - row.unmodelled_read
    extra_write = None if row.measured_write is None else row.measured_write - row.modelled_write
    w = "" if extra_write is None else f", +{extra_write:,.0f} B written"
    row.note = (f"naive gather+SDPA over Quest attention: +{extra_read:,.0f} B read{w}; "
                f"the gathered copy of the chosen K/V pages is {gathered:,.0f} B")


def run_check(configs, source: str = "cupti", tolerance: float = TOLERANCE,
              naive: bool = True, log=None, protocol: str = "rotate") -> CheckResult:
    """Measure and judge every stage of every configuration (see module docstring).

    configs: questprof.config.Config list; source: cupti | ncu | nvml | all; tolerance: relative.
    Status EXIT_OK / EXIT_FAIL / EXIT_NO_SOURCE (no source usable: one line says why).
    """
    sources = source_status(source)
    usable = [s for s in SOURCES if sources.get(s, "not asked") is None]
    if not usable:
        status, lines = verdict([], tolerance, sources)
        return CheckResult([], [], status, lines, sources)
    from questprof.backends import get_backend

    from questprof.measure import cupti

    backend, flush = get_backend("cupy"), Flush()
    rows, rho = [], []
    for source in usable:  # SOURCES order: CUPTI first, released once before ncu and GPM
        if source != "cupti":
            cupti.release()
        more, full_scale = calibrate([source], flush)
        rows += more
        for cfg in configs:
            more, more_rho = measure_config(cfg, backend, source, flush, full_scale, naive,
                                            protocol)
            rows += more
            rho += more_rho
            if log is not None:  # a long check shows it is alive, one line per configuration
                log(f"{source}: {label(cfg)} measured")
    rows = [judge(r, tolerance) for r in rows]
    for r in rows:  # GPM is a whole-device signal: it decides only when it is the one source
        if r.source == "nvml" and len(usable) > 1 and r.within is not None:
            r.within, r.note = None, "GPM whole-device signal: cross-check, not judged"
    status, lines = verdict(rows, tolerance, sources)
    agree, agree_lines = agreement(rows)
    if not agree and status == EXIT_OK:
        status = EXIT_FAIL
    lines += agree_lines
    skipped = [f"{s} unavailable: {why}" for s, why in sources.items() if why]
    return CheckResult(rows, rho, status, lines + skipped, sources)


if __name__ == "__main__":  # python3 -m questprof.bytecheck SCENARIO LENGTHS BUDGETS [SOURCE]
    import sys

    from questprof.config import expand, load_scenario

    args = sys.argv[1:] + [None] * 4
    points = expand(load_scenario(args[0] or "smoke"), lengths=args[1], budgets=args[2],
                    batches=[1], page_sizes=[16])
    result = run_check(points, args[3] or "all")
    print(table(result))
    sys.exit(result.status)
