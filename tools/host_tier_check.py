"""tools/host_tier_check.py: the host tier's two fetch paths on a GPU, checked and timed.

python3 tools/host_tier_check.py [--repeats N] [--layers L]
1. Correct: a ragged batch (tails 1, S-1, S, S+1 and a one-token request; pages drawn shuffled
   from a pool larger than the batch, so page ids are reused across requests' ranges, and the
   unused pages hold NaN) whose K and V live in mapped pinned host memory. Sparse attention over
   Quest's selection (shared-mean) by the zero-copy path (the attention kernel reads host
   memory in place) and by the gather path (chosen pages copied to an HBM staging pool, then
   attention there), and dense over the host tier, each against the float64 reference
   (relative error <= 1e-3 for fp16).
2. Timed: Llama-3.1-8B's shape (32 q / 8 KV heads, d 128, fp16, page 16), 32K tokens, batch 1,
   budget 2048, shared-mean, summaries in HBM: dense over the host tier, Quest's attention by
   each path, the estimate, against the link's ceilings measured in the same run (pinned
   host-to-device copy, zero-copy read kernel). A pass rotates over L layers' pools (host
   memory read in place can sit in the 60 MiB L2 like HBM); us per layer, median of the passes.
Prints a short table last. Random pools: no step-to-step reuse, every chosen page crosses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

S, D, Q_HEADS, KV_HEADS, DTYPE, TOL = 16, 128, 32, 8, "fp16", 1e-3
CHECK_LENGTHS = (1, S - 1, S, S + 1, 300, 1000)
CHECK_BUDGET = 64  # 4 pages: below P for all but the shortest requests


def _pool(rng, lengths, spare: int = 7):
    """A device PagedKV for `lengths` (pages shuffled from a pool with `spare` unused pages,
    NaN in those), summaries built by the summary kernel, and q (CuPy)."""
    import cupy

    from questprof.backends import cupy as ops
    from questprof.core.layout import PagedKV, page_tables, pages_for, rebuild_plan, to_storage

    num_pages = sum(pages_for(n, S) for n in lengths) + spare
    indptr, indices, last = page_tables(lengths, S, num_pages, rng)
    shape = (num_pages, KV_HEADS, S, D)
    k, v = (np.full(shape, np.nan, np.float32) for _ in range(2))
    for x in (k, v):
        x[indices] = rng.standard_normal((len(indices), KV_HEADS, S, D), dtype=np.float32)
    summ = cupy.empty((num_pages, KV_HEADS, 2, D), dtype=cupy.float16)
    kv = PagedKV(cupy.asarray(to_storage(k, DTYPE)), cupy.asarray(to_storage(v, DTYPE)), summ,
                 cupy.asarray(indptr), cupy.asarray(indices), cupy.asarray(last),
                 tuple(lengths), S, DTYPE)
    valid = np.full(len(indices), S, dtype=np.int32)
    valid[indptr[1:] - 1] = last
    ops.summary(kv, rebuild_plan(indices, valid))
    q = to_storage(rng.standard_normal((len(lengths), Q_HEADS, D), dtype=np.float32), DTYPE)
    return kv, cupy.asarray(q)


def _reference(q, kv, sel=None, count=None):
    """The float64 reference's out [B, Hq, d] on host copies (NaN pages are never read)."""
    import cupy

    from questprof.core import reference
    from questprof.core.layout import from_storage

    host = {n: cupy.asnumpy(getattr(kv, n)) for n in ("k", "v", "kv_indptr", "kv_indices",
                                                       "last_page_len")}
    out, _ = reference.attention(
        from_storage(cupy.asnumpy(q), DTYPE), from_storage(host["k"], DTYPE),
        from_storage(host["v"], DTYPE), host["kv_indptr"], host["kv_indices"],
        host["last_page_len"], None if sel is None else cupy.asnumpy(sel),
        None if count is None else cupy.asnumpy(count))
    return out


