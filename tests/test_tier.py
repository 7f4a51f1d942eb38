"""The byte model per tier (core/tier.py) against hand counts, and the tier checks of Config."""

import pytest

from questprof.core import tier
from questprof.core.config import Config, ConfigError, ModelShape

# Llama-3.1-8B's attention shape: 32 q / 8 KV heads of 128 dims, 16-bit cache (M = 256 B)
LLAMA = ModelShape("llama3-8b", layers=32, q_heads=32, kv_heads=8, head_dim=128, dtype="bf16")


def host(mode="shared-mean", summary="hbm", pages=0, length=32768, batch=1):
    return Config(LLAMA, length, batch, 16, 2048, mode, kv_tier="host", summary_tier=summary,
                  hbm_pages=pages)


def test_dense_over_the_host_moves_every_page():
    # 8 KV heads x (K + V) x 256 B x 32768 tokens = 134,217,728 B (134 MB) per layer
    got = tier.tier_bytes(host())["dense"]
    assert got.link == 8 * 2 * 256 * 32768 == 134_217_728


def test_quest_with_summaries_in_hbm_moves_the_chosen_pages():
    # K = 2048 // 16 = 128 pages of 16 tokens: 8 x 2 x 256 x 2048 = 8,388,608 B
    parts = tier.tier_bytes(host())
    assert parts["attention"].link == 8_388_608
    assert parts["estimate"].link == 0 and parts["topk"].link == 0
    assert tier.quest_tier_bytes(host()).link == 8_388_608
    assert tier.link_rho(host()) == 1 / 16  # K/P = 128/2048


def test_summaries_on_the_host_add_one_over_s():
    # 2048 pages x 8 KV heads x (min + max) x 256 B = 8,388,608 B more: rho 1/16 + 1/16
    parts = tier.tier_bytes(host(summary="host"))
    assert parts["estimate"].link == 2048 * 8 * 2 * 256
    assert tier.link_rho(host(summary="host")) == 1 / 8
    # the append: the new key (8 x 256) and the tail page's old and new min/max (2 x 8 x 512)
    assert parts["summary"].link == 2048 + 8192
    assert tier.tier_bytes(host())["summary"].link == 2048


def test_a_page_cache_moves_the_misses_only():
    cfg = host(pages=256)
    assert tier.tier_bytes(cfg, miss_rate=0.25)["attention"].link == 2_097_152
    assert tier.link_rho(cfg, miss_rate=0.25) == 1 / 64
    # without a cache the miss rate given does not apply: every chosen page crosses
    assert tier.tier_bytes(host(), miss_rate=0.25)["attention"].link == 8_388_608


def test_gather_reads_the_misses_twice_in_hbm_zero_copy_never():
    hbm = Config(LLAMA, 32768, 1, 16, 2048, "shared-mean")
    resident = tier.tier_bytes(hbm)["attention"]
    gather = tier.tier_bytes(host(), fetch="gather")["attention"]
    zero = tier.tier_bytes(host(), fetch="zero-copy")["attention"]
    assert resident.link == 0
    assert gather.hbm - resident.hbm == 8_388_608  # written to staging, read back: +1x
    assert resident.hbm - zero.hbm == 8_388_608  # read over the link, not from HBM


def test_per_head_reads_the_union_bound():
    # per-head, group 4: min(4 x 127 + 1, 2048) = 509 pages = 8144 tokens per KV head
    assert tier.tier_bytes(host("per-head"))["attention"].link == 8 * 2 * 256 * 8144


def test_hbm_tier_moves_nothing_over_the_link():
    cfg = Config(LLAMA, 131072, 4, 16, 4096, "shared-mean")
    assert all(b.link == 0 for b in tier.tier_bytes(cfg).values())
    assert tier.link_rho(cfg) == 0.0


def test_128k_b4_budget_4096():
    cfg = Config(LLAMA, 131072, 4, 16, 4096, "shared-mean", kv_tier="host")
    dense = tier.tier_bytes(cfg)["dense"].link
    assert dense == 4 * 8 * 2 * 256 * 131072 == 2 * 1024**3  # 2 GiB per layer, 64 GiB in 32
    assert dense / tier.quest_tier_bytes(cfg).link == 32


