"""The fidelity path where the model ran (torch) against the host path it replaced for real
models (NumPy float64): each metric of metrics_device.py against its reference in metrics.py
on random inputs, and evaluate_device.py against evaluate.py (the same metrics and the same
rows) on seeded random weights and tokens, lengths whose decode steps cross page boundaries."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import TOL  # noqa: E402
from questprof.backends import get_backend  # noqa: E402
from questprof.fidelity import evaluate_device, metrics_device, model_run, runner  # noqa: E402
from questprof.fidelity import metrics as reference  # noqa: E402
from questprof.fidelity.device import stored  # noqa: E402
from questprof.fidelity.evaluate import FidelityGrid, evaluate_batch, flat_selection  # noqa: E402
from questprof.fidelity.host_index import stored as host_stored  # noqa: E402
from questprof.fidelity.metrics import METRICS  # noqa: E402
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
    _same(evaluate_device.evaluate_captured(got, backend, grid, bases),
          evaluate_batch(got.captures, backend, grid, bases=bases))
    _same(evaluate_device.evaluate_captured(got, backend, grid),
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
    got = metrics_device.selection_masks(torch.from_numpy(sel), k, batch * q_heads, pages)
    want = reference.selection_mask(flat_selection(sel), k, batch * q_heads, pages)
    np.testing.assert_array_equal(got.numpy(), want)


BATCH, Q_HEADS, KV_HEADS, D, SCALING, SIZES = 2, 6, 2, 8, 0.35, (8, 16, 32)
TAILS = [1, 31, 32, 33, 45]  # tokens: tails of 1, S-1, S and S+1 at S = 32, and 45


def _close(got, want, what: str) -> None:
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-9, atol=1e-12, err_msg=what)


def _attention(rng, n: int):
    """Both paths' dense attention of random q [B, Hq, d] over n random keys and values:
    (the device path's (qk, weights, out) and its values as rows [B * Hkv, width, d], zeros
    after n; the reference's DenseAttention per request)."""
    width = -(-n // max(SIZES)) * max(SIZES)
    q = rng.standard_normal((BATCH, Q_HEADS, D))
    k, v = (rng.standard_normal((BATCH, KV_HEADS, n, D)) for _ in range(2))
    rows = [torch.zeros((BATCH * KV_HEADS, width, D), dtype=torch.float64) for _ in range(2)]
    for flat, x in zip(rows, (k, v)):
        flat[:, :n] = torch.from_numpy(x.reshape(-1, n, D))
    device = metrics_device.dense_attention(torch.from_numpy(q), *rows, n, SCALING)
    return (device, rows[1]), [reference.dense_attention(q[b], k[b], v[b], SCALING)
                               for b in range(BATCH)]


@pytest.mark.parametrize("n", TAILS)
def test_device_dense_attention_and_page_stats_equal_the_reference(rng, n):
    """metrics_device's dense attention (requests as rows) and page statistics of every page
    size (16 and 32 summed from 8's pages) against metrics.py's, request by request."""
    ((qk, weights, out), values), dense = _attention(rng, n)
    for name, got in (("qk", qk), ("weights", weights), ("out", out)):
        _close(got, np.concatenate([getattr(x, name) for x in dense]), name)
    stats = metrics_device.step_stats(qk, weights, out, values, SIZES, n)
    for s in SIZES:
        want = [reference.page_stats(x, s) for x in dense]
        for name in ("mass", "max_qk", "weighted_v", "out"):
            _close(getattr(stats[s], name), np.concatenate([getattr(w, name) for w in want]),
                   f"{name} at S = {s}")
        np.testing.assert_array_equal(np.sort(stats[s].top_pages.numpy(), axis=1),
                                      np.sort(np.concatenate([w.top_pages for w in want]), 1))


def _masks(rng, heads: int, pages: int, counts: list[int]) -> np.ndarray:
    """[len(counts), heads, pages] bool: counts[i] pages per row, the tail page among them."""
    masks = np.zeros((len(counts), heads, pages), dtype=bool)
    masks[..., -1] = True
    for i, count in enumerate(counts):
        for h in range(heads):
            masks[i, h, rng.choice(pages - 1, count - 1, replace=False)] = True
    return masks


@pytest.mark.parametrize("n", TAILS)
def test_device_head_metrics_and_stale_masks_equal_the_reference(rng, n):
    """metrics_device.head_metrics of every budget at once against metrics.head_metrics of
    each budget and request (float64 within rounding, pages read exactly), on random
    selections with the tail page, random bounds above the pages' largest q.k and stale
    masks grown from a step with one page fewer."""
    ((qk, weights, out), values), dense = _attention(rng, n)
    stats = metrics_device.step_stats(qk, weights, out, values, SIZES, n)
    heads = BATCH * Q_HEADS
    for s in SIZES:
        pages = stats[s].mass.shape[1]
        counts = sorted({1, min(2, pages), pages})
        masks = _masks(rng, heads, pages, counts)
        first = _masks(rng, heads, max(pages - 1, 1), [1] * len(counts))
        stale = metrics_device.stale_masks(torch.from_numpy(first), pages).numpy()
        bound = stats[s].max_qk.numpy() + rng.random((heads, pages))
        got = metrics_device.head_metrics(stats[s], torch.from_numpy(masks), counts,
                                          torch.from_numpy(bound), torch.from_numpy(stale))
        for b in range(BATCH):
            rows, ref = slice(b * Q_HEADS, (b + 1) * Q_HEADS), reference.page_stats(dense[b], s)
            for i, count in enumerate(counts):
                np.testing.assert_array_equal(stale[i], reference.stale_mask(first[i], pages))
                want = reference.head_metrics(ref, masks[i, rows], bound[rows], stale[i, rows])
                for j, name in enumerate(METRICS):
                    _close(got[i, j, rows], want[name], f"{name} at S = {s}, K = {count}")
                np.testing.assert_array_equal(got[i, PAGES_READ, rows], count)


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
    monkeypatch.setattr(evaluate_device, "evaluate_captured",
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
        metrics = evaluate_device.evaluate_captured(got, backend, grid, bases)
        answers = model_run.task_answers(tiny, batch, got, bases[8], [8, 16], 8, "per-head", 1)
        return metrics, answers

    host = run()
    make = lambda b, keys, s, dtype, cap: PageIndex(b, keys, s, dtype, cap)  # noqa: E731
    monkeypatch.setattr(model_run, "page_index", make)
    monkeypatch.setattr(evaluate_device, "page_index", make)
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
    new = evaluate_device.evaluate_captured(got, gpu, grid)
    _same(new, evaluate_batch(got.captures, gpu, grid))
    bases = model_run.base_indexes(got, gpu, 16, "fp16", 1)
    answers = model_run.task_answers(loaded, batch, got, bases, [16, 512], 16, "per-head", 1)
    assert [a[0] for a in answers[512]] == got.tokens  # 512 tokens: every page of 304
    assert [len(a[0]) for a in answers[16]] == [4] * 3
