"""A random-weight decoder shaped like a scenario's model, for measured end-to-end decode steps.

One decode step per layer: RMSNorm, fused q/k/v projection (GQA: k, v of kv_heads * d), RoPE
on q and k, the new token's k/v written into the layer's paged cache, attention through the
backend protocol, o projection, RMSNorm and a SwiGLU MLP (width model.mlp_width). After the
last layer a final norm and the LM head when the shape has a vocab (model.weight_params counts
the head then too, so the 4-bit prediction scales the same weights that run). q/k/v and
gate/up are fused as serving engines do: the same weight bytes in fewer launches.

Dense step: every layer runs dense attention. Quest step: the first `dense_layers` layers run
dense; the others run summary (the new key into its page's min/max) -> estimate -> topk ->
attention. Both steps share one cache; each step rewrites the same tail slot (token length-1),
so repeated steps are identical. Weights and caches are seeded random: nothing is downloaded.
torch in the scenario's dtype on CUDA (CuPy backend, DLPack zero-copy; its kernels take fp16
and bf16); float32 on CPU (NumPy backend, tensors shared through .numpy()). torch and CuPy are
imported lazily.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass

import numpy as np

from questprof import model
from questprof.config import Config, ModelShape
from questprof.layout import (DTYPE_BYTES, AppendPlan, PagedKV, append_plan, page_tables,
                              rebuild_plan)
from questprof.measure.timing import Timing, time_layers

ROPE_THETA = 10000.0  # LLaMA-2 / LongChat
NORM_EPS = 1e-5
HEADROOM_BYTES = 2 * 2**30  # cuBLAS workspaces, graph pools, activations, scores, selections
COLUMNS = ("length", "batch", "page_size", "budget", "mode", "step_ms_dense", "step_ms_quest",
           "attention_ms_dense", "attention_ms_quest", "attention_fraction",
           "attention_speedup", "amdahl_predicted", "measured_speedup", "predicted_4bit")
_TORCH_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def to_backend(t, backend):
    """A torch tensor as the backend's array, zero-copy (NumPy: .numpy(); CuPy: DLPack).

    bf16 travels as its uint16 bit pattern, the layout's storage form."""
    import torch
    t = t.contiguous()
    if not backend.is_gpu:
        return t.numpy()
    import cupy
    if t.dtype == torch.bfloat16:
        return cupy.from_dlpack(t.view(torch.int16)).view(cupy.uint16)
    return cupy.from_dlpack(t)


def from_backend(a, backend):
    """A backend array as a torch tensor, zero-copy (uint16 storage comes back as bf16)."""
    import torch
    if not backend.is_gpu:
        return torch.from_numpy(a)
    import cupy
    if a.dtype == cupy.uint16:
        return torch.from_dlpack(a.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


@dataclass
class Decoder:
    """Random weights of `shape`, stored [in, out] so a projection is `h @ w`."""

    shape: ModelShape
    device: str
    dtype: object  # torch dtype
    layers: list
    norm: object
    head: object | None
    inv_freq: object


def build_decoder(shape: ModelShape, device: str = "cpu", seed: int = 0) -> Decoder:
    """Seeded random weights, scaled 1/sqrt(fan_in) so activations stay O(1) over the layers."""
    import torch
    dtype = getattr(torch, _TORCH_DTYPE[shape.dtype])
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, kv_width = shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim
    inter = model.mlp_width(shape)

    def weight(rows: int, cols: int):
        w = torch.randn(rows, cols, generator=gen, device=device, dtype=dtype)
        return w.mul_(rows ** -0.5)

    def ones():
        return torch.ones(hidden, device=device, dtype=dtype)

    layers = [{"ln1": ones(), "wqkv": weight(hidden, hidden + 2 * kv_width),
               "wo": weight(hidden, hidden), "ln2": ones(),
               "w_gate_up": weight(hidden, 2 * inter), "w_down": weight(inter, hidden)}
              for _ in range(shape.layers)]
    head = weight(hidden, shape.vocab) if shape.vocab else None
    steps = torch.arange(0, shape.head_dim, 2, device=device, dtype=torch.float32)
    inv_freq = 1.0 / ROPE_THETA ** (steps / shape.head_dim)
    return Decoder(shape, device, dtype, layers, ones(), head, inv_freq)


def _rms_norm(x, weight):
    import torch
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)).to(x.dtype) * weight


