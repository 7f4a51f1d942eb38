"""tools/kernel_digest.py: digests of every kernel's outputs on fixed inputs, to hold a refactor
to "bit for bit as before".

    python3 tools/kernel_digest.py --write before.json     # on the old tree, on a GPU
    python3 tools/kernel_digest.py --check before.json     # on the new tree: exit 1 on any change

Each case builds a seeded random cache (ragged lengths with tails 1, S-1, S, S+1 and rows long
enough for many attention splits and the wide merge), then runs on the CuPy backend the summary
(over the whole cache), the estimate, the top-K, dense and sparse attention and the Quest step,
and the selectors' kernel forms (boxes, FP8 summaries, dynamic budgets), some under QP_TUNE
(deep rings, each merge, top-K's CTA sizes). A digest is the SHA-256 of an output's bytes: the
kernels are deterministic (the splits of a row merge in one fixed order), so equal inputs give
equal digests exactly when the outputs are bit for bit equal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

# (name, q heads, KV heads, d, page size, dtype, kv dtype, summary dtype, long pages)
SHAPES = [
    ("mha-d128-s16", 8, 8, 128, 16, "fp16", None, None, 900),
    ("g2-d64-s32-bf16", 8, 4, 64, 32, "bf16", None, None, 300),
    ("g4-d128-s16-bf16", 32, 8, 128, 16, "bf16", None, None, 2100),
    ("g7-d128-s16", 28, 4, 128, 16, "bf16", None, None, 700),
    ("g8-d128-s8", 8, 1, 128, 8, "bf16", None, None, 1500),
    ("g16-d128-s16", 32, 2, 128, 16, "bf16", None, None, 600),
    ("g32-d64-s16", 32, 1, 64, 16, "fp16", None, None, 400),
    ("g4-d256-s64", 8, 2, 256, 64, "fp16", None, None, 120),
    ("g2-d80-s128", 4, 2, 80, 128, "bf16", None, None, 40),
    ("g4-d96-s8", 8, 2, 96, 8, "fp16", None, None, 500),
    ("g3-d192-s32", 6, 2, 192, 32, "bf16", None, None, 200),
    ("fp8-g4-d128-s16", 32, 8, 128, 16, "bf16", "fp8_e4m3", None, 1200),
    ("fp8-g4-d128-fp16summ", 16, 4, 128, 16, "bf16", "fp8_e4m3", "fp16", 800),
    ("fp8-mha-d64-s32", 4, 4, 64, 32, "fp16", "fp8_e4m3", None, 300),
]
MODES = ("per-head", "shared-mean", "shared-max")
TUNINGS = ("", "merge=wide", "merge=old", "stages=4", "stages=6", "tk_threads=256",
           "tk_threads=1024", "split=tokens,value=256")
FORMS = ("quest-boxes:2", "quest-fp8", "quest-gap:1", "quest-topp:0.9")


def _digest(gpu, x) -> str:
    return hashlib.sha256(np.ascontiguousarray(gpu.to_host(x)).tobytes()).hexdigest()[:16]


def _case(gpu, shape, seed):
    from questprof.core.layout import full_plan, random_paged_kv, random_queries

    _, hq, hkv, d, s, dtype, kv_dtype, summ, long_pages = shape
    rng = np.random.default_rng(seed)
    lengths = [1, s - 1, s, s + 1, 37 * s + 3, long_pages * s + 5]
    kv = random_paged_kv(rng, lengths, s, hkv, d, dtype, spare_pages=3, tail_fill=np.nan,
                         kv_dtype=kv_dtype, summary_dtype=summ,
                         kv_scale="head" if summ else "tensor")
    q = random_queries(rng, len(lengths), hq, d, dtype)
    dev, dq = gpu.put(kv), gpu.asarray(q)
    gpu.summary(dev, full_plan(kv))
    return kv, dev, dq


def run_all(only: str | None = None, backend: str = "cupy") -> dict[str, str]:
    from questprof.backends import get_backend

    gpu = get_backend(backend)
    out: dict[str, str] = {}
    for i, shape in enumerate(SHAPES):
        if only and only not in shape[0]:
            continue
        kv, dev, dq = _case(gpu, shape, 1000 + i)
        name = shape[0]
        out[f"{name}/summary"] = _digest(gpu, dev.summary)
        k_pages = max(2, min(64, 2048 // shape[4]))
        for tune in TUNINGS:
            os.environ["QP_TUNE"] = tune
            tag = f"{name}[{tune}]" if tune else name
            o, lse = gpu.attention(dq, dev)
            out[f"{tag}/dense"] = _digest(gpu, o) + _digest(gpu, lse)
            for mode in MODES if not tune else ("per-head",):
                scores = gpu.estimate(dq, dev, mode)
                sel, count = gpu.topk(scores, dev, k_pages)
                o, lse = gpu.attention(dq, dev, sel, count)
                qo, qlse = gpu.quest(dq, dev, k_pages, mode)
                out[f"{tag}/{mode}/estimate"] = _digest(gpu, scores)
                out[f"{tag}/{mode}/topk"] = _digest(gpu, sel) + _digest(gpu, count)
                out[f"{tag}/{mode}/sparse"] = _digest(gpu, o) + _digest(gpu, lse)
                out[f"{tag}/{mode}/quest"] = _digest(gpu, qo) + _digest(gpu, qlse)
        os.environ["QP_TUNE"] = ""
        if backend == "cupy" and shape[6] is None and shape[3] in (64, 128):
            out.update(_forms(gpu, kv, dev, dq, name, k_pages))
        gpu.synchronize()
    return out


def _forms(gpu, kv, dev, dq, name, k_pages) -> dict[str, str]:
    from questprof.backends import cupy_selectors as cs
    from questprof.core import selectors
    from questprof.core.layout import full_plan

    out = {}
    for text in FORMS:
        form = selectors.parse(text).kernel_form
        if form.boxes > 1 and kv.page_size % form.boxes:
            continue
        try:
            fs = cs.summaries(dev, form, full_plan(kv))
        except ValueError as e:  # a form not built for this head dim: say so in the digest
            out[f"{name}/{text}"] = f"not built: {e}"
            continue
        out[f"{name}/{text}/summary"] = _digest(gpu, fs.summary)
        scores = cs.estimate(dq, dev, fs, "per-head")
        sel, count = cs.topk(scores, dev, k_pages, form)
        o, lse = cs.quest(dq, dev, fs, k_pages, "per-head")
        out[f"{name}/{text}/estimate"] = _digest(gpu, scores)
        out[f"{name}/{text}/topk"] = _digest(gpu, sel) + _digest(gpu, count)
        out[f"{name}/{text}/quest"] = _digest(gpu, o) + _digest(gpu, lse)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", metavar="FILE", help="write the digests to FILE")
    group.add_argument("--check", metavar="FILE", help="compare with FILE; exit 1 on a change")
    ap.add_argument("--only", help="cases whose name holds this text")
    ap.add_argument("--backend", default="cupy", help="cupy (default); numpy tries the tool on a CPU")
    args = ap.parse_args(argv)
    got = run_all(args.only, args.backend)
    if args.write:
        with open(args.write, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
        print(f"{len(got)} digests -> {args.write}")
        return 0
    with open(args.check) as f:
        want = json.load(f)
    changed = sorted(k for k in got if k in want and got[k] != want[k])
    missing = sorted(k for k in want if k not in got and (not args.only or args.only in k))
    for k in changed:
        print(f"CHANGED {k}: {want[k]} -> {got[k]}")
    for k in missing:
        print(f"MISSING {k}")
    same = sum(1 for k in got if want.get(k) == got[k])
    print(f"{same} of {len(got)} digests equal, {len(changed)} changed, {len(missing)} missing, "
          f"{len(set(got) - set(want))} new")
    return 1 if changed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
