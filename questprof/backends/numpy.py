"""The NumPy backend: every stage through the float64 reference, results rounded to storage."""

from __future__ import annotations

import numpy as np

from questprof.core import reference
from questprof.core.layout import AppendPlan, PagedKV, from_storage, to_storage


def _readable(x, dtype: str):
    """What the reference can read: fp16/fp32 as stored (widened per page), bf16 decoded."""
    return from_storage(x, dtype) if dtype == "bf16" else x


class NumpyBackend:
    """Runs anywhere; its times are CPU times of the reference, not GPU kernel times."""

    name = "numpy"
    is_gpu = False
    quest_path = "composed"  # quest() is the three stage calls in sequence

    def __init__(self) -> None:
        self.fallback_reason: str | None = None

    def put(self, host_kv: PagedKV) -> PagedKV:
        return host_kv.with_arrays(np.asarray)

    def asarray(self, host_array):
        return np.asarray(host_array)

    def to_host(self, array):
        return np.asarray(array)

    def synchronize(self) -> None:
        pass

    def summary(self, kv: PagedKV, plan: AppendPlan) -> None:
        new = reference.summary(from_storage(kv.summary, kv.dtype), _readable(kv.k, kv.dtype), plan)
        kv.summary[...] = to_storage(new, kv.dtype)

    def estimate(self, q, kv: PagedKV, mode: str = "per-head"):
        summ = from_storage(kv.summary, kv.dtype)
        u = reference.estimate(from_storage(q, kv.dtype), summ, kv.kv_indptr, kv.kv_indices, mode)
        return u.astype(np.float32)

    def topk(self, scores, kv: PagedKV, k_pages: int, sinks: int = 0, window: int = 0):
        return reference.topk(scores, kv.kv_indptr, k_pages, sinks, window)

    def attention(self, q, kv: PagedKV, sel=None, count=None):
        out, lse = reference.attention(
            from_storage(q, kv.dtype), _readable(kv.k, kv.dtype), _readable(kv.v, kv.dtype),
            kv.kv_indptr, kv.kv_indices, kv.last_page_len, sel, count)
        return to_storage(out, kv.dtype), lse.astype(np.float32)

    def quest(self, q, kv: PagedKV, k_pages: int, mode: str = "per-head", sinks: int = 0,
              window: int = 0):
        scores = self.estimate(q, kv, mode)
        sel, count = self.topk(scores, kv, k_pages, sinks, window)
        return self.attention(q, kv, sel, count)
