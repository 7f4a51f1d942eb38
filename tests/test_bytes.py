"""bytes --check-formula logic without a GPU: judging rows, exit statuses, the no-GPU path."""

import json

import numpy as np
import pytest

from questprof.commands import bytes as bytes_cmd
from questprof.commands import bytes_verdict
from questprof.commands.bytes_verdict import EXIT_FAIL, EXIT_NO_SOURCE, EXIT_OK, judge, verdict
from questprof.core import model
from questprof.core.config import Config, config_from_dict
from questprof.core.scenarios import load_scenario
from questprof.workload.pools import Workload

MIB = 1 << 20


def raw(stage="attention", read=64 * MIB, measured=64 * MIB, write=0, measured_write=0,
        source="cupti", unmodelled=0, impl="ours"):
    return {"model": "cfg", "stage": stage, "impl": impl, "bytes_source": source,
            "read_bytes": read, "unmodelled_bytes": unmodelled, "write_bytes": write,
            "measured_read_bytes": measured, "measured_write_bytes": measured_write}


def row(*args, **kwargs):
    return judge(raw(*args, **kwargs))


def test_within_tolerance_passes():
    rows = [row(measured=64 * MIB * 1.049), row("dense", measured=64 * MIB * 0.951)]
    assert all(r["bytes_within"] for r in rows)
    status, lines = verdict(rows)
    assert status == EXIT_OK and "all 2 judged" in lines[0]


def test_outside_tolerance_fails_and_names_stage_and_amount():
    rows = [row(), row("estimate", measured=64 * MIB * 1.12)]
    status, lines = verdict(rows)
    assert status == EXIT_FAIL
    assert any("estimate [cupti]" in line and "+12.0%" in line for line in lines)


def test_unmodelled_bytes_count_in_the_expected_read():
    assert row(read=60 * MIB, unmodelled=4 * MIB, measured=64 * MIB)["bytes_ratio"] == pytest.approx(1)


def test_tolerance_is_a_parameter():
    assert judge(raw("dense", measured=64 * MIB * 1.08), 0.10)["bytes_within"]
    assert not judge(raw("dense", measured=64 * MIB * 1.08), 0.05)["bytes_within"]


def test_writes_are_reported_not_judged():
    """DRAM writes of a window carry write-backs of lines dirtied before it (H200: 1.4 MB per
    2 GiB read call) and miss outputs that stay in L2: shown with their ratio, never judged."""
    high = row(write=8 * MIB, measured_write=10 * MIB)
    assert high["bytes_within"] and high["write_ratio"] == pytest.approx(1.25)
    assert row(write=8 * MIB, measured_write=0.1 * MIB)["bytes_within"]
    assert not row(write=8 * MIB, measured_write=8 * MIB, measured=80 * MIB)["bytes_within"]


def test_small_stage_is_reported_not_judged():
    r = row("summary", read=6144, measured=90_000)
    assert r["bytes_within"] is None and "not judged" in r["note"]
    assert verdict([r, row()])[0] == EXIT_OK


def test_naive_rows_are_never_judged():
    r = row("attention", measured=200 * MIB, impl="torch-gather")
    assert r["bytes_within"] is None
    assert verdict([r])[0] == EXIT_OK


def test_nvml_rows_judge_total_bytes():
    r = row(read=60 * MIB, write=4 * MIB, measured=64 * MIB, measured_write=None, source="nvml")
    assert r["bytes_within"] and r["write_ratio"] is None


def test_no_source_gives_distinct_status_and_one_line():
    status, lines = verdict([], sources={"cupti": "no GPU", "ncu": "no GPU", "nvml": "no GPU"})
    assert status == EXIT_NO_SOURCE and status not in (EXIT_OK, EXIT_FAIL)
    assert len(lines) == 1 and "\n" not in lines[0] and lines[0].count("no GPU") == 1


def test_run_check_without_gpu_returns_no_source(monkeypatch):
    monkeypatch.setattr(bytes_cmd, "gpu_unavailable_reason", lambda: "no CUDA device")
    cfg = smoke_config()
    for source in ("cupti", "ncu", "nvml", "all"):
        result = bytes_cmd.run_check([cfg], source)
        assert result.status == EXIT_NO_SOURCE and len(result.lines) == 1
        assert "no CUDA device" in result.lines[0]
        assert json.loads(result.to_json())["status"] == EXIT_NO_SOURCE


