"""The fidelity path where the model ran (device_eval.py, torch) against the host path it
replaced for real models (evaluate.py, NumPy float64): the same metrics and the same rows, on
seeded random weights and tokens, lengths whose decode steps cross page boundaries."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import TOL  # noqa: E402
from questprof.backends import get_backend  # noqa: E402
from questprof.fidelity import device_eval, model_run, runner  # noqa: E402
from questprof.fidelity.device import selection_masks, stored  # noqa: E402
from questprof.fidelity.evaluate import FidelityGrid, evaluate_batch, flat_selection  # noqa: E402
from questprof.fidelity.host_index import stored as host_stored  # noqa: E402
from questprof.fidelity.metrics import METRICS, selection_mask  # noqa: E402
from questprof.fidelity.models import LoadedModel  # noqa: E402
from questprof.fidelity.prompts import random_tokens  # noqa: E402

GRID = FidelityGrid((8, 16), (8, 16, 32, 128), ("per-head", "shared-max", "shared-mean"))
PAGES_READ = METRICS.index("pages_read")


@pytest.fixture(scope="module")
def tiny():
    """A randomly initialised 2-layer Llama, 6 q / 2 KV heads of 16."""
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=256)
    return LoadedModel(transformers.LlamaForCausalLM(config).eval(), None, "tiny", 256)


def _same(new: dict, old: dict) -> None:
    """Float64 metrics within rounding; pages read (a count) exactly."""
    assert new.keys() == old.keys()
    for key in old:
        np.testing.assert_allclose(new[key], old[key], rtol=1e-9, atol=1e-12, err_msg=str(key))
        np.testing.assert_array_equal(new[key][:, :, :, PAGES_READ], old[key][:, :, :, PAGES_READ])


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("length", [46, 57])  # 45 / 56 prefilled: steps cross pages of 8, 16
def test_metrics_where_the_model_ran_equal_the_host_path(tiny, dtype, length):
    batch = [random_tokens(97, length, seed=s) for s in (1, 2, 3)]
    got = model_run.capture(tiny, batch, 4, "random-tokens")
    grid = FidelityGrid(GRID.page_sizes, GRID.budgets, GRID.modes, dtype)
    backend = get_backend("numpy")
    bases = {s: model_run.base_indexes(got, backend, s, dtype, 0) for s in grid.page_sizes}
    _same(device_eval.evaluate_captured(got, backend, grid, bases),
          evaluate_batch(got.captures, backend, grid, bases=bases))
    _same(device_eval.evaluate_captured(got, backend, grid),
          evaluate_batch(got.captures, backend, grid))


def test_rounding_to_storage_matches_the_host(rng):
    """Values and storage bits (what the kernels read, bf16 as 16 bits) as the host makes them."""
    from questprof.core.layout import to_storage
    from questprof.fidelity.device import storage
    x = (rng.standard_normal((5, 301)) * np.logspace(-6, 4, 301)).astype(np.float32)
    for dtype in ("fp32", "fp16", "bf16"):
        np.testing.assert_array_equal(stored(torch.from_numpy(x), dtype).numpy(),
                                      host_stored(x, dtype))
        bits = storage(torch.from_numpy(x), dtype).numpy()
        want = to_storage(x, dtype)
        np.testing.assert_array_equal(bits.view(want.dtype), want)


@pytest.mark.parametrize("mode_heads", [6, 2])  # per-head (Hs = Hq) and shared (Hs = Hkv)
def test_selection_masks_equal_the_reference_masks(rng, mode_heads):
    batch, q_heads, pages, k = 3, 6, 13, 5
    sel = np.full((mode_heads, batch, k + 2), -1, np.int32)  # -1 padded past the count
    for h in range(mode_heads):
        for b in range(batch):
            sel[h, b, :k] = np.sort(rng.choice(pages, k, replace=False))
    got = selection_masks(torch.from_numpy(sel), k, batch * q_heads, pages)
    want = selection_mask(flat_selection(sel), k, batch * q_heads, pages)
    np.testing.assert_array_equal(got.numpy(), want)


def _rows(request, backend):
    return list(runner.fidelity_rows(request, backend))


def test_rows_of_the_new_path_equal_the_old(monkeypatch):
    """Every row of a random-weight run, new path (metrics where the model ran, selections on
    the device) against the old (host captures, NumPy metrics): integer fields exactly, floats
    within fp32's tolerance (both round to 5 decimals)."""
    request = runner.Request("passkey", FidelityGrid((8, 16), (16, 64), ("per-head",
                                                                         "shared-max")),
                             (300,), steps=3, model="random:smoke", prompts=3, dense_layers=1)
    backend = get_backend("numpy")
    new = _rows(request, backend)
    monkeypatch.setattr(device_eval, "evaluate_captured",
                        lambda got, b, grid, bases: evaluate_batch(got.captures, b, grid,
                                                                   bases=bases))
    old = _rows(request, backend)
    assert len(new) == len(old) > 0
    for a, b in zip(new, old):
        assert a.keys() == b.keys()
        for name, value in b.items():
            if isinstance(value, float) and not isinstance(a[name], bool):
                assert a[name] == pytest.approx(value, abs=TOL["fp32"], nan_ok=True), name
            else:
                assert a[name] == value, name


