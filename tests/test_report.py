"""The HTML report on synthetic rows: figures present, the planted crossover found, edge runs."""

import re
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.offline
import pytest

from questprof.core import model
from questprof.core.config import Config, ModelShape
from questprof.report import CPU_BANNER, frames, write_report

SHAPE = ModelShape("gqa-8b", layers=32, q_heads=32, kv_heads=8, head_dim=128, dtype="fp16")
LENGTHS = [2048 * 2**i for i in range(7)]  # 2k .. 128k
PLANTED = {"batch": 1, "page_size": 16, "budget": 2048, "length": 16384}
BANDWIDTH = 4.0e12  # bytes/s of the pretend GPU
LAUNCH_MS = {"estimate": 0.006, "topk": 0.012, "attention": 0.006, "dense": 0.004, "summary": 0.003}
STAGES = ("summary", "estimate", "topk", "attention", "dense")


def _row(cfg: Config, stage: str, work, ms: float, measured: bool) -> dict:
    p = model.pages(cfg.length, cfg.page_size)
    return {"scenario": "synthetic", "model": SHAPE.name, "layers": SHAPE.layers,
            "q_heads": SHAPE.q_heads, "kv_heads": SHAPE.kv_heads, "head_dim": SHAPE.head_dim,
            "dtype": SHAPE.dtype, "length": cfg.length, "batch": cfg.batch,
            "page_size": cfg.page_size, "budget": cfg.budget, "k_pages": cfg.k_pages, "pages": p,
            "mode": cfg.mode, "stage": stage, "backend": "cupy", "method": "events",
            "median_ms": ms, "p20_ms": ms * 0.98, "p80_ms": ms * 1.02, "p95_ms": ms * 1.05,
            "read_bytes": work.read, "unmodelled_bytes": work.unmodelled_read,
            "write_bytes": work.write, "flops": work.flops,
            "bandwidth_gbs": work.total_bytes / ms / 1e6,
            "measured_read_bytes": work.total_read * 1.04 if measured else None,
            "measured_write_bytes": work.write * 1.1 if measured else None,
            "bytes_source": "cupti" if measured else None,
            "rho_formula": model.rho(cfg.page_size, cfg.k_pages, p), "rho_model": model.quest_rho(cfg),
            "sm_clock_mhz": 1980, "mem_clock_mhz": 3201, "throttled": False, "status": "ok",
            "reason": None}


def _times(cfg: Config, rng) -> dict:
    """Stage ms: bytes at BANDWIDTH plus launch latency, with 2% noise; the planted curve is
    forced to lose (0.7x) below PLANTED['length'] and win (1.6x) from it on."""
    work = model.stage_work(cfg)
    ms = {s: (work[s].total_bytes / BANDWIDTH * 1e3 + LAUNCH_MS[s]) * rng.uniform(0.98, 1.02)
          for s in STAGES}
    curve = {k: getattr(cfg, k) for k in ("batch", "page_size", "budget")}
    if curve == {k: PLANTED[k] for k in curve}:
        target = ms["dense"] / (1.6 if cfg.length >= PLANTED["length"] else 0.7)
        scale = target / sum(ms[s] for s in model.QUEST_STAGES)
        ms.update({s: ms[s] * scale for s in model.QUEST_STAGES})
    ms["quest"] = sum(ms[s] for s in model.QUEST_STAGES)
    return ms


def synthetic(lengths=LENGTHS, batches=(1, 4), page_sizes=(16, 32), budgets=(512, 2048),
              modes=("per-head",), measured=True, seed=0) -> pd.DataFrame:
    """Seeded result rows shaped like a sweep's, with a crossover planted at PLANTED."""
    rng = np.random.default_rng(seed)
    rows = []
    for batch in batches:
        for size in page_sizes:
            for budget in budgets:
                for mode in modes:
                    for length in lengths:
                        cfg = Config(SHAPE, length, batch, size, budget, mode)
                        work, ms = model.stage_work(cfg), _times(cfg, rng)
                        quest = model.quest_work(cfg)
                        rows += [_row(cfg, s, work[s], ms[s], measured) for s in STAGES]
                        rows.append(_row(cfg, "quest", quest, ms["quest"], measured))
    return pd.DataFrame(rows)


