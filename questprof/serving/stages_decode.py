"""Decode steps of the serving loop answered by a backend's stages (backends/base.py: `quest`
= estimate -> top-K -> attention, `attention` for dense): on a GPU the CuPy kernels, anywhere
the NumPy float64 reference.

This path copies. transformers stores a layer's cache token-major (NHD: [pages, page size, KV
heads, d]) and hands attention the keys it gathered in request order; the stages read
head-major pages (HND: [pages, KV heads, page size, d]). `StagesDecode` writes the step's
requests into one head-major pool (every request's pages one after another, CSR page tables,
no padding to the longest request), with the summaries `QuestPaged` keeps, and runs one stage
call for the sparse requests and one for the dense. What it measures is the kernels plus that
copy through the host; reading transformers' blocks in place is a kernel layout not built yet.
"""

from __future__ import annotations

import math

import numpy as np

from questprof.core.layout import PagedKV, to_storage
from questprof.core.selection import union_pages
from questprof.serving.paged_attention import Decode

TORCH_DTYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}


def head_major(items: list[Decode], page_size: int, dtype: str) -> PagedKV:
    """The items' keys, values and summaries as one head-major paged cache on the host."""
    kv_heads, _, d = items[0].k.shape
    lengths = [int(item.k.shape[1]) for item in items]
    pages = [-(-n // page_size) for n in lengths]
    k = np.zeros((sum(pages), page_size, kv_heads, d), np.float32)
    v = np.zeros_like(k)
    summary = np.zeros((sum(pages), kv_heads, 2, d))
    at = 0
    for item, n, p in zip(items, lengths, pages):
        flat_k = k[at:at + p].reshape(p * page_size, kv_heads, d)
        flat_v = v[at:at + p].reshape(p * page_size, kv_heads, d)
        flat_k[:n] = item.k.transpose(0, 1).float().cpu().numpy()
        flat_v[:n] = item.v.transpose(0, 1).float().cpu().numpy()
        summary[at:at + p] = item.box
        at += p
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * page_size for n, p in zip(lengths, pages)], np.int32)
    return PagedKV(to_storage(k.transpose(0, 2, 1, 3), dtype),
                   to_storage(v.transpose(0, 2, 1, 3), dtype), to_storage(summary, dtype),
                   indptr, np.arange(sum(pages), dtype=np.int32), last, tuple(lengths),
                   page_size, dtype)


class StagesDecode:
    """The decode engine of QuestPaged over `backend`'s stages (see the module)."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def decode(self, items: list[Decode], k_pages: int, page_size: int,
               scaling: float) -> list[tuple[object, float]]:
        """(out [Hq, d], pages read) per item; sparse and dense items one stage call each."""
        d = items[0].q.shape[-1]
        if not math.isclose(scaling, d ** -0.5, rel_tol=1e-6):
            raise ValueError(f"the stages scale by 1/sqrt(d); this model by {scaling}")
        got: list = [None] * len(items)
        for sparse in (True, False):
            which = [i for i, item in enumerate(items) if (item.box is not None) == sparse]
            if which:
                for i, answer in zip(which, self._run([items[i] for i in which], k_pages,
                                                      page_size, sparse)):
                    got[i] = answer
        return got

    def _run(self, items: list[Decode], k_pages: int, page_size: int, sparse: bool):
        import torch
        q0 = items[0].q
        dtype = TORCH_DTYPES[str(q0.dtype)]
        if not sparse:
            items = [Decode(i.q, i.k, i.v, np.zeros((-(-i.k.shape[1] // page_size),
                                                      i.k.shape[0], 2, i.k.shape[2])))
                     for i in items]
        kv = self.backend.put(head_major(items, page_size, dtype))
        q = np.stack([i.q.float().cpu().numpy() for i in items])
        q = self.backend.asarray(to_storage(q, dtype))
        out, count = (sparse_reads(self.backend, q, kv, k_pages) if sparse
                      else dense_reads(self.backend, q, kv))
        reads = count()
        host = self.backend.to_host(out)
        values = host.astype(np.float32) if dtype != "bf16" else \
            (host.astype(np.uint32) << 16).view(np.float32)
        return [(torch.as_tensor(values[j], dtype=q0.dtype, device=q0.device), read)
                for j, read in enumerate(reads)]


def dense_reads(backend, q, kv: PagedKV):
    """(dense attention's out, a callable giving the pages read per request): every page."""
    out, _ = backend.attention(q, kv)
    pages = [float(p) for p in kv.pages()]
    return out, lambda: pages


def sparse_reads(backend, q, kv: PagedKV, k_pages: int):
    """(Quest's out, pages read per request): the stages one by one, so each request's read is
    the mean over KV heads of the union of its q heads' pages, as HostDecode counts it (not K:
    per-head q heads choose apart). backend.quest composes the same three, but on a GPU it
    chains them by PDL, and here the selection also comes back to the host: not the bench's
    Quest step. The pages read come as a callable: on a GPU the selection comes back to the host
    when it is called, so a caller that can wait for its count (InPlacePaged: until the next
    forward, which waits for the GPU anyway) adds no wait to the step."""
    scores = backend.estimate(q, kv, "per-head")
    sel, count = backend.topk(scores, kv, k_pages)
    out, _ = backend.attention(q, kv, sel, count)

    def reads() -> list[float]:
        chosen = np.asarray(backend.to_host(sel))  # [Hq, B, K], -1 past a short request
        counts, group = np.asarray(backend.to_host(count)), chosen.shape[0] // kv.kv_heads
        return [union_pages(chosen[:, [j]], counts[[j]], group) for j in range(kv.batch)]
    return out, reads
