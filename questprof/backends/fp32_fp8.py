"""FP8 (e4m3) caches on the NumPy backend's float32 path (numpy_fp32.py).

K and V: each code is decoded once per pool into the float32 working copies (fp32_copies.py),
times its head's scale: the float32 product of two float32 values is the exact product rounded
once, so the stages read what the reference reads within float32 rounding.

Summaries: the min and max of each page's codes, taken in an order-preserving key (KEY: a code's
rank by value), are the page's own codes, as the reference's outward rounding of the exact
values gives them; fp16 summaries take each code's value rounded outward from a table per head
(256 entries). Rounding every summary value instead (core.fp8.to_e4m3: 288 ns a value on the
2-core machine, 2026-12-01) would have cost minutes per large pool.
"""

from __future__ import annotations

import numpy as np

from questprof.backends.fp32_stages import minmax
from questprof.core.fp8 import E4M3, E4M3_VALUES, to_fp16
from questprof.core.layout import PagedKV

E4M3_F32 = E4M3_VALUES.astype(np.float32)  # the value of every code (exact in float32)


def _keys() -> np.ndarray:
    """KEY[code]: codes ranked by value, uint8: -448 (0xFE) -> 1 .. -0 (0x80) -> 0x7F,
    +0 -> 0x80 .. 448 (0x7E) -> 0xFE; the NaN codes at the ends (0xFF -> 0, 0x7F -> 0xFF)."""
    codes = np.arange(256)
    magnitude = codes & 0x7F
    return np.where(codes & 0x80, 0x7F - magnitude, 0x80 + codes).astype(np.uint8)


KEY = _keys()
UNKEY = np.argsort(KEY).astype(np.uint8)  # the code of each key


def decode(codes, scale=None) -> np.ndarray:
    """float32 values of e4m3 codes [..., H, S, d] times the scale [H] (float32) of their head
    (scale None: the codes' own values)."""
    values = E4M3_F32[np.asarray(codes)]
    if scale is not None:
        values *= np.asarray(scale, dtype=np.float32)[:, None, None]
    return values


def summaries(kv: PagedKV, ids: np.ndarray, first: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Summaries [n, H, 2, d] in kv's summary storage of its pages `ids` (distinct) over slots
    [first, end), merged with the stored ones where first > 0 (an append): what
    layout.encode_summary gives the reference's exact min and max."""
    keys = KEY[np.asarray(kv.k)[ids]].transpose(1, 0, 2, 3)            # [H, n, S, d]
    lo, hi = minmax(keys, first, end)                                 # [H, n, d] keys
    old = first > 0
    if kv.summary_dtype == E4M3:
        if old.any():
            prev = KEY[np.asarray(kv.summary)[ids[old]]]                 # [m, H, 2, d]
            lo[:, old] = np.minimum(lo[:, old], prev[:, :, 0].transpose(1, 0, 2))
            hi[:, old] = np.maximum(hi[:, old], prev[:, :, 1].transpose(1, 0, 2))
        return np.stack([UNKEY[lo], UNKEY[hi]], axis=2).transpose(1, 0, 2, 3)
    down, up = _fp16_tables(kv.k_scale)
    heads = np.arange(kv.kv_heads)[:, None, None]
    out = np.stack([down[heads, UNKEY[lo]], up[heads, UNKEY[hi]]], axis=2).transpose(1, 0, 2, 3)
    if old.any():  # rounding is monotone and the stored values are fp16: merge after it
        prev = np.asarray(kv.summary)[ids[old]]
        out[old, :, 0] = np.minimum(out[old, :, 0], prev[:, :, 0])
        out[old, :, 1] = np.maximum(out[old, :, 1], prev[:, :, 1])
    return out


def _fp16_tables(k_scale) -> tuple[np.ndarray, np.ndarray]:
    """(down, up) [H, 256] float16: each code's value times its head's scale, rounded toward
    -inf and +inf (core.fp8.to_fp16, as layout.encode_summary rounds fp16 summaries)."""
    exact = E4M3_VALUES[None, :] * np.asarray(k_scale, dtype=np.float64)[:, None]
    return to_fp16(exact, "down"), to_fp16(exact, "up")
