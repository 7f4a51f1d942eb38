"""Which kernel variant serves a shape, from the tables of kernels/constants.cuh (no CuPy here, so
CI checks every rule on a CPU).

A group of g q heads per KV head runs on a tile of QP_GROUPS: the smallest tile >= g, the rows
past g masked (g 3 on 4, 5-7 on 8, 9-15 on 16); a group over the largest tile (multi-query, e.g.
Falcon-7B's 71) is cut into ceil(g / 16) near-equal chunks, one attention CTA row each.
Attention's shared memory and tile length follow kernels/attention_tile.cuh (Ring,
attention_ring_bytes); tests/test_kernels_compile.py compares them with what nvcc computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from questprof.backends import constants

_C = constants.load()
GROUPS = _C["QP_GROUPS"]  # tiles: q heads per attention CTA / per estimate pass over a box
HEAD_DIMS = _C["QP_HEAD_DIMS"]
PAGE_SIZES = _C["QP_PAGE_SIZES"]
MEASURED_HEAD_DIMS, MEASURED_GROUPS = _C["QP_MEASURED_HEAD_DIMS"], _C["QP_MEASURED_GROUPS"]
MEASURED_PAGE_SIZES = _C["QP_MEASURED_PAGE_SIZES"]
FUSED_HEAD_DIMS = _C["QP_FUSED_HEAD_DIMS"]  # estimate_topk's builds
EST_THREADS, EST_UNROLL = _C["EST_THREADS"], _C["EST_UNROLL"]
ATT_WARPS = _C["ATT_WARPS"]
VEC = 8  # values per 16-byte piece (kernels/common.cuh)


@dataclass(frozen=True)
class GroupPlan:
    """How the g q heads of one KV head map onto kernel tiles."""

    tile: int        # G: the template's q heads (a QP_GROUPS entry)
    chunks: int      # attention CTA rows per KV head (1 unless g exceeds the largest tile)
    chunk_size: int  # q heads per chunk (the last chunk may hold fewer)


def plan_group(g: int) -> GroupPlan:
    """The tile and chunks of a group of g q heads per KV head."""
    if g < 1:
        raise ValueError(f"a group needs at least one q head, got {g}")
    chunks = -(-g // GROUPS[-1])
    size = -(-g // chunks)
    return GroupPlan(min(t for t in GROUPS if t >= size), chunks, size)


def shape_problem(head_dim: int, page_size: int | None = None) -> str | None:
    """Why the kernels cannot run this head dim / page size (None when they can)."""
    if head_dim not in HEAD_DIMS:
        near = min(HEAD_DIMS, key=lambda d: (abs(d - head_dim), d))
        return (f"head_dim {head_dim} is not built (the kernels take {_join(HEAD_DIMS)}; "
                f"nearest {near})")
    if page_size is not None and page_size not in PAGE_SIZES:
        return f"page size {page_size} is not built (the kernels take {_join(PAGE_SIZES)})"
    return None


def _join(values) -> str:
    return ", ".join(map(str, values))


def row_lanes(d: int) -> int:
    """Lanes holding one row of d values, 8 each: d / 8 rounded up to a power of two."""
    lanes = 1
    while lanes < d // VEC:
        lanes *= 2
    return lanes


def measured(d: int, tile: int) -> bool:
    """A variant kept as timed on the H200 (constants.cuh, measured_variant)."""
    return d in MEASURED_HEAD_DIMS and tile in MEASURED_GROUPS


def page_template(d: int, tile: int, page_size: int) -> int:
    """attention_kernel's S: the page size for measured variants at measured page sizes, else 0
    (one build that takes the page size at launch)."""
    return page_size if measured(d, tile) and page_size in MEASURED_PAGE_SIZES else 0


def estimate_exact(d: int, g: int) -> bool:
    """estimate_kernel's EXACT: the group is the tile and that build exists (tiles 1 and 2, the
    measured variants); otherwise the build that takes the group from the launch."""
    tile = plan_group(g).tile
    return g == tile and (tile <= 2 or measured(d, tile))


def uses_mma(d: int, tile: int) -> bool:
    """Tensor-core tile (MmaTile) or CUDA-core tile (CoreTile): attention_tile.cuh's Tile."""
    return tile >= 4 or row_lanes(d) != d // VEC


def tile_tokens(d: int, tile: int) -> int:
    """Tokens of one warp tile (Ring::TT): 32 at d 64, 16 at d 80 to 128, 8 at d 192 and 256."""
    return constants.per_group("ATT_LOADS", tile) * 32 // row_lanes(d)


def ring_bytes(d: int, tile: int) -> int:
    """Dynamic shared memory of one attention CTA: ATT_WARPS rings of NS stages (K and V)."""
    pieces = d // VEC
    row_slots = -(-pieces // 8) * 8 if uses_mma(d, tile) else pieces
    stage = 2 * tile_tokens(d, tile) * row_slots * 16
    return ATT_WARPS * constants.per_group("ATT_STAGES", tile) * stage


def estimate_tiles(d: int, units: int) -> int:
    """Tiles of the estimate's walk over `units` (page, KV head) units: EST_UNROLL batches of one
    unit per row_lanes(d) lanes."""
    return -(-units // (EST_UNROLL * (EST_THREADS // row_lanes(d))))
