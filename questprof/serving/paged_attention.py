"""questprof's decode attention over the cache transformers' continuous batching holds.

transformers (>= 5) batches requests of many lengths into one packed forward: the queries of
every request of a step side by side ([1, Hq, tokens, d]), the keys and values of each request
read back from its paged cache in order ([1, Hkv, sum of lengths, d]), with `cu_seq_lens_q` /
`cu_seq_lens_k` marking where each request starts and `read_index` / `write_index` naming the
cache slots of those tokens. `QuestPaged` is an attention function for that call: a request
that brings one query (a decode step) is answered by questprof's stages, dense or Quest
(estimate -> top-K -> attention over the chosen pages); the others (prefill chunks) by the
attention function it replaces. Page size = transformers' page (block) size, so a page of the
cache is a Quest page: its min/max summary is kept per cache page (slot index // page size) and
updated as transformers writes tokens; a page whose first slot is written starts afresh, which
re-initialises a freed page that a new request reuses.

transformers runs continuous batching only under its own implementation names, and the name
SDPA runs under and how the loop calls it differ by version: 5.24's loop calls 'sdpa' with the
pages already read; 5.17's calls 'paged|sdpa' with the cache itself (a `cache` argument), which
the function writes and reads (`read_cache`, as 5.17's sdpa_paged.py does). `bound` asks the
installed loop which name it runs (`loop_name`), binds QuestPaged to it for the run and gives the
name back after.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from questprof.core.config import ConfigError
from questprof.core.selection import union_pages
from questprof.core.selectors import QUEST
from questprof.fidelity.host_index import topk
from questprof.fidelity.task_selectors import matmul_bound

NAME = "questprof_paged"  # the name it is registered under, for a reader of AttentionInterface
# The names transformers' loop runs SDPA under, each with how it calls the function: 'sdpa'
# (5.24) with each request's keys and values read from the cache, 'paged|sdpa' (5.17) with the
# cache to write and read. On the H200's 5.17 (2026-12-02) a function bound to 'sdpa' alone was
# never called and the "quest" run was transformers' own attention.
LOOP_NAMES = ("sdpa", "paged|sdpa")


class _StandIn:
    """A model without flash attention, set to 'sdpa': what the loop switches it to is the name
    the loop runs SDPA under."""

    _supports_flash_attn = False

    def __init__(self) -> None:
        self.config = type("Config", (), {"_attn_implementation": "sdpa"})()

    def set_attn_implementation(self, name: str) -> None:
        self.config._attn_implementation = name


def loop_name(manager=None, version: str = "") -> str:
    """The name of LOOP_NAMES the installed transformers' continuous batching runs SDPA under,
    asked of its own `switch_to_cb_friendly_attn` (`manager`: its ContinuousBatchingManager);
    ConfigError in one line where it runs neither."""
    if manager is None:
        import transformers
        from transformers.generation import ContinuousBatchingManager as manager
        version = transformers.__version__
    model = _StandIn()
    try:
        manager.switch_to_cb_friendly_attn(type("Manager", (), {})(), model)
    except (AttributeError, TypeError, ValueError) as e:
        raise ConfigError(f"transformers {version}: its continuous batching does not run "
                          f"'sdpa' ({e}), so questprof's attention cannot be bound") from None
    name = model.config._attn_implementation
    if name not in LOOP_NAMES:
        raise ConfigError(f"transformers {version}: its continuous batching runs SDPA as "
                          f"{name!r}, which questprof's attention does not know how to take "
                          f"the place of (it knows {', '.join(LOOP_NAMES)})")
    return name


def read_cache(module, key, value, kwargs: dict):
    """What 5.17's 'paged|sdpa' does first: write this call's keys and values [1, Hkv, n, d]
    into kwargs' `cache` (popped) at write_index and read every request's back by read_index;
    returns keys and values [1, Hkv, sum of lengths, d], as 5.24's loop passes them."""
    cache = kwargs.pop("cache")
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                              read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    return key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)


POLICIES = ("dense", "quest", "hybrid")


