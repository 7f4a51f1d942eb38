"""The stage launches a byte measurement replays: one configuration's cache on `layers` layers,
each stage's inputs ready, and an L2-evicting read for the flush protocol (questprof.bytecheck).
"""

from __future__ import annotations

import numpy as np

from questprof import model

FLUSH_BYTES = 256 << 20


class Workload:
    """`layers` copies of one configuration's cache on a backend, with each stage's inputs.

    Built by the sweep's own `prepare` (pools tiled from one random block, summaries by prefill),
    so the bytes checked are those of the kernels the sweep times, and a 17 GB layer of
    llama3-8b at 128K x batch 8 builds on the device instead of drawing 17 GB on the host.
    """

    def __init__(self, cfg, backend, layers: int = 2, topk_calls: int = 1):
        from questprof import sweep

        prep = sweep.prepare(cfg, backend, layers)
        self.cfg, self.backend = cfg, backend
        self.kv, self.q, self.plan = prep.kvs, prep.q, prep.decode_plan
        self.scores = prep.scores or [backend.estimate(self.q, kv, cfg.mode) for kv in self.kv]
        self.sel = prep.selections or [backend.topk(s, kv, cfg.k_pages)
                                       for s, kv in zip(self.scores, self.kv)]
        # top-K reads scores only: copies of them make its own cold rotation, pools or not
        self.topk_scores = [self.scores[i] if i < layers else self.scores[i % layers].copy()
                            for i in range(max(layers, topk_calls))]
        backend.synchronize()

    def calls(self, stage: str) -> int:
        """Calls of `stage` in one cold rotation pass (launch(0) .. launch(calls - 1))."""
        return len(self.topk_scores) if stage == "topk" else len(self.kv)

    def launcher(self, stage: str):
        """launch(layer) of one stage; asynchronous, no synchronisation."""
        b, cfg, q = self.backend, self.cfg, self.q

        def quest(l):
            sel, count = b.topk(b.estimate(q, self.kv[l], cfg.mode), self.kv[l], cfg.k_pages)
            return b.attention(q, self.kv[l], sel, count)

        return {"summary": lambda l: b.summary(self.kv[l], self.plan),
                "estimate": lambda l: b.estimate(q, self.kv[l], cfg.mode),
                "topk": lambda l: b.topk(self.topk_scores[l], self.kv[l % len(self.kv)],
                                         cfg.k_pages),
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
        hs, g = self.sel[0][0].shape[0], m.group
        gqa = hs != m.q_heads  # shared modes: one gathered copy per KV head
        kv_head = (torch.arange(hs, device=t(self.q).device) // (g if hs == m.q_heads else 1))
        kv_head = kv_head.view(1, hs, 1)
        q = view(t(self.q)).unsqueeze(2)  # [B, Hq, 1, d]
        plans = [self._naive_plan(t(sel).long(), t(kv.kv_indptr).long(), t(kv.last_page_len),
                                  t(kv.kv_indices).long(), g if gqa else 1)
                 for (sel, _), kv in zip(self.sel, self.kv)]  # outside the timed calls

        def run(l):
            ids, mask = plans[l]
            k = view(t(self.kv[l].k))[ids, kv_head]  # the gather copy: [B, Hs, K, S, d]
            v = view(t(self.kv[l].v))[ids, kv_head]
            flat = lambda x: x.reshape(cfg.batch, hs, -1, m.head_dim)  # noqa: E731
            return torch.nn.functional.scaled_dot_product_attention(
                q, flat(k), flat(v), attn_mask=mask, enable_gqa=gqa)
        return run

    def _naive_plan(self, sel, indptr, last_len, indices, repeat: int):
        """(page ids [B, Hs, K], mask [B, Hq, 1, K * S]) of one layer's selection [Hs, B, K]."""
        import torch

        pos = sel.clamp(min=0) + indptr[:-1].view(1, -1, 1)
        tail = (indptr[1:] - 1).view(1, -1, 1)
        slot = torch.arange(self.cfg.page_size, device=sel.device)
        last = last_len.long().view(1, -1, 1, 1)
        valid = (sel >= 0).unsqueeze(-1) & ((pos != tail).unsqueeze(-1) | (slot < last))
        mask = valid.permute(1, 0, 2, 3).reshape(self.cfg.batch, sel.shape[0], 1, -1)
        return indices[pos].permute(1, 0, 2), mask.repeat_interleave(repeat, dim=1)


class Flush:
    """A 256 MiB read that evicts L2 after each stage call (4x an H200's 60 MiB L2)."""

    def __init__(self, nbytes: int = FLUSH_BYTES):
        import cupy

        from questprof.measure import ceilings

        self.launch_read = ceilings.launch_read
        self.buf, self.sink = ceilings.random_buffer(nbytes), cupy.zeros(1, dtype=cupy.float32)

    def __call__(self) -> None:
        self.launch_read(self.buf, self.sink)
