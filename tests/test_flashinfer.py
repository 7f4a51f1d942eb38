"""FlashInfer as a peer, without FlashInfer (CI has none): the requests built from our pools and
selections, the skipped rows and the doctor line when it is absent, speedups against it."""

from __future__ import annotations

import sys
import types

import numpy as np
import pandas as pd
import pytest

from questprof.backends.numpy import NumpyBackend
from questprof.commands import bench, sweep
from questprof.core import reference
from questprof.core.config import Config, ModelShape
from questprof.core.layout import from_storage
from questprof.workload import flashinfer as fi

from conftest import make_case, rel_err

SMALL = ModelShape("small", layers=2, q_heads=4, kv_heads=2, head_dim=64, dtype="fp16")
INDPTR, POOL, LAST = np.array([0, 3, 7]), np.array([5, 2, 9, 0, 7, 3, 8]), np.array([5, 3])


@pytest.fixture
def absent(monkeypatch):
    """FlashInfer not importable, as on a machine without the extra."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)


def test_head_requests_of_a_hand_built_selection():
    """4 q heads over 2 KV heads (per-head), requests of 3 and 4 pages (page size 8, tails of
    5 and 3 tokens): one request per (head, request), row hs * B + b, pages of the
    [N * Hkv, 1, S, d] view, the tail's length only where the tail page was chosen."""
    sel = np.array([[[0, 2, -1], [0, 1, 3]], [[1, 2, -1], [1, 2, 3]],
                    [[0, 1, -1], [0, 2, 3]], [[0, 2, -1], [0, 1, 2]]], dtype=np.int32)
    indptr, indices, last = fi.head_requests(sel, np.array([2, 3]), INDPTR, POOL, LAST,
                                             kv_heads=2, page_size=8)
    assert indptr.tolist() == [0, 2, 5, 7, 10, 12, 15, 17, 20]
    assert indices.tolist() == [10, 18, 0, 14, 16, 4, 18, 14, 6, 16,
                                11, 5, 1, 7, 17, 11, 19, 1, 15, 7]
    assert last.tolist() == [5, 3, 5, 3, 8, 3, 5, 8]
    assert indptr.dtype == indices.dtype == last.dtype == np.int32


def test_head_requests_of_shared_selections_with_counts_per_head():
    """Shared modes: one selection per KV head (its own KV head), counts [Hs, B]."""
    sel = np.array([[[2, -1], [1, 3]], [[0, 1], [3, -1]]], dtype=np.int32)
    indptr, indices, last = fi.head_requests(sel, np.array([[1, 2], [2, 1]]), INDPTR, POOL,
                                             LAST, kv_heads=2, page_size=8)
    assert indptr.tolist() == [0, 1, 3, 5, 6]
    assert indices.tolist() == [18, 14, 16, 11, 5, 17]
    assert last.tolist() == [5, 3, 8, 3]


@pytest.mark.parametrize("count, sel, word", [
    (np.array([0, 1]), [[[0], [1]]], "chosen pages"),   # a request without a page
    (np.array([1, 1]), [[[3], [1]]], "outside"),         # position 3 of a 3-page request
    (np.array([1, 1]), [[[-1], [1]]], "outside"),        # padding inside the count
])
def test_head_requests_refuse_what_a_decode_request_cannot_hold(count, sel, word):
    with pytest.raises(ValueError, match=word):
        fi.head_requests(np.array(sel), count, INDPTR, POOL, LAST, kv_heads=1, page_size=8)


def _paged_decode(q_rows, k_view, v_view, indptr, indices, last):
    """FlashInfer's decode as specified, in float64: request r attends to its pages' tokens
    (the last page's first last[r] only) with its G q heads; one KV head per page."""
    page_size, out = k_view.shape[2], np.zeros(q_rows.shape)
    for r in range(len(last)):
        pages = indices[indptr[r]:indptr[r + 1]]
        keep = np.ones((len(pages), page_size), dtype=bool)
        keep[-1, last[r]:] = False
        keys, vals = k_view[pages, 0][keep], v_view[pages, 0][keep]
        s = q_rows[r] @ keys.T / np.sqrt(q_rows.shape[-1])
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        out[r] = (w / w.sum(axis=-1, keepdims=True)) @ vals
    return out


@pytest.mark.parametrize("mode", ["per-head", "shared-max"])
@pytest.mark.parametrize("lengths", [[37, 48, 1], [17, 15, 16]])
def test_requests_from_our_selection_attend_like_the_reference(rng, mode, lengths):
    """A float64 decode over head_requests' pages of the per-head view equals reference
    attention over the same selection: tails of 1, S-1, S, S+1 tokens, a one-token request."""
    kv = make_case(rng, lengths, 16, 2, 64, "fp16", spare_pages=3)
    f = lambda x: from_storage(x, "fp16")  # noqa: E731
    q = rng.standard_normal((len(lengths), 4, 64))
    scores = reference.estimate(q, f(kv.summary), kv.kv_indptr, kv.kv_indices, mode)
    sel, count = reference.topk(scores, kv.kv_indptr, 2)
    want, _ = reference.attention(q, f(kv.k), f(kv.v), kv.kv_indptr, kv.kv_indices,
                                  kv.last_page_len, sel, count)
    heads = sel.shape[0]
    requests = fi.head_requests(sel, count, kv.kv_indptr, kv.kv_indices, kv.last_page_len,
                                2, 16)
    view = lambda x: f(x).reshape(-1, 1, 16, 64)  # noqa: E731
    rows = q.reshape(len(lengths), heads, -1, 64).transpose(1, 0, 2, 3).reshape(
        heads * len(lengths), -1, 64)
    got = _paged_decode(rows, view(kv.k), view(kv.v), *requests)
    got = got.reshape(heads, len(lengths), -1, 64).transpose(1, 0, 2, 3).reshape(q.shape)
    assert rel_err(got, want) < 1e-12


