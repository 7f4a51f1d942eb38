"""Where a step's time goes in transformers' continuous batching: each forward of the loop split
into questprof's attention, transformers' cache reads and writes, prefill chunks of other
requests, the rest of the model and the Python between forwards.

Method (timers, not a profiler: torch.profiler's CPU events nest the attention function inside
the decoder layer's ops and cost more than the attention of a small step). Wall-clock
`perf_counter` around:
- each forward of the model (a forward pre-hook and hook on the model): the step's forward;
- `PagedAttentionCache.update` (wrapped for the run): it writes the step's keys and values at
  `write_index` and reads every request's back by `read_index`, all layers (5.24's model calls
  it; on 5.17 QuestPaged does, before its own timer starts, so it is never in attention too);
- QuestPaged's call per layer, and inside it the calls of the attention it replaced for
  prefill chunks (QuestPaged.timer).
A step runs from one forward's start to the next's (the last: to its own end). Its parts:
  attention  = QuestPaged's time for its decode requests (summaries, selection, attention)
  cache      = PagedAttentionCache.update
  prefill    = the prefill chunks' attention and summary writes + their tokens' share of the
               rest of the model
  model_rest = forward - attention - cache - prefill chunks' attention - that share
  python     = step - forward (scheduling, input preparation, sampling, outputs)
which sum to the step. The prefill tokens' share of the rest (embeddings, projections, MLP,
norms, logits) is apportioned by token count, as those layers' work is per token; where a small
step is bound by reading the weights (a GPU) this overstates what the prefill adds.
On CUDA a reading is an event recorded on the current stream, read after the run: the timers
wait for nothing, so they leave the run as it runs (a timer that synchronised the device at
each reading, as these did until 2026-12-02, exposed the host's launch time of every op after
it: 64 waits per decode step of a 32-layer model). A part is then the GPU's time from its first
reading to its last, which holds the kernels and any wait of the GPU for the host between them;
where the host runs ahead, the host's own time hides behind the GPU's, as it does in the run.
While transformers captures a forward as a CUDA graph (serve --cuda-graph) the timers read
nothing: a reading there would be a node of the graph and the lengths are device tensors that
cannot be copied while capturing. The graph's replays call no hook either, so the readings of
such a run miss the replayed forwards and a "step" would span every replay up to the next eager
forward: a run that captured any forward has no step parts (its tokens are timed all the same).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

PARTS = ("attention", "cache", "prefill", "model_rest", "python")


@dataclass
class Forward:
    """One forward's readings (StepClock.now: seconds once the clock is read) and the spans its
    timers took, by part; `seconds` sums them once read."""

    start: object
    end: object = None
    decode: int = 0          # requests answered as one query (decode steps)
    prefill_tokens: int = 0  # tokens of prefill chunks
    spans: dict = field(default_factory=dict)  # part -> [(reading, reading)]
    ours: bool = False  # questprof's attention ran (and was timed) in this forward

    @property
    def seconds(self) -> dict:
        total = {"attention_call": 0.0, "base": 0.0, "cache": 0.0}
        for part, spans in self.spans.items():
            total[part] = total.get(part, 0.0) + sum(b - a for a, b in spans)
        return total


class StepClock:
    """The timers of one run (see the module); QuestPaged calls `add` and `batch`. `device`: a
    CUDA device, whose current stream its readings are events on; None: perf_counter seconds."""

    def __init__(self, device=None) -> None:
        self.forwards: list[Forward] = []
        self.captured = 0  # forwards captured as CUDA graphs (not timed: see the module)
        self.device = device
        self.events = device is not None  # readings are events not read yet

    def now(self):
        """A reading: seconds, or (CUDA) an event recorded now, seconds once `read`."""
        if not self.events:
            return time.perf_counter()
        import torch
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def capturing(self) -> bool:
        """The current stream is being captured as a CUDA graph (no reading may be taken)."""
        if not self.events:
            return False
        import torch
        return torch.cuda.is_current_stream_capturing()

    def add(self, part: str, start, end) -> None:
        """A span of `part` from reading `start` to `end`, in the current forward."""
        if self.forwards:
            self.forwards[-1].spans.setdefault(part, []).append((start, end))
            self.forwards[-1].ours |= part == "attention_call"

    def read(self) -> None:
        """Every reading as seconds (CUDA: after the device finishes, from the first reading)."""
        if not self.events or not self.forwards:
            return
        import torch
        torch.cuda.synchronize(self.device)
        first = self.forwards[0].start
        seconds = {}

        def s(event):
            if not hasattr(event, "elapsed_time"):
                return event
            if id(event) not in seconds:
                seconds[id(event)] = first.elapsed_time(event) / 1e3
            return seconds[id(event)]

        for f in self.forwards:
            f.start, f.end = s(f.start), (s(f.end) if f.end is not None else None)
            f.spans = {p: [(s(a), s(b)) for a, b in v] for p, v in f.spans.items()}
        self.events = False  # every reading is seconds now

    def batch(self, decode: int, prefill_tokens: int) -> None:
        """The current forward's requests: decodes and prefill tokens (from layer 0)."""
        if self.forwards:
            self.forwards[-1].decode, self.forwards[-1].prefill_tokens = decode, prefill_tokens

    @contextmanager
    def watching(self, model):
        """Within the block, the model's forwards and transformers' cache updates are timed
        (a transformers without PagedAttentionCache.update where 5.24 has it: cache time then
        counts in the rest of the model)."""
        try:
            from transformers.generation.continuous_batching.cache import (
                PagedAttentionCache,
            )
            update = PagedAttentionCache.update
        except (ImportError, AttributeError):
            PagedAttentionCache = update = None

        def timed_update(cache, *args, **kwargs):
            if self.capturing():
                return update(cache, *args, **kwargs)
            t0 = self.now()
            try:
                return update(cache, *args, **kwargs)
            finally:
                self.add("cache", t0, self.now())

        def start(_, args, kwargs):
            if self.capturing():
                self.captured += 1
            else:
                self.forwards.append(Forward(self.now(), **batch_of(kwargs)))

        def end(*_):
            if self.forwards and not self.capturing():
                self.forwards[-1].end = self.now()

        pre = model.register_forward_pre_hook(start, with_kwargs=True)
        post = model.register_forward_hook(end)
        if update is not None:
            PagedAttentionCache.update = timed_update
        try:
            yield self
        finally:
            if update is not None:
                PagedAttentionCache.update = update
            pre.remove()
            post.remove()


