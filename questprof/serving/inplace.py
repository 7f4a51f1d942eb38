"""Decode steps read where transformers wrote them: questprof's stages over the loop's own paged
cache, token-major blocks (NHD) read in place, no gather and no copy.

transformers 5.17's loop calls 'paged|sdpa' with its cache (kwargs `cache`, a
PagedAttentionCache): one [(blocks + 2) x S, Hkv, d] key and value tensor per layer of a group,
which viewed as [blocks + 2, S, Hkv, d] is a PagedKV of layout NHD (a cache block = a Quest
page; a request's token at position p sits in slot read_index[p], its page read_index[p] // S).
`InPlacePaged` takes QuestPaged's place for such a loop. Per call it writes the new keys and
values at write_index (index_copy_, what 5.17's cache.update does first; the gather that
update then does for every request is left out) and gathers only the prefill chunks' keys for
the attention it replaced. Decode requests go to the backend in one call each for the dense
and the sparse ones (`attention`, `quest`: estimate -> top-K -> attention, PDL-chained on a
GPU) over CSR tables of their pages; the min/max summaries live beside the cache, one
[blocks + 2, Hkv, 2, d] array per layer in the cache's dtype, folded by the `summary` kernel
over the slots written (a run that starts at slot 0 re-initialises its page, so a freed and
reused block starts afresh). Tables and the summary plan are built once per forward (one host
sync for the sequence lengths and write slots; a forward is known by its write_index list, which
the loop builds once per forward and hands every layer) and reused by every layer. So are the
launches: on a GPU the first layer's summary, Quest and dense launches are recorded and every
other layer makes them again with its own K, V, summary and query pointers (backends/replay.py).
Where one call answers every row of a decode-only forward, the query rows are read where the
projection left them ([1, T, Hq, d] viewed [1, Hq, T, d]) and the recording's output is the
layer's answer, valid until the next layer's call (the output projection reads it first); else
the rows are copied into the recording's query buffer and the answer rows out of its output.
Everything the backend does runs on torch's current stream (5.17 runs the forward on a stream
of its own).

5.24's loop gathers each request's keys before attention and keeps every layer's pages
interleaved in one tensor, so it cannot be read this way; `check_loop` says so in one line.
The pages read that StepLog records need the selection on the host: the last layer runs the
three stages one by one for that (the other layers' Quest is one chained call).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from questprof.backends.params import address
from questprof.core.config import ConfigError
from questprof.core.layout import AppendPlan, PagedKV, page_tables, pages_for, storage_dtype
from questprof.serving.paged_attention import Policy, StepLog, _is_decode, _one, loop_name
from questprof.serving.stages_decode import dense_reads, sparse_reads

MOVED = ("k", "v", "summary")  # what one layer's launches read that another's do not
CACHE_LOOP = "paged|sdpa"  # the loop name whose calls bring the cache (transformers 5.17)
TORCH_TAGS = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}  # caches the kernels read NHD


def check_loop(name: str | None = None) -> None:
    """ConfigError in one line unless the installed loop hands attention its cache."""
    name = name or loop_name()
    if name != CACHE_LOOP:
        import transformers
        raise ConfigError(f"--engine inplace reads the cache where the loop wrote it, which needs "
                          f"a loop that hands attention its cache ('{CACHE_LOOP}', transformers "
                          f"5.17); transformers {transformers.__version__} runs {name!r} with "
                          f"keys already gathered: use --engine kernels or host")


class Bridge:
    """torch tensors <-> the backend's arrays, storage form (bf16 as uint16 bits), no copy on
    a GPU (DLPack); the backend's launches on torch's current stream."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.gpu = backend.name == "cupy"
        self.streams: dict[int, object] = {}

    def array(self, t):
        import torch
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        if not self.gpu:
            a = t.detach().cpu().numpy()
            return a.view(np.uint16) if a.dtype == np.int16 else a
        import cupy
        a = cupy.from_dlpack(t.detach().contiguous())
        return a.view(cupy.uint16) if a.dtype == cupy.int16 else a

    def tensor(self, a, like):
        """a (storage form of like's dtype) as a torch tensor on like's device."""
        import torch
        bf16 = like.dtype == torch.bfloat16
        if self.gpu:
            t = torch.from_dlpack(a.view("int16") if bf16 else a)
        else:
            t = torch.as_tensor(np.asarray(a).view(np.int16) if bf16 else np.asarray(a))
        return (t.view(torch.bfloat16) if bf16 else t.to(like.dtype)).to(like.device)

    def stream(self):
        """The backend's launches on torch's current stream (a GPU), so order holds; one CuPy
        stream object per torch stream."""
        if not self.gpu:
            return nullcontext()
        import cupy
        import torch
        stream = torch.cuda.current_stream()
        if stream.cuda_stream not in self.streams:
            self.streams[stream.cuda_stream] = (
                cupy.cuda.Stream.from_external(stream)  # CuPy 14: ExternalStream deprecated
                if hasattr(cupy.cuda.Stream, "from_external")
                else cupy.cuda.ExternalStream(stream.cuda_stream))
        return self.streams[stream.cuda_stream]


