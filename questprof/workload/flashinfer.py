"""FlashInfer (the optional extra `.[flashinfer]`, flashinfer-python 0.6.0) as a peer over our
own pools, imported only when asked for: its kernels are JIT-compiled on first use (about a
minute on an H200), and CI has none.

Every tensor is a torch view of our CuPy memory through DLPack: no copy of the cache.
- dense: `BatchDecodeWithPagedKVCacheWrapper` (CUDA-core decode, kv_layout "HND") over the
  pool as it is: our k, v [N, Hkv, S, d] are its (k_cache, v_cache) HND pair.
- attention: the same decode over each head's chosen pages: one request per (head, request),
  head-major (row hs * B + b), with one KV head, over the pool viewed as [N * Hkv, 1, S, d]
  (page p of KV head h is p * Hkv + h); the pages come from our selections (`head_requests`).
- topk: `top_k_page_table_transform` over our scores [Hs, nnz] viewed as rows [Hs * B, P]; it
  maps the chosen columns through `row_tables` straight to pages of that view.
- quest: our estimate, its top-K, its decode: Quest as the paper's code runs it. Its top-K
  picks K pages by score alone (ours always keeps the tail page): the same work.
The sparse rows' queries are laid out head-major once, before timing (a layout the q
projection could write), and their outputs stay in that order. Each stage's run(layer) only
launches work, for measure.timing.time_layers (uses_torch=True).
"""

from __future__ import annotations

import numpy as np

from questprof.workload.peers import torch_dtype

IMPL = "flashinfer"
STAGES = ("topk", "attention", "dense", "quest")  # the rows it has, in order
INSTALL = "pip install -e '.[flashinfer]'"
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partials)
REASON_CHARS = 240


class Unavailable(RuntimeError):
    """FlashInfer cannot run here, or not on this configuration (the message says why)."""


def _import():
    """The flashinfer module, or Unavailable with one line saying why it does not import."""
    try:
        import flashinfer
    except ImportError as exc:
        if getattr(exc, "name", None) == "flashinfer":
            raise Unavailable(f"flashinfer-python is not installed ({INSTALL})") from None
        raise Unavailable(f"import flashinfer failed: {refusal(exc)}") from None
    except Exception as exc:  # deliberately any: a broken install fails its own way, and its
        # words become the reason FlashInfer's rows are skipped with, on one line
        raise Unavailable(f"import flashinfer failed: {refusal(exc)}") from None
    return flashinfer


def missing_reason() -> str | None:
    """Why FlashInfer's rows cannot be timed here (one line), or None when it imports."""
    try:
        _import()
    except Unavailable as exc:
        return str(exc)
    return None


def refusal(exc: BaseException) -> str:
    """One line from an exception FlashInfer raised: its own message (the last line of a
    multi-line one, where a C++ error puts it), prefixed with the exception's type."""
    if isinstance(exc, Unavailable):
        return str(exc)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__
    return said[:REASON_CHARS]


