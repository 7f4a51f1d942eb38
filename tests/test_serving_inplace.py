"""The in-place decode (serving/inplace.py) against QuestPaged's host decode, driven as
transformers 5.17's loop drives 'paged|sdpa': a cache object of that loop's shape (token-major
[(blocks + 2) x S, Hkv, d] per layer, update() writes at write_index and reads by read_index),
a prefill of ragged requests, decode steps, a mixed call (a prefill chunk beside decodes) and a
request reusing a finished one's blocks. The NumPy reference on the CPU, the CuPy kernels on a
GPU; outputs, summaries and the pages read must agree."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from questprof.backends.params import address
from questprof.core.config import ConfigError
from questprof.core.layout import from_storage
from questprof.serving.inplace import TORCH_TAGS as TAGS
from questprof.serving.inplace import InPlacePaged, check_loop
from questprof.serving.paged_attention import Policy, QuestPaged

SIZE, KV_HEADS, Q_HEADS, D, LAYERS, BLOCKS = 8, 2, 4, 64, 5, 24


class Cache:
    """What 5.17's PagedAttentionCache offers the attention call (one full-attention group)."""

    def __init__(self, dtype, device):
        shape = ((BLOCKS + 2) * SIZE, KV_HEADS, D)
        self.key_cache = [torch.full(shape, float("nan"), dtype=dtype, device=device)
                          for _ in range(LAYERS)]
        self.value_cache = [torch.full(shape, float("nan"), dtype=dtype, device=device)
                            for _ in range(LAYERS)]
        self.layer_index_to_group_indices = {i: (0, i) for i in range(LAYERS)}
        self.sliding_windows = dict.fromkeys(range(LAYERS), 1)
        self.block_size = SIZE

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        kc, vc = self.key_cache[layer_idx], self.value_cache[layer_idx]
        k, v = (x.transpose(1, 2).squeeze(0) for x in (key_states, value_states))
        kc.index_copy_(0, write_index[0], k)
        vc.index_copy_(0, write_index[0], v)
        if read_index[0].numel() == 0:
            return k, v
        return kc.index_select(0, read_index[0]), vc.index_select(0, read_index[0])


class Module:
    def __init__(self, layer):
        self.layer_idx, self.scaling = layer, D ** -0.5
        self.config = type("Config", (), {"num_hidden_layers": LAYERS})()