META = {"scenario": "synthetic", "command": "questprof sweep synthetic --lengths 2k..128k",
        "started": "2025-01-01T00:00:00+00:00", "finished": "2025-01-01T00:10:00+00:00",
        "git_commit": "abc1234", "backend": "cupy", "fallback_reason": None,
        "machine": {"gpu": "NVIDIA H200", "driver": "570.86", "cuda": "12.8", "cupy": "13.4.0",
                    "torch": "2.6.0", "numpy": "2.2", "python": "3.11", "sm_count": 132,
                    "l2_bytes": 62914560},
        "ceilings": {"read_gbs": 4100.0, "copy_gbs": 3900.0, "fp16_tflops": 720.0,
                     "datasheet_gbs": 4800.0, "datasheet_tflops": 989.0},
        "grid": {"lengths": "2k..128k"}}


def plot_ids(text: str) -> list[str]:
    return re.findall(r'<div id="fig-([^"]+)" class="plotly-graph-div"', text)


def table_rows(text: str, table_id: str) -> list[list[str]]:
    """Cells of each body row of the table with this id."""
    body = re.search(rf'<table id="{table_id}">.*?<tbody>(.*?)</tbody>', text, re.S)
    assert body, f"no table {table_id}"
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body.group(1))]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = write_report(synthetic(), META, tmp_path_factory.mktemp("r") / "report.html")
    return path.read_text(encoding="utf-8")


def test_one_plot_div_per_figure(report):
    panels = [0, 1]  # batch 1 and batch 4
    expected = ([f"crossover-{i}" for i in panels] + [f"speedup-{i}" for i in panels]
                + ["roofline", "bytes", "rho"] + [f"heatmap-{i}" for i in panels] + ["amdahl"])
    assert sorted(plot_ids(report)) == sorted(expected)


def test_self_contained_plotly_once(report):
    assert report.count("* plotly.js v") == 1
    ours = report.replace(plotly.offline.get_plotlyjs(), "")  # the bundle names its CDN itself
    for external in ("<script src", "cdn.plot.ly", "<link", "http://", "https://"):
        assert external not in ours


def test_crossover_table_names_planted_length(report):
    rows = table_rows(report, "crossover-table")
    planted = [r for r in rows if r[:4] == ["1", "per-head", "16", "2k"]]
    assert len(planted) == 1
    assert planted[0][4] == "16k"
    assert planted[0][5].startswith("≈ ")


def test_glance_names_planted_crossover_and_speedup(report):
    rows = table_rows(report, "glance-table")
    planted = [r for r in rows if r[:3] == ["1", "16", "2k"]]
    assert planted and planted[0][3] == "16k" and planted[0][4] == "128k"
    assert planted[0][5] == "1.60x"


def test_machine_and_ceilings_listed(report):
    for text in ("NVIDIA H200", "570.86", "abc1234", "questprof sweep synthetic", "4100.0"):
        assert text in report
    assert CPU_BANNER not in report


def test_no_measured_bytes_says_how(tmp_path):
    text = write_report(synthetic(measured=False), META, tmp_path / "r.html").read_text()
    assert "did not measure DRAM bytes" in text and "questprof bytes --check-formula" in text
    assert "bytes" not in plot_ids(text) and "rho" not in plot_ids(text)
    assert "roofline" in plot_ids(text)


def test_only_skipped_rows(tmp_path):
    df = synthetic(lengths=[4096, 8192])
    df["status"], df["reason"] = "skipped", "KV pool of 90 GiB does not fit in 80 GiB"
    text = write_report(df, META, tmp_path / "r.html").read_text()
    assert plot_ids(text) == []
    assert "does not fit in 80 GiB" in text
    assert table_rows(text, "skipped-table")[0][1] == str(len(df))


def test_single_length(tmp_path):
    text = write_report(synthetic(lengths=[65536]), META, tmp_path / "r.html").read_text()
    kinds = {r[4] for r in table_rows(text, "crossover-table")}
    assert kinds <= {"no crossover in range", "Quest wins from the shortest length (64k)"}
    assert "heatmap-0" in plot_ids(text)