def head_requests(sel, count, kv_indptr, kv_indices, last_page_len, kv_heads: int,
                  page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's (indptr [R + 1], indices [nnz], last_page_len [R]) int32 of one request per
    (head, request) of a selection, R = Hs * B in the order hs * B + b.

    sel [Hs, B, K] ascending positions within each request (-1 padded), count [B] or [Hs, B];
    indices are pages of the pool viewed as [N * Hkv, 1, S, d]: kv_indices[...] * Hkv + the
    head's KV head. A request's last page is partial only where it is the request's tail page.
    """
    sel = np.asarray(sel)
    heads, batch, k = sel.shape
    indptr, pool = np.asarray(kv_indptr, dtype=np.int64), np.asarray(kv_indices, dtype=np.int64)
    count = np.broadcast_to(np.asarray(count), (heads, batch))
    if (count < 1).any() or (count > k).any():
        raise ValueError(f"every (head, request) needs 1..{k} chosen pages for a decode request")
    pages = np.diff(indptr)[None, :, None]
    taken = np.arange(k)[None, None, :] < count[:, :, None]
    if ((sel < 0) | (sel >= pages))[taken].any():
        raise ValueError("a selected position lies outside its request's pages")
    kv_head = (np.arange(heads) // (heads // kv_heads))[:, None, None]
    ids = pool[indptr[:-1][None, :, None] + np.where(taken, sel, 0)] * kv_heads + kv_head
    out_indptr = np.concatenate([[0], np.cumsum(count.reshape(-1))])
    last_pos = np.take_along_axis(sel, (count - 1)[:, :, None].astype(np.int64), 2)[:, :, 0]
    tail = np.asarray(last_page_len)[None, :]
    last = np.where(last_pos == pages[:, :, 0] - 1, tail, page_size)
    return (out_indptr.astype(np.int32), ids[taken].astype(np.int32),
            last.reshape(-1).astype(np.int32))


def row_tables(kv_indptr, kv_indices, kv_heads: int, heads: int) -> np.ndarray:
    """top_k_page_table_transform's source table [Hs * B, P] int32: row hs * B + b holds the
    pages of request b in the per-head view (kv_indices * Hkv + the head's KV head).

    Scores [Hs, nnz] are rows [Hs * B, P] only when every request has P pages."""
    indptr, pool = np.asarray(kv_indptr, dtype=np.int64), np.asarray(kv_indices, dtype=np.int64)
    pages = np.diff(indptr)
    if len(set(pages.tolist())) != 1:
        raise ValueError("FlashInfer's top-K reads scores as rows of one length: requests of "
                         f"{sorted(set(pages.tolist()))} pages differ")
    table = pool[indptr[0]:indptr[-1]].reshape(len(pages), int(pages[0]))
    kv_head = (np.arange(heads) // (heads // kv_heads))[:, None, None]
    return (table[None] * kv_heads + kv_head).reshape(heads * len(pages), -1).astype(np.int32)


def head_queries(q, heads: int):
    """q [B, Hq, d] (torch) as the requests' queries [Hs * B, Hq / Hs, d] (a copy)."""
    batch, q_heads, d = q.shape
    return q.view(batch, heads, q_heads // heads, d).transpose(0, 1).contiguous().view(
        heads * batch, q_heads // heads, d)


def request_order(out, batch: int):
    """The requests' output [Hs * B, G, d] back as [B, Hq, d] (a copy; for checks)."""
    rows, g, d = out.shape
    return out.view(rows // batch, batch, g, d).transpose(0, 1).reshape(batch, -1, d)


def _point(wrapper, indices) -> None:
    """Make FlashInfer's decode read `indices`. Its run() reads the page indices its plan kept
    (0.6.0: `_paged_kv_indices_buf`); layers that share a plan (same request lengths) point it
    at their own pages, and the quest step at its top-K's output, whose address a CUDA graph
    captures: one plan, no re-plan (a host step) inside the timed pass."""
    if not hasattr(wrapper, "_paged_kv_indices_buf"):
        raise Unavailable("this FlashInfer's decode wrapper keeps no _paged_kv_indices_buf "
                          "(questprof's peer is written against flashinfer-python 0.6.0)")
    wrapper._paged_kv_indices_buf = indices


CALLS = {"dense": "BatchDecodeWithPagedKVCacheWrapper (HND, CUDA cores)",
         "attention": "BatchDecodeWithPagedKVCacheWrapper, one request per (head, request)",
         "topk": "top_k_page_table_transform",
         "quest": "our estimate, top_k_page_table_transform, BatchDecodeWithPagedKVCacheWrapper "
                  "per (head, request)"}


class FlashInferPeer:
    """FlashInfer's launches over one Workload's pools (workload.pools): build it once per
    workload, drop it before the pools are released (its views keep their memory)."""

    def __init__(self, work):
        self.fi = _import()
        import torch

        if not work.backend.is_gpu:
            raise Unavailable(f"the {work.backend.name} backend keeps its pools on the host")
        if not torch.cuda.is_available():
            raise Unavailable("torch sees no CUDA device")
        if work.cfg.model.is_fp8:  # ours scale each KV head; its decode takes one scale
            raise Unavailable("FP8 caches with per-KV-head scales: not lent to FlashInfer")
        self.torch, self.work, self.version = torch, work, self.fi.__version__

        bf16 = work.cfg.model.dtype == "bf16"  # our bf16 travels as uint16 bits
        self.dtype = torch_dtype(work.cfg.model.dtype)
        self._as = (lambda x: torch.from_dlpack(x).view(torch.bfloat16)) if bf16 \
            else torch.from_dlpack
        self.k = [self._as(kv.k) for kv in work.kvs]
        self.v = [self._as(kv.v) for kv in work.kvs]
        self.q = self._as(work.q)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.q.device)

    def pipeline(self, stage: str) -> str:
        """What the row of `stage` runs, with FlashInfer's version."""
        return f"{CALLS[stage]} (flashinfer {self.version})"

    def launcher(self, stage: str):
        """run(layer) of `stage` (one of STAGES); Unavailable where FlashInfer cannot run it."""
        if stage not in STAGES:
            raise ValueError(f"unknown FlashInfer stage {stage!r}: expected one of {STAGES}")
        if stage != "dense" and self.work.cfg.is_dense_budget:
            raise Unavailable("budget >= length: Quest selects every page (no selection)")
        run = getattr(self, f"_{stage}")()
        # Its plan copies the schedule to the device asynchronously, and the copies of q run on
        # torch's stream: done before a timing stream (not synchronised with it) reads them.
        self.torch.cuda.synchronize()
        return run

    def _dev(self, array):
        return self.torch.as_tensor(np.ascontiguousarray(array), device=self.q.device)

    def _heads(self) -> int:
        m = self.work.cfg.model
        return m.q_heads if self.work.cfg.mode == "per-head" else m.kv_heads

    def _plan(self, indptr, indices, last, q_heads: int, kv_heads: int):
        cfg = self.work.cfg
        wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "HND")
        indptr, indices, last = (self._dev(np.asarray(x, dtype=np.int32))
                                 for x in (indptr, indices, last))
        wrapper.plan(indptr, indices, last, q_heads, kv_heads,
                     cfg.model.head_dim, cfg.page_size, q_data_type=self.dtype,
                     kv_data_type=self.dtype)
        return wrapper

    def _head_views(self) -> list[tuple]:
        """Each layer's (k, v) as [N * Hkv, 1, S, d]: a decode request per head (views)."""
        return [tuple(x.view(-1, 1, *x.shape[2:]) for x in kv) for kv in zip(self.k, self.v)]

    def _table(self):
        """(row table [Hs * B, P], lengths [Hs * B], K) of FlashInfer's top-K, on the device."""
        host, kv = self.work.backend.to_host, self.work.kvs[0]  # every layer shares the tables
        table = row_tables(host(kv.kv_indptr), host(kv.kv_indices), kv.kv_heads, self._heads())
        lengths = np.full(table.shape[0], table.shape[1], dtype=np.int32)
        return self._dev(table), self._dev(lengths), min(self.work.cfg.k_pages, table.shape[1])

    def _dense(self):
        m, kv, host = self.work.cfg.model, self.work.kvs[0], self.work.backend.to_host
        wrapper = self._plan(host(kv.kv_indptr), host(kv.kv_indices), host(kv.last_page_len),
                             m.q_heads, m.kv_heads)
        return lambda layer: wrapper.run(self.q, (self.k[layer], self.v[layer]))

    def _attention(self):
        work, host, heads = self.work, self.work.backend.to_host, self._heads()
        plans, runs = {}, []
        for (sel, count), kv in zip(work.selections, work.kvs):
            indptr, indices, last = head_requests(
                host(sel), host(count), host(kv.kv_indptr), host(kv.kv_indices),
                host(kv.last_page_len), kv.kv_heads, kv.page_size)
            key = (indptr.tobytes(), last.tobytes())  # layers of equal request lengths share one
            if key not in plans:
                plans[key] = self._plan(indptr, indices, last, work.cfg.model.q_heads // heads, 1)
            runs.append((plans[key], self._dev(indices)))
        q, views = head_queries(self.q, heads), self._head_views()

        def run(layer: int):
            wrapper, indices = runs[layer]
            _point(wrapper, indices)
            return wrapper.run(q, views[layer])
        return run

    def _topk(self):
        tables, lengths, k = self._table()
        scores = [self.torch.from_dlpack(s).view(tables.shape[0], -1) for s in self.work.scores]
        top = self.fi.top_k_page_table_transform
        return lambda layer: top(scores[layer], tables, lengths, k)

    def _quest(self):
        work, cfg, heads = self.work, self.work.cfg, self._heads()
        if cfg.length % cfg.page_size:
            raise Unavailable("its top-K may put the partial tail page anywhere in a request's "
                              "pages, where the decode reads it whole: needs whole pages")
        tables, lengths, k = self._table()
        rows = tables.shape[0]
        wrapper = self._plan(np.arange(rows + 1) * k, np.zeros(rows * k),
                             np.full(rows, cfg.page_size), cfg.model.q_heads // heads, 1)
        q, views, top = head_queries(self.q, heads), self._head_views(), \
            self.fi.top_k_page_table_transform
        estimate, t = work.backend.estimate, self.torch.from_dlpack

        def run(layer: int):
            scores = t(estimate(work.q, work.kvs[layer], cfg.mode)).view(rows, -1)
            _point(wrapper, top(scores, tables, lengths, k).view(-1))
            return wrapper.run(q, views[layer])
        return run