def _rope(x, cos, sin):
    """Rotate-half RoPE (LLaMA) of x [B, H, d] at one position; cos, sin [d] float32."""
    import torch
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


@dataclass
class StepCache:
    """Every layer's paged cache (backend arrays) with torch views of k, v sharing their memory."""

    kvs: list
    k: list
    v: list
    tail_pages: object  # torch int64 [B]: page holding each request's new token
    tail_slots: object  # torch int64 [B]: its slot, last_page_len - 1
    plan: object  # AppendPlan of the new token (n_new = 1)
    cos: object
    sin: object


def _prefill_plan(indptr, indices, last, page_size: int):
    """Rebuild plan of the tokens before the new one (a tail page holding only it is skipped)."""
    valid = np.full(len(indices), page_size, dtype=np.int32)
    valid[indptr[1:] - 1] = last - 1
    keep = valid > 0
    return rebuild_plan(indices[keep], valid[keep])


def build_cache(dec: Decoder, backend, length: int, batch: int, page_size: int,
                seed: int = 0) -> StepCache:
    """Random keys and values of `length` tokens per request on shuffled pages, summaries built
    by the backend's `summary` stage over the first length - 1 tokens."""
    import torch
    s, lengths = dec.shape, [length] * batch
    pages = batch * model.pages(length, page_size)
    indptr, indices, last = page_tables(lengths, page_size, pages, np.random.default_rng(seed))
    prefill = _prefill_plan(indptr, indices, last, page_size)
    gen = torch.Generator(device=dec.device).manual_seed(seed + 1)
    dims = (pages, s.kv_heads, page_size, s.head_dim)
    tables = [backend.asarray(a) for a in (indptr, indices, last)]
    kvs, ks, vs = [], [], []
    for _ in range(s.layers):
        k, v = (torch.randn(dims, generator=gen, device=dec.device, dtype=dec.dtype)
                for _ in range(2))
        summ = torch.full((pages, s.kv_heads, 2, s.head_dim), float("nan"), device=dec.device,
                          dtype=dec.dtype)
        kv = PagedKV(to_backend(k, backend), to_backend(v, backend), to_backend(summ, backend),
                     *tables, tuple(lengths), page_size, s.dtype)
        _sync(dec.device)  # torch filled the arrays; the backend's stream reads them next
        backend.summary(kv, prefill)
        kvs.append(kv), ks.append(k), vs.append(v)
    angle = (length - 1) * dec.inv_freq
    cos, sin = (torch.cat((f(angle), f(angle))) for f in (torch.cos, torch.sin))
    as_long = lambda a: torch.as_tensor(a, dtype=torch.int64, device=dec.device)  # noqa: E731
    plan = append_plan(indptr, indices, last, [1] * batch, page_size)
    # on the device once: a host plan is copied per call, which CUDA graph capture refuses
    plan = AppendPlan(*(backend.asarray(a) for a in (plan.page_ids, plan.first, plan.end)))
    backend.synchronize()
    return StepCache(kvs, ks, vs, as_long(indices[indptr[1:] - 1]), as_long(last - 1), plan,
                     cos, sin)


def _sync(device: str) -> None:
    """Wait for the whole device (torch's and CuPy's streams alike)."""
    if device != "cpu":
        import torch
        torch.cuda.synchronize()