def test_unknown_source_is_refused():
    with pytest.raises(ValueError, match="unknown byte source"):
        bytes_cmd.source_status("perf")


def smoke_config(**over) -> Config:
    shape = load_scenario("smoke").model
    args = dict(length=1000, batch=2, page_size=16, budget=128, mode="per-head", seed=3)
    return Config(shape, **{**args, **over})


def test_config_round_trips_through_as_dict():
    cfg = smoke_config(mode="shared-max")
    assert config_from_dict(json.loads(json.dumps(cfg.as_dict()))) == cfg


@pytest.mark.parametrize("mode", ["per-head", "shared-max"])
def test_workload_and_naive_peer_on_numpy(mode):
    """The naive torch gather + SDPA must compute Quest's sparse attention."""
    pytest.importorskip("torch")
    from questprof.backends.numpy import NumpyBackend
    from questprof.core.layout import from_storage

    cfg = smoke_config(mode=mode)
    work = Workload(cfg, NumpyBackend(), 2)
    quest, _ = work.launcher("attention")(1)
    naive = work.launcher("torch-gather")(1).squeeze(2).float().numpy()
    ref = from_storage(quest, cfg.model.dtype)
    assert np.linalg.norm(naive - ref) / np.linalg.norm(ref) < 2e-3
    from questprof.workload.peers import gathered_bytes

    union = work.union
    k = cfg.k_pages
    assert (union is None) == (mode != "per-head")
    if union is not None:
        assert k <= union <= min(cfg.model.group * k, cfg.pages)
    sel = work.selections[0][0]
    assert gathered_bytes(cfg, sel) == 2 * model.score_heads(cfg) * cfg.batch * k * 16 * 64 * 2


def test_every_stage_launcher_computes_its_stage():
    """Each launcher returns what its stage computes on that layer (checked against the
    reference composition), and an unknown stage is refused by name."""
    from questprof.backends.numpy import NumpyBackend
    from questprof.core import reference

    work = Workload(smoke_config(length=100, batch=1, budget=32), NumpyBackend(), 2)
    b, kv, q = work.backend, work.kvs[1], work.q
    scores = work.launcher("estimate")(1)
    np.testing.assert_array_equal(scores, b.estimate(q, kv, "per-head"))
    sel, count = work.launcher("topk")(1)
    np.testing.assert_array_equal(sel, b.topk(scores, kv, work.cfg.k_pages)[0])
    out, _ = work.launcher("quest")(1)
    np.testing.assert_allclose(out, work.launcher("attention")(1)[0])
    dense, _ = work.launcher("dense")(1)
    assert not np.allclose(dense, out)  # 2 of 7 pages: the sparse output differs from dense
    assert reference.MODES and work.calls("dense") == 2
    with pytest.raises(ValueError, match="unknown stage"):
        work.launcher("nope")


def test_cupti_and_ncu_agreement_names_the_stage_beyond_one_percent():
    rows = [row("dense", 64 * MIB, 64 * MIB * 1.004, source="cupti"),
            row("dense", 64 * MIB, 64 * MIB, source="ncu"),
            row("estimate", 4 * MIB, 4 * MIB * 1.03, source="cupti"),
            row("estimate", 4 * MIB, 4 * MIB, source="ncu"),
            row("topk", 1000, 5000, source="cupti"), row("topk", 1000, 1000, source="ncu")]
    ok, lines = bytes_verdict.agreement(rows)
    assert not ok
    assert "2 stage rows" in lines[0] and "+3.00% (estimate" in lines[0]  # topk: not judged
    assert len(lines) == 2 and "estimate" in lines[1] and "dense" not in lines[1]
    assert bytes_verdict.agreement(rows[:2]) == (True, [lines[0].replace(
        "2 stage rows, largest difference +3.00% (estimate", "1 stage rows, largest difference "
        "+0.40% (dense")])
    assert bytes_verdict.agreement(rows[:1]) == (True, [])  # nothing to compare


