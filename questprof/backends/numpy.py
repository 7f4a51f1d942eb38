"""The NumPy backend: every stage through the float64 reference, results rounded to storage."""

from __future__ import annotations

import numpy as np

from questprof.core import reference
from questprof.core.layout import (AppendPlan, PagedKV, encode_summary, from_storage, kv_values,
                                   summary_values, to_storage)


class HostArrays:
    """What every CPU backend shares: host arrays, nothing to wait for."""

    is_gpu = False
    quest_path = "composed"  # quest() is the three stage calls in sequence

    def asarray(self, host_array):
        return np.asarray(host_array)

    def to_host(self, array):
        return np.asarray(array)

    def synchronize(self) -> None:
        pass


class NumpyBackend(HostArrays):
    """Runs anywhere; its times are CPU times of the reference, not GPU kernel times."""

    name = "numpy"
    kv_dtypes = ("fp16", "bf16", "fp32", "fp8_e4m3")  # caches it runs (FP8: dequantized, float64)

    def __init__(self) -> None:
        self.fallback_reason: str | None = None

    def put(self, host_kv: PagedKV) -> PagedKV:
        return host_kv.with_arrays(np.asarray)

    def summary(self, kv: PagedKV, plan: AppendPlan) -> None:
        new = reference.summary(summary_values(kv), kv_values(kv, "k"), plan)
        kv.summary[...] = encode_summary(new, kv)

    def estimate(self, q, kv: PagedKV, mode: str = "per-head"):
        summ = summary_values(kv)
        u = reference.estimate(from_storage(q, kv.dtype), summ, kv.kv_indptr, kv.kv_indices, mode)
        return u.astype(np.float32)

    def topk(self, scores, kv: PagedKV, k_pages: int, sinks: int = 0, window: int = 0):
        return reference.topk(scores, kv.kv_indptr, k_pages, sinks, window)

    def attention(self, q, kv: PagedKV, sel=None, count=None):
        out, lse = reference.attention(
            from_storage(q, kv.dtype), kv_values(kv, "k"), kv_values(kv, "v"),
            kv.kv_indptr, kv.kv_indices, kv.last_page_len, sel, count)
        return to_storage(out, kv.dtype), lse.astype(np.float32)

    def quest(self, q, kv: PagedKV, k_pages: int, mode: str = "per-head", sinks: int = 0,
              window: int = 0):
        scores = self.estimate(q, kv, mode)
        sel, count = self.topk(scores, kv, k_pages, sinks, window)
        return self.attention(q, kv, sel, count)
