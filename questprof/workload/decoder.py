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

from dataclasses import dataclass

import numpy as np

from questprof.core import model
from questprof.core.config import Config, ModelShape
from questprof.core.layout import AppendPlan, append_plan
from questprof.workload.pools import build_pools

ROPE_THETA = 10000.0  # LLaMA-2 / LongChat
NORM_EPS = 1e-5
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


def build_cache(dec: Decoder, backend, length: int, batch: int, page_size: int,
                seed: int = 0) -> StepCache:
    """Every layer's paged cache of `length` tokens per request (workload.pools.build_pools:
    random pages, summaries by the backend's `summary` stage) with torch views of k and v."""
    import torch

    cfg = Config(dec.shape, length, batch, page_size, page_size, seed=seed)
    rng = np.random.default_rng(seed)
    kvs, (indptr, indices, last) = build_pools(cfg, backend, dec.shape.layers, rng)
    backend.synchronize()
    angle = (length - 1) * dec.inv_freq
    cos, sin = (torch.cat((f(angle), f(angle))) for f in (torch.cos, torch.sin))
    as_long = lambda a: torch.as_tensor(a, dtype=torch.int64, device=dec.device)  # noqa: E731
    plan = append_plan(indptr, indices, last, [1] * batch, page_size)
    # on the device once: a host plan is copied per call, which CUDA graph capture refuses
    plan = AppendPlan(*(backend.asarray(a) for a in (plan.page_ids, plan.first, plan.end)))
    return StepCache(kvs, [from_backend(kv.k, backend) for kv in kvs],
                     [from_backend(kv.v, backend) for kv in kvs],
                     as_long(indices[indptr[1:] - 1]), as_long(last - 1), plan, cos, sin)


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