def batch_of(kwargs: dict) -> dict:
    """A forward's decode requests and prefill tokens from the loop's sequence lengths (the
    attention call's `batch` says the same from layer 0; this serves a run whose attention is
    transformers' own); {} where the forward does not bring them."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if isinstance(cu_k, dict):
        cu_k = next(iter(cu_k.values()), None)
    if cu_q is None or cu_k is None:
        return {}
    q, k = cu_q.tolist(), cu_k.tolist()
    decode = sum(q[r + 1] - q[r] == 1 and k[r + 1] - k[r] > 1 for r in range(len(q) - 1))
    return {"decode": decode, "prefill_tokens": q[-1] - q[0] - decode}


def split(f: Forward, next_start: float | None) -> dict:
    """A forward's step in ms by part (see the module), with its shape."""
    forward = f.end - f.start
    step = (next_start if next_start is not None else f.end) - f.start
    s = f.seconds
    ours, base = s["attention_call"] - s["base"], s["base"]
    rest = max(forward - s["attention_call"] - s["cache"], 0.0)
    tokens = f.decode + f.prefill_tokens
    share = rest * f.prefill_tokens / tokens if tokens else 0.0
    # a forward without our attention (transformers' own, serve --engine transformers) has its
    # attention inside the rest of the model: not measured apart, so not a share of 0
    ms = {"attention": ours if f.ours else float("nan"), "cache": s["cache"],
          "prefill": base + share,
          "model_rest": rest - share, "python": max(step - forward, 0.0)}
    return {**{f"{k}_ms": v * 1e3 for k, v in ms.items()}, "step_ms": step * 1e3,
            "forward_ms": forward * 1e3, "decode_requests": f.decode,
            "prefill_tokens": f.prefill_tokens}


def step_parts(clock: StepClock) -> list[dict]:
    """One dict per forward of the run, in order (see split); none where a forward was
    captured as a CUDA graph (the module says why)."""
    if clock.captured:
        return []
    clock.read()
    done = [f for f in clock.forwards if f.end is not None]  # a forward that finished
    return [split(f, done[i + 1].start if i + 1 < len(done) else None)
            for i, f in enumerate(done)]


def shares(steps: list[dict]) -> dict:
    """Each part's share of the decode steps' time (those with a decode request), and their
    mean step in ms; {} without decode steps."""
    decodes = [s for s in steps if s["decode_requests"]]
    total = sum(s["step_ms"] for s in decodes)
    if not decodes or total <= 0:
        return {}
    return {**{f"{p}_share": sum(s[f"{p}_ms"] for s in decodes) / total for p in PARTS},
            "step_ms_mean": total / len(decodes), "decode_steps": len(decodes)}