def test_a_nan_in_the_capture_is_one_clear_error(tiny):
    from questprof.core.config import ConfigError
    got = model_run.capture(tiny, [random_tokens(97, 30, seed=4)], 2, "random-tokens")
    with torch.inference_mode():  # the captured cache is an inference tensor
        got.values[1][0, 1, 5, 3] = torch.nan
    with pytest.raises(ConfigError, match=r"layers\.1\.value holds 1 non-finite"):
        got.check()


def test_the_gpu_index_class_on_the_device_path_gives_the_host_results(tiny, monkeypatch):
    """PageIndex (a GPU backend's index: the backend's stages over one pool) under the device
    path and the task, here over the NumPy reference backend, against the vectorised host
    index: its selections stay backend arrays (host=False) with count min(K, pages)."""
    from questprof.fidelity.page_index import PageIndex
    batch = [random_tokens(97, 45, seed=s) for s in (1, 2)]
    got = model_run.capture(tiny, batch, 3, "random-tokens")
    backend, grid = get_backend("numpy"), FidelityGrid((8,), (16, 64), ("per-head", "shared-mean"))

    def run():
        bases = {8: model_run.base_indexes(got, backend, 8, "fp32", 0)}
        metrics = device_eval.evaluate_captured(got, backend, grid, bases)
        answers = model_run.task_answers(tiny, batch, got, bases[8], [8, 16], 8, "per-head", 1)
        return metrics, answers

    host = run()
    make = lambda b, keys, s, dtype, cap: PageIndex(b, keys, s, dtype, cap)  # noqa: E731
    monkeypatch.setattr(model_run, "page_index", make)
    monkeypatch.setattr(device_eval, "page_index", make)
    pool = run()
    _same(pool[0], host[0])
    assert pool[1] == host[1]


@pytest.mark.gpu
def test_the_device_path_on_the_gpu_equals_the_host_metrics_of_its_selections(gpu):
    """On the GPU: captures on the device, indexes from them through DLPack, the CUDA kernels'
    selections crossing back to torch, float64 metrics there; against the host path over the
    same kernels (host captures and NumPy metrics). And the task: a budget over every page
    answers as dense attention."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    torch.manual_seed(5)
    config = transformers.LlamaConfig(  # head dim 64: the kernels are built for it
        hidden_size=576, intermediate_size=256, num_hidden_layers=3, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=97, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config).eval().to("cuda")
    loaded = LoadedModel(model, None, "tiny-gpu", 512)
    batch = [random_tokens(97, 301, seed=s) for s in (1, 2, 3)]
    got = model_run.capture(loaded, batch, 4, "random-tokens")
    assert got.keys[0].is_cuda
    grid = FidelityGrid((8, 16, 32), (64, 128, 512), ("per-head", "shared-max"), "fp16")
    new = device_eval.evaluate_captured(got, gpu, grid)
    _same(new, evaluate_batch(got.captures, gpu, grid))
    bases = model_run.base_indexes(got, gpu, 16, "fp16", 1)
    answers = model_run.task_answers(loaded, batch, got, bases, [16, 512], 16, "per-head", 1)
    assert [a[0] for a in answers[512]] == got.tokens  # 512 tokens: every page of 304
    assert [len(a[0]) for a in answers[16]] == [4] * 3
