"""`questprof bytes --check-formula`: measured DRAM bytes of every stage against core.model.

For each configuration and stage (summary, estimate, topk, attention, dense, quest) the CuPy
backend's launches on a Workload are measured with CUPTI (primary), ncu (per kernel, in a child
process under Nsight Compute) or NVML GPM (whole device, calibrated), and compared with the
modelled bytes; then measured rho (quest read over dense read) against 1/S + K/P. A naive torch
peer (gather the chosen pages, then SDPA) is measured too: its excess is named. Protocols
(rotate, flush) are measure.dram's. Rows are results rows; verdicts are bytes_verdict's.

Over the host tier (--kv-tier host) the pages a stage reads from host memory never reach DRAM:
DRAM reads are judged against the rest (results.dram_read), and the CUPTI source also counts
each stage's link bytes (pcie__read_bytes.sum, calibrated on a zero-copy read of known size in
the same run: commands/link_bytes.py, measure/link.py), judged against core/tier.py's link
reads; link rho (Quest's link bytes over dense's) replaces the DRAM rho there. Where no link is
counted (a CPU, no CUPTI, another source) the rows say why in `link_reason`.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from questprof import console
from questprof.backends import get_backend, gpu_unavailable_reason
from questprof.commands import link_bytes
from questprof.commands.bytes_args import BytesArgs
from questprof.commands.bytes_verdict import (CheckResult, EXIT_NO_SOURCE, MIN_JUDGED_BYTES,
                                              TOLERANCE, conclude, label, table, verdict)
from questprof.core import model, tier
from questprof.core.config import ConfigError
from questprof.core.machine import git_fields, machine_info
from questprof.core.scenarios import configs_from_args
from questprof.core.stages import ROW_STAGES
from questprof.measure import ceilings, cupti, dram, link, ncu, nvml
from questprof.measure.ceilings import Flush
from questprof.measure.dram import PROTOCOLS, SOURCES, TARGET_SECONDS  # noqa: F401
from questprof.results import OURS, ResultsWriter, check_new_run, check_out_file, make_row, now
from questprof.workload.peers import gathered_bytes
from questprof.workload.pools import Workload, check_cache, host_free_bytes, l2_bytes

STAGES = ROW_STAGES
NAIVE = "torch-gather"
NCU_ENTRY = "questprof.workload.ncu_child"  # the child ncu replays a configuration in
MAX_LAYERS = 64  # pools of one rotation at most


def rotate_bytes() -> int:
    """Bytes a rotation pass reads at least: the cold-pass rule (core.model.COLD_FACTOR x the
    device's L2; at 4x an H200 still served 1.3-2.5% of estimate's summaries from L2)."""
    return model.COLD_FACTOR * l2_bytes()
CALIBRATION_BYTES = 2 << 30


def rotation_layers(cfg, free_bytes: float) -> int:
    """Layers whose smallest judged input read from the pools (summaries for estimate, chosen
    pages for attention) makes a pass >= rotate_bytes(), as many as half the free memory holds.
    Top-K reads only scores: it rotates over copies of them (Workload.topk_calls)."""
    works = model.stage_work(cfg)
    reads = [works[s].read for s in ("estimate", "attention") if works[s].read >= MIN_JUDGED_BYTES]
    need = math.ceil(rotate_bytes() / max(min(reads, default=works["estimate"].read), 1))
    fit = int(0.5 * free_bytes // max(model.kv_pool_bytes(cfg), 1))
    return max(2, min(need, MAX_LAYERS, fit))


def ncu_bytes(cfg, stages) -> dict[str, tuple[float, float]]:
    """(read, write) per stage from one ncu child replaying `cfg` (workload.ncu_child)."""
    cupti.release()
    job = {"kind": "stages", "config": cfg.as_dict(), "stages": list(stages)}
    groups = ncu.split_by_marker(ncu.profile(job, entry=NCU_ENTRY), "ceilings_read")
    if len(groups) != len(stages):
        raise ncu.NcuError(f"ncu profiled {len(groups)} marked groups for {len(stages)} stages")
    return {s: (sum(k.read_bytes for k in g), sum(k.write_bytes for k in g))
            for s, g in zip(stages, groups)}


def source_status(source: str) -> dict[str, str | None]:
    """Each asked source (cupti, ncu, nvml or all) -> None when usable, else why not."""
    asked = SOURCES if source == "all" else (source,)
    if any(s not in SOURCES for s in asked):
        raise ValueError(f"unknown byte source {source!r}: expected cupti, ncu, nvml or all")
    gpu = gpu_unavailable_reason()
    if gpu:  # every source measures the CuPy backend's kernels
        return {s: f"the CuPy backend cannot run: {gpu}" for s in asked}
    probes = {"cupti": cupti.available, "ncu": ncu.available, "nvml": nvml.gpm_available}
    return {s: probes[s]()[1] for s in asked}


def _calibration_row(source: str, modelled: int, read, write, note=None) -> dict:
    """A byte row of the read kernel of known size (no configuration)."""
    return {"model": "read kernel", "stage": "calibration-read", "impl": OURS,
            "bytes_source": source, "read_bytes": modelled, "unmodelled_bytes": 0,
            "write_bytes": 0, "measured_read_bytes": read, "measured_write_bytes": write,
            "note": note, "status": "ok"}


def calibrate(sources, flush, tolerance: float = TOLERANCE):
    """A read kernel of known bytes through each source (rows), and GPM's calibration
    (measure.nvml.GpmCalibration) when nvml is among them, else None."""
    x = ceilings.random_buffer(CALIBRATION_BYTES)
    read = lambda: ceilings.launch_read(x, flush.sink)  # noqa: E731
    rows, gpm = [], None
    if "cupti" in sources:
        got = cupti.measure(read, 20)
        rows.append(_calibration_row("cupti", CALIBRATION_BYTES, got.read, got.write))
    if "ncu" in sources:
        cupti.release()
        (k,) = ncu.profile({"kind": "read", "bytes": ceilings.FLUSH_BYTES})
        rows.append(_calibration_row("ncu", ceilings.FLUSH_BYTES, k.read_bytes, k.write_bytes))
    if "nvml" in sources:
        cupti.release()
        repeats = dram.repeats_for(read, TARGET_SECONDS["nvml"])
        gpm = dram.gpm_calibration(read, repeats, CALIBRATION_BYTES, tolerance)
        holds = gpm.why_not is None
        rows.append(_calibration_row(
            "nvml", CALIBRATION_BYTES, gpm.repeat_ratio * CALIBRATION_BYTES if holds else None,
            None, f"GPM 100% = {gpm.full_scale_gbs:,.0f} GB/s here" if holds
            else gpm_note(gpm.why_not)))
    return rows, gpm


def gpm_note(why: str | None) -> str | None:
    """A GPM row's note where its figure is no byte count (it is then never printed or judged)."""
    return None if why is None else f"nvml: not a byte count here ({why})"