@dataclass(frozen=True)
class Policy:
    """Which decode steps run Quest: `quest` in every layer >= dense_layers, `hybrid` only for
    requests longer than `crossover` tokens, `dense` never. budget in tokens (K = budget //
    page_size pages, the tail page in)."""

    name: str
    page_size: int
    budget: int
    dense_layers: int = 2
    crossover: int | None = None
    selector: str = QUEST

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}: expected one of {', '.join(POLICIES)}")
        if self.name == "hybrid" and self.crossover is None:
            raise ValueError("policy hybrid needs the crossover a sweep measured")
        if self.selector != QUEST:
            raise ValueError(f"selector {self.selector!r}: the serving loop runs Quest's only")
        if self.budget < self.page_size:
            raise ValueError(f"budget {self.budget} is less than one page of {self.page_size}")

    @property
    def k_pages(self) -> int:
        return self.budget // self.page_size

    def sparse(self, layer: int, length: int) -> bool:
        """Whether a decode step of a request of `length` tokens selects pages in `layer`."""
        if self.name == "dense" or layer < self.dense_layers:
            return False
        return self.name == "quest" or length >= self.crossover  # wins from it on


class PageSummaries:
    """One layer's min/max of the keys of every cache page, [pages, Hkv, 2, d] float64, indexed
    by slot // page_size, grown as slots further out are written."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.box = np.zeros((0, 0, 2, 0))

    def _grow(self, pages: int, kv_heads: int, d: int) -> None:
        if pages > self.box.shape[0]:
            more = np.full((max(pages, 2 * self.box.shape[0]), kv_heads, 2, d), np.nan)
            if self.box.size:
                more[: self.box.shape[0]] = self.box
            self.box = more

    def write(self, slots: np.ndarray, keys: np.ndarray) -> None:
        """Fold keys [n, Hkv, d] written at cache slots [n] into their pages' min/max; a page
        whose slot 0 is among them starts again at +inf/-inf."""
        pages, within = np.divmod(np.asarray(slots, np.int64), self.page_size)
        self._grow(int(pages.max()) + 1, keys.shape[1], keys.shape[2])
        fresh = np.unique(pages[within == 0])
        self.box[fresh, :, 0], self.box[fresh, :, 1] = np.inf, -np.inf
        np.minimum.at(self.box[:, :, 0], pages, keys)
        np.maximum.at(self.box[:, :, 1], pages, keys)

    def of(self, slots: np.ndarray) -> np.ndarray:
        """Summaries [P, Hkv, 2, d] of a request's pages, slots [L] its tokens' slots in order."""
        return self.box[np.asarray(slots[:: self.page_size], np.int64) // self.page_size]


@dataclass
class StepLog:
    """The ragged shape of each decode step (read at the last layer): decode requests, their
    pages, pages read (the mean over KV heads of the union its q heads chose, summed over
    requests; every page for a dense request) and when the step's last layer ran."""

    done: list = field(default_factory=list)
    selections: int = 0  # (request, layer) decodes that ran Quest's selection
    parts: list = field(default_factory=list)  # each forward's time by part (step_time.split)
    later: list = field(default_factory=list)  # steps whose pages read are not counted yet

    def add(self, requests: int, active: int, read) -> None:
        """A step; `read` its pages read, or a callable giving them when first asked (a GPU's
        selection read back later: a copy now would make the host wait in the step). One
        attention function adds one kind, so the steps stay in order."""
        step = {"requests": requests, "active_pages": active, "pages_read": read,
                "t": time.perf_counter()}
        (self.later if callable(read) else self.done).append(step)

    def settle(self) -> None:
        """Count the pages read of the steps added with a callable."""
        if not self.later:
            return
        for step in self.later:
            step["pages_read"] = float(step["pages_read"]())
        self.done += self.later
        self.later = []

    @property
    def steps(self) -> list:
        """Every step, its pages read counted."""
        self.settle()
        return self.done


def select_pages(q: np.ndarray, box: np.ndarray, k_pages: int) -> np.ndarray:
    """Page positions [Hq, min(K, P)] Quest keeps for one request, ascending: q [Hq, d], box
    [P, Hkv, 2, d] its pages' summaries; the bound and top-K of the fidelity task's loop
    (task_selectors.matmul_bound, host_index.topk: the tail page in, ties to the lower page)."""
    sel, count = topk(matmul_bound(q, box)[:, None, :], k_pages)
    return sel[:, 0, :count]


