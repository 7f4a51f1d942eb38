"""Kernel benchmark on the cold-cache protocol: our stages, their bytes and bandwidth against the
read ceiling measured in the same run, and the torch peers beside them. A second ratio (same-B)
compares a stage with a plain cold read of its own bytes (measure.ceilings.read_ladder, taken
first): the ceiling at that size, where launch, ramp and tail are not hidden.

Each simulated layer has its own KV pool; a timed pass walks every layer (measure.timing), with
enough layers that the bytes a pass reads are >= 8x the 60 MiB L2 of an H200.
Run: python3 -m questprof.bench [--quick] [--no-peers] [--no-graph] [--json rows.json]
"""

from __future__ import annotations

import argparse
import functools
import json

from questprof import model, sweep
from questprof.config import Config, ModelShape
from questprof.measure.timing import cold_layers, time_layers

L2_BYTES = 60 << 20
POOL_BUDGET = 24 << 30  # device bytes of our KV pools per case (the torch peers take as much)
MHA = ModelShape("mha-32h-d128", 32, 32, 32, 128, "fp16")
LLAMA3_8B = ModelShape("llama3-8b", 32, 32, 8, 128, "fp16")


def default_cases(quick: bool = False) -> list[Config]:
    """The issue's goals: MHA batch 1 at 32K / 128K, batch 8, and llama3-8b in each GQA mode."""
    cases = [Config(MHA, 32768, 1, 16, 2048), Config(MHA, 131072, 1, 16, 4096)]
    if quick:
        return cases
    cases.append(Config(MHA, 32768, 8, 16, 2048))
    cases += [Config(LLAMA3_8B, 32768, 1, 16, 2048, mode) for mode in
              ("per-head", "shared-max", "shared-mean")]
    return cases


def _layers(cfg: Config) -> int:
    """Layers of a cold pass (measure.timing.cold_layers) within POOL_BUDGET."""
    return cold_layers(cfg, L2_BYTES, POOL_BUDGET)


_GRAPH_FAILED: list[str] = []  # the first capture failure turns graphs off for the run


def _time(backend, run, layers: int, repeats: int, graph: bool):
    """Timing of run(layer); CUDA-graph replay when asked and capturable, else events."""
    run(0)  # warm the memory pool and compile, so a capture allocates nothing new
    backend.synchronize()
    if graph and not _GRAPH_FAILED:
        try:
            return time_layers(backend, run, layers, repeats=repeats, graph=True)
        except Exception as exc:  # capture unsupported here: fall back, and say so
            _GRAPH_FAILED.append(f"{type(exc).__name__}: {exc}")
            print(f"  graph capture failed ({_GRAPH_FAILED[0]}); timing with events from now on")
    return time_layers(backend, run, layers, repeats=repeats)


def _on_cupy_stream(fn):
    """Run a torch callable on the CuPy stream that time_layers records its events on."""
    import cupy
    import torch
    streams = {}

    def run(layer: int):
        ptr = cupy.cuda.get_current_stream().ptr
        if ptr not in streams:
            streams[ptr] = torch.cuda.ExternalStream(ptr)
        with torch.cuda.stream(streams[ptr]):
            return fn(layer)
    return run


def _row(cfg, stage, impl, timing, work, ceiling, layers) -> dict:
    t = timing.summary()
    read = work.total_read if work is not None else None
    gbs = read / (t["median_ms"] * 1e-3) / 1e9 if read else None
    return {**cfg.as_dict(), "k_pages": cfg.k_pages, "stage": stage, "backend": impl,
            "method": timing.method, **t, "read_bytes": work.read if work else None,
            "unmodelled_bytes": work.unmodelled_read if work else None,
            "bandwidth_gbs": gbs, "ceiling_gbs": ceiling,
            "ratio": gbs / ceiling if gbs and ceiling else None, "layers": layers}


def _ours(backend, cfg, prep, ceiling, repeats, graph) -> list[dict]:
    """Rows of our stages over the sweep's prepared layers, and of a whole Quest step."""
    kvs, q = prep.kvs, prep.q

    def quest(l):
        s = backend.estimate(q, kvs[l], cfg.mode)
        return backend.attention(q, kvs[l], *backend.topk(s, kvs[l], cfg.k_pages))

    runs = {stage: sweep.runner(stage, backend, cfg, prep)
            for stage in ("summary", "estimate", "topk", "attention", "dense")}
    runs["quest"] = quest
    union = prep.union_pages
    work = {**model.stage_work(cfg, union), "quest": model.quest_work(cfg, union)}
    return [_row(cfg, stage, "cupy", _time(backend, run, len(kvs), repeats, graph), work[stage],
                 ceiling, len(kvs)) for stage, run in runs.items()]