class DecodeRun:
    """Decode steps of one configuration: dense or Quest, whole steps or attention calls alone."""

    def __init__(self, dec: Decoder, cache: StepCache, backend, budget: int, page_size: int,
                 mode: str = "per-head", seed: int = 0):
        import torch
        self.dec, self.shape, self.cache, self.backend = dec, dec.shape, cache, backend
        self.k_pages, self.mode = model.k_pages(budget, page_size), mode
        gen = torch.Generator(device=dec.device).manual_seed(seed + 2)
        hidden = self.shape.q_heads * self.shape.head_dim
        batch = len(cache.kvs[0].lengths)
        self.x = torch.randn(batch, hidden, generator=gen, device=dec.device, dtype=dec.dtype)
        self.saved_q: list = [None] * self.shape.layers
        self.logits = None

    def step(self, quest: bool, save_q: bool = False):
        """One decode step; returns the last layer's hidden state [B, hidden]."""
        import torch
        with torch.no_grad():
            x = self.x
            for layer in range(self.shape.layers):
                x = self._layer(layer, x, quest, save_q)
            if self.dec.head is not None:
                self.logits = _rms_norm(x, self.dec.norm) @ self.dec.head
        return x

    def attention_pass(self, quest: bool) -> None:
        """The attention calls of a step alone, every layer, with the q of a saved step."""
        for layer in range(self.shape.layers):
            self._attention(layer, self.saved_q[layer][1], quest)

    def _layer(self, layer: int, x, quest: bool, save_q: bool):
        import torch
        s, w, c = self.shape, self.dec.layers[layer], self.cache
        b, d = x.shape[0], s.head_dim
        q, k, v = (_rms_norm(x, w["ln1"]) @ w["wqkv"]).split(
            [s.q_heads * d, s.kv_heads * d, s.kv_heads * d], dim=-1)
        q = _rope(q.reshape(b, s.q_heads, d), c.cos, c.sin)
        c.k[layer][c.tail_pages, :, c.tail_slots] = _rope(k.reshape(b, s.kv_heads, d), c.cos, c.sin)
        c.v[layer][c.tail_pages, :, c.tail_slots] = v.reshape(b, s.kv_heads, d)
        qb = to_backend(q, self.backend)
        if save_q:
            self.saved_q[layer] = (q, qb)
        out = from_backend(self._attention(layer, qb, quest), self.backend)
        x = x + out.reshape(b, -1).to(x.dtype) @ w["wo"]
        gate, up = (_rms_norm(x, w["ln2"]) @ w["w_gate_up"]).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ w["w_down"]

    def _attention(self, layer: int, qb, quest: bool):
        """Attention output [B, Hq, d] (backend array); Quest only past the dense layers."""
        kv, be = self.cache.kvs[layer], self.backend
        if not quest or layer < self.shape.dense_layers:
            return be.attention(qb, kv)[0]
        be.summary(kv, self.cache.plan)
        scores = be.estimate(qb, kv, self.mode)
        sel, count = be.topk(scores, kv, self.k_pages)
        return be.attention(qb, kv, sel, count)[0]


def _capture(fn, stream):
    """fn as a torch CUDA graph on `stream` (CuPy launches join through an ExternalStream)."""
    import cupy
    import torch
    graph = torch.cuda.CUDAGraph()
    # relaxed: CuPy's pool may still cudaMalloc during capture (not recorded into the graph)
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="relaxed"):
        with cupy.cuda.ExternalStream(stream.cuda_stream):
            fn()
    return graph.replay


def time_cuda(fn, warmup: int, steps: int, graph: bool) -> tuple[Timing, str | None]:
    """ms per call of fn with CUDA events, torch and CuPy on one stream; a CUDA graph of fn
    when `graph` (eager launches, and the reason, when capture fails)."""
    import cupy
    import torch
    stream = torch.cuda.Stream()

    def eager():
        with cupy.cuda.ExternalStream(stream.cuda_stream):
            fn()

    with torch.cuda.stream(stream):
        for _ in range(max(warmup, 1)):  # also compiles kernels and fills the memory pools
            eager()
    run, method, note = eager, "cuda-events", None
    if graph:
        try:
            run, method = _capture(fn, stream), "cuda-graph"
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back, with its reason
            torch.cuda.synchronize()
            note = f"CUDA graph capture failed ({type(exc).__name__}: {exc}); eager launches"
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            run()
        for start, end in events:
            start.record(stream)
            run()
            end.record(stream)
    stream.synchronize()
    return Timing(tuple(s.elapsed_time(e) for s, e in events), method), note


def time_step(fn, backend, warmup: int, steps: int, graph: bool) -> tuple[Timing, str | None]:
    """ms per call of fn: CUDA events on a GPU backend, perf_counter (measure.timing) on CPU."""
    if backend.is_gpu:
        return time_cuda(fn, warmup, steps, graph)
    return time_layers(backend, lambda _: fn(), 1, warmup, steps), None


def memory_reason(need_bytes: float, free_bytes: float, what: str) -> str | None:
    """Why `what` does not fit in free device memory, or None when it does."""
    if need_bytes <= free_bytes:
        return None
    return (f"{what} needs {need_bytes / 2**30:.1f} GiB (with {HEADROOM_BYTES / 2**30:.0f} GiB "
            f"headroom) but {free_bytes / 2**30:.1f} GiB is free")


def _free_bytes(device: str) -> float:
    """Free device memory after returning cached blocks of torch and CuPy."""
    gc.collect()
    if device == "cpu":
        return float("inf")  # CPU runs are smoke runs; the OS reports what does not fit
    import cupy
    import torch
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()
    return float(torch.cuda.mem_get_info()[0])