def test_cpu_banner_and_directory_path(tmp_path):
    df = synthetic(lengths=[2048, 4096], batches=(1,), measured=False)
    df["backend"] = "numpy"
    meta = {**META, "backend": "numpy", "machine": {"gpu": None},
            "ceilings": {"read_gbs": None, "reason": "the numpy backend runs on the CPU"}}
    path = write_report(df, meta, tmp_path)
    assert path == tmp_path / "report.html"
    text = path.read_text()
    assert CPU_BANNER in text and "<h1>questprof: synthetic on the CPU</h1>" in text
    assert "no measured ceilings (the numpy backend runs on the CPU)" in text


def test_modes_make_panels(tmp_path):
    df = synthetic(lengths=[4096, 16384], batches=(1,), modes=("per-head", "shared-max"))
    ids = plot_ids(write_report(df, META, tmp_path / "r.html").read_text())
    assert {"crossover-0", "crossover-1", "heatmap-1"} <= set(ids)


def test_e2e_rows_measured_not_modelled(tmp_path):
    df = synthetic(lengths=[16384, 65536], batches=(1,), budgets=(2048,), page_sizes=(16,))
    e2e = pd.DataFrame([{"stage": "e2e", "status": "ok", "batch": 1, "mode": "per-head",
                         "page_size": 16, "budget": 2048, "length": n, "attention_fraction": f,
                         "step_ms_dense": 30.0, "step_ms_quest": 30.0 / s,
                         "predicted_4bit": s * 1.3}
                        for n, f, s in ((16384, 0.3, 1.2), (65536, 0.6, 1.9))])
    text = write_report(pd.concat([df, e2e], ignore_index=True), META, tmp_path / "r.html").read_text()
    assert "amdahl" in plot_ids(text) and "Modelled, not measured" not in text
    assert "Amdahl, 4-bit weights" in text
    text = write_report(df, META, tmp_path / "m.html").read_text()
    assert "Modelled, not measured" in text


@pytest.mark.parametrize("speedups, kind, length", [
    ([0.5, 0.8, 1.2, 2.0], "from", 8192),
    ([1.1, 1.5, 2.0, 3.0], "always", 2048),
    ([0.5, 0.8, 0.9, 0.95], "never", None),
    ([0.5, 1.2, 0.9, 1.5], "from", 16384),  # a dip: Quest must stay ahead to count
])
def test_crossover_kinds(speedups, kind, length):
    curve = pd.DataFrame({"length": [2048, 4096, 8192, 16384], "speedup": speedups})
    found = frames.crossover(curve.sample(frac=1, random_state=1))
    assert (found["kind"], found["length"]) == (kind, length)
    if kind == "from":
        assert found["length"] / 2 < found["estimate"] < found["length"]


def test_element_ids_unique(report):
    """Plotly draws into getElementById(figure id): an id shared with a section steals the plot."""
    ids = re.findall(r'\bid="([^"]+)"', report.replace(plotly.offline.get_plotlyjs(), ""))
    assert len(ids) == len(set(ids))


def test_context_parallel_section(tmp_path):
    df = synthetic(lengths=[8192, 16384], batches=(1,), page_sizes=(16,), budgets=(512,))
    text = write_report(df, META, tmp_path / "r.html").read_text()
    assert "did not measure context-parallel Quest" in text
    phases = ("local_candidates", "gather_candidates", "select", "local_attention")
    cp = pd.DataFrame([{"stage": "context-parallel", "length": 16384, "batch": 1, "page_size": 16,
                        "budget": 512, "mode": "per-head", "phase": p, "gpus": 2,
                        "median_ms": 0.01 * (i + 1), "cheap_variant_miss_rate": 0.25,
                        "gpu_read_bytes_max": 3e6, "single_read_bytes": 5e6,
                        "status": "ok", "backend": "cupy+nccl"} for i, p in enumerate(phases)])
    text = write_report(pd.concat([df, cp], ignore_index=True), META,
                        tmp_path / "cp.html").read_text()
    rows = table_rows(text, "cp-table")
    assert [r[5] for r in rows] == list(phases) and rows[1][6] == "20.0" and rows[0][7] == "25.0%"
    assert rows[0][8] == "0.600" and rows[0][0] == "2"
    assert plot_ids(text) == plot_ids(write_report(df, META, tmp_path / "r2.html").read_text())


