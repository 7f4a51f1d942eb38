"""Which kernel variant serves a shape (backends/variants.py): every group on a built tile, large
groups in chunks, the page-size argument of attention, and the shapes core.config accepts are the
shapes the kernels are built for (CI, no GPU)."""

from __future__ import annotations

import pytest

from questprof.backends import variants
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


@pytest.mark.parametrize("q,summ,d,g,mode,want", [
    ("fp16", "fp16", 128, 4, 2, (4, 2, True)),     # measured: group and mode constants
    ("bf16", "bf16", 64, 1, 1, (1, 1, True)),
    ("fp16", "fp16", 128, 3, 1, (4, -1, False)),   # 3 on tile 4, group and mode at launch
    ("fp16", "fp16", 128, 16, 0, (16, -1, False)),
    ("bf16", "bf16", 96, 1, 2, (1, 0, True)),      # tile 1: every mode is the per-head build
    ("bf16", "bf16", 96, 2, 2, (2, -1, True)),
    ("bf16", "fp16", 128, 4, 0, (4, -1, False)),   # fp16 summaries of an FP8 cache
    ("fp16", E4M3, 64, 71, 1, (16, -1, False))])
def test_estimate_builds(q, summ, d, g, mode, want):
    assert variants.estimate_build(q, summ, d, g, mode) == want


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


@pytest.mark.parametrize("d,page,needle", [(112, None, "nearest 96"), (576, None, "nearest 256"),
                                           (72, None, "nearest 64"), (128, 256, "page size 256")])
def test_shape_problems_are_one_line(d, page, needle):
    problem = variants.shape_problem(d, page)
    assert needle in problem and "\n" not in problem
    assert variants.shape_problem(128, 16) is None