def _peers(backend, cfg, layers, ceiling, repeats, union) -> list[dict]:
    """torch SDPA dense and naive torch Quest on contiguous caches of the same shape."""
    import torch
    from questprof import peers
    m = cfg.model
    caches = peers.make_layers(layers, cfg.batch, m.kv_heads, cfg.length, m.head_dim,
                               cfg.page_size, m.dtype, cfg.seed)
    q = peers.random_query(cfg.batch, m.q_heads, m.head_dim, m.dtype, cfg.seed)
    torch.cuda.synchronize()
    work = model.stage_work(cfg, union)
    runs = {("dense", "torch-sdpa"): (peers.sdpa_dense(caches, q), work["dense"]),
            ("quest", "torch-naive"): (peers.naive_quest(caches, q, cfg.k_pages, cfg.mode),
                                       model.quest_work(cfg, union))}
    rows = []
    for (stage, impl), (run, w) in runs.items():
        timing = _time(backend, _on_cupy_stream(run), layers, repeats, graph=False)
        rows.append(_row(cfg, stage, impl, timing, w, ceiling, layers))
    del caches
    torch.cuda.empty_cache()
    return rows


SAME_BYTES_STAGES = ("estimate", "attention", "dense")  # stages that stream their bytes once


def add_same_bytes(rows: list[dict], read_ms) -> None:
    """Give each streaming row of ours the time of a plain read of its bytes (`read_ms(nbytes)`,
    None where unknown) and its ratio to that: the ceiling at the stage's own size."""
    for r in rows:
        if r["backend"] != "cupy" or r["stage"] not in SAME_BYTES_STAGES:
            continue
        ms = read_ms(int(r["read_bytes"] + r["unmodelled_bytes"]))
        if ms is not None:
            r["same_read_ms"], r["same_ratio"] = ms, ms / r["median_ms"]


def run_case(backend, cfg: Config, ceiling: float | None, repeats: int = 20, graph: bool = True,
             with_peers: bool = True, read_ms=None) -> list[dict]:
    """All rows of one configuration (our stages, then the peers); `read_ms(nbytes)` gives a
    plain read's time for a stage's bytes (measure.ceilings.ladder_ms), None to skip it."""
    import cupy
    layers = _layers(cfg)
    prep = sweep.prepare(cfg, backend, layers)  # the sweep's pools, queries and selections
    rows, union = _ours(backend, cfg, prep, ceiling, repeats, graph), prep.union_pages
    del prep
    cupy.get_default_memory_pool().free_all_blocks()
    if read_ms is not None:
        add_same_bytes(rows, read_ms)
    if with_peers:
        rows += _peers(backend, cfg, layers, ceiling, repeats, union)
    return rows


def _median(rows, stage, impl="cupy", **where) -> float | None:
    for r in rows:
        if r["stage"] == stage and r["backend"] == impl and all(r[k] == v for k, v in where.items()):
            return r["median_ms"]
    return None


def _ratio(rows, stage, **where) -> float | None:
    hit = [r["ratio"] for r in rows if r["stage"] == stage and r["backend"] == "cupy"
           and all(r[k] == v for k, v in where.items())]
    return hit[0] if hit else None


def goals(rows: list[dict]) -> list[tuple[str, float | None, str, bool | None]]:
    """(goal, measured, target, met) for the issue's goals, from the MHA batch-1 rows."""
    mha = {"model": MHA.name, "batch": 1}
    out = []
    for n in (32768, 131072):
        at = {**mha, "length": n}
        dense, sdpa = _median(rows, "dense", **at), _median(rows, "dense", "torch-sdpa", **at)
        quest, naive = _median(rows, "quest", **at), _median(rows, "quest", "torch-naive", **at)
        speed = dense / quest if dense and quest else None
        target = 9.1 if n == 131072 else 6.4
        out += [(f"dense {n // 1024}K / read BW", _ratio(rows, "dense", **at), ">= 0.90", None),
                (f"dense {n // 1024}K / torch SDPA time", dense / sdpa if dense and sdpa else None,
                 "< 1", None),
                (f"estimate {n // 1024}K / read BW", _ratio(rows, "estimate", **at), ">= 0.85", None),
                (f"sparse attn {n // 1024}K / read BW", _ratio(rows, "attention", **at), ">= 0.80",
                 None),
                (f"quest speedup vs dense {n // 1024}K", speed, f">= {target}", None),
                (f"ours / naive torch quest {n // 1024}K", quest / naive if quest and naive else None,
                 "< 1", None)]
    topk = _median(rows, "topk", **mha, length=131072)
    out.append(("topk 8192 pages x 32 heads K=256 (us)", topk * 1e3 if topk else None, "<= 10", None))
    return [(g, v, t, None if v is None else _met(v, t)) for g, v, t, _ in out]


def _met(value: float, target: str) -> bool:
    op, bound = target.split()
    return {">=": value >= float(bound), "<=": value <= float(bound), "<": value < float(bound)}[op]