def _workload(cfg, backend, source: str, protocol: str):
    """The Workload a source measures: a cold rotation of layers for CUPTI's rotate protocol
    (top-K over copies of its scores), else two layers (the flush read keeps calls cold)."""
    import cupy

    rotate = source == "cupti" and protocol == "rotate"
    free = cupy.cuda.runtime.memGetInfo()[0]
    if tier.kv_tier(cfg) == "host":  # the pools end in pinned host memory: the host's bounds too
        free = min(free, host_free_bytes() or free)
    layers = rotation_layers(cfg, free) if rotate else 2
    work = Workload(cfg, backend, layers)
    if rotate and not cfg.is_dense_budget:
        scores = work.work("topk").read
        work.rotate_topk(min(math.ceil(rotate_bytes() / max(scores, 1)), 1024))
    return work


def _measured(work, source: str, keys, flush, gpm, protocol: str) -> dict:
    """{(stage, impl): (read, write, why not a byte count or None)} through one source."""
    name = lambda k: k[1] if k[1] != OURS else k[0]  # noqa: E731 - the launcher's name
    if source == "ncu":
        got = ncu_bytes(work.cfg, [name(k) for k in keys])
        return {k: (*got[name(k)], None) for k in keys}
    if source == "nvml":
        figures = {k: dram.gpm_stage_bytes(work.launcher(name(k)), work.calls(k[0]), flush, gpm)
                   for k in keys}
        return {k: (g.bytes, None, g.why_not) for k, g in figures.items()}
    return {k: (*dram.stage_bytes(source, work.launcher(name(k)), work.calls(k[0]), flush,
                                  protocol), None) for k in keys}


