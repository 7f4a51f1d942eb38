"""The passkey task through transformers' serving loop beside the fidelity task's Quest loop
(questprof/serving/task.py): per prompt, whether the answers are the same tokens; per policy,
accuracy, per-token latency p50 / p95, tokens per second and where the decode steps' time went
(serving/step_time.py), as Markdown (and JSON with --out).

    python tools/serve_task.py --model smollm2 --length 2048 --prompts 20 --page-size 16 \\
        --budget 256 --dense-layers 2 --steps 8 --out task.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="what fidelity loads (with a tokenizer)")
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--prompts", type=int, default=20, help="passkey prompts (spread depths)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--budget", type=int, default=256, help="Quest's tokens, whole pages")
    parser.add_argument("--dense-layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="answer tokens per prompt")
    parser.add_argument("--seed", type=int, default=0, help="of the prompts' keys")
    parser.add_argument("--out", type=Path, help="JSON of every answer and figure")
    return parser.parse_args()


def _rows(got, tokenizer) -> list[dict]:
    """One dict per prompt: its label, and each source's answer text and correctness."""
    sources = {"fidelity dense": got.dense, "fidelity quest": got.quest,
               **{f"serving {k}": v for k, v in got.serving.items()}}
    return [{"prompt": p.label, **{f"{name} text": tokenizer.decode(list(a[i].tokens))
                                   for name, a in sources.items()},
             **{f"{name} correct": a[i].correct for name, a in sources.items()},
             "quest same tokens": got.same("quest")[i],
             "dense same tokens": got.same("dense", against="dense")[i]}
            for i, p in enumerate(got.prompts)]


def _policies(got) -> list[dict]:
    """Per serving policy: answers right, latency, and the decode steps' split (step_time)."""
    from questprof.serving.latency import summarize
    from questprof.serving.step_time import shares
    out = []
    for name, (runs, log) in got.served.items():
        s = summarize(runs)
        out.append({"policy": name, "correct": sum(bool(a.correct) for a in got.serving[name]),
                    "p50_ms": s.token["p50_ms"], "p95_ms": s.token["p95_ms"],
                    "tokens_per_s": s.tokens_per_s, "tokens": s.tokens, **shares(log.parts)})
    return out


def main() -> None:
    args = _args()
    from questprof.fidelity.models import load_model
    from questprof.fidelity.prompts import passkeys, spread_depths
    from questprof.serving.paged_attention import Policy
    from questprof.serving.step_time import PARTS
    from questprof.serving.task import compare
    started = time.perf_counter()
    loaded = load_model(args.model)
    prompts = passkeys(loaded.tokenizer, args.length, spread_depths(args.prompts), args.seed)
    policies = [Policy(n, args.page_size, args.budget, args.dense_layers)
                for n in ("dense", "quest")]
    got = compare(loaded, prompts, policies, args.steps)
    rows, figures = _rows(got, loaded.tokenizer), _policies(got)
    print("| prompt | fidelity quest | serving quest | same tokens |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt']} | {r['fidelity quest text']!r} {r['fidelity quest correct']} | "
              f"{r['serving quest text']!r} {r['serving quest correct']} | "
              f"{r['quest same tokens']} |")
    print(f"\nfidelity task: dense {sum(bool(a.correct) for a in got.dense)}/{len(prompts)}, "
          f"quest {sum(bool(a.correct) for a in got.quest)}/{len(prompts)}")
    print("| policy | correct | p50 ms | p95 ms | tokens/s |\n|---|---|---|---|---|")
    for f in figures:
        print(f"| {f['policy']} | {f['correct']}/{len(prompts)} | {f['p50_ms']:.1f} | "
              f"{f['p95_ms']:.1f} | {f['tokens_per_s']:.2f} |")
    print("\n| policy | decode step ms | " + " | ".join(PARTS) + " |\n"
          + "|---" * (len(PARTS) + 2) + "|")
    for f in figures:
        print(f"| {f['policy']} | {f.get('step_ms_mean', float('nan')):.1f} | "
              + " | ".join(f"{f.get(p + '_share', float('nan')):.3f}" for p in PARTS) + " |")
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "prompts": rows, "policies": figures}, indent=1))


if __name__ == "__main__":
    main()