def test_row_tables_map_score_rows_to_pages_of_the_head_view():
    indptr, pool = np.array([0, 3, 6]), np.array([5, 2, 9, 0, 7, 3])
    table = fi.row_tables(indptr, pool, kv_heads=2, heads=4)
    assert table.tolist() == [[10, 4, 18], [0, 14, 6], [10, 4, 18], [0, 14, 6],
                              [11, 5, 19], [1, 15, 7], [11, 5, 19], [1, 15, 7]]
    shared = fi.row_tables(indptr, pool, kv_heads=2, heads=2)  # one row per KV head
    assert shared.tolist() == table[[0, 1, 4, 5]].tolist()
    with pytest.raises(ValueError, match="differ"):
        fi.row_tables(INDPTR, POOL, kv_heads=2, heads=2)


def test_head_queries_and_request_order_invert_each_other(rng):
    torch = pytest.importorskip("torch")
    q = torch.from_numpy(rng.standard_normal((3, 8, 16)))
    rows = fi.head_queries(q, 2)  # shared modes: 2 KV heads of 4 q heads each
    assert rows.shape == (6, 4, 16) and torch.equal(rows[1 * 3 + 2], q[2, 4:8])
    assert torch.equal(fi.request_order(rows, 3), q)
    assert torch.equal(fi.request_order(fi.head_queries(q, 8), 3), q)


def test_refusal_is_flashinfers_own_last_line():
    exc = RuntimeError("Traceback:\n  File x.cu, line 3\n"
                       "Error in decode: Unsupported group_size: 7\n")
    assert fi.refusal(exc) == "RuntimeError: Error in decode: Unsupported group_size: 7"
    assert fi.refusal(ValueError("x" * 999)).startswith("ValueError: x")
    assert len(fi.refusal(ValueError("x" * 999))) == fi.REASON_CHARS


def test_absent_flashinfer_is_one_line_naming_the_extra(absent):
    why = fi.missing_reason()
    assert "not installed" in why and fi.INSTALL in why and "\n" not in why
    with pytest.raises(fi.Unavailable, match="not installed"):
        fi.FlashInferPeer(None)


def test_bench_rows_without_flashinfer_are_skipped_with_the_reason(absent):
    cfg = Config(SMALL, 256, 1, 16, 64)
    rows = bench._flashinfer_rows(cfg, None, None, None, 3, NumpyBackend())
    assert [r["stage"] for r in rows] == list(fi.STAGES)
    assert {(r["impl"], r["status"]) for r in rows} == {("flashinfer", "skipped")}
    assert all(r["reason"] == fi.missing_reason() for r in rows)


def test_bench_prints_each_skip_reason_once(absent, monkeypatch):
    from questprof import console

    said = []
    monkeypatch.setattr(console, "warn", said.append)
    cfg = Config(SMALL, 256, 1, 16, 64)
    rows = [{**_case("dense", 100.0), "read_bytes": 1e6, "unmodelled_bytes": 0, "status": "ok"}]
    bench._print(rows + bench._flashinfer_rows(cfg, None, None, None, 3, NumpyBackend()), [])
    assert said == [f"flashinfer {', '.join(fi.STAGES)} skipped: {fi.missing_reason()}"]


def test_sweep_rows_without_flashinfer_are_skipped_with_the_reason(tmp_path, absent):
    from questprof.core.scenarios import expand, load_scenario

    smoke = load_scenario("smoke")
    points = expand(smoke, lengths="256", budgets="64")
    opts = sweep.Options(repeats=1, warmup=0, flashinfer=True)
    rows = sweep.run_sweep(smoke, points, NumpyBackend(), tmp_path, opts)
    peer = [r for r in rows if r["impl"] == "flashinfer"]
    assert len(peer) == len(points) * len(fi.STAGES)
    assert {r["status"] for r in peer} == {"skipped"} and "not installed" in peer[0]["reason"]
    assert {r["status"] for r in rows if r["impl"] == "ours"} == {"ok"}
    from questprof import results
    from questprof.report import write_report

    html = write_report(*results.load(tmp_path), tmp_path / "report.html").read_text()
    assert "flashinfer-python is not installed" in html