def test_link_seconds_and_bad_inputs():
    assert tier.link_seconds(134_217_728, 54.9) == pytest.approx(2.445e-3, rel=1e-3)
    with pytest.raises(ValueError):
        tier.check_miss_rate(1.5)
    with pytest.raises(ValueError):
        tier.tier_bytes(host(), fetch="teleport")


@pytest.mark.parametrize(("kw", "said"), [
    ({"kv_tier": "disk"}, "--kv-tier 'disk'"),
    ({"summary_tier": "host"}, "--summary-tier host with --kv-tier hbm"),
    ({"hbm_pages": 256}, "an HBM page cache serves a cache in host memory"),
    ({"kv_tier": "host", "hbm_pages": 64}, "at least one step's 128 chosen pages"),
])
def test_tiers_that_make_no_sense_are_one_line(kw, said):
    with pytest.raises(ConfigError) as err:
        Config(LLAMA, 32768, 1, 16, 2048, "shared-mean", **kw)
    assert said.split(":")[0] in str(err.value) or said in str(err.value)
    assert "\n" not in str(err.value)


def test_keys_of_hbm_runs_are_unchanged_and_tiers_travel_in_rows():
    hbm = Config(LLAMA, 32768, 1, 16, 2048, "shared-mean")
    assert "tier" not in hbm.key() and "hbm_pages" not in hbm.key()
    cfg = host(summary="host", pages=256)
    assert "kv_tier=host" in cfg.key() and "hbm_pages=256" in cfg.key()
    row = cfg.as_dict()
    assert (row["kv_tier"], row["summary_tier"], row["hbm_pages"]) == ("host", "host", 256)


def test_a_cpu_sweep_over_the_host_tier_says_so_and_rows_carry_link_bytes(tmp_path):
    """The NumPy backend runs the tier on the CPU: the host is the host; link bytes modelled."""
    from typer.testing import CliRunner

    from questprof import results
    from questprof.cli import app

    out = tmp_path / "run"
    got = CliRunner().invoke(app, [
        "sweep", "--scenario", "smoke", "--lengths", "2k", "--budget", "256", "--kv-tier",
        "host", "--summary-tier", "host", "--out", str(out), "--repeats", "2", "--warmup", "0",
        "--backend", "numpy", "--no-fidelity", "--no-e2e"])
    assert got.exit_code == 0, got.output
    assert "the host is the host" in got.stderr and "no step-to-step reuse" in got.stderr
    rows = {r["stage"]: r for r in results.read_rows(out) if r["impl"] == "ours"}
    assert {r["kv_tier"] for r in rows.values()} == {"host"}
    cfg = Config(load_smoke(), 2048, rows["dense"]["batch"], rows["dense"]["page_size"], 256,
                 rows["dense"]["mode"], kv_tier="host", summary_tier="host")
    want = tier.tier_bytes(cfg)
    assert rows["dense"]["link_bytes"] == want["dense"].link
    # per-head, read in place: each q head's own pages cross the link (no union: H200, 2026-12-02)
    assert rows["quest"]["link_bytes"] == tier.quest_tier_bytes(cfg, fetch="zero-copy").link
    assert 0 < tier.quest_tier_bytes(cfg).link < rows["quest"]["link_bytes"]  # gather: the union
    from questprof.report import tier as tier_report

    df, meta = results.load(out)
    html = tier_report.section(df, meta)
    assert "dense / Quest" in html and tier_report.NO_CEILINGS in html
    assert meta["link_ceilings"] is None
    stages = tier_report._stages(df[df["kv_tier"] == "host"])  # rounded as drawn; '-' where
    assert (stages["us"] == stages["us"].round(1)).all()     # nothing crossed the link
    assert set(stages.loc[stages["link_bytes"] == 0, "link_gbs"]) <= {"-"}