def test_crossover_leaves_out_dense_budget_points():
    """At budget >= length Quest is dense and ties with it: 'beats from' and the interpolation
    must not lean on that point (it put '≈ 2.0k' beside 'from 4k' at budget 2k)."""
    curve = pd.DataFrame({"length": [2048, 4096, 8192], "budget": 2048,
                          "speedup": [0.98, 1.3, 1.8]})
    found = frames.crossover(curve)
    assert (found["kind"], found["length"], found["estimate"]) == ("always", 4096, None)
    assert found["text"] == "Quest wins from the shortest length above the budget (4k)"
    curve["speedup"] = [0.98, 0.9, 1.8]
    found = frames.crossover(curve)
    assert (found["kind"], found["length"]) == ("from", 8192)
    assert 4096 < found["estimate"] < 8192
    dense_only = frames.crossover(curve[curve["length"] == 2048])
    assert dense_only["kind"] == "none" and "Quest is dense" in dense_only["text"]


def test_crossover_table_agrees_with_its_interpolation(tmp_path):
    """Batch 1, page 16, budget 2k: at 2k Quest is dense and loses by noise; it wins from 4k.
    The table said 'from 4k' beside '≈ 2.0k'; both columns must now tell one story."""
    df = synthetic(batches=(1,), page_sizes=(16,), budgets=(512, 2048))
    curve = df["budget"] == 2048
    dense_ms = df[curve & (df["stage"] == "dense")].set_index("length")["median_ms"]
    quest = curve & (df["stage"] == "quest")
    df.loc[quest, "median_ms"] = [dense_ms[n] * (1.01 if n == 2048 else 0.6)
                                  for n in df.loc[quest, "length"]]
    df.loc[quest, "p20_ms"] = df.loc[quest, "median_ms"] * 0.98  # spreads move with medians
    df.loc[quest, "p80_ms"] = df.loc[quest, "median_ms"] * 1.02
    rows = table_rows(write_report(df, META, tmp_path / "r.html").read_text(), "crossover-table")
    row = next(r for r in rows if r[2:4] == ["16", "2k"])
    assert row[4:] == ["Quest wins from the shortest length above the budget (4k)", "–"]
    for *_, budget, beats, about in rows:
        if about != "–":  # an interpolation lies above the budget and below the length named
            budget_t = int(budget.removesuffix("k")) * (1024 if budget.endswith("k") else 1)
            about_t = float(about.removeprefix("≈ ").removesuffix("k")) * 1024
            assert budget_t < about_t < int(beats.removesuffix("k")) * 1024, (budget, beats, about)


def memory_skipped(need_free):
    """Skipped rows of one cause whose memory figures differ row to row."""
    df = synthetic(lengths=[4096 * 2**i for i in range(len(need_free))], batches=(8,),
                   page_sizes=(16,), budgets=(512,))
    df["status"], df["reason"] = "skipped", "does not fit in host memory"
    for i, (need, free) in enumerate(need_free):
        df.loc[df["length"] == 4096 * 2**i, ["need_gib", "free_gib"]] = need, free
    return df


def test_skipped_rows_group_by_cause_with_figures_in_columns(tmp_path):
    df = memory_skipped([(24.8, 20.1), (102.1, 20.1), (9.5, 20.1)])
    dense = synthetic(lengths=[2048], batches=(1,), page_sizes=(16,), budgets=(2048,))
    dense.loc[dense["stage"] != "dense", ["status", "reason"]] = ("skipped", "budget >= length")
    table = frames.skipped(pd.concat([df, dense], ignore_index=True))
    assert list(table["reason"]) == ["does not fit in host memory", "budget >= length"]
    memory = table.iloc[0]
    assert memory["rows"] == len(df) and memory["lengths"] == "4k, 8k, 16k"
    assert (memory["need GiB"], memory["free GiB"]) == ("9.5–102.1", "20.1")
    assert table.iloc[1]["need GiB"] == "–"
    text = write_report(df, META, tmp_path / "r.html").read_text()
    rows = table_rows(text, "skipped-table")
    assert len(rows) == 1 and rows[0][0] == "does not fit in host memory"
    assert rows[0][-2:] == ["9.5–102.1", "20.1"]


