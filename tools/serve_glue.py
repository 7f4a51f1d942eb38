"""What questprof's attention call costs inside transformers' loop beside its kernels alone:
serving/inplace.InPlacePaged called as 5.17's loop calls it (a cache of that loop's shape, a
decode-only forward of B requests of L tokens), per layer, against the same Quest step and
dense attention launched from Python in a loop and replayed as a CUDA graph (bench's way).
One layer's cache (Llama-3.1-8B's: 32 q / 8 KV heads, d 128, bf16, page 16, budget 2048).

    python tools/serve_glue.py [--batches 1,8] [--length 32768] [--repeats 50]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

Q_HEADS, KV_HEADS, D, SIZE, BUDGET, LAYERS = 32, 8, 128, 16, 2048, 32


class Cache:
    """One full-attention layer group as 5.17's PagedAttentionCache holds it (two layers)."""

    def __init__(self, blocks, torch):
        shape = ((blocks + 2) * SIZE, KV_HEADS, D)
        self.key_cache = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(2)]
        self.value_cache = [torch.randn(shape, device="cuda").to(torch.bfloat16)
                            for _ in range(2)]
        self.layer_index_to_group_indices = {0: (0, 0), 1: (0, 1)}
        self.sliding_windows = {0: 1, 1: 1}
        self.block_size = SIZE


class Module:
    def __init__(self, layer):
        self.layer_idx, self.scaling = layer, D ** -0.5
        self.config = type("Config", (), {"num_hidden_layers": LAYERS})()


def _kwargs(batch, length, torch):
    """A decode-only forward's kwargs: request r's pages are blocks r*P .. r*P + P - 1."""
    pages = -(-length // SIZE)
    read = torch.cat([torch.arange(r * pages * SIZE, r * pages * SIZE + length)
                      for r in range(batch)]).cuda()
    write = torch.tensor([r * pages * SIZE + length - 1 for r in range(batch)]).cuda()
    cu_q = torch.arange(batch + 1).cuda()
    cu_k = torch.arange(batch + 1).cuda() * length
    return {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k, "write_index": [write],
            "read_index": [read]}, pages


ROUNDS = 5  # a figure is the median round: one round of a probe moved 2-10x (H200, 2026-12-02)


def _per_call_us(run, repeats, torch):
    """us per call: `repeats` calls then one synchronise (a call costs the larger of its host
    and GPU time), the median of ROUNDS such rounds."""
    run()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / repeats * 1e6)
    return sorted(rounds)[ROUNDS // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--profile", type=int, default=0,
                        help="print this many lines of a cProfile of each layer's call")
    parser.add_argument("--trace", action="store_true",
                        help="print the GPU's time per op of each layer's call (torch.profiler)")
    args = parser.parse_args()

    import cupy
    import numpy as np
    import torch

    from questprof.backends import get_backend
    from questprof.core.layout import AppendPlan
    from questprof.serving.inplace import InPlacePaged, with_tables
    from questprof.serving.paged_attention import Policy

    backend = get_backend("cupy")
    print(f"{'B':>3}{'L':>8}  {'call dense':>11}{'call quest':>11}{'quest py':>10}"
          f"{'quest graph':>12}{'dense py':>10}{'dense graph':>12}   us per layer", flush=True)
    for batch in (int(b) for b in args.batches.split(",")):
        kwargs, pages = _kwargs(batch, args.length, torch)
        cache = Cache(batch * pages, torch)
        attention = InPlacePaged(Policy("quest", SIZE, BUDGET, dense_layers=1), backend,
                                 base=None)
        # as the projection leaves it: [1, T, Hq, d] viewed [1, Hq, T, d]
        q = torch.randn(1, batch, Q_HEADS, D, device="cuda").to(torch.bfloat16).transpose(1, 2)
        k = torch.randn(1, KV_HEADS, batch, D, device="cuda").to(torch.bfloat16)

        modules = [Module(0), Module(1)]  # the loop's layers exist before its calls

        def layer(i):
            return attention(modules[i], q, k, k, None, cache=cache, **kwargs)

        layer(0)  # the forward's tables and both layers' summaries; then every page's
        layer(1)  # summary, as a prefill leaves them
        for i in (0, 1):
            kv, _ = attention._pages(Module(i), cache.key_cache[i], cache.value_cache[i])
            every = np.arange(batch * pages, dtype=np.int32)
            backend.summary(kv, AppendPlan(every, np.zeros_like(every),
                                           np.full_like(every, SIZE)))
        calls = [_per_call_us(lambda: layer(i), args.repeats, torch) for i in (0, 1)]
        kv = with_tables(attention._pages(Module(1), cache.key_cache[1], cache.value_cache[1])[0],
                          attention._tables(list(range(batch)), list(range(batch)), q.device))
        qc = attention.bridge.array(q[0].transpose(0, 1))
        steps = {"quest": lambda: backend.quest(qc, kv, BUDGET // SIZE, "per-head"),
                 "dense": lambda: backend.attention(qc, kv)}
        alone = []
        for run in steps.values():
            alone.append(_per_call_us(run, args.repeats, torch))
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                run()
                stream.begin_capture()
                run()
                graph = stream.end_capture()
            stream.synchronize()
            alone.append(_per_call_us(lambda: graph.launch(stream), args.repeats, torch))
        print(f"{batch:>3}{args.length:>8}  {calls[0]:>11.1f}{calls[1]:>11.1f}{alone[0]:>10.1f}"
              f"{alone[1]:>12.1f}{alone[2]:>10.1f}{alone[3]:>12.1f}", flush=True)
        for i in (0, 1) if args.trace else ():
            print(f"torch.profiler of layer {i}'s call ({'dense' if i == 0 else 'Quest'}), "
                  f"{args.repeats} calls")
            _trace(lambda: layer(i), args.repeats, torch)
        for i in (0, 1) if args.profile else ():
            print(f"cProfile of layer {i}'s call ({'dense' if i == 0 else 'Quest'})")
            _profile(lambda: layer(i), args.repeats, args.profile)


def _trace(run, repeats: int, torch) -> None:
    """The GPU's time per op of `repeats` calls (torch.profiler: torch's ops and the kernels
    launched through the driver)."""
    from torch.profiler import ProfilerActivity, profile
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14,
                                    max_name_column_width=60), flush=True)


def _profile(run, repeats: int, lines: int) -> None:
    """cProfile of `repeats` calls: the functions with the most own time, then cumulative."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeats):
        run()
    prof.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(lines)
        print("\n".join(x for x in text.getvalue().splitlines() if x.strip())[:6000],
              flush=True)


if __name__ == "__main__":
    main()