def causal(module, q, k, v, mask, **kwargs):
    """A prefill chunk's attention (the function both replace): q [1, Hq, T, d], k, v [1, Hkv,
    n, d], the chunk's queries the last T positions; returns ([1, T, Hq, d], None)."""
    t, n = q.shape[2], k.shape[2]
    k, v = (x.repeat_interleave(Q_HEADS // KV_HEADS, dim=1).float() for x in (k, v))
    s = q.float() @ k.transpose(-1, -2) * module.scaling
    at = torch.arange(n, device=q.device)
    allowed = at[None, :] <= at[n - t:, None]
    s = s.masked_fill(~allowed, -torch.inf)
    return (torch.softmax(s, -1) @ v).to(q.dtype).transpose(1, 2), None


class Loop:
    """Requests with block tables over one shared cache; each call's kwargs as 5.17 builds them."""

    def __init__(self, blocks):
        self.free = list(blocks)
        self.tables, self.lengths = {}, {}

    def slots(self, r, start, end):
        while len(self.tables.setdefault(r, [])) * SIZE < end:
            self.tables[r].append(self.free.pop(0))
        return [self.tables[r][p // SIZE] * SIZE + p % SIZE for p in range(start, end)]

    def finish(self, r):
        self.free = self.tables.pop(r) + self.free
        self.lengths.pop(r)

    def call(self, new: dict, device):
        """kwargs of a forward where request r brings new[r] tokens."""
        cu_q, cu_k, write, read = [0], [0], [], []
        reads = any(self.lengths.get(r, 0) for r in new)
        for r, n in new.items():
            past = self.lengths.get(r, 0)
            write += self.slots(r, past, past + n)
            self.lengths[r] = past + n
            read += self.slots(r, 0, past + n) if reads else []
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + (past + n if reads else n))
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        return {"cu_seq_lens_q": as_t(cu_q), "cu_seq_lens_k": as_t(cu_k),
                "write_index": [as_t(write)], "read_index": [as_t(read)]}


QUEST = Policy("quest", SIZE, 2 * SIZE, dense_layers=1)
# request 0 (34-39 tokens at its decodes) over the crossover, 1, 2 and 3 (8-26) under it
HYBRID = Policy("hybrid", SIZE, 2 * SIZE, dense_layers=1, crossover=4 * SIZE - 2)


def _drive(backend, dtype, device, layers=range(LAYERS), policy=QUEST):
    """Both attention functions over the same calls, each forward through `layers`; (their
    outputs per call and layer, both)."""
    gen = torch.Generator().manual_seed(7)
    host = QuestPaged(policy, base=causal)
    inplace = InPlacePaged(policy, backend, base=causal)
    caches = {id(host): Cache(dtype, device), id(inplace): Cache(dtype, device)}
    loop = Loop(np.random.default_rng(3).permutation(BLOCKS).tolist())
    # prefill of tails 1, S - 1, S + 1 (requests 0-2), decodes, 1 finishes, 3 reuses its blocks
    # as a prefill chunk beside decodes, decodes
    calls = [{0: 4 * SIZE + 1, 1: SIZE - 1, 2: 2 * SIZE + 1}] + [{0: 1, 1: 1, 2: 1}] * 3
    calls += ["finish 1", {0: 1, 3: 3 * SIZE, 2: 1}, {0: 1, 2: 1, 3: 1}, {0: 1, 2: 1, 3: 1}]
    outs = []
    for new in calls:
        if isinstance(new, str):
            loop.finish(int(new.split()[1]))
            continue
        kwargs = loop.call(new, device)
        tokens = int(kwargs["cu_seq_lens_q"][-1])
        for layer in layers:
            q = torch.randn(1, Q_HEADS, tokens, D, generator=gen).to(dtype).to(device)
            if layer % 2 == 0:  # as a projection leaves it: [1, T, Hq, d] viewed [1, Hq, T, d]
                q = q.transpose(1, 2).contiguous().transpose(1, 2)
            k = torch.randn(1, KV_HEADS, tokens, D, generator=gen).to(dtype).to(device)
            v = torch.randn(1, KV_HEADS, tokens, D, generator=gen).to(dtype).to(device)
            # cloned: a replayed layer answers in the recording's output, valid until the next
            # layer's call (the loop's projection reads it first)
            outs.append([f(Module(layer), q, k, v, None, cache=caches[id(f)], **kwargs)[0]
                         .clone() for f in (host, inplace)])
    return outs, host, inplace


def _check(backend, dtype, device, tol, layers=range(LAYERS), policy=QUEST):
    """tol: the host decode's logits are rounded to the cache dtype before the softmax (torch
    matmul in fp16 / bf16), the stages' are float32, so the two differ by that rounding."""
    outs, host, inplace = _drive(backend, dtype, device, layers, policy)
    for want, got in outs:
        want, got = want.float().cpu(), got.float().cpu()
        assert torch.isfinite(got).all()
        assert torch.linalg.norm(got - want) <= tol * torch.linalg.norm(want)
    assert [s["pages_read"] for s in inplace.log.steps] == [s["pages_read"] for s in host.log.steps]
    assert [s["active_pages"] for s in inplace.log.steps] == \
        [s["active_pages"] for s in host.log.steps]
    assert inplace.log.selections == host.log.selections > 0
    # the summaries beside the cache are the host's min/max of the pages in use, every layer's
    for layer in (x for x in layers if x >= policy.dense_layers):
        box = host.summaries[layer].box
        ours = from_storage(backend.to_host(inplace.summaries[layer]), TAGS[str(dtype)])
        used = [b for b in range(box.shape[0]) if np.isfinite(box[b]).all()]
        np.testing.assert_allclose(ours[used], box[used], rtol=0, atol=0)


class Replaying:
    """NumPy's stages behind a GPU backend's recording protocol (backends/replay.py), to hold
    InPlacePaged's use of it on a CPU: a replay runs the recorded calls again over the arrays at
    the moved addresses (views made from the bare addresses, as a kernel is handed them) and
    writes into the recorded outputs; its query is the recorded one, refilled by the caller."""

    def __init__(self):
        from questprof.backends.numpy import NumpyBackend
        self.inner, self.kept, self.replays = NumpyBackend(), None, 0
        self.name, self.is_gpu = "numpy", False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def recording(self):
        self.kept = []
        try:
            yield self.kept
        finally:
            self.kept = None

    def _call(self, name, *args):
        got = getattr(self.inner, name)(*args)
        if self.kept is not None:
            self.kept.append((name, args, got))
        return got

    def summary(self, kv, plan):
        return self._call("summary", kv, plan)

    def quest(self, q, kv, k_pages, mode="per-head"):
        return self._call("quest", q, kv, k_pages, mode)

    def attention(self, q, kv, sel=None, count=None):
        return self._call("attention", q, kv, sel, count)

    def replay(self, kept, moved):
        def of(name, args, what):  # the array `what` (a cache field, or "q") of a call
            return args[0] if what == "q" else getattr(args[0 if name == "summary" else 1], what)

        for what in moved:  # as a GPU replay refuses a pointer no launch reads
            assert any(address(of(n, args, what)) == moved[what] for n, args, _ in kept
                       if what != "q" or n != "summary")

        def run(**addresses):
            self.replays += 1
            for name, args, got in kept:
                at = 0 if name == "summary" else 1
                kv = dataclasses.replace(args[at], **{
                    n: _at(addresses[n], getattr(args[at], n)) for n in moved if n != "q"})
                args = list(args)
                if "q" in moved and name != "summary":
                    args[0] = _at(addresses["q"], args[0])
                again = getattr(self.inner, name)(*args[:at], kv, *args[at + 1:])
                if got is not None:
                    np.copyto(got[0], again[0])
        return run


def _at(addr: int, like: np.ndarray) -> np.ndarray:
    """The array of `like`'s dtype and shape at address `addr` (a view, no copy)."""
    buf = (ctypes.c_char * like.nbytes).from_address(addr)
    return np.frombuffer(buf, dtype=like.dtype).reshape(like.shape)


@pytest.mark.parametrize("layers,policy", [(range(LAYERS), QUEST), ([2, 3], QUEST),
                                           (range(LAYERS), HYBRID)])
@pytest.mark.parametrize("records", [False, True])
def test_inplace_on_the_reference_is_the_host_decode(layers, policy, records):
    """Every layer per forward, and layers 2 and 3 only (a forward is known by its own
    write_index, not by layer 0 coming first); hybrid: Quest for the requests over the
    crossover, dense for the others in the same forward (two calls, their rows apart). Where the
    backend records (a GPU's, here NumPy's behind that protocol), layers after a forward's
    first make its launches again over their own cache, summaries and query rows."""
    from questprof.backends.numpy import NumpyBackend
    backend = Replaying() if records else NumpyBackend()
    _check(backend, torch.float16, "cpu", 5e-3, layers, policy)
    if records:
        assert backend.replays > 0


@pytest.mark.parametrize("what,said", [("scaling", "1/sqrt(d)"), ("block", "cache blocks")])
def test_inplace_refuses_what_its_stages_would_get_wrong(what, said):
    """A model that scales scores otherwise than 1/sqrt(d), cache blocks of another size than
    Quest's pages: one line, never a wrong output."""
    from questprof.backends.numpy import NumpyBackend
    attention = InPlacePaged(Policy("dense", SIZE, 2 * SIZE), NumpyBackend(), base=causal)
    cache, module = Cache(torch.float16, "cpu"), Module(0)
    if what == "scaling":
        module.scaling = 0.02
    else:
        cache.block_size = 2 * SIZE
    kwargs = Loop(range(BLOCKS)).call({0: SIZE + 3}, "cpu")
    q = torch.randn(1, Q_HEADS, SIZE + 3, D).half()
    k = torch.randn(1, KV_HEADS, SIZE + 3, D).half()
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
        attention(module, q, k, k, None, cache=cache, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_inplace_on_the_kernels_is_the_host_decode(dtype):
    from questprof.backends import get_backend
    _check(get_backend("cupy"), getattr(torch, dtype), "cuda",
           3e-2 if dtype == "bfloat16" else 5e-3)


def test_inplace_needs_a_loop_that_brings_its_cache():
    check_loop("paged|sdpa")
    with pytest.raises(ConfigError, match="paged|sdpa"):
        check_loop("sdpa")