def _error(got, want) -> float:
    import cupy

    got = cupy.asnumpy(got).astype(np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check(seed: int = 0) -> dict[str, float]:
    """{path: relative error against float64} of the ragged batch (module text, part 1)."""
    from questprof.backends import cupy as ops
    from questprof.backends.host_tier import (attention_gathered, host_tier, is_host_memory,
                                              staging_pool)

    kv, q = _pool(np.random.default_rng(seed), CHECK_LENGTHS)
    k_pages = CHECK_BUDGET // S
    sel, count = ops.topk(ops.estimate(q, kv, "shared-mean"), kv, k_pages)
    want_sparse, want_dense = _reference(q, kv, sel, count), _reference(q, kv)
    host = host_tier(kv)
    if not (is_host_memory(host.k) and is_host_memory(host.v)):
        raise RuntimeError("host_tier left K or V in device memory")
    errors = {"zero-copy attention": _error(ops.attention(q, host, sel, count)[0], want_sparse),
              "dense over host": _error(ops.attention(q, host)[0], want_dense)}
    # the gather path serves requests of at least K pages (top-K fills every slot there)
    full = [i for i, n in enumerate(CHECK_LENGTHS) if -(-n // S) >= k_pages]
    long_kv, long_q = _pool(np.random.default_rng(seed + 1), [CHECK_LENGTHS[i] for i in full])
    sel, count = ops.topk(ops.estimate(long_q, long_kv, "shared-mean"), long_kv, k_pages)
    want = _reference(long_q, long_kv, sel, count)
    long_host = host_tier(long_kv)
    staging = staging_pool(long_host, k_pages)
    errors["gather + attention"] = _error(
        attention_gathered(ops, long_q, long_host, sel, staging)[0], want)
    return errors


TIME_LENGTH, TIME_BUDGET = 32768, 2048


def _time_pools(layers: int):
    """`layers` pools of the timed case, K and V in host memory (summaries in HBM), with their
    selection (shared-mean) and a staging pool each, and q."""
    from questprof.backends import cupy as ops
    from questprof.backends.host_tier import host_tier, staging_pool

    rng, k_pages, out = np.random.default_rng(1), TIME_BUDGET // S, []
    for _ in range(layers):
        kv, q = _pool(rng, [TIME_LENGTH], spare=0)
        host = host_tier(kv)
        del kv
        sel, count = ops.topk(ops.estimate(q, host, "shared-mean"), host, k_pages)
        out.append((host, sel, count, staging_pool(host, k_pages)))
    return out, q


def time_paths(layers: int, repeats: int) -> list[tuple[str, float, float, float]]:
    """[(path, us per layer, link bytes, link GB/s)] of the timed case and the two ceilings."""
    from questprof.backends import cupy as ops
    from questprof.backends import get_backend
    from questprof.backends.host_tier import attention_gathered, gather
    from questprof.measure.ceilings import measure_link_ceilings
    from questprof.measure.timing import time_layers

    backend, (pools, q) = get_backend("cupy"), _time_pools(layers)
    dense = TIME_LENGTH * KV_HEADS * 2 * D * 2  # every K and V byte of the request
    chosen = TIME_BUDGET * KV_HEADS * 2 * D * 2
    runs = {"dense over host (zero-copy)": (lambda i: ops.attention(q, pools[i][0]), dense),
            "quest attention, zero-copy": (lambda i: ops.attention(q, pools[i][0], pools[i][1],
                                                                   pools[i][2]), chosen),
            "quest attention, gather": (lambda i: attention_gathered(
                ops, q, pools[i][0], pools[i][1], pools[i][3]), chosen),
            "gather alone": (lambda i: gather(pools[i][0], pools[i][1], pools[i][3]), chosen),
            "estimate (summaries in HBM)": (lambda i: ops.estimate(q, pools[i][0],
                                                                   "shared-mean"), 0)}
    rows = []
    for name, (run, link) in runs.items():
        ms = time_layers(backend, run, layers, repeats=repeats, graph=True).median
        rows.append((name, ms * 1e3, link, link / (ms * 1e-3) / 1e9 if link else 0.0))
    ceil = measure_link_ceilings()
    rows += [("ceiling: pinned H2D copy, 1 GiB", 2**30 / (ceil["copy_gbs"] * 1e3), 2**30,
              ceil["copy_gbs"]),
             ("ceiling: zero-copy read, 1 GiB", 2**30 / (ceil["zero_copy_gbs"] * 1e3), 2**30,
              ceil["zero_copy_gbs"])]
    return rows


def table(rows) -> str:
    """The timed rows as a Markdown table; 'of copy' is link GB/s over the copy ceiling."""
    copy = next(g for name, _, _, g in rows if name.startswith("ceiling: pinned"))
    lines = ["| path | us per layer | link MB | link GB/s | of copy ceiling |",
             "|---|---|---|---|---|"]
    for name, us, link, gbs in rows:
        lines.append(f"| {name} | {us:.1f} | {link / 1e6:.1f} | {gbs:.1f} | "
                     f"{gbs / copy:.2f} |")
    dense = next(us for name, us, _, _ in rows if name.startswith("dense"))
    for name, us, _, _ in rows:
        if name.startswith("quest attention"):
            lines.append(f"dense over host / {name}: {dense / us:.1f}x (attention alone; the "
                         f"estimate adds its row)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="tools/host_tier_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="timed passes")
    parser.add_argument("--layers", type=int, default=8, help="pools a pass rotates over")
    args = parser.parse_args()
    errors = check()
    bad = {k: e for k, e in errors.items() if not e <= TOL}
    for path, err in errors.items():
        print(f"{path}: relative error {err:.2e} (tolerance {TOL:g})")
    print(table(time_paths(args.layers, args.repeats)))
    if bad:
        sys.exit(f"FAILED: {', '.join(bad)} beyond {TOL:g}")


if __name__ == "__main__":
    main()
