"""Which kernel variant serves a shape (backends/variants.py): every group on a built tile, large
groups in chunks, the page-size argument of attention, and the shapes core.config accepts are the
shapes the kernels are built for (CI, no GPU)."""

from __future__ import annotations

import pytest

from questprof.backends import variants
from questprof.core import config


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


def test_estimate_builds_with_the_group_a_constant():
    assert variants.estimate_exact(128, 4) and variants.estimate_exact(96, 2)
    assert not variants.estimate_exact(128, 3) and not variants.estimate_exact(128, 16)
    assert not variants.estimate_exact(96, 4) and not variants.estimate_exact(64, 71)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 192, 256])
def test_tiles_and_rings(d):
    """Whole rounds of 32 copies per tile, tensor-core tiles whole (or half) k-steps of 16."""
    for tile in variants.GROUPS:
        tokens = variants.tile_tokens(d, tile)
        assert tokens * (d // 8) % 32 == 0
        if variants.uses_mma(d, tile):
            assert tokens % 16 == 0 or tokens == 8
        assert variants.ring_bytes(d, tile) <= 96 * 1024
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