def test_row_keys_put_each_peer_after_ours():
    keys = sweep.row_keys(None, peers=True, flashinfer=True)
    at = keys.index(("dense", "ours"))
    assert keys[at + 1:at + 3] == [("dense", "torch-sdpa"), ("dense", "flashinfer")]
    assert keys[keys.index(("quest", "ours")) + 1] == ("quest", "flashinfer")
    assert ("summary", "flashinfer") not in keys and ("estimate", "flashinfer") not in keys
    assert sweep.row_keys(None, peers=True) == [k for k in keys if k[1] != "flashinfer"]


def test_doctor_lists_flashinfer_or_why_not(monkeypatch):
    from questprof.core import machine

    def not_installed(*names):
        raise machine.Missing(f"{names[0]} not installed")

    monkeypatch.setattr(machine, "_dist_version", not_installed)
    rows = {item: (status, detail) for item, status, detail in machine.doctor_rows()}
    assert rows["FlashInfer"][0] == "missing" and fi.INSTALL in rows["FlashInfer"][1]
    monkeypatch.setattr(machine, "_dist_version", lambda *names: "0.6.0")
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.6.0"))
    status, detail = machine._probe(machine._doctor_flashinfer)
    assert detail is None and status.startswith("flashinfer 0.6.0")


def _case(stage, us, impl="ours"):
    return {"model": "mha", "batch": 1, "length": 32768, "page_size": 16, "budget": 2048,
            "mode": "per-head", "stage": stage, "impl": impl, "median_ms": us * 1e-3}


def test_speedups_and_goals_against_flashinfer():
    rows = [_case("dense", 129.0), _case("dense", 126.0, "torch-sdpa"),
            _case("dense", 125.0, "flashinfer"), _case("quest", 32.0),
            _case("quest", 40.0, "flashinfer")]
    bench.add_speedups(rows)
    ours = rows[3]
    assert ours["speedup"] == pytest.approx(125 / 32) and ours["dense_impl"] == "flashinfer"
    assert ours["vs_flashinfer"] == pytest.approx(40 / 32)
    assert "vs_flashinfer" not in rows[4] and rows[4]["speedup"] == pytest.approx(125 / 40)
    case = {"model": "mha", "length": 32768, "batch": 1}
    got = bench.goals(rows, [{"metric": "vs_flashinfer", "case": case, "target": ">= 1.25"},
                             {"metric": "dense_best", "case": case, "target": "<= 1.00"}])
    assert got[0][1:] == (pytest.approx(1.25), ">= 1.25", True)
    assert got[1][1] == pytest.approx(129 / 125) and got[1][3] is False


def test_paired_takes_flashinfers_dense_and_never_its_quest():
    from questprof.report.frames import paired

    rows = [{**_case(s, us, impl), "status": "ok", "rho_formula": 0.1}
            for s, us, impl in [("estimate", 11, "ours"), ("topk", 7, "ours"),
                                ("attention", 14, "ours"), ("quest", 32, "ours"),
                                ("dense", 129, "ours"), ("dense", 125, "flashinfer"),
                                ("quest", 20, "flashinfer"), ("topk", 5, "flashinfer")]]
    out = paired(pd.DataFrame(rows)).iloc[0]
    assert out["dense_impl"] == "flashinfer" and out["dense_ms"] == pytest.approx(0.125)
    assert out["quest_ms"] == pytest.approx(0.032) and out["topk_ms"] == pytest.approx(0.007)
    assert out["speedup"] == pytest.approx(125 / 32)


def test_the_flashinfer_bench_file_holds_issue_21s_cases():
    from pathlib import Path

    path = Path(__file__).parent / "fixtures" / "bench_flashinfer.toml"
    cases, goals = bench.load_bench(path)
    assert [(c.length, c.batch, c.budget, c.page_size) for c in cases] == [
        (32768, 1, 2048, 16), (131072, 1, 4096, 16), (32768, 8, 2048, 16)]
    assert {g["metric"] for g in goals} == {"speedup", "vs_flashinfer", "dense_best"}


@pytest.mark.parametrize("peers, on_gpu, want", [(True, True, True), (None, True, False),
                                                 (False, True, False), (True, False, True)])
def test_sweep_times_flashinfer_when_peers_are_asked_for_on_a_gpu(absent, monkeypatch, peers,
                                                                  on_gpu, want):
    """`sweep --peers` adds FlashInfer's rows (said once when it is missing); the default keeps
    torch SDPA alone; on the CPU the peers' rows are skipped rows, said once."""
    from questprof import console
    from questprof.commands import sweep_job

    said = []
    monkeypatch.setattr(console, "warn", said.append)
    monkeypatch.setattr(sweep_job, "_torch_missing", lambda: None)  # torch sees the GPU
    backend = types.SimpleNamespace(is_gpu=on_gpu, name="cupy" if on_gpu else "numpy")
    opts = sweep_job._options(sweep_job.SweepArgs(peers=peers), backend, None)
    assert opts.flashinfer is want
    if not on_gpu:
        assert said == [f"the peers' rows are skipped: {opts.peers_skipped}"]
        return
    assert opts.peers_skipped is None
    assert said == ([f"FlashInfer's rows are skipped: {fi.missing_reason()}"] if want else [])
