"""The serving decode through a backend's stages (serving/stages_decode.py, the seam the GPU
kernels sit behind) against the host decode: the NumPy reference on the CPU, the CuPy kernels
on a GPU; a ragged step of requests of tail lengths 1, S-1, S, S+1, sparse and dense mixed."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from questprof.serving.paged_attention import Decode, HostDecode, PageSummaries
from questprof.serving.stages_decode import StagesDecode

SIZE, KV_HEADS, Q_HEADS, D = 8, 2, 4, 64  # D: a head dim the kernels build


def _items(dtype, device, lengths=(1, SIZE - 1, SIZE, SIZE + 1, 5 * SIZE + 3)):
    gen = torch.Generator().manual_seed(0)
    items = []
    for i, n in enumerate(lengths):
        k = torch.randn(KV_HEADS, n, D, generator=gen)
        v = torch.randn(KV_HEADS, n, D, generator=gen)
        q = torch.randn(Q_HEADS, D, generator=gen)
        table = PageSummaries(SIZE)
        table.write(np.arange(n), k.to(dtype).float().transpose(0, 1).numpy())
        box = table.of(np.arange(n)) if i % 2 == 0 else None  # every other request dense
        items.append(Decode(*(x.to(dtype).to(device) for x in (q, k, v)), box))
    return items


def _check(backend, dtype, device, tol, same_reads=True):
    items = _items(dtype, device)
    scaling = D ** -0.5
    host = HostDecode().decode(items, 2, SIZE, scaling)
    staged = StagesDecode(backend).decode(items, 2, SIZE, scaling)
    for (want, _), (got, read) in zip(host, staged):
        want, got = want.float().cpu(), got.float().cpu()
        assert torch.linalg.norm(got - want) <= tol * torch.linalg.norm(want)
    # pages read as the host engine counts them: the union of a KV head's q heads' pages
    # (sparse: P 1, 1, 6 at K 2), every page (dense: P 1, 2); 16-bit summaries round the boxes
    # (the host's are float32), so a near tie may pick another page: only the bounds hold there
    reads = [r for _, r in staged]
    assert reads[1::2] == [1.0, 2.0]
    if same_reads:
        assert reads == [r for _, r in host]
    group = Q_HEADS // KV_HEADS
    assert all(min(2, p) <= r <= min(p, 2 * group) for r, p in zip(reads[::2], (1, 1, 6)))


def test_stages_decode_on_the_reference_is_the_host_decode():
    from questprof.backends.numpy import NumpyBackend
    _check(NumpyBackend(), torch.float32, "cpu", 1e-5)


@pytest.mark.gpu
def test_stages_decode_on_the_kernels_is_the_host_decode():
    from questprof.backends import get_backend
    _check(get_backend("cupy"), torch.float16, "cuda", 1e-3, same_reads=False)
