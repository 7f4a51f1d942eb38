"""Recorded launches made again with the cache's pointers moved (backends/replay.py), in a dry run
of backends/cupy.py over a CPU stand-in for CuPy (tests/cupy_stub.py): a replay for another
layer launches what a fresh call for that layer launches, byte for byte, except the addresses
of its own temporaries, which stay the recording's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cupy_stub
from questprof.backends import params
from questprof.core.layout import full_plan, random_paged_kv, random_queries

NAMES = ("questprof.backends.cupy", "questprof.backends.pdl", "questprof.backends.replay")
MOVED = ("k", "v", "summary")  # what differs between layers of one forward


@pytest.fixture
def dry(monkeypatch):
    """(backends/cupy.py over the stub, the stub): plain launches through the stub's kernels."""
    with cupy_stub.installed(monkeypatch, NAMES) as (stub, (ops, _, _)):
        yield ops, stub


def _layers(layout: str, seed: int):
    """Two layers of one forward: the same tables, other K, V and summaries."""
    rng = np.random.default_rng(seed)
    kv = random_paged_kv(rng, [1, 15, 17, 300], 16, 2, 128, "bf16", spare_pages=3)
    kv = kv.token_major() if layout == "NHD" else kv
    other = dataclasses.replace(kv, **{n: getattr(kv, n).copy() for n in MOVED})
    return kv, other, random_queries(rng, 4, 8, 128, "bf16")


def _addresses(kv) -> dict[str, int]:
    return {n: params.address(getattr(kv, n)) for n in MOVED}


def _address(arg) -> int:
    """A pointer argument's address: a replay passes a moved one as its value (np.uint64)."""
    return int(arg) if isinstance(arg, np.uint64) else params.address(arg)


def _pointers(arg) -> dict[int, int]:
    raw = arg.view(np.uint8)
    return {o: int(raw[o:o + 8].view("<u8")[0]) for o in params.pointer_offsets(arg.dtype)}


STEPS = {  # what one layer of the in-place decode launches
    "quest": lambda b, q, kv: (b.summary(kv, full_plan(kv)), b.quest(q, kv, 5, "per-head")),
    "quest shared": lambda b, q, kv: b.quest(q, kv, 3, "shared-mean"),
    "dense": lambda b, q, kv: (b.summary(kv, full_plan(kv)), b.attention(q, kv)),
}


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("step", list(STEPS))
def test_a_replay_launches_what_a_fresh_call_launches(dry, layout, step):
    ops, stub = dry
    backend = ops.CupyBackend(pdl=False)
    kv, other, q = _layers(layout, 11)
    with backend.recording() as kept:
        STEPS[step](backend, q, kv)
    replay = backend.replay(kept, _addresses(kv))
    start = len(stub.LAUNCHES)
    replay(**_addresses(other))
    replayed = stub.LAUNCHES[start:]
    start = len(stub.LAUNCHES)
    STEPS[step](backend, q, other)
    fresh = stub.LAUNCHES[start:]
    assert len(kept) == len(replayed) == len(fresh) >= 2
    inputs = {params.address(a) for a in (other.k, other.v, other.summary, other.kv_indptr,
                                          other.kv_indices, other.last_page_len, q)}
    for recorded, again, new in zip(kept, replayed, fresh):
        assert again[:3] + again[4:] == new[:3] + new[4:]  # kernel, grid, block, shared memory
        for was, got, want in zip(recorded.args, again[3], new[3]):
            if not want.dtype.names:  # a pointer beside the struct (the estimate's q)
                assert _address(got) == params.address(want)
                continue
            before, after, fresh_ptrs = _pointers(was), _pointers(got), _pointers(want)
            for offset, value in fresh_ptrs.items():  # an input of the layer, or a temporary
                assert after[offset] == (value if value in inputs or value == 0
                                         else before[offset]), offset
            mask = np.ones(got.dtype.itemsize, bool)
            for offset in fresh_ptrs:
                mask[offset:offset + 8] = False
            assert (got.view(np.uint8)[mask] == want.view(np.uint8)[mask]).all()


def _recorded_attention(ops, layout: str, seed: int):
    """(backend, kv, q, the launches of one dense attention recorded)."""
    backend = ops.CupyBackend(pdl=False)
    kv, _, q = _layers(layout, seed)
    with backend.recording() as kept:
        backend.attention(q, kv)
    return backend, kv, q, kept


def test_a_replay_refuses_a_pointer_no_launch_reads(dry):
    backend, kv, _, kept = _recorded_attention(dry[0], "NHD", 5)
    with pytest.raises(ValueError, match="summary"):  # dense attention reads no summaries
        backend.replay(kept, _addresses(kv))
    with pytest.raises(ValueError, match="distinct"):
        backend.replay(kept, {"k": params.address(kv.k), "v": params.address(kv.k)})


def test_the_recording_ends_with_its_block(dry):
    """Launches after the block are not kept, and the backend launches as before."""
    ops, stub = dry
    backend, kv, q, kept = _recorded_attention(ops, "HND", 3)
    backend.quest(q, kv, 4)
    assert len(kept) == 1 and kept[0].stage == "attention" and not kept[0].pdl
    assert [x[0].split("<")[0] for x in stub.LAUNCHES[-3:]] == [
        "estimate_kernel", "topk_kernel", "attention_kernel"]
