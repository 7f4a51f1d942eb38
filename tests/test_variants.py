"""Which kernel variant serves a shape (backends/variants.py): every group on a built tile, large
groups in chunks, the page-size argument of attention, and the shapes core.config accepts are the
shapes the kernels are built for (CI, no GPU)."""

from __future__ import annotations

import pytest

from questprof.backends import constants, variants
from questprof.core import config
from questprof.core.fp8 import E4M3


@pytest.mark.parametrize("g", range(1, 129))
def test_every_group_on_a_built_tile(g):
    plan = variants.plan_group(g)
    assert plan.tile in variants.GROUPS and plan.chunk_size <= plan.tile
    assert plan.chunks == -(-g // variants.GROUPS[-1])  # chunks of at most 16 q heads
    assert (plan.chunks - 1) * plan.chunk_size < g <= plan.chunks * plan.chunk_size  # none empty
    if g <= variants.GROUPS[-1]:  # the smallest tile that holds the group
        assert plan.chunks == 1 and plan.tile == min(t for t in variants.GROUPS if t >= g)


@pytest.mark.parametrize("g,want", [(1, (1, 1, 1)), (3, (4, 1, 3)), (7, (8, 1, 7)),
                                    (16, (16, 1, 16)), (17, (16, 2, 9)), (71, (16, 5, 15)),
                                    (128, (16, 8, 16))])
def test_group_plans_of_named_models(g, want):
    """SmolLM2 (3), Qwen2.5-7B (7), Llama-3.1-405B (16), Falcon-7B (71, multi-query)."""
    assert variants.plan_group(g) == variants.GroupPlan(*want)


def test_the_page_size_is_a_template_argument_only_for_measured_variants():
    assert variants.page_template(128, 4, 16) == 16 and variants.page_template(64, 1, 64) == 64
    assert variants.page_template(128, 16, 16) == 0 and variants.page_template(96, 1, 8) == 0
    assert variants.page_template(64, 1, 128) == 0  # page size 128 was not timed


@pytest.mark.parametrize("g,want", [(1, 1), (4, 1), (7, 1), (8, 1), (9, 2), (16, 2), (17, 2),
                                    (24, 2), (71, 2), (128, 2)])
def test_estimate_ntiles_hold_a_chunk_of_the_group(g, want):
    """n-tiles of 8 q heads: one up to 8, two up to 16; larger groups in plan_group's chunks of
    at most 16 (24 as 2 x 12, 71 as 5 x 15, 128 as 8 x 16)."""
    assert variants.estimate_ntiles(g) == want


def test_estimate_grid_is_one_resident_wave_of_warps_per_unit():
    """A warp per unit of 16 rows x KV head, at most EST_NTILE_BLOCKS blocks per SM, >= 1."""
    assert variants.estimate_blocks(2048, 8, 1, 4, 132) == 2048 // 16 * 8 // variants.EST_WARPS
    assert variants.estimate_blocks(65536, 8, 1, 4, 132) == 4 * 132
    assert variants.estimate_blocks(65536, 8, 1, 16, 132) == 3 * 132
    assert variants.estimate_blocks(17, 1, 2, 1, 132) == 1  # 34 box rows: 3 units
    assert variants.estimate_blocks(0, 8, 1, 1, 132) == 1


def test_estimate_shared_memory_fits_its_blocks_per_sm():
    """q's fragments per warp (d / 16 words per lane and n-tile) at the blocks per SM the grid
    plans for fit an H200's 227 KiB per block and 228 KiB per SM."""
    per_sm = dict(zip(variants.EST_NTILES, constants.load()["EST_NTILE_BLOCKS"]))
    assert variants.estimate_shared_bytes(128, 4, E4M3) == 4 * 1 * 8 * 512
    assert variants.estimate_shared_bytes(128, 4, "bf16") == 0  # built in the product
    for d in variants.HEAD_DIMS:
        for g in (1, 8, 9, 16, 71):
            smem = variants.estimate_shared_bytes(d, g, E4M3)
            assert smem * per_sm[variants.estimate_ntiles(g)] <= variants.SMEM_PER_SM, (d, g)


def test_fp8_caches_take_page_sizes_at_launch_and_twice_the_tokens():
    assert variants.page_template(128, 4, 16, E4M3) == 0
    assert variants.tile_tokens(128, 4, E4M3) == 2 * variants.tile_tokens(128, 4)
    assert variants.uses_mma(128, 1, E4M3) and not variants.uses_mma(128, 1)
    assert variants.ring_bytes(64, 1, E4M3) == variants.ring_bytes(64, 1)  # rows of 4 slots


@pytest.mark.parametrize("d", [64, 80, 96, 128, 192, 256])
def test_tiles_and_rings(d):
    """Whole rounds of 32 copies per tile, tensor-core tiles whole (or half) k-steps of 16."""
    for tile in variants.GROUPS:
        tokens = variants.tile_tokens(d, tile)
        assert tokens * (d // 8) % 32 == 0
        if variants.uses_mma(d, tile):
            assert tokens % 16 == 0 or tokens == 8
        assert variants.ring_bytes(d, tile) <= 96 * 1024
        tokens = variants.tile_tokens(d, tile, E4M3)  # whole k-steps, whole rounds of copies
        assert tokens % 16 == 0 and tokens * (d // 16) % 32 == 0
        assert variants.ring_bytes(d, tile, E4M3) <= 96 * 1024
    assert variants.uses_mma(d, 1) == (d in (80, 96, 192))


def test_config_accepts_what_the_kernels_are_built_for():
    """core.config (which may not import the backends) names the same head dims and page sizes."""
    assert config.HEAD_DIMS == variants.HEAD_DIMS
    assert config.PAGE_SIZES == variants.PAGE_SIZES
    assert config.MAX_HBM_PAGES == constants.load()["PC_MAX_SLOTS"]


@pytest.mark.parametrize("d,page,needle", [(112, None, "nearest 96"), (576, None, "nearest 256"),
                                           (72, None, "nearest 64"), (128, 256, "page size 256")])
def test_shape_problems_are_one_line(d, page, needle):
    problem = variants.shape_problem(d, page)
    assert needle in problem and "\n" not in problem
    assert variants.shape_problem(128, 16) is None


def _old_splits(rows, row_pages, page_size, tile_tokens, sms=132):
    """The split rule before QP_TUNE (2 CTAs per SM), kept here as the default's specification."""
    min_pages = max(1, -(-2 * 4 * tile_tokens // page_size))
    want = max(1, 2 * sms // rows)
    per_split = min(512, max(min_pages, -(-row_pages // want)))
    return -(-row_pages // per_split), per_split


@pytest.mark.parametrize("rows,pages,s,tt", [(32, 2048, 16, 16), (16, 2048, 16, 16),
                                             (256, 8192, 16, 16), (264, 3, 16, 16),
                                             (17, 37, 128, 8)])
def test_default_splits_are_todays_past_few_rows(rows, pages, s, tt):
    """Rows that 2 CTAs per SM cut into fewer than FEW_ROW_SPLITS splits keep the old rule."""
    default = variants.Tuning()
    assert variants.attention_splits(rows, pages, s, tt, 512, 132, default) == _old_splits(
        rows, pages, s, tt)
    assert variants.parse_tuning("") == default


@pytest.mark.parametrize("rows,pages,want", [(8, 2048, (16, 128)), (4, 2048, (33, 63)),
                                             (1, 1, (1, 8)), (5, 37, (5, 8))])
def test_dense_few_rows_take_one_cta_per_sm(rows, pages, want):
    """Dense rows of tile 16 over a 16-bit cache that 2 per SM would cut into >= 32 splits plan
    1 CTA per SM (the G 16 shape: 8 rows, 16 x 128); tile 8 (the 70B share, GPT-OSS-20B,
    Qwen2.5-7B since 2b5e07e: 33-66 splits), tile 4 (llama3-8b), an FP8 cache and selections
    keep 2 (each measured slower at 1); tile 8 over 1-2 rows (132-264 splits) takes 1."""
    one = variants.attention_ctas(rows, 132, tile=16)
    assert one == 1
    assert variants.attention_splits(rows, pages, 16, 16, 512, 132, ctas=one) == want
    assert variants.attention_ctas(rows, 132, E4M3, tile=16) == variants.attention_ctas(
        rows, 132, dense=False, tile=16) == variants.attention_ctas(rows, 132, tile=4) == 2
    assert variants.attention_ctas(rows, 132, tile=8) == (1 if rows <= 2 else 2)
    assert variants.attention_ctas(16, 132, tile=16) == variants.attention_ctas(32, 132) == 2
    assert variants.attention_ctas(1, 132, tile=8) == variants.attention_ctas(2, 132, tile=8) == 1
    assert variants.attention_ctas(3, 132, tile=8) == variants.attention_ctas(1, 132, tile=4) == 2


def test_split_by_bytes_gives_few_rows_and_fp8_fewer_longer_splits():
    """Qwen2.5-7B 32K B1 (4 rows, 2048 pages): 64 splits of 32 pages by default; a 512 KiB floor
    halves them. FP8 Llama-3.1-8B (8 rows, 256-byte tokens): 33 splits, 16 with the floor, while
    the fp16 cache (512-byte tokens) goes from 33 to 32: the floor is in bytes, not tokens."""
    t = variants.parse_tuning("split=bytes,value=512k")
    two = variants.parse_tuning("ctas=2")
    assert variants.attention_splits(4, 2048, 16, 16, 512, 132, two) == (64, 32)
    assert variants.attention_splits(4, 2048, 16, 16, 512, 132, t, ctas=2) == (32, 64)
    assert variants.attention_splits(8, 2048, 16, 32, 256, 132, t, ctas=2) == (16, 128)
    assert variants.attention_splits(8, 2048, 16, 16, 512, 132, t, ctas=2) == (32, 64)
    # never more CTAs than the ctas rule, never over ATT_MAX_PAGES pages a split
    assert variants.attention_splits(256, 8192, 16, 16, 512, 132, t) == (16, 512)


def test_split_by_tokens_and_ctas():
    tokens = variants.parse_tuning("split=tokens, value=2048")
    assert variants.attention_splits(4, 2048, 16, 16, 512, 132, tokens) == (16, 128)
    assert variants.attention_splits(4, 2048, 16, 16, 512, 132,
                                     variants.parse_tuning("split=tokens,value=16")) == (256, 8)
    one = variants.parse_tuning("ctas=1")
    assert variants.attention_splits(4, 2048, 16, 16, 512, 132, one) == (33, 63)


@pytest.mark.parametrize("text,needle", [("split=pages", "split='pages'"),
                                         ("split=bytes", "value"), ("est16=loop", "expected name=value"),
                                         ("depth=3", "expected name=value"),
                                         ("stages=5", "stages=5"), ("ctas=-1", "ctas"),
                                         ("value=lots", "whole number"),
                                         ("merge=fast", "merge='fast'")])
def test_bad_tuning_is_one_line(text, needle):
    with pytest.raises(ValueError, match=needle) as info:
        variants.parse_tuning(text)
    assert "\n" not in str(info.value)


def test_tuning_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("QP_TUNE", "split=bytes,value=1m,stages=6")
    t = variants.current_tuning()
    assert (t.split, t.value, t.stages) == ("bytes", 1 << 20, 6) and t.name == (
        "bytes 1024K, stages 6")
    monkeypatch.delenv("QP_TUNE")
    assert variants.current_tuning().name == "ctas auto"


def test_the_shapes_example_is_every_named_model_in_both_caches():
    """scenarios/shapes.toml (the bench file of the shapes example) holds each named scenario's
    shape as `sweep --scenario NAME [--kv-dtype fp8]` takes it (tp shares included), at 8k, 32k,
    128k, batch 1 and 8, page 16, budget 2048, and every one runs on built kernels."""
    from questprof import SCENARIOS_DIR
    from questprof.commands.bench import load_bench
    from questprof.core.scenarios import ShapeOptions, load_scenario

    cases, _ = load_bench(SCENARIOS_DIR / "shapes.toml")
    assert len(cases) == 10 * 2 * 3 * 2
    for cfg in cases:
        name, fp8 = cfg.model.name.removesuffix("-fp8"), cfg.model.name.endswith("-fp8")
        want = load_scenario(name, ShapeOptions(kv_dtype="fp8" if fp8 else None)).model
        got = cfg.model
        assert (got.q_heads, got.kv_heads, got.head_dim, got.dtype, got.tp, got.is_fp8) == (
            want.q_heads, want.kv_heads, want.head_dim, want.dtype, want.tp, want.is_fp8)
        assert variants.shape_problem(got.head_dim, cfg.page_size) is None
        assert (cfg.page_size, cfg.budget, cfg.mode) == (16, 2048, "per-head")
    assert {(c.length, c.batch) for c in cases} == {(n, b) for n in (8192, 32768, 131072)
                                                    for b in (1, 8)}


KIB = 1024


@pytest.mark.parametrize("rows,pages,d,tile,kv,tune,want", [
    # Qwen2.5-7B dense 32K B1 (4 rows, tile 8): 2 CTAs per SM by default (since 2b5e07e; the
    # launch of ab138da), its measured S 16 build; G 16 (8 rows) takes 1, page size at launch
    (4, 2048, 128, 8, "bf16", "", (64, 32, 2, 64 * KIB, 16, 2)),
    (8, 2048, 128, 16, "bf16", "", (16, 128, 2, 64 * KIB, 0, 1)),
    (4, 2048, 128, 8, "bf16", "stages=6", (33, 63, 6, 192 * KIB, 0, 1)),  # deep: page at launch
    (8, 2048, 128, 16, "bf16", "ctas=2,stages=4", (16, 128, 4, 128 * KIB, 0, 1)),  # 1 fits
    (8, 2048, 128, 4, E4M3, "", (33, 63, 3, 96 * KIB, 0, 2)),  # FP8 keeps 2 per SM
    (8, 2048, 128, 4, E4M3, "stages=4", (16, 128, 4, 128 * KIB, 0, 1)),
    (32, 2048, 128, 1, "fp16", "stages=6", (8, 256, 3, 96 * KIB, 16, 2)),  # tile 1: not built
    (32, 2048, 96, 1, "bf16", "", (8, 256, 3, 96 * KIB, 0, 2))])  # Phi-3-mini: today's
def test_attention_launch_table(rows, pages, d, tile, kv, tune, want):
    """variants.attention_launch: splits, ring depth and bytes, page template, CTAs per SM."""
    run = variants.attention_launch(rows, pages, d, tile, 16, kv, 132,
                                    tuning=variants.parse_tuning(tune))
    assert (run.splits, run.pages_per_split, run.stages, run.ring, run.page, run.ctas) == want
    sparse = variants.attention_launch(rows, 128, d, tile, 16, kv, 132, dense=False,
                                       tuning=variants.parse_tuning(tune))
    assert sparse.ctas == (1 if run.stages > 3 else 2)  # selections: 2 per SM where 2 fit


def test_every_default_ring_fits_two_ctas_and_deep_rings_one():
    """Today's depths keep 2 CTAs per SM at every cache, head dim and tile (the default grids do
    not change); the deeper rings fit one CTA (227 KiB) beside its static arrays."""
    for kv in ("fp16", E4M3):
        for d in variants.HEAD_DIMS:
            for tile in variants.GROUPS:
                need = (variants.ring_bytes(d, tile, kv) + variants.static_bytes(d, tile, kv)
                        + variants.SMEM_RESERVED)
                assert variants.SMEM_PER_SM // need >= 2, (kv, d, tile)
        for d in variants.DEEP_HEAD_DIMS:
            for tile in variants.DEEP_GROUPS:
                for n in variants.DEEP_STAGES:
                    ring = variants.ring_bytes(d, tile, kv, n)
                    assert ring + variants.static_bytes(d, tile, kv) <= 227 * KIB
    assert variants.static_bytes(128, 8) == 20864 and variants.static_bytes(128, 16) == 4736


def test_wide_merge_is_asked_where_there_are_splits_and_its_scratch_fits(tmp_path):
    """QP_TUNE merge=wide: launches of several splits run it (the launch's name says so), one
    split has no merge, and a scratch over the ring falls back to the old merge; merge_scratch
    is attention_merge.cuh's WideMerge::scratch (a host program nvcc builds)."""
    from kernel_objects import host_program

    wide = variants.parse_tuning("merge=wide")
    assert wide.name == "ctas auto, merge wide"
    run = variants.attention_launch(4, 2048, 128, 8, 16, "bf16", 132, tuning=wide)
    assert (run.merge, run.name) == ("wide", "64 x 32, 2 stages, merge wide")
    # the default (auto): wide for rows of >= 16 splits, dense or sparse, old below and explicitly
    assert variants.attention_launch(4, 2048, 128, 8, 16, "bf16", 132).merge == "wide"
    few = variants.attention_launch(4, 128, 128, 4, 16, "bf16", 132, dense=False)
    many = variants.attention_launch(32, 128, 128, 1, 16, "bf16", 132, dense=False)
    assert (few.splits >= variants.WIDE_MERGE_SPLITS, few.merge) == (True, "wide")
    assert (many.splits < variants.WIDE_MERGE_SPLITS, many.merge) == (True, "old")
    old = variants.parse_tuning("merge=old")
    assert variants.attention_launch(4, 2048, 128, 8, 16, "bf16", 132, tuning=old).merge == "old"
    assert variants.attention_launch(4, 8, 128, 8, 16, "bf16", 132, tuning=wide).merge == "old"
    assert 4 * variants.merge_scratch(1024, 128, 16) > variants.ring_bytes(128, 16)
    cases = [(d, g, s) for d in variants.HEAD_DIMS for g in variants.GROUPS for s in (2, 33, 264)]
    out = host_program(tmp_path, ("attention_merge.cuh",), [
        f'std::printf("%d\\n", WideMerge<{g}, {d}>::scratch({s}));' for d, g, s in cases])
    assert [int(x) for x in out.split()] == [variants.merge_scratch(s, d, g) for d, g, s in cases]


def test_few_row_plans_of_the_deep_ring_cases(monkeypatch):
    """The launch plans tests/test_shapes.py runs on a GPU (FEW_ROWS), checked here on a CPU so
    that a launch-rule change fails in CI, not on the next GPU run: 5 dense rows of 38 pages at
    head dim 128, 1 CTA per SM for tile 16 over a 16-bit cache, 2 for tiles 4 and 8 (5 rows)."""
    from test_shapes import FEW_ROWS

    for g, dtype, fp8, tune, ctas in FEW_ROWS:
        monkeypatch.setenv("QP_TUNE", tune)
        tile = variants.plan_group(g).tile
        run = variants.attention_launch(5, 38, 128, tile, 16, E4M3 if fp8 else dtype, 132)
        assert run.ctas == ctas, (g, dtype, fp8, tune)
        assert run.stages == (int(tune[-1]) if tune else constants.per_group("ATT_STAGES", tile))


@pytest.mark.parametrize("rows,pages,want", [(32, 2048, (512, 4)), (8, 2049, (512, 16)),
                                             (64, 8192, (512, 16)), (32, 8193, (1024, 0)),
                                             (133, 2048, (256, 8)), (224, 1024, (256, 8)),
                                             (256, 8192, (512, 16)), (133, 2049, (512, 16)),
                                             (1024, 8193, (512, 0))])
def test_topk_form_follows_the_rows(monkeypatch, rows, pages, want):
    """Keys in registers for rows that fit 512 x 16 keys, the first form of the rule's table that
    holds the row: 512 x 4 then 512 x 16 for rows of one wave (132 SMs), 256 x 8 then 512 x 16
    over one wave; the shared-memory form (0) past 512 x 16; QP_TUNE tk_threads (the fewest keys
    that hold the row) and tk_keys override the rule, a bad tk_keys is named."""
    monkeypatch.delenv("QP_TUNE", raising=False)
    assert variants.topk_form(rows, pages, 132) == want
    monkeypatch.setenv("QP_TUNE", "tk_keys=0")  # the launch before the register form
    assert variants.topk_form(rows, pages, 132) == (variants.topk_threads(rows, pages, 132), 0)
    assert variants.topk_form(64, 8192, 132) == (1024, 0)
    monkeypatch.setenv("QP_TUNE", "tk_threads=256")
    fit = [r for r in (4, 8, 16) if 256 * r >= pages]
    assert variants.topk_form(rows, pages, 132) == (256, fit[0] if fit and want[1] else 0)
    monkeypatch.setenv("QP_TUNE", "tk_keys=12")
    with pytest.raises(ValueError, match="tk_keys=12"):
        variants.topk_form(rows, pages, 132)


@pytest.mark.parametrize("rows,pages,want", [(32, 2048, 512), (4, 2048, 512), (32, 8192, 1024),
                                             (128, 8192, 1024), (256, 8192, 512),
                                             (512, 8192, 512)])
def test_topk_threads_follow_the_rows(monkeypatch, rows, pages, want):
    """512 threads per row but for rows of over 4096 pages that fit one CTA per SM (132), as
    timed on the H200; QP_TUNE tk_threads overrides the rule."""
    monkeypatch.delenv("QP_TUNE", raising=False)
    assert variants.topk_threads(rows, pages, 132) == want
    monkeypatch.setenv("QP_TUNE", "tk_threads=256")
    assert variants.topk_threads(rows, pages, 132) == 256


def test_register_fit_counts_warps_of_256_registers():
    """sm_90 allocates a warp's registers in 256s: 164 registers leave 3 CTAs of 128 threads an
    SM (the Llama-3.1-405B dense build), 179 leave 2 (its build at 05797cf)."""
    assert variants.register_fit(164, 128) == 3
    assert variants.register_fit(179, 128) == 2
    assert variants.register_fit(128, 128) == 4
    assert variants.register_fit(255, 1024) == 0


@pytest.mark.parametrize("regs,rows,row_pages,held", [(164, 64, 8192, True),
                                                       (176, 64, 8192, False),
                                                       (164, 8, 2048, False)])
def test_held_ring_holds_multi_wave_grids_at_the_planned_ctas(regs, rows, row_pages, held):
    """A grid of more than one planned wave whose kernel's registers would let one more CTA
    share an SM gets the least shared memory that leaves the planned CTAs; otherwise the ring
    alone (a one-wave grid, or registers that already hold the plan)."""
    run = variants.attention_launch(rows, row_pages, 128, 16, 16, "bf16", 132)
    ring = variants.held_ring(run, rows, 132, regs, 128, 16, "bf16")
    fixed = variants.static_bytes(128, 16, "bf16") + variants.SMEM_RESERVED
    fits = min(variants.register_fit(regs, 128), variants.SMEM_PER_SM // (ring + fixed))
    assert (ring > run.ring) == held
    assert variants.register_fit(regs, 128) == (3 if regs == 164 else 2)
    # held at the plan (2) where 3 would fit; 2 where the registers hold 2; 3 in a grid of one
    # wave (8 rows of tile 16 plan 1 CTA per SM: 128 CTAs)
    assert (run.ctas, fits) == ((2, 2) if held or regs != 164 else (1, 3))
    if held:  # the least padding: one byte less and a third CTA fits
        assert variants.SMEM_PER_SM // (ring - 1 + fixed) == 3
    assert ring + variants.static_bytes(128, 16, "bf16") <= 227 * 1024