def test_cupti_window_leaves_out_its_first_sample():
    """The first PM sample spans the time since the previous window (H200: 4x the region)."""
    from types import SimpleNamespace

    from questprof.measure import cupti

    samples = [SimpleNamespace(metric_values=v) for v in ([4e9, 1e6], [1e9, 10.0], [2e9, 20.0])]
    assert cupti.sum_samples(samples) == (3e9, 30.0)
    assert cupti.sum_samples(samples[:1]) == (0.0, 0.0)


def test_rotation_follows_the_smallest_judged_input():
    """H200: two 128K layers' chosen pages (budget 1024, 34 MB) sat in L2 and read -92%."""
    shape = load_scenario("longchat-7b").model
    free = 140e9
    sparse = Config(shape, length=131072, batch=1, page_size=16, budget=1024)
    works = model.stage_work(sparse)
    layers = bytes_cmd.rotation_layers(sparse, free)
    assert works["attention"].read < works["estimate"].read
    assert layers * works["attention"].read >= bytes_cmd.rotate_bytes()
    assert (layers - 1) * works["attention"].read < bytes_cmd.rotate_bytes()
    assert layers * model.kv_pool_bytes(sparse) <= 0.5 * free  # and the pools fit
    assert bytes_cmd.rotation_layers(sparse, 4 * model.kv_pool_bytes(sparse)) == 2


def test_topk_rotates_over_score_copies():
    from questprof.backends.numpy import NumpyBackend

    work = Workload(smoke_config(), NumpyBackend(), 2)
    work.rotate_topk(5)
    assert work.calls("topk") == 5 and work.calls("estimate") == work.calls("dense") == 2
    assert work.topk_scores[0] is work.scores[0] and work.topk_scores[3] is not work.scores[1]
    np.testing.assert_array_equal(work.topk_scores[3], work.scores[1])
    for call in range(work.calls("topk")):
        work.launcher("topk")(call)


def test_agreement_with_ncu_at_zero_bytes_is_a_disagreement():
    rows = [row("dense", 64 * MIB, 64 * MIB, source="cupti"), row("dense", 64 * MIB, 0, source="ncu")]
    rows[1]["bytes_within"] = True  # judged elsewhere; a 0 B ncu count must not divide by zero
    ok, lines = bytes_verdict.agreement(rows)
    assert not ok and "inf" in lines[0]


def test_short_rotations_are_named():
    from types import SimpleNamespace

    rows = [row("estimate", 8 * MIB), row("attention", 100 * MIB), row("summary", 1000, 0)]
    work = SimpleNamespace(calls=lambda stage: 4)  # 4 x 8 MiB < 8 x 60 MiB; 4 x 100 MiB too
    bytes_cmd._note_short_rotations(rows, work)
    assert "rotation pass 32 MiB < 480 MiB" in rows[0]["note"]
    assert "rotation pass 400 MiB" in rows[1]["note"] and "rotation" not in (rows[2]["note"] or "")
    work = SimpleNamespace(calls=lambda stage: 5)
    rows = [row("attention", 100 * MIB)]
    bytes_cmd._note_short_rotations(rows, work)
    assert not rows[0].get("note")


def test_a_failing_source_is_one_line_and_the_others_still_run(monkeypatch):
    """bytes --source all stopped with a traceback when CUPTI failed to configure."""
    monkeypatch.setattr(bytes_cmd, "source_status",
                        lambda source: {"cupti": None, "ncu": None, "nvml": "no GPM here"})
    monkeypatch.setattr(bytes_cmd, "get_backend", lambda name: object())
    monkeypatch.setattr(bytes_cmd, "Flush", lambda: None)
    monkeypatch.setattr("questprof.measure.cupti.release", lambda: None)

    def measure(src, configs, backend, flush, naive, protocol, log, link_run=None):
        if src == "cupti":
            raise RuntimeError("CUPTI configure: ERROR_INVALID_PARAMETER")
        return [raw("dense", source=src)], []

    monkeypatch.setattr(bytes_cmd, "_measure_source", measure)
    result = bytes_cmd.run_check([smoke_config()], "all")
    assert [r["bytes_source"] for r in result.rows] == ["ncu"]
    assert result.status == EXIT_OK
    failed = [line for line in result.lines if line.startswith("cupti unavailable")]
    assert len(failed) == 1 and "ERROR_INVALID_PARAMETER" in failed[0]