def kept_tokens(sel: np.ndarray, pages: int, page_size: int, length: int) -> np.ndarray:
    """[Hq, length] bool: the tokens of the selected pages."""
    keep = np.zeros((sel.shape[0], pages), dtype=bool)
    np.put_along_axis(keep, sel, True, axis=1)
    return np.repeat(keep, page_size, axis=1)[:, :length]


def attend(q, k, v, keep, scaling: float):
    """Exact decode attention of q [Hq, d] over k, v [Hkv, L, d] (torch), only the tokens of
    keep [Hq, L] bool (every token when None); softmax in float32. Returns [Hq, d]."""
    import torch
    kv_heads, length, d = k.shape
    s = torch.matmul(q.reshape(kv_heads, -1, d), k.transpose(-1, -2)).float() * scaling
    if keep is not None:
        s = s.masked_fill(~keep.reshape(kv_heads, -1, length), -torch.inf)
    return torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v).reshape(-1, d)


def _one(index):
    """The first full-attention group's index tensor (transformers passes one per group)."""
    return index[0] if isinstance(index, (list, tuple)) else index


@dataclass
class Decode:
    """One request's decode step in one layer: q [Hq, d], its keys and values [Hkv, L, d]
    (torch, in token order) and its pages' summaries [P, Hkv, 2, d] (None: dense)."""

    q: object
    k: object
    v: object
    box: np.ndarray | None


