"""FP8 (e4m3) KV caches: the code table, directed rounding on every code, quantisation, the
summaries' outward rounding and the NumPy backend on FP8 caches against float64 values."""

import numpy as np
import pytest

from questprof.backends.numpy import NumpyBackend
from questprof.core import fp8, layout, reference
from questprof.core.layout import random_paged_kv
from conftest import full_plan

CODES = np.arange(256, dtype=np.uint8)
FINITE = CODES[(CODES & 0x7F) != 0x7F]


def test_code_table_is_the_e4m3fn_format():
    v = fp8.E4M3_VALUES
    assert v[0x7E] == 448 and v[0xFE] == -448 and v[0x01] == 2.0**-9 and v[0x08] == 2.0**-6
    assert v[0x38] == 1.0 and v[0x39] == 1.125 and v[0xB8] == -1.0
    assert np.isnan(v[0x7F]) and np.isnan(v[0xFF]) and np.signbit(v[0x80])
    assert np.all(np.diff(v[:0x7F]) > 0)
    torch = pytest.importorskip("torch")
    ref = torch.from_numpy(CODES.copy()).view(torch.float8_e4m3fn).double().numpy()
    np.testing.assert_array_equal(v, ref)


@pytest.mark.parametrize("direction", fp8.DIRECTIONS)
def test_every_code_round_trips_in_every_direction(direction):
    back = fp8.to_e4m3(fp8.from_e4m3(FINITE), direction)
    np.testing.assert_array_equal(back, FINITE)
    assert np.all(fp8.to_e4m3(fp8.from_e4m3([0x7F, 0xFF]), direction) == fp8.E4M3_NAN)


def test_between_codes_nearest_even_down_and_up():
    pos = np.arange(0x7E)
    lo_v, hi_v = fp8.E4M3_VALUES[pos], fp8.E4M3_VALUES[pos + 1]
    for sign in (1.0, -1.0):
        mid, near_lo = sign * (lo_v + hi_v) / 2, sign * (0.75 * lo_v + 0.25 * hi_v)
        lo_c, hi_c = (pos, pos + 1) if sign > 0 else (pos | 0x80, (pos + 1) | 0x80)
        even = np.where(pos % 2 == 0, lo_c, hi_c)
        np.testing.assert_array_equal(fp8.to_e4m3(mid), even)
        np.testing.assert_array_equal(fp8.to_e4m3(near_lo), lo_c)
        down, up = fp8.to_e4m3(mid, "down"), fp8.to_e4m3(mid, "up")
        np.testing.assert_array_equal(down, lo_c if sign > 0 else hi_c)
        np.testing.assert_array_equal(up, hi_c if sign > 0 else lo_c)
        assert np.all(fp8.from_e4m3(down) <= mid) and np.all(fp8.from_e4m3(up) >= mid)


def test_nearest_matches_torch_within_range(rng):
    torch = pytest.importorskip("torch")
    x = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.uniform(-4, 2.6, 20000),
                        fp8.E4M3_VALUES[FINITE]])
    x = x[np.abs(x) <= 448]
    ref = torch.from_numpy(x).float().to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(fp8.to_e4m3(x.astype(np.float32)), ref)


def test_saturation_nan_and_signed_zero():
    x = np.array([448.0, 460.0, 1e6, np.inf, -np.inf, -1e6, np.nan, -0.0, 1e-9, -1e-9])
    assert fp8.to_e4m3(x).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F, 0x80, 0, 0x80]
    assert fp8.to_e4m3([1e-9], "up").tolist() == [0x01]
    assert fp8.to_e4m3([-1e-9], "down").tolist() == [0x81]
    with pytest.raises(ValueError):
        fp8.to_e4m3([1.0], "outward")