def measure_config(cfg, backend, source: str, flush, gpm=None, naive=True,
                   protocol: str = "rotate", link_run=None) -> tuple[list[dict], list[dict]]:
    """Rows and rho rows of every stage of `cfg` through one source (gpm: GPM's calibration;
    link_run: the run's link counting, commands/link_bytes.LinkRun, for the host tier)."""
    work = _workload(cfg, backend, source, protocol)
    # the naive torch peer gathers 16-bit pages: over an FP8 cache it has nothing to compare (on
    # an H200, 2026-12-01, it failed the whole CUPTI source of an FP8 Llama-3.1-8B check)
    naive = naive and not cfg.model.is_fp8 and tier.kv_tier(cfg) == "hbm"
    keys = [(s, OURS) for s in STAGES] + ([("attention", NAIVE)] if naive else [])
    got = _measured(work, source, keys, flush, gpm, protocol)
    links = _links(work, source, keys, link_run)
    rows = [make_row(cfg, s, scenario="bytes", backend=backend.name, impl=i, work=work.work(s),
                     layers=work.calls(s), union=work.union, measured_read_bytes=got[(s, i)][0],
                     measured_write_bytes=got[(s, i)][1], bytes_source=source,
                     note=gpm_note(got[(s, i)][2]), **links.get((s, i), {}))
            for s, i in keys]
    if source == "cupti" and protocol == "rotate":
        _note_short_rotations(rows, work)
    if naive:
        _name_naive(rows[-1], work)
    if tier.kv_tier(cfg) == "host":  # dense's pages never reach DRAM: rho over the link
        return rows, _link_rho(rows, cfg, source, work.union)
    if source == "nvml":  # GPM gives read + write together: no read rho
        return rows, []
    read = {s: got[(s, OURS)][0] for s in STAGES}
    works = {s: work.work(s) for s in STAGES}
    unmodelled = sum(works[s].unmodelled_read for s in model.QUEST_STAGES)
    rho = {"config": label(rows[0]), "source": source,
           "rho_measured": sum(read[s] for s in model.QUEST_STAGES) / read["dense"],
           "rho_formula": rows[0]["rho_formula"], "rho_model": rows[0]["rho_model"],
           "rho_text": model.rho_text(cfg.model),
           "rho_unmodelled": unmodelled / works["dense"].read}
    return rows, [rho]


def _links(work, source: str, keys, link_run) -> dict:
    """{(stage, impl): link fields} of our stages over the host tier: counted in the CUPTI
    source's pass (after its DRAM windows, in the process's one configure), else why
    not. The torch peers have no rows over the host tier."""
    ours = [k for k in keys if k[1] == OURS]
    if source != "cupti":
        why = (link_run.reason if link_run is not None and link_run.reason else
               f"link bytes are counted through CUPTI; this row's source is {source}")
        return {k: link_bytes.fields(link_bytes.LinkRun(None, why), work.cfg) for k in ours}
    return {k: link_bytes.fields(link_run, work.cfg, work.launcher(k[0]), work.calls(k[0]))
            for k in ours}


