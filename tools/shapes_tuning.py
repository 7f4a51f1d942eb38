"""Issue 24's missed shapes under several launch choices, side by side in one process.

python3 tools/shapes_tuning.py [--repeats N] [--cases qwen,g16,...] [--tunes merge|rings|ctas]: for
each case (models of scenarios/bench.toml) and each QP_TUNE variant of the set (backends/
variants.py, Tuning), first the variant's output against the float64 reference (dense attention,
sparse attention over the per-head selection of a 2048-token budget, and the estimate where the
variant picks its build) on the same model at batch 1 and min(length, 32K) - 5 tokens; a variant
that is wrong is not timed and says why. Then the stages over the case's cold per-layer
pools (workload.pools.Workload, measure.timing.time_layers: CUDA-graph replays, the bench's
protocol), torch SDPA beside them, and the read ceiling measured first in the same process
(measure.ceilings). Each case runs in its own process, so a fault loses one case. The last thing
printed is one table: case, stage, variant, splits, us per layer, ratio to the read ceiling,
dense / SDPA.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from questprof.backends import variants  # noqa: E402
from questprof.core import model  # noqa: E402
from questprof.core.config import Config, ModelShape  # noqa: E402

# (label, bench.toml model, length, batch): issue 24's four missed cases, llama3-8b as the
# reference, and issue 30's dense cases
CASES = {
    "llama3-8b": ("llama3-8b", 32768, 1),
    "qwen": ("qwen2.5-7b", 32768, 1),
    "g16": ("llama3.1-405b", 32768, 1),
    "phi": ("phi-3-mini", 32768, 1),
    "phi-b8": ("phi-3-mini", 131072, 8),
    "fp8": ("llama3.1-8b-fp8", 32768, 1),
    "mha": ("mha-32h-d128", 32768, 1),
    # issue 30's dense goal (at most the fastest peer) where ours trails SDPA most
    "70b-b8": ("llama3.1-70b-tp8", 131072, 8),
    # the 70B share at batch 1: one dense row of tile 8 (variants.FEW_ROW_SPLITS)
    "70b-8k": ("llama3.1-70b-tp8", 8192, 1),
    "70b": ("llama3.1-70b-tp8", 32768, 1),
    "70b-128k": ("llama3.1-70b-tp8", 131072, 1),
    "gptoss": ("gpt-oss-20b", 32768, 1),
    "qwen-b8": ("qwen2.5-7b", 131072, 8),
    "fp8-b8": ("llama3.1-8b-fp8", 131072, 8),
}
# QP_TUNE values of dense attention ('' = the default launch; ctas=2 = the launch of commit
# ab138da, 2 CTAs per SM for every shape): CTAs per SM, a floor in bytes per split, and deeper
# rings (stages 4 / 6 of 8 KiB per warp, built at head dim 128 for tiles 4, 8, 16) at 1 CTA per
# SM. Dropped after the H200 run of ab138da: splits of 4096 tokens and a 1 MiB floor (1.4-3.6x
# slower than the best wherever they differed from it).
DENSE = ("", "ctas=2", "ctas=1", "split=bytes,value=256k", "split=bytes,value=512k",
         "ctas=1,stages=4", "ctas=1,stages=6")
# The sets of --tunes, stage -> QP_TUNE values. "merge" (issue 24, round 3): the wide merge of a
# row's splits beside the old one at the default launch, at 2 CTAs per SM (twice the splits) and
# with a 256 KiB floor (FP8's best at ab138da); sparse attention at the default launch. "rings":
# round 2's dense variants.
MERGE = ("", "merge=wide", "ctas=2", "ctas=2,merge=wide", "split=bytes,value=256k",
         "split=bytes,value=256k,merge=wide")
# "ctas": the default launch beside 2 and 1 CTAs per SM forced (variants.attention_ctas' rule)
TUNES = {"merge": {"dense": MERGE, "attention": ("", "merge=wide")},
         "rings": {"dense": DENSE}, "ctas": {"dense": ("", "ctas=2", "ctas=1")}}
BUDGET = 2048  # tokens: sparse attention's selection (the Quest step table's budget)
CHECK_LENGTH = 32768
TOL = {"fp16": 1e-3, "bf16": 1e-2}  # the tests' table: ||out - ref|| / ||ref|| against float64


def shape(model: str) -> ModelShape:
    data = tomllib.loads((ROOT / "scenarios" / "bench.toml").read_text(encoding="utf-8"))
    return ModelShape(name=model, **data["models"][model])


def config(model: str, length: int, batch: int) -> Config:
    """A configuration of per-head selections of BUDGET tokens (dense ignores them)."""
    return Config(shape(model), length, batch, 16, BUDGET, "per-head")


def variants_of(m: ModelShape, tunes: str) -> list[tuple[str, str]]:
    """(stage, QP_TUNE) pairs timed for a model from the set `tunes`."""
    return [(stage, t) for stage, values in TUNES[tunes].items() for t in values]


def splits_of(cfg: Config, stage: str, tune: str, device: tuple[int, int]) -> str:
    """'splits x pages, stages[, merge wide]' of dense or sparse attention (per-head selections:
    a row per q head on tile 1 when g > 1) under `tune` (the launcher's own rule,
    variants.attention_launch); device: (SMs, shared memory bytes per SM); '' for the estimate."""
    m, kv, dense = cfg.model, model.kv_dtype(cfg.model), stage == "dense"
    if stage not in ("dense", "attention"):
        return ""
    plan = variants.plan_group(m.group)
    if not dense and m.group > 1:
        plan = variants.GroupPlan(1, m.group, 1)
    rows, pages = cfg.batch * m.kv_heads * plan.chunks, cfg.pages if dense else cfg.k_pages
    return variants.attention_launch(rows, min(pages, cfg.pages), m.head_dim, plan.tile,
                                     cfg.page_size, kv, device[0], dense, device[1],
                                     variants.parse_tuning(tune)).name


def device_of() -> tuple[int, int]:
    """(SMs, shared memory bytes per SM) of the current CuPy device."""
    import cupy

    attrs = cupy.cuda.Device().attributes
    return (int(attrs["MultiProcessorCount"]),
            int(attrs.get("MaxSharedMemoryPerMultiprocessor", variants.SMEM_PER_SM)))


def check_case(label: str, tunes: str) -> dict[str, str | None]:
    """'stage|QP_TUNE' -> why that variant is wrong on the case's model at batch 1 and
    min(length, 32K) - 5 tokens (None: right; 'same launch as X': not run again). Builds every
    kernel the timing uses, so the checks of all cases can run at once to compile in parallel."""
    from questprof.backends import get_backend
    from questprof.core import reference
    from questprof.core.layout import from_storage, kv_values, summary_values
    from questprof.workload.pools import Workload

    name, length, batch = CASES[label]
    cfg, backend = config(name, length, batch), get_backend("cupy")
    dev = device_of()
    small = Config(cfg.model, min(length, CHECK_LENGTH) - 5, 1, 16, BUDGET, "per-head")
    work = Workload(small, backend, 1)
    kv, q = work.kvs[0].with_arrays(backend.to_host), backend.to_host(work.q)
    qf, tables = from_storage(q, cfg.model.dtype), (kv.kv_indptr, kv.kv_indices)
    want = {mode: reference.estimate(qf, summary_values(kv), *tables, mode)
            for mode in ("per-head", "shared-max")}
    kvf = kv_values(kv, "k"), kv_values(kv, "v")
    want["dense"] = reference.attention(qf, *kvf, *tables, kv.last_page_len)
    sel = [backend.to_host(x) for x in work.selections[0]]
    want["attention"] = reference.attention(qf, *kvf, *tables, kv.last_page_len, *sel)

    def wrong(stage: str) -> str | None:
        if stage == "estimate":
            for mode in ("per-head", "shared-max"):
                got = backend.to_host(backend.estimate(work.q, work.kvs[0], mode))
                err = _rel(got, want[mode])
                if not err < 1e-5:
                    return f"estimate {mode}: relative error {err:.2e} (>= 1e-5)"
            return None
        sel = work.selections[0] if stage == "attention" else ()
        out, lse = (backend.to_host(x) for x in backend.attention(work.q, work.kvs[0], *sel))
        err, lse_err = _rel(from_storage(out, cfg.model.dtype), want[stage][0]), _rel(
            lse, want[stage][1])
        if not (err < TOL[cfg.model.dtype] and lse_err < 1e-5):
            return f"{stage}: relative error {err:.2e}, lse {lse_err:.2e}"
        return None

    found, seen = {}, {}
    for stage, tune in variants_of(cfg.model, tunes):
        os.environ["QP_TUNE"] = tune
        same = seen.setdefault((stage, splits_of(cfg, stage, tune, dev) or tune),
                               tune or "default")
        try:
            found[f"{stage}|{tune}"] = (f"same launch as {same}" if same != (tune or "default")
                                        else wrong(stage))
        except Exception as exc:  # a build or launch that fails is that variant's row
            found[f"{stage}|{tune}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    os.environ["QP_TUNE"] = ""
    return found


def _rel(got, want) -> float:
    """||got - want|| / ||want|| in float64; inf when got holds a non-finite value."""
    got = np.asarray(got, dtype=np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def run_case(label: str, repeats: int, wrong: dict[str, str | None], tunes: str) -> list[dict]:
    """Rows of one case: the variants check_case passed, timed; torch SDPA beside."""
    from questprof.backends import get_backend
    from questprof.measure.timing import time_layers
    from questprof.workload.pools import Workload, free_bytes, l2_bytes, release

    name, length, batch = CASES[label]
    cfg, backend = config(name, length, batch), get_backend("cupy")
    dev = device_of()
    layers = model.cold_layers(cfg, l2_bytes(), 0.4 * (free_bytes(backend) or 0))
    work, works, rows = Workload(cfg, backend, layers), model.stage_work(cfg), []
    for stage, tune in variants_of(cfg.model, tunes):
        os.environ["QP_TUNE"] = tune
        row = {"case": label, "stage": stage, "variant": tune or "default",
               "splits": splits_of(cfg, stage, tune, dev),
               "bytes": works[stage].total_read,
               "wrong": wrong.get(f"{stage}|{tune}", "not checked")}
        if row["wrong"] is None:
            t = time_layers(backend, work.launcher(stage), layers, 3, repeats, graph=True)
            row["us"] = t.median * 1e3
        rows.append(row)
    os.environ["QP_TUNE"] = ""
    try:
        t = time_layers(backend, work.launcher("torch-sdpa"), layers, 3, repeats, graph=True,
                        uses_torch=True)
        rows.append({"case": label, "stage": "dense", "variant": "torch SDPA", "splits": "",
                     "bytes": works["dense"].total_read * (2 if cfg.model.is_fp8 else 1),
                     "wrong": None, "us": t.median * 1e3})
    except Exception as exc:  # no torch: the rows say so
        rows.append({"case": label, "stage": "dense", "variant": "torch SDPA", "splits": "",
                     "bytes": 0, "wrong": f"not timed: {type(exc).__name__}: {exc}"[:200]})
    del work
    release(backend)
    return rows


def table(rows: list[dict], ceiling: float) -> list[str]:
    """The markdown table: us, ratio to the read ceiling, dense / SDPA of the same case."""
    sdpa = {r["case"]: r.get("us") for r in rows if r["variant"] == "torch SDPA"}
    lines = [f"us per layer, median of CUDA-graph replays; ratio = bytes / time / read ceiling "
             f"({ceiling:.0f} GB/s); vs SDPA = ours / torch SDPA (FP8: against the 16-bit cache)",
             "| case | stage | variant | launch | us | ratio | vs SDPA |",
             "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        if r.get("us") is None:
            lines.append(f"| {r['case']} | {r['stage']} | {r['variant']} | {r['splits']} | "
                         f"- | - | {r['wrong']} |")
            continue
        ratio = r["bytes"] / (r["us"] * 1e-6) / (ceiling * 1e9) if ceiling else float("nan")
        vs = (f"{r['us'] / sdpa[r['case']]:.2f}" if r["stage"] == "dense" and
              sdpa.get(r["case"]) and r["variant"] != "torch SDPA" else "")
        lines.append(f"| {r['case']} | {r['stage']} | {r['variant']} | {r['splits']} | "
                     f"{r['us']:.1f} | {ratio:.2f} | {vs} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated labels")
    parser.add_argument("--tunes", default="merge", choices=sorted(TUNES), help="variant set")
    parser.add_argument("--case", help="time one case, print its rows as JSON (internal)")
    parser.add_argument("--check", help="check one case, print its verdicts as JSON (internal)")
    parser.add_argument("--wrong", default="{}", help="--check's verdicts (internal)")
    args = parser.parse_args()
    if args.check:
        print(json.dumps(check_case(args.check, args.tunes)))
        return
    if args.case:
        print(json.dumps(run_case(args.case, args.repeats, json.loads(args.wrong), args.tunes)))
        return
    from questprof.backends import get_backend
    from questprof.measure.ceilings import measure_ceilings

    from questprof.workload.pools import release

    backend = get_backend("cupy")
    ceiling = measure_ceilings(backend)["read_gbs"]
    release(backend)  # the cases' processes get the memory
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    labels, start = args.cases.split(","), time.time()
    checks = {label: subprocess.Popen([sys.executable, __file__, "--check", label, "--tunes",
                                       args.tunes],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for label in labels}  # all at once: the kernels compile in parallel
    verdicts = {}
    for label, proc in checks.items():  # every check ends before any timing starts
        out, err = proc.communicate()
        if proc.returncode:
            print(f"case {label}: the check failed:\n{err[-3000:]}", flush=True)
            continue
        verdicts[label] = out.strip().splitlines()[-1]
        print(f"case {label} checked at {time.time() - start:.0f} s: {verdicts[label]}",
              flush=True)
    rows = []
    for label, wrong in verdicts.items():
        done = subprocess.run([sys.executable, __file__, "--case", label, "--repeats",
                               str(args.repeats), "--wrong", wrong, "--tunes", args.tunes],
                              capture_output=True, text=True)
        if done.returncode:
            print(f"case {label} failed:\n{done.stderr[-3000:]}", flush=True)
            continue
        rows += json.loads(done.stdout.strip().splitlines()[-1])
        print(f"case {label} timed at {time.time() - start:.0f} s", flush=True)
    fp8 = [r.get("us") for r in rows if r["case"] == "fp8" and r["variant"] != "torch SDPA"
           and r["stage"] == "dense" and r.get("us")]
    ref = [r.get("us") for r in rows if r["case"] == "llama3-8b" and r["variant"] == "default"
           and r["stage"] == "dense" and r.get("us")]
    if fp8 and ref:
        print(f"FP8 dense / llama3-8b fp16 dense (goal <= 0.55): best {min(fp8) / ref[0]:.2f}")
    print("\n".join(table(rows, ceiling)))


if __name__ == "__main__":
    main()