@pytest.mark.parametrize("direction", ["down", "up"])
def test_fp16_directed_rounding_is_the_nearest_bound(rng, direction):
    x = np.concatenate([rng.standard_normal(5000) * 10.0 ** rng.uniform(-8, 4.5, 5000),
                        [65504.0, 65510.0, 70000.0, -70000.0, 0.0, 2.0**-30, -(2.0**-30)]])
    h = fp8.to_fp16(x, direction)
    toward = np.float16(np.inf if direction == "down" else -np.inf)
    with np.errstate(over="ignore"):  # the next fp16 on x's other side (inf past 65504)
        beyond = np.nextafter(h, toward).astype(np.float64)
    if direction == "down":
        assert np.all(h.astype(np.float64) <= x) and np.all(beyond > x)
    else:
        assert np.all(h.astype(np.float64) >= x) and np.all(beyond < x)


@pytest.mark.parametrize("per", ["tensor", "head"])
def test_scales_and_quantisation(rng, per):
    x = rng.standard_normal((6, 3, 8, 16)) * np.array([1.0, 30.0, 0.01])[None, :, None, None]
    x[0, 0, 5:] = np.nan
    scale = fp8.kv_scale(x, per)
    assert scale.dtype == np.float32 and scale.shape == (3,)
    amax = np.nanmax(np.abs(x), axis=(0, 2, 3))
    want = amax / 448 if per == "head" else np.full(3, amax.max() / 448)
    np.testing.assert_allclose(scale, want, rtol=1e-7)
    codes = fp8.quantize(x, scale)
    back = fp8.from_e4m3(codes) * scale.astype(np.float64)[None, :, None, None]
    ok = ~np.isnan(x)
    assert np.isnan(back[~ok]).all()
    assert np.all(np.abs(back[ok] - x[ok]) <= np.abs(x[ok]) / 16 + 2.0**-10 * scale.max())
    assert np.all(np.abs(fp8.from_e4m3(codes[ok])) <= 448)


def _fp8_kv(rng, summary_dtype, per="head", lengths=(1, 15, 16, 17, 40), s=16, heads=2, d=32,
            dtype="fp16"):
    kv = random_paged_kv(rng, list(lengths), s, heads, d, dtype, spare_pages=2,
                         tail_fill=np.nan, kv_dtype=fp8.E4M3, summary_dtype=summary_dtype,
                         kv_scale=per)
    NumpyBackend().summary(kv, full_plan(kv))
    return kv


@pytest.mark.parametrize("summary_dtype", ["fp16", fp8.E4M3])
def test_fp8_cache_layout(rng, summary_dtype):
    kv = _fp8_kv(rng, summary_dtype)
    assert kv.k.dtype == kv.v.dtype == np.uint8 and kv.is_fp8 and kv.dtype == "fp16"
    assert kv.summary.dtype == (np.float16 if summary_dtype == "fp16" else np.uint8)
    assert kv.k_scale.dtype == kv.v_scale.dtype == np.float32 and kv.k_scale.shape == (2,)
    host = kv.with_arrays(np.array)
    assert host.k_scale is not kv.k_scale and host.kv_dtype == fp8.E4M3


def _valid_keys(kv, page):
    """Dequantized float64 keys of a page's valid slots, [H, n, d]."""
    indptr, indices, last = kv.kv_indptr, kv.kv_indices, kv.last_page_len
    pos = int(np.where(indices == page)[0][0])
    b = int(np.searchsorted(indptr, pos, side="right") - 1)
    n = int(last[b]) if pos == indptr[b + 1] - 1 else kv.page_size
    return layout.kv_values(kv, "k")[page][:, :n]


@pytest.mark.parametrize("summary_dtype", ["fp16", fp8.E4M3])
def test_fp8_summaries_bound_the_keys_outward(rng, summary_dtype):
    kv = _fp8_kv(rng, summary_dtype)
    summ = layout.summary_values(kv)
    for page in np.asarray(kv.kv_indices):
        keys = _valid_keys(kv, page)
        lo, hi = keys.min(axis=1), keys.max(axis=1)
        if summary_dtype == fp8.E4M3:  # the page's own codes: exact
            np.testing.assert_array_equal(summ[page, :, 0], lo)
            np.testing.assert_array_equal(summ[page, :, 1], hi)
            continue
        assert np.all(summ[page, :, 0] <= lo) and np.all(summ[page, :, 1] >= hi)
        np.testing.assert_array_equal(kv.summary[page, :, 0], fp8.to_fp16(lo, "down"))
        np.testing.assert_array_equal(kv.summary[page, :, 1], fp8.to_fp16(hi, "up"))