def test_summaries_on_the_host_over_an_hbm_cache_exit_2_in_one_line():
    from typer.testing import CliRunner

    from questprof.cli import app

    got = CliRunner().invoke(app, ["sweep", "--scenario", "smoke", "--lengths", "2k",
                                   "--summary-tier", "host", "--backend", "numpy"])
    assert got.exit_code == 2
    (line,) = got.stderr.strip().splitlines()
    assert "--summary-tier host with --kv-tier hbm" in line


def load_smoke():
    from questprof.core.scenarios import load_scenario

    return load_scenario("smoke").model


def test_the_tier_table_pairs_dense_and_quest_of_one_model_only():
    """Two models at one (length, batch, budget, mode): each model's dense over its own Quest
    step (the table cross-joined them before: each line carried both ratios)."""
    import pandas as pd

    from questprof.report import tier as tier_report

    base = {"impl": "ours", "kv_tier": "host", "length": 32768, "batch": 1, "page_size": 16,
            "budget": 2048, "mode": "shared-mean", "summary_tier": "hbm", "hbm_pages": 0,
            "kv_dtype": "bf16", "summary_dtype": "bf16", "tp": None, "link_bytes": 1.0}
    rows = pd.DataFrame([{**base, "model": m, "stage": s, "median_ms": ms}
                         for m, d, q in (("a", 2.0, 1.0), ("b", 6.0, 1.0))
                         for s, ms in (("dense", d), ("quest", q))])
    got = tier_report._stages(rows)
    assert len(got) == 4
    assert dict(zip(got["model"], got["dense_over_quest"])) == {"a": 2.0, "b": 6.0}


def test_the_byte_check_over_the_host_tier_runs_and_says_why_no_link_is_counted():
    """bytes --kv-tier host was refused in one line (DRAM counters cannot judge link bytes); it
    now counts them through CUPTI on a GPU. Here, without one: exit 3 (no source on this
    machine), one line that says why neither DRAM nor link bytes are measured."""
    from typer.testing import CliRunner

    from questprof.backends import gpu_unavailable_reason
    from questprof.cli import app

    if gpu_unavailable_reason() is None:
        pytest.skip("this machine has a GPU: the CUPTI path runs (tests/test_link_gpu.py)")
    got = CliRunner().invoke(app, ["bytes", "--check-formula", "--scenario", "smoke",
                                   "--lengths", "2k", "--budget", "256", "--kv-tier", "host"])
    assert got.exit_code == 3, got.output
    assert "Traceback" not in got.output and "judges DRAM" not in got.stderr
    (line,) = [x for x in got.stderr.strip().splitlines() if not x.startswith("rho =")]
    assert "no DRAM byte source is available" in line
    assert "link bytes not measured: no GPU here" in line


def test_every_timed_tier_row_carries_its_share_of_the_copy_ceiling():
    """With the run's link ceilings in meta, each timed row's link GB/s over the pinned-copy
    ceiling ('-' where nothing crossed); without them, '-' and the sentence that says why."""
    import pandas as pd

    from questprof.report import tier as tier_report

    base = {"impl": "ours", "kv_tier": "host", "model": "a", "length": 32768, "batch": 1,
            "page_size": 16, "budget": 2048, "mode": "shared-mean", "summary_tier": "hbm",
            "hbm_pages": 0, "kv_dtype": "bf16", "summary_dtype": "bf16", "tp": None}
    df = pd.DataFrame([{**base, "stage": "dense", "median_ms": 2.0, "link_bytes": 100e6},
                       {**base, "stage": "estimate", "median_ms": 0.004, "link_bytes": 0.0}])
    got = tier_report._of_copy(tier_report._stages(df), 55.0)
    assert dict(zip(got["stage"], got["of_copy"])) == {"dense": round(50.0 / 55.0, 2),
                                                      "estimate": "-"}
    html = tier_report.section(df, {"link_ceilings": {"copy_gbs": 55.0, "zero_copy_gbs": 51.0}})
    assert "of the copy ceiling" in html and "pinned copy 55.0 GB/s" in html
    assert set(tier_report._of_copy(tier_report._stages(df), None)["of_copy"]) == {"-"}