def test_skipped_values_sort_as_numbers():
    df = memory_skipped([(1.0, 2.0), (1.0, 2.0), (1.0, 2.0), (1.0, 2.0)])
    df["budget"] = df["length"].map({4096: 512, 8192: 4096, 16384: 1024, 32768: 20480})
    assert frames.skipped(df).iloc[0]["budgets"] == "512, 1k, 4k, 20k"


def with_bytes(df: pd.DataFrame, off: dict) -> pd.DataFrame:
    """df with the measured read of the rows matching `off` (column: value) scaled by 1.2."""
    df = df.copy()
    hit = np.logical_and.reduce([df[k] == v for k, v in off.items()])
    df.loc[hit, "measured_read_bytes"] *= 1.2 / 1.04
    return df


def test_bytes_section_flags_rows_off_the_model(tmp_path):
    df = synthetic(lengths=[8192, 32768], batches=(1,), page_sizes=(16,), budgets=(512, 2048))
    df = with_bytes(df, {"stage": "attention", "length": 32768, "budget": 2048})
    text = write_report(df, META, tmp_path / "r.html").read_text()
    assert "by more than 5%" in text and "<code>cupti</code>" in text
    off = table_rows(text, "bytes-off-table")
    assert [(r[0], r[1], r[4], r[8]) for r in off] == [("attention", "32k", "2k", "1.200")]
    assert '<tr class="off">' in text
    per_kernel = {r[0]: r for r in table_rows(text, "bytes-table")}
    assert per_kernel["attention"][5] == "1" and per_kernel["dense"][5] == "0"
    assert {"bytes", "rho"} <= set(plot_ids(text))


def test_measured_rho_for_every_configuration():
    from questprof.report import hardware

    df = synthetic(lengths=[8192, 32768], batches=(1, 4), page_sizes=(16, 32), budgets=(512, 2048))
    rho = hardware.measured_rho(df)
    assert len(rho) == 2 * 2 * 2 * 2  # batches x page sizes x budgets x lengths
    one = df[(df["batch"] == 4) & (df["page_size"] == 32) & (df["budget"] == 512)
             & (df["length"] == 32768)].set_index("stage")["measured_read_bytes"]
    expected = (one["estimate"] + one["topk"] + one["attention"]) / one["dense"]
    got = rho.set_index(["batch", "page_size", "budget", "length"]).loc[(4, 32, 512, 32768)]
    assert got["measured_rho"] == pytest.approx(expected)


def test_peers_bytes_are_shown_not_judged(tmp_path):
    df = synthetic(lengths=[8192], batches=(1,), page_sizes=(16,), budgets=(512,))
    sdpa = df[df["stage"] == "dense"].assign(impl="torch-sdpa")
    sdpa["measured_read_bytes"] *= 3  # far off our model: still no flag
    text = write_report(pd.concat([df.assign(impl="ours"), sdpa], ignore_index=True), META,
                        tmp_path / "r.html").read_text()
    assert "bytes-off-table" not in text and "within 5% of the model" in text
    assert "rows of peers (torch-sdpa) carry measured bytes" in text


def test_no_measured_bytes_says_why(tmp_path):
    meta = {**META, "bytes": {"source": None, "reason": "the numpy backend runs on the CPU"}}
    text = write_report(synthetic(measured=False), meta, tmp_path / "r.html").read_text()
    assert "did not measure DRAM bytes (the numpy backend runs on the CPU)" in text


def test_bytes_under_one_mib_are_drawn_not_judged():
    """The summary append reads ~0.2 MB per layer; the L2 decides what reaches DRAM there, so a
    measured 0 must not be flagged as off the model (bytes --check-formula does not judge it)."""
    from questprof.report import hardware

    base = {"status": "ok", "impl": "ours", "batch": 1, "mode": "per-head", "page_size": 16,
            "budget": 512, "length": 8192, "bytes_source": "cupti", "unmodelled_bytes": 0.0}
    df = pd.DataFrame([{**base, "stage": "summary", "read_bytes": 200e3, "measured_read_bytes": 10.0},
                       {**base, "stage": "dense", "read_bytes": 64e6, "measured_read_bytes": 80e6}])
    rows = hardware.byte_rows(df).set_index("stage")
    assert bool(rows.loc["summary", "small"]) and not rows.loc["summary", "off"]
    assert bool(rows.loc["dense", "off"])
    assert list(hardware.off_rows(df)["stage"]) == ["dense"]


