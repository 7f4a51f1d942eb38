"""End-to-end decode steps on the smoke shape, CPU and the NumPy backend (seconds)."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from questprof.commands import e2e  # noqa: E402
from questprof.workload import decoder  # noqa: E402
from questprof.core import model
from questprof.backends.numpy import NumpyBackend  # noqa: E402
from questprof.core.scenarios import load_scenario  # noqa: E402


@pytest.fixture(scope="module")
def smoke():
    """The smoke shape in float32, as the CPU runs it."""
    return dataclasses.replace(load_scenario("smoke").model, dtype="fp32")


@pytest.fixture(scope="module")
def rows():
    shape = load_scenario("smoke").model
    return e2e.measure_e2e(shape, [17, 300], 16, 64, batch=2, backend=NumpyBackend(),
                           steps=2, warmup=1, scenario="smoke")


def _run(shape, length, budget, batch=2, seed=3):
    backend = NumpyBackend()
    dec = decoder.build_decoder(shape, "cpu", seed)
    cache = decoder.build_cache(dec, backend, length, batch, 16, seed)
    return decoder.DecodeRun(dec, cache, backend, budget, 16, "per-head", seed)


def test_rows_have_the_columns(rows):
    assert [r["length"] for r in rows] == [17, 300]
    for row in rows:
        assert set(e2e.PASSES) | {"attention_fraction", "amdahl_predicted", "measured_speedup", "predicted_4bit"} <= set(row)
        assert row["stage"] == "e2e" and row["status"] == "ok" and row["reason"] is None
        assert row["backend"] == "numpy" and row["method"] == "perf-counter"
        assert (row["model"], row["dtype"], row["batch"], row["budget"]) == ("smoke", "fp32", 2, 64)
        assert row["pages"] == model.pages(row["length"], 16) and row["k_pages"] == 4


def test_amdahl_columns_follow_the_model(rows):
    for row in rows:
        f, s = row["attention_fraction"], row["attention_speedup"]
        assert 0 < f <= 1 and s > 0
        assert f == pytest.approx(min(row["attention_ms_dense"] / row["step_ms_dense"], 1.0))
        assert s == pytest.approx(row["attention_ms_dense"] / row["attention_ms_quest"])
        assert row["amdahl_predicted"] == model.amdahl_speedup(f, s)
        assert row["measured_speedup"] > 0
        assert row["measured_speedup"] == pytest.approx(row["step_ms_dense"] / row["step_ms_quest"])
        # 4-bit weights shrink the part Quest does not touch: the prediction moves away from 1
        assert (row["predicted_4bit"] >= row["amdahl_predicted"]) == (s >= 1)


def test_predicted_4bit_limits():
    assert model.predicted_4bit(0.4, 3.0, 1.0) == pytest.approx(model.amdahl_speedup(0.4, 3.0))
    assert model.predicted_4bit(0.4, 3.0, 1e-12) == pytest.approx(3.0)
    assert model.predicted_4bit(0.0, 3.0, 0.25) == pytest.approx(1.0)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 77])
def test_quest_with_full_budget_is_dense(smoke, length):
    run = _run(smoke, length, budget=model.pages(length, 16) * 16)
    dense = run.step(quest=False)
    quest = run.step(quest=True)
    assert torch.isfinite(dense).all()
    torch.testing.assert_close(quest, dense, rtol=1e-5, atol=1e-5)


def test_quest_with_small_budget_is_sparse(smoke):
    run = _run(smoke, 300, budget=32)
    assert not torch.allclose(run.step(quest=True), run.step(quest=False), rtol=1e-5, atol=1e-5)


def test_dense_layers_stay_dense(smoke):
    all_dense = dataclasses.replace(smoke, dense_layers=smoke.layers)
    run = _run(all_dense, 300, budget=32)
    torch.testing.assert_close(run.step(quest=True), run.step(quest=False), rtol=0, atol=0)


def test_steps_repeat(smoke):
    run = _run(smoke, 200, budget=64, seed=3)
    first = run.step(quest=True)
    torch.testing.assert_close(run.step(quest=True), first, rtol=0, atol=0)


def test_new_token_updates_the_summary(smoke):
    run = _run(smoke, 33, budget=64, batch=1)  # token 33 opens the third page alone
    run.step(quest=True)
    kv, c = run.cache.kvs[-1], run.cache
    page, slot = int(c.tail_pages[0]), int(c.tail_slots[0])
    key = kv.k[page, :, slot]
    assert slot == 0
    assert (kv.summary[page, :, 0] == key).all() and (kv.summary[page, :, 1] == key).all()


def test_memory_reason():
    assert e2e.memory_reason(1.0, 2.0, "x") is None
    reason = e2e.memory_reason(3 * 2**30, 2**30, "the KV caches of 131072 tokens")
    assert "the KV caches of 131072 tokens needs 3.0 GiB" in reason and "1.0 GiB is free" in reason


def test_weights_that_do_not_fit_skip_every_row(monkeypatch):
    monkeypatch.setattr(e2e, "_free_bytes", lambda device: 0.0)
    shape = load_scenario("smoke").model
    rows = e2e.measure_e2e(shape, [64, 128], 16, 32, backend=NumpyBackend(), steps=1, warmup=0)
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert all("the weights needs" in r["reason"] for r in rows)
    assert all(r.get("measured_speedup") is None and r["median_ms"] is None for r in rows)


def _relative_error(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gpu_interop_is_zero_copy(gpu, dtype):
    t = torch.randn(3, 4, 64, device="cuda", dtype=getattr(torch, decoder._TORCH_DTYPE[dtype]))
    a = decoder.to_backend(t, gpu)
    assert a.dtype == ("float16" if dtype == "fp16" else "uint16") and a.flags.c_contiguous
    back = decoder.from_backend(a, gpu)
    assert back.dtype == t.dtype and back.data_ptr() == t.data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gpu_quest_with_full_budget_is_dense(gpu, dtype):
    shape = dataclasses.replace(load_scenario("smoke").model, dtype=dtype)
    dec = decoder.build_decoder(shape, "cuda", 0)
    run = decoder.DecodeRun(dec, decoder.build_cache(dec, gpu, 77, 2, 16, 0), gpu, 80, 16)
    dense, quest = run.step(quest=False), run.step(quest=True)
    torch.cuda.synchronize()
    assert torch.isfinite(dense).all()
    # attention's split order differs between dense and a selection; two layers follow it
    assert _relative_error(quest, dense) < 1e-2
    small = decoder.DecodeRun(dec, decoder.build_cache(dec, gpu, 3000, 2, 16, 0), gpu, 64, 16)
    assert _relative_error(small.step(quest=True), small.step(quest=False)) > 1e-3


@pytest.mark.gpu
def test_gpu_rows_are_timed_as_a_cuda_graph(gpu):
    shape = load_scenario("smoke").model
    rows = e2e.measure_e2e(shape, [1000, 8192], 16, 256, backend=gpu, steps=3, warmup=1)
    for row in rows:
        assert row["status"] == "ok" and row["method"] == "cuda-graph", row["reason"]
        assert 0 < row["attention_fraction"] <= 1 and row["measured_speedup"] > 0
        assert row["dtype"] == "fp16"