def test_fp8_summaries_from_finer_keys_round_outward(rng):
    """FP8 summaries of values that are not codes (say a quantized fp16 summary) still bound."""
    kv = _fp8_kv(rng, fp8.E4M3, per="tensor")
    exact = rng.standard_normal(np.shape(kv.summary)) * float(kv.k_scale[0]) * 100
    exact.sort(axis=2)
    back = layout.summary_values(layout.replace(kv, summary=layout.encode_summary(exact, kv)))
    assert np.all(back[:, :, 0] <= exact[:, :, 0]) and np.all(back[:, :, 1] >= exact[:, :, 1])


@pytest.mark.parametrize("summary_dtype", ["fp16", fp8.E4M3])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_numpy_backend_on_fp8_equals_float64_on_dequantized(rng, summary_dtype, dtype):
    kv = _fp8_kv(rng, summary_dtype, lengths=(1, 15, 33), heads=2, dtype=dtype)
    q = layout.random_queries(rng, kv.batch, 8, kv.head_dim, dtype)
    qf = layout.from_storage(q, dtype)
    k, v = layout.kv_values(kv, "k")[...], layout.kv_values(kv, "v")[...]
    backend = NumpyBackend()
    scores = backend.estimate(q, kv, "per-head")
    want = reference.estimate(qf, layout.summary_values(kv), kv.kv_indptr, kv.kv_indices)
    np.testing.assert_allclose(scores, want, rtol=1e-6)
    for p_at, page in enumerate(np.asarray(kv.kv_indices)):  # U_p bounds every valid q.k
        keys = _valid_keys(kv, page)
        b = int(np.searchsorted(kv.kv_indptr, p_at, side="right") - 1)
        dots = np.einsum("hgd,hnd->hgn", qf[b].reshape(2, 4, -1), keys).max(axis=2).ravel()
        assert np.all(want[:, p_at] >= dots - 1e-9 * np.abs(dots).max())
    sel, count = backend.topk(scores, kv, 2)
    out, lse = backend.attention(q, kv, sel, count)
    ref_out, ref_lse = reference.attention(qf, k, v, kv.kv_indptr, kv.kv_indices,
                                           kv.last_page_len, sel, count)
    np.testing.assert_array_equal(out, layout.to_storage(ref_out, dtype))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


def test_cache_dtype_rules():
    with pytest.raises(ValueError, match="summaries"):
        layout.check_cache_dtypes("fp16", "fp16", fp8.E4M3)
    with pytest.raises(ValueError, match="not supported"):
        layout.check_cache_dtypes("fp32", fp8.E4M3, fp8.E4M3)
    with pytest.raises(ValueError, match="not supported"):
        layout.check_cache_dtypes("fp16", "bf16", "bf16")
    with pytest.raises(ValueError, match="k_scale"):
        layout.PagedKV(*([np.zeros(1)] * 6), (1,), 16, "fp16", fp8.E4M3)
    layout.check_cache_dtypes("bf16", fp8.E4M3, "fp16")


def test_context_parallel_split_keeps_the_fp8_cache(rng):
    """Each rank's share of an FP8 cache keeps its dtypes and scales: the split step equals
    the one-device Quest step."""
    from questprof.core import sharding

    kv = _fp8_kv(rng, "fp16", lengths=(40, 70), heads=2)
    part = sharding.local_kv(kv, sharding.shard_bounds(kv.pages(), 2, 1))
    assert part.is_fp8 and part.summary_dtype == "fp16" and part.k_scale is kv.k_scale
    q = layout.random_queries(rng, kv.batch, 4, kv.head_dim, "fp16")
    backend = NumpyBackend()
    out, lse, _, _ = sharding.simulate(backend, q, kv, 3, world=2)
    want, want_lse = backend.quest(q, kv, 3)
    np.testing.assert_allclose(out, layout.from_storage(want, "fp16"), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
