"""The protocol every backend implements; arrays are the backend's own (numpy or cupy)."""

from __future__ import annotations

from typing import Protocol

from questprof.core.layout import AppendPlan, PagedKV


class BackendUnavailable(RuntimeError):
    """A backend was asked for that cannot run on this machine."""


class Backend(Protocol):
    """Stage calls; launches are asynchronous on GPU backends (call `synchronize` to wait).

    q [B, Hq, d] storage dtype; scores [Hs, nnz] float32; sel [Hs, B, K] int32 positions
    ascending, -1 padded; count [B] int32; out [B, Hq, d] storage dtype; lse [B, Hq] float32.
    """

    name: str
    is_gpu: bool
    fallback_reason: str | None
    quest_path: str  # how quest() runs: 'composed', or '<pdl / plain: why not>, <fused / 3 kernels>'

    def put(self, host_kv: PagedKV) -> PagedKV: ...
    def asarray(self, host_array): ...
    def to_host(self, array): ...
    def synchronize(self) -> None: ...

    def summary(self, kv: PagedKV, plan: AppendPlan) -> None:
        """Update kv.summary in place for the plan's pages."""

    def estimate(self, q, kv: PagedKV, mode: str = "per-head"):
        """Scores [Hs, nnz] float32."""

    def topk(self, scores, kv: PagedKV, k_pages: int, sinks: int = 0, window: int = 0):
        """(sel [Hs, B, K] int32, count [B] int32)."""

    def attention(self, q, kv: PagedKV, sel=None, count=None):
        """(out [B, Hq, d] storage dtype, lse [B, Hq] float32); dense when sel is None."""

    def quest(self, q, kv: PagedKV, k_pages: int, mode: str = "per-head", sinks: int = 0,
              window: int = 0):
        """One decode step, estimate -> topk -> attention over the selection: (out, lse) as
        attention returns them; equal to the three calls composed."""