class HostDecode:
    """Decode steps answered where the model runs: the bound and top-K on the host (NumPy, the
    fidelity task's), exact attention in torch over the chosen pages' tokens of the keys
    transformers gathered."""

    def decode(self, items: list[Decode], k_pages: int, page_size: int,
               scaling: float) -> list[tuple[object, float]]:
        """(out [Hq, d], pages read) per item."""
        return [self._one(item, k_pages, page_size, scaling) for item in items]

    @staticmethod
    def _one(item: Decode, k_pages: int, page_size: int, scaling: float):
        length = item.k.shape[1]
        pages = -(-length // page_size)
        if item.box is None:
            return attend(item.q, item.k, item.v, None, scaling), float(pages)
        sel = select_pages(item.q.float().cpu().numpy().astype(np.float64), item.box, k_pages)
        keep = _as_tensor(kept_tokens(sel, pages, page_size, length), item.q.device)
        group = sel.shape[0] // item.k.shape[0]
        read = union_pages(sel[:, None, :], [sel.shape[1]], group)
        return attend(item.q, item.k, item.v, keep, scaling), read


class QuestPaged:
    """The attention function (see the module): policy's decode by `engine` (HostDecode, or
    serving/stages_decode.StagesDecode: a backend's stages), `base` for prefill chunks."""

    def __init__(self, policy: Policy, base=None, engine=None, timer=None) -> None:
        self.policy, self.base = policy, base
        self.engine = engine or HostDecode()
        self.summaries: dict[int, PageSummaries] = {}
        self.log = StepLog()
        self.timer = timer  # serving/step_time.StepClock: this call's and base's seconds

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        if "cache" in kwargs:  # 5.17's loop: the cache's time is its own part, not ours
            key, value = read_cache(module, key, value, kwargs)
        if self.timer is None:
            return self._call(module, query, key, value, attention_mask, **kwargs)
        t0 = self.timer.now()
        try:
            return self._call(module, query, key, value, attention_mask, **kwargs)
        finally:
            self.timer.add("attention_call", t0, self.timer.now())

    def _prefill(self, module, query, key, value, mask, **kwargs):
        """A prefill chunk's attention by the function QuestPaged replaced: [q tokens, Hq, d]."""
        if self.timer is None:
            return self.base(module, query, key, value, mask, **kwargs)[0][0]
        t0 = self.timer.now()
        out = self.base(module, query, key, value, mask, **kwargs)[0][0]
        self.timer.add("base", t0, self.timer.now())
        return out

    def _call(self, module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        cu_q = kwargs["cu_seq_lens_q"].tolist()
        cu_k = kwargs["cu_seq_lens_k"].tolist()
        read = _one(kwargs["read_index"])
        spans = [(cu_q[r], cu_q[r + 1], cu_k[r], cu_k[r + 1]) for r in range(len(cu_q) - 1)
                 if cu_q[r + 1] > cu_q[r]]
        if self.policy.name != "dense" and layer >= self.policy.dense_layers:
            self._write(layer, key, _one(kwargs["write_index"]), spans)
        out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
        slots = read.cpu().numpy() if read.numel() else None
        rows, items = [], []
        for q0, q1, k0, k1 in spans:
            if _is_decode(q0, q1, k0, k1) and slots is not None:
                rows.append(q0)
                items.append(self._item(layer, query[0, :, q0], key[0, :, k0:k1],
                                        value[0, :, k0:k1], slots[k0:k1]))
            else:
                # contiguous copies: a slice of the mask starts k0 elements in, and torch's
                # memory-efficient SDPA takes such a bias without checking its alignment (the
                # H200, torch 2.11, transformers 5.17: 'misaligned address' in the loop's prefill)
                mask = (None if attention_mask is None
                        else attention_mask[..., q0:q1, k0:k1].contiguous())
                out[0, q0:q1] = self._prefill(module, *(x.contiguous() for x in (
                    query[..., q0:q1, :], key[..., k0:k1, :], value[..., k0:k1, :])), mask,
                    **kwargs)
        if self.timer is not None and layer == 0:
            self.timer.batch(len(items), sum(q1 - q0 for q0, q1, _, _ in spans) - len(items))
        if items:
            self._decode(module, out, rows, items)
        return out, None

    def _item(self, layer: int, q, k, v, slots: np.ndarray) -> Decode:
        """A decode step, with its pages' summaries when the policy selects for it."""
        sparse = self.policy.sparse(layer, k.shape[1])
        return Decode(q, k, v, self.summaries[layer].of(slots) if sparse else None)

    def _decode(self, module, out, rows: list[int], items: list[Decode]) -> None:
        """The engine's answers into out's rows; the step's shape logged at the last layer."""
        got = self.engine.decode(items, self.policy.k_pages, self.policy.page_size,
                                 float(module.scaling))
        for row, (answer, _) in zip(rows, got):
            out[0, row] = answer
        self.log.selections += sum(item.box is not None for item in items)
        if module.layer_idx == module.config.num_hidden_layers - 1:
            size = self.policy.page_size
            self.log.add(len(items), sum(-(-item.k.shape[1] // size) for item in items),
                         sum(read for _, read in got))

    def _write(self, layer: int, key, write, spans) -> None:
        """Fold the tokens this call writes into their pages' summaries (they are the last
        q1 - q0 keys of each request's span, written at write_index's slots): decode tokens in
        this call's time, prefill chunks' in the timer's `base` (the prefill part of a step,
        serving/step_time.py), so the summaries of a prompt never count as decode attention."""
        at = np.concatenate([np.arange(k1 - (q1 - q0), k1) for q0, q1, _, k1 in spans])
        decode = np.concatenate([np.full(q1 - q0, _is_decode(q0, q1, k0, k1))
                                 for q0, q1, k0, k1 in spans])
        slots = write[: len(at)].cpu().numpy()
        table = self.summaries.setdefault(layer, PageSummaries(self.policy.page_size))
        for mine in (decode, ~decode):
            if not mine.any():
                continue
            t0 = self.timer.now() if self.timer is not None and mine is not decode else None
            table.write(slots[mine], key[0, :, at[mine]].transpose(0, 1).float().cpu().numpy())
            if t0 is not None:
                self.timer.add("base", t0, self.timer.now())


def _is_decode(q0: int, q1: int, k0: int, k1: int) -> bool:
    """Whether a request's span in a call is a decode step: one query over cached keys."""
    return q1 - q0 == 1 and k1 - k0 > 1


def _as_tensor(x: np.ndarray, device):
    import torch
    return torch.as_tensor(x, device=device)


@contextmanager
def bound(model, attention: QuestPaged):
    """Within the block, `model`'s attention in continuous batching is `attention` (bound to the
    name the loop runs SDPA under, its prefill chunks to transformers' plain 'sdpa'); the name
    and the model's implementation are given back after."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    name = loop_name()
    before, was = ALL_ATTENTION_FUNCTIONS[name], model.config._attn_implementation
    attention.base = attention.base or ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register(NAME, attention)
    AttentionInterface.register(name, attention)
    model.set_attn_implementation(name)
    try:
        yield attention
    finally:
        AttentionInterface.register(name, before)
        model.set_attn_implementation(was)
