"""Launches recorded once and made again with some pointers moved: the in-place decode plans a
forward's launches at its first layer and makes them again at every other layer, whose cache,
summaries (and only those) live elsewhere (serving/inplace.py).

Launched from Python, each launch of the Quest step built its params struct field by field and
the driver's launch objects afresh: about 0.8 ms of host time for the step's three kernels
against 19-150 us of their own (H200, 2026-12-02, afd1441, tools/serve_glue.py). A replay keeps
each launch's config and argument bytes (backends/pdl.Prepared) and rewrites only the pointers
that move before the driver call.

A recording runs the launches for real. Their temporaries (scores, selections, attention's
workspace, outputs) come from a memory pool of the backend's own that only recordings draw
from, so the addresses the recorded launches hold stay the pool's while the recording lives:
the next recording may reuse a freed temporary's bytes, which is safe because recordings and
replays run in order on one stream and every kernel writes its temporaries before it reads
them. An output a replay writes again is the array the recording returned; its caller reads it
before the next replay of the same launches (the in-place decode: the layer's output
projection, queued first on the stream).

One thing a replay trusts and does not check: no call between a recording and its replay
lowers a kernel's dynamic shared memory attribute below the recorded launch's (estimate and
top-K set theirs to each call's need; a smaller call of the same kernel in between, which the
in-place decode does not make, would make the replay's launch fail with the driver's error).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from questprof.backends import params


@dataclass(frozen=True)
class Launch:
    """One launch as a launcher was asked to make it (its struct arguments copied)."""

    kernel: object
    grid: tuple
    block: tuple
    args: tuple
    shared_mem: int
    stage: str
    pdl: bool


class Recorder:
    """A launcher (backends/pdl.PlainLaunch's protocol) that launches through `inner` and keeps
    each launch in `kept`."""

    def __init__(self, inner, kept: list) -> None:
        self.inner, self.kept = inner, kept

    @property
    def path(self) -> str:
        return self.inner.path

    def defines(self, stage: str) -> tuple[str, ...]:
        return self.inner.defines(stage)

    def uses_pdl(self, stage: str) -> bool:
        return self.inner.uses_pdl(stage)

    def __call__(self, kernel, grid, block, args, shared_mem: int = 0, stage: str = "") -> None:
        self.inner(kernel, grid, block, args, shared_mem, stage)
        copied = tuple(_bytes_of(a) if _is_struct(a) else a for a in args)
        self.kept.append(Launch(kernel, tuple(grid), tuple(block), copied, int(shared_mem), stage,
                                self.inner.uses_pdl(stage)))


def _is_struct(a) -> bool:
    return isinstance(a, np.ndarray) and a.dtype.names is not None


def _bytes_of(a: np.ndarray) -> np.ndarray:
    """A writable copy of a struct byte for byte (NumPy's copy() copies field by field and leaves
    the padding between fields unset)."""
    return np.frombuffer(bytearray(a.tobytes()), dtype=a.dtype)


def relocations(args: tuple, names: dict[int, str]) -> list[tuple[int, int, str]]:
    """(argument, byte offset, name) of every pointer among `args` whose address `names` names:
    a struct's pointer fields, or a device array passed beside it (offset 0)."""
    found = []
    for i, a in enumerate(args):
        if _is_struct(a):
            for offset in params.pointer_offsets(a.dtype):
                (value,) = struct.unpack_from("<Q", a, offset)
                if value in names:
                    found.append((i, offset, names[value]))
        elif hasattr(a, "data") and not isinstance(a, np.generic):
            value = params.address(a)
            if value in names:
                found.append((i, 0, names[value]))
    return found


class Called:
    """A launch through CuPy's kernel call (where cuda.bindings is missing, as in a CPU dry run),
    its pointers moved in its own copies of the arguments."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.args = [_bytes_of(a) if _is_struct(a) else a for a in launch.args]

    def move(self, arg: int, offset: int, address: int) -> None:
        if _is_struct(self.args[arg]):
            struct.pack_into("<Q", self.args[arg], offset, address)
        else:  # a pointer beside the struct: passed as its 8-byte value
            self.args[arg] = np.uint64(address)

    def __call__(self) -> None:
        x = self.launch
        x.kernel(x.grid, x.block, tuple(self.args), shared_mem=x.shared_mem)


class Replay:
    """`launches` made again by calling it with a new address for each name of `moved` (name ->
    the address the recording used); every other byte as recorded. `prepare(launch)` gives the
    object that makes one launch: pdl.Prepared's form, or Called."""

    def __init__(self, launches: list[Launch], moved: dict[str, int], prepare) -> None:
        names = {address: name for name, address in moved.items()}
        if len(names) != len(moved) or 0 in names:
            raise ValueError(f"moved pointers must be distinct and not null: {moved}")
        self.steps = [(prepare(x), relocations(x.args, names)) for x in launches]
        found = {name for _, relocs in self.steps for _, _, name in relocs}
        if found != set(moved):
            raise ValueError(f"no recorded launch reads {sorted(set(moved) - found)}")

    def __call__(self, **addresses: int) -> None:
        for run, relocs in self.steps:
            for arg, offset, name in relocs:
                run.move(arg, offset, addresses[name])
            error = run()
            if error is not None:
                raise RuntimeError(error)