def test_points_of_different_models_are_never_pooled():
    """A bench holds several models at the same length, batch, page size and budget: each keeps
    its own point (a median over models would describe none of them)."""
    from questprof.report import frames

    base = {"status": "ok", "impl": "ours", "mode": "per-head", "batch": 1, "page_size": 16,
            "budget": 2048, "length": 32768, "kv_dtype": "fp16", "summary_dtype": "fp16"}
    rows = []
    for model, ms, kv in (("a", 1.0, "fp16"), ("b", 3.0, "fp16"), ("a", 5.0, "fp8_e4m3")):
        for stage, t in (("quest", ms), ("dense", 10 * ms)):
            rows.append({**base, "model": model, "stage": stage, "median_ms": t, "kv_dtype": kv})
    pairs = frames.paired(pd.DataFrame(rows))
    assert sorted(pairs["quest_ms"]) == [1.0, 3.0, 5.0]
    assert list(pairs["speedup"]) == [10.0, 10.0, 10.0]
    assert set(pairs["shape"]) == {"a", "b", "a (FP8 cache, fp16 summaries)"}


def test_bench_rows_of_selectors_without_fidelity_render(tmp_path):
    """A bench's selector rows (H200, 2026-12-01: quest, quest-fp8, quest-boxes:2, quest-topp)
    carry `selector` but no fidelity columns: the report renders them (it raised KeyError 'head')."""
    from questprof.results import load

    df, meta = load(Path(__file__).parent / "fixtures" / "bench-selectors")
    assert "head" not in df and set(df["selector"].dropna()) >= {"quest", "quest-fp8"}
    out = tmp_path / "report.html"
    write_report(df, meta, out)
    assert "mha-32h-d128" in out.read_text(encoding="utf-8")


def test_stage_bands_stack_to_the_quest_total():
    """Timed apart, the stages summed to 1.1x the Quest step (the bands rose above its line,
    ~195 against ~175 ms), and where the budget covers the length they were missing (the bands
    started from 0 under a Quest total at dense's time)."""
    curve = pd.DataFrame({"length": [4096, 8192, 16384], "budget": 4096,
                          "estimate_ms": [np.nan, 20.0, 30.0], "topk_ms": [np.nan, 10.0, 10.0],
                          "attention_ms": [np.nan, 165.0, 60.0], "quest_ms": [40.0, 175.0, 110.0]})
    bands = frames.stage_bands(curve)
    assert np.allclose(bands.sum(axis=1), curve["quest_ms"])
    assert list(bands.iloc[0]) == [0.0, 0.0, 40.0]  # budget 4k covers 4k: dense attention
    assert bands.loc[1, "estimate_ms"] == pytest.approx(20.0 * 175 / 195)
    assert bands.loc[2, "attention_ms"] == pytest.approx(60.0 * 110 / 100)


@pytest.mark.parametrize("lo, hi, kind, text", [
    ([0.5, 0.99, 1.3], [0.6, 1.02, 1.5], "from", "8k"),       # 4k ties, 8k wins clearly
    ([0.5, 0.8, 0.99], [0.6, 0.9, 1.02], "ties", "ties with dense from 8k"),
    ([0.5, 0.98, 0.99], [0.6, 1.01, 1.02], "ties", "ties with dense from 4k"),
])
def test_a_speedup_within_the_spreads_is_a_tie(lo, hi, kind, text):
    """"Quest beats dense from 4k" was claimed at 1.007x, inside the runs' p20..p80 spreads."""
    curve = pd.DataFrame({"length": [2048, 4096, 8192], "speedup": [0.55, 1.007, 1.4],
                          "speedup_lo": lo, "speedup_hi": hi})
    curve.loc[2, "speedup"] = (lo[2] + hi[2]) / 2
    found = frames.crossover(curve)
    assert found["kind"] == kind and found["text"].startswith(text), found


def test_paired_carries_the_speedup_over_both_spreads():
    df = synthetic(lengths=[8192], batches=(1,), page_sizes=(16,), budgets=(512,))
    (row,) = frames.paired(df).itertuples()
    assert row.speedup_lo == pytest.approx(row.dense_p20 / row.quest_p80)
    assert row.speedup_lo < row.speedup < row.speedup_hi