def _link_rho(rows: list[dict], cfg, source: str, union) -> list[dict]:
    """The rho row of a host-tier configuration: Quest's calibrated link bytes over dense's
    against core/tier.py's link rho (K/P, G x K/P per-head, + M_s/M / S for host summaries);
    [] where nothing was counted."""
    by = {r["stage"]: r for r in rows if r["impl"] == OURS}
    quest, dense = (by[s].get("calibrated_link_bytes") for s in ("quest", "dense"))
    if quest is None or not dense:
        return []
    modelled = tier.link_rho(cfg, union_pages=union, fetch="zero-copy")  # read in place
    text = "link G x K/P" if cfg.mode == "per-head" else "link K/P"  # each q head's own pages
    if tier.summary_tier(cfg) == "host":
        text += " + summaries"
    return [{"config": label(rows[0]), "source": f"{source}-link", "rho_measured": quest / dense,
             "rho_formula": modelled, "rho_model": modelled, "rho_text": text,
             "rho_unmodelled": 0.0}]


def _note_short_rotations(rows: list[dict], work) -> None:
    """Name the rows whose cold rotation stayed under rotate_bytes() (pools capped by memory or
    MAX_LAYERS): part of their input may come from L2, so their read can fall short."""
    rotate = rotate_bytes()
    for row in rows:
        passed = work.calls(row["stage"]) * row["read_bytes"]
        if row["read_bytes"] >= MIN_JUDGED_BYTES and passed < rotate:
            row["note"] = (f"rotation pass {passed / 2**20:,.0f} MiB < "
                           f"{rotate / 2**20:,.0f} MiB: part may come from L2")


def _name_naive(row: dict, work) -> None:
    """Say how much more the naive peer reads and writes than our sparse attention."""
    if row["measured_read_bytes"] is None:  # GPM gave no byte count: its note says why
        return
    gathered = gathered_bytes(work.cfg, work.backend.to_host(work.selections[0][0]))
    extra_read = row["measured_read_bytes"] - row["read_bytes"] - row["unmodelled_bytes"]
    extra_write = (None if row["measured_write_bytes"] is None
                   else row["measured_write_bytes"] - row["write_bytes"])
    w = "" if extra_write is None else f", +{extra_write:,.0f} B written"
    row["note"] = (f"naive gather+SDPA over Quest attention: +{extra_read:,.0f} B read{w}; "
                   f"the gathered copy of the chosen K/V pages is {gathered:,.0f} B")


def run_check(configs, source: str = "cupti", tolerance: float = TOLERANCE,
              naive: bool = True, log=None, protocol: str = "rotate") -> CheckResult:
    """Measure and judge every stage of every configuration (see module docstring).

    source: cupti | ncu | nvml | all. A source that fails is one line, and the others still run.
    Status EXIT_OK / EXIT_FAIL / EXIT_NO_SOURCE (no source usable: one line says why).
    """
    sources = source_status(source)
    usable = [s for s in SOURCES if sources.get(s, "not asked") is None]
    # before the CuPy backend starts: CUPTI's collector wants torch's CUDA context (cupti.py)
    link_run = link_bytes.prepare(configs, _link_why_not(sources))
    link_meta = link_run.as_meta() if link_run is not None else {}
    if not usable:
        status, lines = verdict([], tolerance, sources)
        return CheckResult([], [], status, lines + _link_lines(link_run), sources, link_meta)

    backend, flush = get_backend("cupy"), Flush()
    for cfg in configs:  # a cache dtype the kernels do not run yet: one line before any work
        check_cache(cfg.model, backend)
    rows, rho = [], []
    for src in usable:  # SOURCES order: CUPTI first, released once before ncu and GPM
        if src != "cupti":
            cupti.release()
        try:
            more, more_rho = _measure_source(src, configs, backend, flush, naive, protocol, log,
                                             link_run)
        except Exception as exc:  # one failing source is one line; the others still run
            sources[src] = f"{src} failed: {type(exc).__name__}: {exc}"
            continue
        rows, rho = rows + more, rho + more_rho
    if not rows:
        status, lines = verdict([], tolerance, sources)
        return CheckResult([], [], status, lines + _link_lines(link_run), sources, link_meta)
    rows, status, lines = conclude(rows, tolerance, sources, usable)
    skipped = [f"{s} unavailable: {why}" for s, why in sources.items() if why]
    return CheckResult(rows, rho, status, lines + skipped + _link_lines(link_run), sources,
                       link_meta)