def format_table(rows: list[dict]) -> str:
    """One line per (configuration, stage, implementation)."""
    head = (f"{'model':<13}{'L':>7}{'B':>3}{'S':>3}{'budget':>7} {'mode':<12}{'stage':<10}"
            f"{'impl':<12}{'us/layer':>10}{'MB read':>9}{'GB/s':>7}{'ratio':>7}{'same-B':>7} method")
    lines = [head]
    for r in rows:
        mb = (r["read_bytes"] + r["unmodelled_bytes"]) / 1e6 if r["read_bytes"] is not None else 0
        gbs = f"{r['bandwidth_gbs']:7.0f}" if r["bandwidth_gbs"] else f"{'':7}"
        ratio = f"{r['ratio']:7.2f}" if r["ratio"] else f"{'':7}"
        same = f"{r['same_ratio']:7.2f}" if r.get("same_ratio") else f"{'':7}"
        lines.append(f"{r['model']:<13}{r['length']:>7}{r['batch']:>3}{r['page_size']:>3}"
                     f"{r['budget']:>7} {r['mode']:<12}{r['stage']:<10}{r['backend']:<12}"
                     f"{r['median_ms'] * 1e3:10.1f}{mb:9.1f}{gbs}{ratio}{same} {r['method']}")
    return "\n".join(lines)


def format_goals(rows: list[dict]) -> str:
    lines = [f"{'goal':<42}{'measured':>10}  {'target':<9} met"]
    for goal, value, target, met in goals(rows):
        shown = f"{value:10.3f}" if value is not None else f"{'n/a':>10}"
        lines.append(f"{goal:<42}{shown}  {target:<9} {'-' if met is None else 'yes' if met else 'NO'}")
    return "\n".join(lines)


def same_bytes_bounds(rows: list[dict]) -> list[tuple[str, float | None, float | None]]:
    """(what, plain-read us, ratio) at MHA batch 1: each streaming stage against a plain read of
    its own bytes, and the Quest speedup if estimate and attention took exactly those reads."""
    out = []
    for n in (32768, 131072):
        at = {"model": MHA.name, "batch": 1, "length": n}
        hit = {r["stage"]: r for r in rows if r["backend"] == "cupy" and r.get("same_read_ms")
               and all(r[k] == v for k, v in at.items())}
        for stage in ("estimate", "attention"):
            r = hit.get(stage)
            out.append((f"{stage} {n // 1024}K / plain read of its bytes",
                        r["same_read_ms"] * 1e3 if r else None, r["same_ratio"] if r else None))
        dense, topk = _median(rows, "dense", **at), _median(rows, "topk", **at)
        if dense and topk and "estimate" in hit and "attention" in hit:
            best = hit["estimate"]["same_read_ms"] + topk + hit["attention"]["same_read_ms"]
            out.append((f"quest {n // 1024}K at plain reads + our top-K (speedup)", best * 1e3,
                        dense / best))
    return out


def format_bounds(rows: list[dict]) -> str:
    """same_bytes_bounds as a table (n/a where a stage has no plain-read time)."""
    lines = ["at a stage's own size".ljust(50) + f"{'us':>8}{'ratio':>8}"]
    for what, us, ratio in same_bytes_bounds(rows):
        shown = f"{us:8.1f}{ratio:8.2f}" if us is not None else f"{'n/a':>8}"
        lines.append(f"{what:<50}{shown}")
    return "\n".join(lines)


def run_bench(cases: list[Config] | None = None, repeats: int = 20, graph: bool = True,
              with_peers: bool = True, log=print) -> list[dict]:
    """Rows (dicts) of every case: ours per stage and the peers, with bytes and bandwidth.

    Needs the CuPy backend (a CUDA GPU); peers need torch. `log` gets progress lines.
    """
    from questprof.backends import get_backend
    from questprof.measure.ceilings import ladder_ms, measure_ceilings, read_ladder
    backend = get_backend("cupy")
    ceilings = measure_ceilings(backend)
    ladder = read_ladder(backend, L2_BYTES, repeats=repeats)  # before any pool comes and goes
    log("plain cold reads: " + ", ".join(f"{n >> 20} MiB {ms * 1e3:.1f} us" for n, ms in ladder))
    read_ms = functools.partial(ladder_ms, ladder)
    read_gbs = ceilings.get("read_gbs")
    log(f"ceilings: read {read_gbs:.0f} GB/s, copy {ceilings.get('copy_gbs'):.0f} GB/s, "
        f"fp16 {ceilings.get('fp16_tflops'):.0f} TFLOP/s ({ceilings.get('gpu')})")
    rows = []
    for cfg in cases if cases is not None else default_cases():
        log(f"case {cfg.model.name} L={cfg.length} B={cfg.batch} S={cfg.page_size} "
            f"budget={cfg.budget} {cfg.mode} ({_layers(cfg)} layers)")
        case_rows = run_case(backend, cfg, read_gbs, repeats, graph, with_peers, read_ms)
        log(format_table(case_rows))
        rows += case_rows
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the MHA batch-1 32K and 128K cases")
    parser.add_argument("--no-peers", action="store_true", help="skip the torch peers")
    parser.add_argument("--no-graph", action="store_true", help="time eager launches, not graphs")
    parser.add_argument("--repeats", type=int, default=20, help="timed passes per stage")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    rows = run_bench(default_cases(args.quick), args.repeats, not args.no_graph, not args.no_peers)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1, default=str)
    print(format_table(rows))
    print(format_goals(rows))
    print(format_bounds(rows))


if __name__ == "__main__":
    main()
