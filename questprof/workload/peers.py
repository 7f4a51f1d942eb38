"""The same decode work done by others, timed in the same run as our kernels (torch, lazily).

- `sdpa_dense`: torch.nn.functional.scaled_dot_product_attention over a contiguous
  [B, Hkv, L, d] cache (torch picks the flash back-end where it applies; enable_gqa for GQA).
- `naive_quest`: Quest as a torch user would write it: score pages from [B, Hkv, P, 2, d]
  summaries, torch.topk (tail page forced in), gather the chosen pages into a new tensor, SDPA.
Each returns a callable run(layer) that only launches work, for measure.timing.time_layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from questprof.core.model import vector_bytes
from questprof.core.stages import check_mode

TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _torch():
    import torch
    return torch


@dataclass
class TorchLayer:
    """One layer's contiguous cache: k, v [B, Hkv, L, d]; summary [B, Hkv, P, 2, d] (min, max)."""

    k: object
    v: object
    summary: object
    page_size: int


def torch_dtype(dtype: str):
    return getattr(_torch(), TORCH_DTYPES[dtype])


def make_layers(layers: int, batch: int, kv_heads: int, length: int, head_dim: int,
                page_size: int, dtype: str, seed: int = 0, device: str = "cuda") -> list[TorchLayer]:
    """`layers` random caches (one per simulated layer: cold L2 like real decode)."""
    torch = _torch()
    if length % page_size:
        raise ValueError(f"naive torch caches need whole pages: {length} % {page_size} != 0")
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, kv_heads, length, head_dim)
    out = []
    for _ in range(layers):
        k = torch.randn(shape, generator=gen, device=device, dtype=torch_dtype(dtype))
        v = torch.randn(shape, generator=gen, device=device, dtype=torch_dtype(dtype))
        pages = k.view(batch, kv_heads, length // page_size, page_size, head_dim)
        summary = torch.stack((pages.amin(3), pages.amax(3)), dim=3).contiguous()
        out.append(TorchLayer(k, v, summary, page_size))
    return out


def random_query(batch: int, q_heads: int, head_dim: int, dtype: str, seed: int = 0,
                 device: str = "cuda"):
    """q [B, Hq, 1, d] (SDPA's layout for one decode token)."""
    torch = _torch()
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    return torch.randn((batch, q_heads, 1, head_dim), generator=gen, device=device,
                       dtype=torch_dtype(dtype))


def sdpa_dense(layers: list[TorchLayer], q):
    """run(layer) -> out [B, Hq, 1, d]: dense decode with torch SDPA."""
    sdpa = _torch().nn.functional.scaled_dot_product_attention
    gqa = q.shape[1] != layers[0].k.shape[1]
    return lambda layer: sdpa(q, layers[layer].k, layers[layer].v, enable_gqa=gqa)


def _scores(q, summary, mode: str):
    """U_p(q) [B, Hkv, Hs/Hkv, P] from the boxes (shared modes keep one row per KV head)."""
    batch, kv_heads, _, _, d = summary.shape
    qg = q.view(batch, kv_heads, -1, 1, d)
    lo, hi = summary[:, :, None, :, 0, :], summary[:, :, None, :, 1, :]
    u = _torch().maximum(qg * lo, qg * hi).float().sum(-1)
    if mode == "shared-max":
        u = u.amax(2, keepdim=True)
    elif mode == "shared-mean":
        u = u.mean(2, keepdim=True)
    return u


def naive_quest(layers: list[TorchLayer], q, k_pages: int, mode: str = "per-head"):
    """run(layer) -> out [B, Hq, 1, d]: estimate, torch.topk, gather the pages, SDPA."""
    torch = _torch()
    check_mode(mode)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run(layer: int):
        c = layers[layer]
        batch, kv_heads, length, d = c.k.shape
        pages, s = length // c.page_size, c.page_size
        u = _scores(q, c.summary, mode)
        u[..., -1] = float("inf")  # the tail page is always selected
        idx = u.topk(min(k_pages, pages), dim=-1).indices  # [B, Hkv, gs, K]
        gs, k = idx.shape[2], idx.shape[3]
        take = idx[..., None, None].expand(batch, kv_heads, gs, k, s, d)
        def gather(x):
            paged = x.view(batch, kv_heads, 1, pages, s, d).expand(batch, kv_heads, gs, pages, s, d)
            return paged.gather(3, take).reshape(batch, kv_heads * gs, k * s, d)
        keys, values = gather(c.k), gather(c.v)
        return sdpa(q, keys, values, enable_gqa=keys.shape[1] != q.shape[1])

    return run


def _gather_plan(cfg, sel, indptr, last_len, indices, repeat: int):
    """(page ids [B, Hs, K], mask [B, Hq, 1, K * S]) of one layer's selection sel [Hs, B, K]."""
    torch = _torch()
    pos = sel.clamp(min=0) + indptr[:-1].view(1, -1, 1)
    tail = (indptr[1:] - 1).view(1, -1, 1)
    slot = torch.arange(cfg.page_size, device=sel.device)
    last = last_len.long().view(1, -1, 1, 1)
    valid = (sel >= 0).unsqueeze(-1) & ((pos != tail).unsqueeze(-1) | (slot < last))
    mask = valid.permute(1, 0, 2, 3).reshape(cfg.batch, sel.shape[0], 1, -1)
    return indices[pos].permute(1, 0, 2), mask.repeat_interleave(repeat, dim=1)


def gathered_attention(cfg, kvs, q, selections):
    """run(layer): our selection's pages gathered from the paged pools into a dense copy, then
    SDPA. The same pages as our sparse kernel, so the difference is the gather copy alone."""
    torch = _torch()
    m = cfg.model
    t = torch.from_dlpack
    view = (lambda x: x.view(torch.bfloat16)) if m.dtype == "bf16" else (lambda x: x)
    hs, g = selections[0][0].shape[0], m.group
    gqa = hs != m.q_heads  # shared modes: one gathered copy per KV head
    kv_head = (torch.arange(hs, device=t(q).device) // (g if hs == m.q_heads else 1)).view(1, hs, 1)
    qt = view(t(q)).unsqueeze(2)  # [B, Hq, 1, d]
    plans = [_gather_plan(cfg, t(sel).long(), t(kv.kv_indptr).long(), t(kv.last_page_len),
                          t(kv.kv_indices).long(), g if gqa else 1)
             for (sel, _), kv in zip(selections, kvs)]  # outside the timed calls

    def run(layer: int):
        ids, mask = plans[layer]
        k = view(t(kvs[layer].k))[ids, kv_head]  # the gather copy: [B, Hs, K, S, d]
        v = view(t(kvs[layer].v))[ids, kv_head]
        flat = lambda x: x.reshape(cfg.batch, hs, -1, m.head_dim)  # noqa: E731
        return torch.nn.functional.scaled_dot_product_attention(
            qt, flat(k), flat(v), attn_mask=mask, enable_gqa=gqa)
    return run


def gathered_bytes(cfg, sel) -> float:
    """Bytes of the K and V pages gathered_attention copies per layer (sel [Hs, B, K] host)."""
    hs, batch, k = sel.shape
    return 2.0 * hs * batch * k * cfg.page_size * vector_bytes(cfg.model)