def _link_why_not(sources: dict[str, str | None]) -> str | None:
    """Why no link byte is counted with these sources (None when CUPTI is usable)."""
    if gpu_unavailable_reason():
        return "no GPU here, so no host link to count (the tier's link bytes are modelled)"
    if "cupti" not in sources:
        return "link bytes are counted through CUPTI PM sampling: --source cupti or all"
    return sources["cupti"]


def _link_lines(link_run) -> list[str]:
    """One line on the run's link counting over the host tier: the calibration, or why none."""
    if link_run is None:
        return []
    if not link_run.counting:
        return [f"link bytes not measured: {link_run.reason}"]
    cal = link_run.calibration
    return [f"link bytes: {link.METRIC} calibrated on a zero-copy read of "
            f"{cal.known / 2**20:,.0f} MiB in this run: counted {cal.factor:.4f}x "
            f"(second read {cal.spread:+.2%}); rows show the raw and the calibrated figure"]


def _measure_source(src, configs, backend, flush, naive, protocol, log, link_run=None):
    """Calibration rows and every configuration's rows through one source."""
    rows, rho = [], []
    more, gpm = calibrate([src], flush)
    rows += more
    for cfg in configs:
        more, more_rho = measure_config(cfg, backend, src, flush, gpm, naive, protocol,
                                        link_run)
        rows, rho = rows + more, rho + more_rho
        if log is not None:  # a long check shows it is alive, one line per configuration
            log(f"{src}: {label(more[0])} measured")
    return rows, rho


def bytes_command(args: BytesArgs, out_dir, json_out, argv) -> int:
    """The whole `questprof bytes`: measure, print, write; returns the exit status."""
    if out_dir is not None:
        check_new_run(out_dir)
    if json_out is not None:
        check_out_file(json_out, "--json")
    if args.source not in (*SOURCES, "all"):
        raise ConfigError(f"--source {args.source!r}: expected cupti, ncu, nvml or all")
    if args.protocol not in PROTOCOLS:
        raise ConfigError(f"--protocol {args.protocol!r}: expected rotate or flush")
    if not (math.isfinite(args.tolerance) and args.tolerance > 0):
        raise ConfigError(f"--tolerance {args.tolerance}: a fraction above 0 (0.05 = 5%)")
    _, configs = configs_from_args(asdict(args))
    console.err.print(f"rho = {model.rho_text(configs[0].model)}", highlight=False, markup=False)
    result = run_check(configs, args.source, args.tolerance,
                       log=lambda line: console.err.print(line, highlight=False),
                       protocol=args.protocol)
    if json_out is not None:
        json_out.write_text(result.to_json(), encoding="utf-8")
    if out_dir is not None and result.rows:
        meta = {"scenario": args.scenario, "command": " ".join(["questprof", *argv]),
                "started": now(), **git_fields(), "machine": machine_info(),
                "backend": "cupy", "bytes": {"sources": result.sources, "rho": result.rho,
                                             "status": result.status, "lines": result.lines},
                "link_bytes": result.link or None}
        with ResultsWriter(out_dir, meta) as writer:
            for row in result.rows:
                writer.append(row)
    if result.rows:
        console.out.print(table(result), highlight=False)
    else:
        how = "" if result.status != EXIT_NO_SOURCE else f"; on a GPU machine: {console.INSTALL_GPU}"
        console.err.print("; ".join(result.lines) + how, highlight=False, markup=False)
    return result.status