@dataclass
class Forward:
    """What every layer of one forward shares: the requests' spans, which are decode steps, the
    summary plans of the tokens written (decode's, prefill's) and the decode tables by which of
    them select pages."""

    key: object  # the forward's write_index list (one per forward, the same for every layer)
    spans: list
    decode: list[bool]
    plans: tuple
    pages: object  # backend int32 [sum of decode requests' pages]: their page ids in order
    lengths: list[int]
    tables: dict = field(default_factory=dict)
    recordings: dict = field(default_factory=dict)  # what the layers launch alike: Recording


@dataclass
class Recording:
    """Launches every layer of a forward makes alike, recorded at the first (backends/replay.py)
    and made again at the others over their own cache and summaries: the replay, the torch
    tensor its query rows are copied into (None where it reads none) and the one it answers in."""

    replay: object
    q: object
    out: object


class InPlacePaged:
    """The attention function for a loop that brings its cache (see the module)."""

    def __init__(self, policy: Policy, backend, base=None, timer=None) -> None:
        self.policy, self.base, self.timer = policy, base, timer
        self.bridge = Bridge(backend)
        self.backend = backend
        self.summaries: dict[int, object] = {}
        # _pages: (layer, K and V pointers) -> its view and the addresses of its MOVED arrays
        self.views: dict[tuple, tuple[PagedKV, dict]] = {}
        self.log = StepLog()
        self.forward: Forward | None = None
        self.stream = None  # torch's current stream as the backend's, asked once per forward
        self.records = hasattr(backend, "recording")  # a GPU's: launches recorded, made again
        self.none = backend.asarray(np.zeros(1, np.int32))  # the tables of no request

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        if "cache" not in kwargs:
            raise ConfigError("--engine inplace: the loop called attention without its cache")
        fresh = self.forward is None or self.forward.key is not kwargs["write_index"]
        if fresh:
            self.log.settle()  # the last forward's pages read, outside its timers and this one's
            self.stream = self.bridge.stream()  # per layer, torch's stream query was 30 us of
            # a 200 us call under cProfile (H200, 2026-12-02, 7221bb5)
        timer = self.timer
        t0 = timer.now() if timer is not None else None
        k_all, v_all, kc, vc = self._write(module, key, value, kwargs)
        if timer is not None:
            t1 = timer.now()
            timer.add("cache", t0, t1)
        try:  # every backend array and launch on torch's stream (5.17's forward has its own)
            with self.stream:
                return self._call(module, query, k_all, v_all, kc, vc, attention_mask, fresh,
                                  **kwargs)
        finally:
            if timer is not None:
                timer.add("attention_call", t1, timer.now())

    def _write(self, module, key, value, kwargs):
        """The call's keys and values written at write_index; (keys and values the prefill
        chunks read: the new ones where the call reads no cache, else the cache tensors
        themselves, gathered per chunk later), and the layer's cache tensors."""
        cache = kwargs.pop("cache")
        group, inner = cache.layer_index_to_group_indices[module.layer_idx]
        if getattr(cache, "sliding_windows", {}).get(module.layer_idx, 1) != 1:
            raise ConfigError("--engine inplace reads full-attention layers only; this model "
                              "has sliding-window layers")
        if cache.block_size != self.policy.page_size:
            raise ConfigError(f"--engine inplace: Quest pages of {self.policy.page_size} tokens "
                              f"over cache blocks of {cache.block_size}")
        kc, vc = cache.key_cache[inner], cache.value_cache[inner]
        write = kwargs["write_index"][group]
        new_k, new_v = (x[0].transpose(0, 1) for x in (key, value))  # [n, Hkv, d]
        kc.index_copy_(0, write, new_k)
        vc.index_copy_(0, write, new_v)
        kwargs["_group"] = group
        return new_k, new_v, kc, vc

    def _call(self, module, query, new_k, new_v, kc, vc, mask, fresh: bool, **kwargs):
        """The call after its keys and values are written; `fresh`: the first of a forward."""
        layer, group = module.layer_idx, kwargs.pop("_group")
        read = kwargs["read_index"][group]
        if fresh:
            self.forward = self._plan(kwargs, group)
        f = self.forward
        out = None if all(f.decode) else _empty_answer(query)
        pages, moved = self._pages(module, kc, vc)
        sparse = self.policy.name != "dense" and layer >= self.policy.dense_layers
        if sparse and f.plans[0] is not None:  # the decode tokens' slots, as every layer
            self._recorded(("summary",), moved, lambda _: self.backend.summary(pages, f.plans[0]))
        for (q0, q1, k0, k1), is_decode in zip(f.spans, f.decode):
            if not is_decode:
                self._prefill(module, out, query, new_k, new_v, kc, vc, read, mask,
                              (q0, q1, k0, k1), **kwargs)
        if sparse:
            self._summarise(pages, f.plans[1])
        if self.timer is not None and layer == 0:
            self.timer.batch(sum(f.decode), sum(q1 - q0 for (q0, q1, _, _), dec in
                                                zip(f.spans, f.decode) if not dec))
        if any(f.decode):
            out = self._decode(module, out, query, pages, moved, layer)
        return out, None

    def _plan(self, kwargs, group: int) -> Forward:
        """This forward's spans, summary plans and decode page ids (see Forward)."""
        cu_q = kwargs["cu_seq_lens_q"].tolist()
        cu_k = _one(kwargs["cu_seq_lens_k"]).tolist()
        spans = [(cu_q[r], cu_q[r + 1], cu_k[r], cu_k[r + 1]) for r in range(len(cu_q) - 1)
                 if cu_q[r + 1] > cu_q[r]]
        decode = [_is_decode(*s) for s in spans]
        write = kwargs["write_index"][group].cpu().numpy()
        plans = tuple(self._on_backend(_plan_of(write, spans, decode, mine,
                                                self.policy.page_size))
                      for mine in (True, False))
        read = kwargs["read_index"][group]
        size = self.policy.page_size
        ids = [read[k0:k1:size] for (_, _, k0, k1), dec in zip(spans, decode) if dec]
        if ids:
            import torch
            page_ids = (torch.cat(ids) // size).to(torch.int32)
        else:
            page_ids = None
        lengths = [k1 - k0 for (_, _, k0, k1), dec in zip(spans, decode) if dec]
        return Forward(kwargs["write_index"], spans, decode, plans,
                       None if page_ids is None else self.bridge.array(page_ids), lengths)

    def _on_backend(self, plan: AppendPlan | None) -> AppendPlan | None:
        """plan's arrays copied to the backend once per forward (not once per layer: on a GPU a
        copy from pageable host memory waits for the stream)."""
        if plan is None:
            return None
        b = self.backend
        return AppendPlan(b.asarray(plan.page_ids), b.asarray(plan.first), b.asarray(plan.end))

    def _pages(self, module, kc, vc) -> tuple[PagedKV, dict]:
        """(the layer's cache as an NHD PagedKV, with its summaries and the tables of no request
        (the summary's; decode subsets get theirs in _tables), the addresses of its MOVED
        arrays); made, and the layer checked, once per layer and cache tensor."""
        key = (module.layer_idx, kc.data_ptr(), vc.data_ptr())
        if key not in self.views:
            size, (slots, kv_heads, d) = self.policy.page_size, kc.shape
            dtype = TORCH_TAGS.get(str(kc.dtype))
            if dtype is None:
                raise ConfigError(f"--engine inplace reads fp16 and bf16 caches; this one is "
                                  f"{kc.dtype}")
            if not math.isclose(float(module.scaling), d ** -0.5, rel_tol=1e-6):
                raise ConfigError(f"--engine inplace: the stages scale scores by 1/sqrt(d); "
                                  f"this model by {float(module.scaling):.6g}")
            summary = self.summaries.setdefault(module.layer_idx, self.backend.asarray(
                np.zeros((slots // size, kv_heads, 2, d), storage_dtype(dtype))))
            k, v = (self.bridge.array(x.view(-1, size, kv_heads, d)) for x in (kc, vc))
            none = self.none
            view = PagedKV(k, v, summary, none, none[:0], none[:0], (), size, dtype,
                           layout="NHD")
            self.views[key] = view, {n: address(getattr(view, n)) for n in MOVED}
        return self.views[key]

    def _summarise(self, pages: PagedKV, plan: AppendPlan | None) -> None:
        """The summary kernel over the prefill chunks' slots, its time counted as theirs (as
        QuestPaged counts them)."""
        if plan is None:
            return
        t0 = self.timer.now() if self.timer is not None else None
        self.backend.summary(pages, plan)
        if t0 is not None:
            self.timer.add("base", t0, self.timer.now())

    def _prefill(self, module, out, query, new_k, new_v, kc, vc, read, mask, span, **kwargs):
        """A prefill chunk by the attention QuestPaged replaced, its keys gathered from the
        cache (or the call's own where it reads none)."""
        q0, q1, k0, k1 = span
        if read.numel():
            with_cache = (kc.index_select(0, read[k0:k1]), vc.index_select(0, read[k0:k1]))
        else:
            with_cache = (new_k[k0:k1], new_v[k0:k1])
        k, v = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in with_cache)
        m = None if mask is None else mask[..., q0:q1, k0:k1].contiguous()
        t0 = self.timer.now() if self.timer is not None else None
        out[0, q0:q1] = self.base(module, query[..., q0:q1, :].contiguous(), k, v, m,
                                  **kwargs)[0][0]
        if t0 is not None:
            self.timer.add("base", t0, self.timer.now())

    def _decode(self, module, out, query, pages: PagedKV, moved: dict, layer: int):
        """The call's answer [1, T, Hq, d] with the decode requests' rows (dense and sparse
        subsets, one call each) written into out (None: a decode-only call's). Where one call
        answers every row of a replayed layer, its output is the answer itself (no copy)."""
        f = self.forward
        rows = [q0 for (q0, _, _, _), dec in zip(f.spans, f.decode) if dec]
        sparse = [self.policy.sparse(layer, n) for n in f.lengths]
        last = layer == module.config.num_hidden_layers - 1
        whole = self.records and not last and out is None and len(set(sparse)) == 1
        if out is None and not whole:
            out = _empty_answer(query)
        counts = []  # the last layer's callables giving pages read per request
        self.log.selections += sum(sparse)
        for want in (True, False):
            which = [i for i, s in enumerate(sparse) if s == want]
            if not which:
                continue
            tables = self._tables(which, [rows[i] for i in which], query.device)
            at = tables[-1]
            if not last:
                mine = moved if want else {n: moved[n] for n in MOVED[:2]}  # dense: no summaries
                answer = self._recorded(("decode", tuple(which), want), mine,
                                        lambda q: self._run(q, with_tables(pages, tables), want),
                                        query, at, whole)
                if whole:
                    return answer.unsqueeze(0)
                out[0].index_copy_(0, at, answer)
                continue
            kv = with_tables(pages, tables)
            q = self.bridge.array(_rows(query, at))
            got, count = (sparse_reads(self.backend, q, kv, self.policy.k_pages) if want
                          else dense_reads(self.backend, q, kv))
            out[0].index_copy_(0, at, self.bridge.tensor(got, query))
            counts.append(count)
        if last:  # counted at the next forward (__call__), not now: no wait for the GPU here
            stream = self.stream  # the selection's copy on the stream that made it

            def pages_read() -> float:
                with stream:
                    return sum(sum(count()) for count in counts)
            self.log.add(len(rows), sum(pages_for(n, self.policy.page_size) for n in f.lengths),
                         pages_read)
        return out

    def _tables(self, which: list[int], rows: list[int], device) -> tuple:
        """(indptr, page ids, last page lengths, lengths) of the decode requests `which` and
        their query rows as a torch index on `device`, made once per forward."""
        f, size, b = self.forward, self.policy.page_size, self.backend
        key = tuple(which)
        if key not in f.tables:
            starts = np.concatenate([[0], np.cumsum([pages_for(n, size) for n in f.lengths])])
            pick = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in which])
            ids = f.pages if len(which) == len(f.lengths) else f.pages[b.asarray(pick)]
            lens = tuple(f.lengths[i] for i in which)
            indptr, _, last = page_tables(lens, size, len(pick))
            f.tables[key] = (b.asarray(indptr), ids, b.asarray(last), lens, _index(rows, device))
        return f.tables[key]

    def _run(self, q, kv: PagedKV, sparse: bool):
        """out [B, Hq, d]: the Quest step chained, or dense attention (the last layer counts the
        pages read instead, stage by stage as StagesDecode does: _decode)."""
        if sparse:
            return self.backend.quest(q, kv, self.policy.k_pages, "per-head")[0]
        return self.backend.attention(q, kv)[0]

    def _recorded(self, key, moved: dict, run, query=None, at=None, whole: bool = False):
        """run(q)'s answer [B, Hq, d] as a torch tensor (None where it answers none), q the
        decode rows `at` of query: run at the forward's first layer that asks for `key` and,
        where the backend records, made again at the others with the addresses `moved` (of their
        K, V, summaries) and of their q. Two layers' launches differ only there: same tables
        (the forward's), same shapes. A replayed answer is the recording's output, valid until
        the next layer's call (the loop's output projection reads it first). `whole`: the rows
        are every row of the call, read in place where they lie as [B, Hq, d] (no copy)."""
        done = self.forward.recordings.get(key)
        if done is not None:
            if query is not None:
                moved = {**moved, "q": _query_rows(query, at, done.q, whole)}
            done.replay(**moved)
            return done.out
        if not self.records:
            got = run(None if query is None else self.bridge.array(_rows(query, at)))
            return None if got is None else self.bridge.tensor(got, query)
        q = source = None
        if query is not None:  # q: the recording's buffer for rows that cannot be read in place
            q = query.new_empty(len(at), query.shape[1], query.shape[3])
            moved = {**moved, "q": _query_rows(query, at, q, whole)}
            source = q if moved["q"] == q.data_ptr() else query[0].transpose(0, 1)
        with self.backend.recording() as kept:
            got = run(None if source is None else self.bridge.array(source))
        replay = self.backend.replay(kept, moved)
        answer = None if got is None else self.bridge.tensor(got, query)
        self.forward.recordings[key] = Recording(replay, q, answer)
        return answer


def with_tables(pages: PagedKV, tables: tuple) -> PagedKV:
    """The layer's pages with the CSR tables of some decode requests (InPlacePaged._tables)."""
    indptr, ids, last, lens, _ = tables
    return PagedKV(pages.k, pages.v, pages.summary, indptr, ids, last, lens, pages.page_size,
                   pages.dtype, layout="NHD")


def _rows(query, at):
    """The query rows `at` of a call's query [1, Hq, T, d] as one contiguous [B, Hq, d]."""
    return query[0].transpose(0, 1).index_select(0, at)


def _query_rows(query, at, into, whole: bool) -> int:
    """The address of the rows `at` of query as one [B, Hq, d]: query's own where they are its
    every row and lie so (a projection's output viewed [1, Hq, T, d]), else `into`'s, after
    copying them there."""
    import torch
    rows = query[0].transpose(0, 1)
    if whole and rows.is_contiguous():
        return rows.data_ptr()
    torch.index_select(rows, 0, at, out=into)
    return into.data_ptr()


def _empty_answer(query):
    """The call's answer [1, T, Hq, d], unset, for query [1, Hq, T, d]."""
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def _index(rows: list[int], device):
    import torch
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _plan_of(write: np.ndarray, spans, decode, mine: bool, size: int) -> AppendPlan | None:
    """The summary plan of the tokens written by the spans whose decode flag is `mine`: a row
    per (page, run of consecutive slots); None where there are none."""
    at, ids, first, end = 0, [], [], []
    for (q0, q1, _, _), dec in zip(spans, decode):
        slots = write[at:at + q1 - q0]
        at += q1 - q0
        if dec != mine:
            continue
        page, within = np.divmod(slots.astype(np.int64), size)
        cut = np.flatnonzero((np.diff(page) != 0) | (np.diff(within) != 1)) + 1
        for run in np.split(np.arange(len(slots)), cut):
            ids.append(page[run[0]])
            first.append(within[run[0]])
            end.append(within[run[-1]] + 1)
    if not ids:
        return None
    as32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return AppendPlan(as32(ids), as32(first), as32(end))


class InPlaceDecode:
    """`serve --engine inplace`: the backend whose stages read the loop's cache in place."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def attention(self, policy: Policy, timer=None) -> InPlacePaged:
        """The attention function for one run of the loop."""
        return InPlacePaged(policy, self.backend, timer=timer)