def _row(cfg: Config, base: dict, ms: dict, method: str, reason: str | None) -> dict:
    """A result row from the medians of the four timed passes."""
    fraction = min(ms["attention_ms_dense"] / ms["step_ms_dense"], 1.0)
    speedup = ms["attention_ms_dense"] / ms["attention_ms_quest"]
    ratio = model.weight_bytes(cfg.model, 4) / model.weight_bytes(cfg.model, 16)
    return {**cfg.as_dict(), **base, "method": method, **ms, "attention_fraction": fraction,
            "attention_speedup": speedup,
            "amdahl_predicted": model.amdahl_speedup(fraction, speedup),
            "measured_speedup": ms["step_ms_dense"] / ms["step_ms_quest"],
            "predicted_4bit": model.predicted_4bit(fraction, speedup, ratio),
            "status": "ok", "reason": reason}


def _skipped(cfg: Config, base: dict, reason: str) -> dict:
    return {**cfg.as_dict(), **base, "method": None, **dict.fromkeys(COLUMNS[5:]),
            "status": "skipped", "reason": reason}


def _measure_point(dec: Decoder, cfg: Config, backend, base: dict, steps: int, warmup: int,
                   graph: bool) -> dict:
    cache = build_cache(dec, backend, cfg.length, cfg.batch, cfg.page_size, cfg.seed)
    run = DecodeRun(dec, cache, backend, cfg.budget, cfg.page_size, cfg.mode, cfg.seed)
    run.step(quest=False, save_q=True)  # q of every layer for the attention-only passes
    _sync(dec.device)  # the timed passes run on a stream of their own
    passes = {"step_ms_dense": lambda: run.step(False), "step_ms_quest": lambda: run.step(True),
              "attention_ms_dense": lambda: run.attention_pass(False),
              "attention_ms_quest": lambda: run.attention_pass(True)}
    ms, methods, notes = {}, set(), []
    for name, fn in passes.items():
        timing, note = time_step(fn, backend, warmup, steps, graph)
        ms[name], methods = timing.median, methods | {timing.method}
        notes += [f"{name}: {note}"] if note else []
    return _row(cfg, base, ms, "+".join(sorted(methods)), "; ".join(notes) or None)


def measure_e2e(shape: ModelShape, lengths, page_size: int, budget: int, batch: int = 1,
                backend=None, steps: int = 10, warmup: int = 2, *, mode: str = "per-head",
                seed: int = 0, scenario: str | None = None,
                graph: bool | None = None) -> list[dict]:
    """Measured decode steps, dense vs Quest, one row (stage 'e2e') per length (tokens).

    Times are medians in ms per whole step (all layers); attention_ms_* time the attention calls
    alone (summary + estimate + topk + attention under Quest) over all layers in the same run.
    On CPU the decoder runs in float32 whatever the shape says (the rows' dtype says fp32).
    graph: CUDA-graph the timed passes (None = on a GPU backend), as serving engines run decode.
    """
    if backend is None:
        from questprof.backends import get_backend
        backend = get_backend("auto")
    device = "cuda" if backend.is_gpu else "cpu"
    run_shape = shape if backend.is_gpu else dataclasses.replace(shape, dtype="fp32")
    cfgs = [Config(run_shape, n, batch, page_size, budget, mode, seed) for n in lengths]
    base = {"scenario": scenario or shape.name, "stage": "e2e", "backend": backend.name,
            "steps": steps}
    bits = 8 * DTYPE_BYTES[run_shape.dtype]
    reason = memory_reason(model.weight_bytes(run_shape, bits) + HEADROOM_BYTES,
                           _free_bytes(device), "the weights")
    if reason:
        return [_skipped(cfg, base, reason) for cfg in cfgs]
    dec = build_decoder(run_shape, device, seed)
    graph = backend.is_gpu if graph is None else graph
    rows = []
    for cfg in cfgs:
        need = run_shape.layers * model.kv_pool_bytes(cfg) + HEADROOM_BYTES
        reason = memory_reason(need, _free_bytes(device), f"the KV caches of {cfg.length} tokens")
        rows.append(_skipped(cfg, base, reason) if reason else
                    _measure_point(dec, cfg, backend, base, steps, warmup, graph))
    del dec
    _free_bytes(device)
    return rows
