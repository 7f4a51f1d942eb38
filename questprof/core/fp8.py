"""FP8 E4M3 codes and directed rounding: the number formats of FP8 KV caches and their summaries.

E4M3 here is the OCP "e4m3fn" format that vLLM's `kv_cache_dtype="fp8_e4m3"` stores (as uint8)
and CUDA's __nv_fp8_e4m3 holds: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; no
infinities; S.1111.111 (0x7F, 0xFF) is NaN; the largest finite value is 448 (0x7E), the smallest
subnormal 2^-9 (0x01). Codes 0x00..0x7E are the non-negative values in increasing order and
0x80 | c is -value(c), so a code's parity is its mantissa's last bit (ties to even = even code).

Directions: "nearest" (round to nearest, ties to even), "down" (toward -inf), "up" (toward +inf).
Summaries round outward (min down, max up) so that U_p(q) stays an upper bound of q.k.
"""

from __future__ import annotations

import numpy as np

E4M3 = "fp8_e4m3"
E4M3_MAX = 448.0
E4M3_NAN = 0x7F
DIRECTIONS = ("nearest", "down", "up")


def _values() -> np.ndarray:
    codes = np.arange(256)
    exp, man = (codes >> 3) & 0xF, codes & 7
    mag = np.where(exp == 0, man * 2.0**-9, (1 + man / 8) * 2.0 ** (exp - 7))
    values = np.where(codes & 0x80, -mag, mag)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values


E4M3_VALUES = _values()  # float64 [256]: the value of every code
_MAGNITUDES = E4M3_VALUES[:0x7F]  # 0 .. 448, increasing, indexed by code


def _check(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown rounding direction {direction!r}: expected one of {DIRECTIONS}")


def from_e4m3(codes) -> np.ndarray:
    """float64 values of uint8 E4M3 codes (NaN for 0x7F and 0xFF)."""
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def to_e4m3(x, direction: str = "nearest") -> np.ndarray:
    """uint8 E4M3 codes of x rounded in `direction`, saturating to +-448 (infinities too); NaN
    gives 0x7F. Saturation is what vLLM's quantisation does (it clamps before the cast); it keeps
    outward rounding a bound only for |x| <= 448, which a scale of amax / 448 guarantees."""
    _check(direction)
    x = np.asarray(x, dtype=np.float64)
    neg = np.signbit(x)
    mag = np.abs(x)
    lo = np.clip(np.searchsorted(_MAGNITUDES, mag, side="right") - 1, 0, 0x7E)
    hi = np.minimum(lo + 1, 0x7E)
    inexact = _MAGNITUDES[lo] != mag
    if direction == "nearest":
        below, above = mag - _MAGNITUDES[lo], _MAGNITUDES[hi] - mag
        away = (above < below) | ((above == below) & (lo % 2 == 1))
    else:  # away from zero when rounding up a positive or down a negative value
        away = inexact & ((direction == "up") != neg)
    code = np.where(away, hi, lo).astype(np.uint8) | (neg.astype(np.uint8) << 7)
    return np.where(np.isnan(x), np.uint8(E4M3_NAN), code).astype(np.uint8)


def to_fp16(x, direction: str = "nearest") -> np.ndarray:
    """float16 of x rounded in `direction` (beyond 65504: inf, or +-65504 when rounding in)."""
    _check(direction)
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):  # beyond 65504 is inf, as a cast to fp16 gives it
        h = x.astype(np.float16)
        if direction == "nearest":
            return h
        wide = h.astype(np.float64)
        if direction == "down":
            return np.where(wide > x, np.nextafter(h, np.float16(-np.inf)), h)
        return np.where(wide < x, np.nextafter(h, np.float16(np.inf)), h)


def kv_scale(x, per: str = "tensor") -> np.ndarray:
    """float32 [H] scales of values x [N, H, S, d]: amax / 448 over the tensor (every head the
    same) or over each KV head (a head of zeros gets 1). NaN slots do not count."""
    if per not in ("tensor", "head"):
        raise ValueError(f"unknown scale granularity {per!r}: expected tensor or head")
    x = np.abs(np.asarray(x, dtype=np.float64))
    x = np.where(np.isnan(x), 0.0, x)
    amax = x.max(axis=(0, 2, 3)) if per == "head" else np.full(x.shape[1], x.max(initial=0.0))
    return np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)


def quantize(x, scale) -> np.ndarray:
    """uint8 E4M3 codes of x [N, H, S, d] / scale [H] (float32), rounded to nearest even and
    saturated: vLLM's quantisation of an FP8 KV cache."""
    x = np.asarray(x, dtype=np.float64)
    return to_e4m3(x / np.asarray(scale, dtype=np.float64)[None, :, None, None])
