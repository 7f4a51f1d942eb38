"""The one registry of stage names, selection modes and what each stage is made of.

Every other module takes stage names from here: kernels/<kernel>.cu, backends' methods,
core.reference's functions, core.model's byte model and tests/test_<stage>.py share one name.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("per-head", "shared-max", "shared-mean")  # GQA selection: one page set per q head or per KV head


@dataclass(frozen=True)
class Stage:
    """One timed stage: its kernel source file, reference function and backend method."""

    name: str
    kernel: str  # kernels/<kernel>.cu
    reference: str  # function of questprof.core.reference (and method of every backend)
    what: str  # its bytes and FLOPs: core.model.stage_work(cfg)[name]


REGISTRY = {s.name: s for s in (
    Stage("summary", "summary", "summary", "append decode keys to their pages' min/max"),
    Stage("estimate", "estimate", "estimate", "upper bound U_p(q) of every page"),
    Stage("topk", "topk", "topk", "the K pages of highest U_p per (request, head)"),
    Stage("attention", "attention", "attention", "exact attention over the selected pages"),
    Stage("dense", "attention", "attention", "exact attention over every page (the baseline)"),
)}
STAGES = tuple(REGISTRY)  # kernel stages, in the order of one configuration's rows
QUEST_STAGES = ("estimate", "topk", "attention")  # one Quest decode step, as the paper counts it
ROW_STAGES = (*STAGES, "quest")  # 'quest' is the step: timed as one pass of its three stages
KERNEL_FILES = tuple(sorted({s.kernel for s in REGISTRY.values()}))


def check_mode(mode: str) -> str:
    """mode if it is a selection mode, else ValueError naming the choices."""
    if mode not in MODES:
        raise ValueError(f"unknown selection mode {mode!r}: expected one of {MODES}")
    return mode
