"""The stage launches a byte measurement replays: one configuration's cache on `layers` layers,
each stage's inputs ready, and an L2-evicting read for the flush protocol (questprof.bytecheck).
"""

from __future__ import annotations

import numpy as np

from questprof import layout, model

FLUSH_BYTES = 256 << 20


class Workload:
    """`layers` copies of one configuration's cache on a backend, with each stage's inputs."""

    def __init__(self, cfg, backend, layers: int = 2):
        m, rng = cfg.model, np.random.default_rng(cfg.seed)
        lengths = [cfg.length] * cfg.batch
        host = layout.random_paged_kv(rng, lengths, cfg.page_size, m.kv_heads, m.head_dim, m.dtype)
        prefill = layout.append_plan(host.kv_indptr, host.kv_indices, host.last_page_len,
                                     lengths, cfg.page_size)
        first = backend.put(host)
        backend.summary(first, prefill)
        self.cfg, self.backend = cfg, backend
        self.kv = [first] + [first.with_arrays(lambda a: a.copy()) for _ in range(layers - 1)]
        plan = layout.append_plan(host.kv_indptr, host.kv_indices, host.last_page_len,
                                  [1] * cfg.batch, cfg.page_size)  # decode: one token each
        self.plan = layout.AppendPlan(*(backend.asarray(x) for x in
                                        (plan.page_ids, plan.first, plan.end)))
        self.q = backend.asarray(layout.random_queries(rng, cfg.batch, m.q_heads, m.head_dim,
                                                       m.dtype))
        self.scores = [backend.estimate(self.q, kv, cfg.mode) for kv in self.kv]
        self.sel = [backend.topk(s, kv, cfg.k_pages) for s, kv in zip(self.scores, self.kv)]
        backend.synchronize()

    def launcher(self, stage: str):
        """launch(layer) of one stage; asynchronous, no synchronisation."""
        b, cfg, q = self.backend, self.cfg, self.q

        def quest(l):
            sel, count = b.topk(b.estimate(q, self.kv[l], cfg.mode), self.kv[l], cfg.k_pages)
            return b.attention(q, self.kv[l], sel, count)

        return {"summary": lambda l: b.summary(self.kv[l], self.plan),
                "estimate": lambda l: b.estimate(q, self.kv[l], cfg.mode),
                "topk": lambda l: b.topk(self.scores[l], self.kv[l], cfg.k_pages),
                "attention": lambda l: b.attention(q, self.kv[l], *self.sel[l]),
                "dense": lambda l: b.attention(q, self.kv[l]),
                "quest": quest, "naive": self._torch_naive()}[stage]

    def union_pages(self) -> float | None:
        """Mean pages one KV head reads in per-head GQA mode (the union of its group's picks)."""
        g = self.cfg.model.group
        if self.cfg.mode != "per-head" or g == 1:
            return None
        sel = np.asarray(self.backend.to_host(self.sel[0][0]))
        sizes = [len(set(sel[h:h + g, r].ravel().tolist()) - {-1})
                 for h in range(0, sel.shape[0], g) for r in range(sel.shape[1])]
        return float(np.mean(sizes))

    def gathered_bytes(self) -> float:
        """Bytes of the K and V pages the naive peer gathers (its copy), per layer."""
        sel = np.asarray(self.backend.to_host(self.sel[0][0]))
        m = self.cfg.model
        return 2.0 * sel.shape[0] * sel.shape[1] * sel.shape[2] * self.cfg.page_size * \
            model.vector_bytes(m)

    def _torch_naive(self):
        """Naive torch Quest attention: gather the chosen pages of the paged cache into a dense
        copy, then SDPA. Same selection as our kernel, so the difference is the gather alone
        (peers.naive_quest scores and selects on its own contiguous cache: not comparable)."""
        import torch

        cfg, m = self.cfg, self.cfg.model
        t = lambda a: torch.from_dlpack(a)  # noqa: E731
        view = (lambda x: x.view(torch.bfloat16)) if m.dtype == "bf16" else (lambda x: x)
        sel, indptr = t(self.sel[0][0]).long(), t(self.kv[0].kv_indptr).long()  # [Hs, B, K]
        hs, g = sel.shape[0], m.group
        pos = sel.clamp(min=0) + indptr[:-1].view(1, -1, 1)
        kv_head = (torch.arange(hs, device=sel.device) // (g if hs == m.q_heads else 1))
        kv_head = kv_head.view(1, hs, 1)
        tail = (indptr[1:] - 1).view(1, -1, 1)
        slot = torch.arange(cfg.page_size, device=sel.device)
        last = t(self.kv[0].last_page_len).long().view(1, -1, 1, 1)
        valid = (sel >= 0).unsqueeze(-1) & ((pos != tail).unsqueeze(-1) | (slot < last))
        mask = valid.permute(1, 0, 2, 3).reshape(cfg.batch, hs, 1, -1)
        gqa = hs != m.q_heads  # shared modes: one gathered copy per KV head
        mask = mask.repeat_interleave(g, dim=1) if gqa else mask
        q = view(t(self.q)).unsqueeze(2)  # [B, Hq, 1, d]

        def run(l):
            ids = t(self.kv[l].kv_indices).long()[pos].permute(1, 0, 2)  # [B, Hs, K]
            k = view(t(self.kv[l].k))[ids, kv_head]  # the gather copy: [B, Hs, K, S, d]
            v = view(t(self.kv[l].v))[ids, kv_head]
            flat = lambda x: x.reshape(cfg.batch, hs, -1, m.head_dim)  # noqa: E731
            return torch.nn.functional.scaled_dot_product_attention(
                q, flat(k), flat(v), attn_mask=mask, enable_gqa=gqa)
        return run


class Flush:
    """A 256 MiB read that evicts L2 after each stage call (4x an H200's 60 MiB L2)."""

    def __init__(self, nbytes: int = FLUSH_BYTES):
        import cupy

        from questprof.measure import ceilings

        self.launch_read = ceilings.launch_read
        self.buf, self.sink = ceilings.random_buffer(nbytes), cupy.zeros(1, dtype=cupy.float32)

    def __call__(self) -> None:
        self.launch_read(self.buf, self.sink)
