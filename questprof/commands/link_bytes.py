"""Measured link bytes of a workload's stages as row fields, over one calibration per run
(measure/link.py); sweep, bench and bytes share them.

A run that keeps pages in host memory on a GPU, with CUPTI as its byte source, calibrates the
link counter once (a zero-copy read of known size) and then counts each of our stages' link
bytes over its cold rotation: `measured_link_bytes` (the counter's, per layer),
`calibrated_link_bytes` (over the factor) and `link_factor`. Elsewhere the rows of the host
tier say why in `link_reason` (a CPU, no CUPTI, another byte source, a calibration that did not
hold), and the run goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from questprof.core import tier
from questprof.measure import link

CPU_REASON = ("the {} backend runs on the CPU: the host is the host, no link to count (the "
              "link bytes are modelled)")
MEASURED = ("measured_link_bytes", "calibrated_link_bytes")


@dataclass(frozen=True)
class LinkRun:
    """A run's link counting: its calibration (None before or without one) and why no stage is
    counted (None when they are)."""

    calibration: link.Calibration | None = None
    reason: str | None = None

    @property
    def counting(self) -> bool:
        return self.calibration is not None and self.reason is None

    def as_meta(self) -> dict:
        """meta.json's `link_bytes`: the calibration's figures and the reason, if any."""
        cal = self.calibration.as_dict() if self.calibration is not None else {}
        return {**cal, "metric": link.METRIC, "reason": self.reason}


def prepare(configs, why_not: str | None) -> LinkRun | None:
    """The run's LinkRun: None when no configuration keeps its pages on the host; the reason
    when `why_not` says one (a CPU, another byte source) or the counter cannot count here;
    else the calibration of this run, measured now."""
    if all(tier.kv_tier(c) == "hbm" for c in configs):
        return None
    if why_not is not None:
        return LinkRun(None, why_not)
    works, why = link.available()
    if not works:
        return LinkRun(None, f"{link.METRIC}: {why}")
    try:
        calibration = link.calibrate()
    except Exception as exc:  # deliberately any: a calibration that fails (CUPTI, CuPy, pinned
        # memory) leaves the run's link bytes modelled, said in one line
        return LinkRun(None, f"link calibration failed: {type(exc).__name__}: {exc}"[:300])
    return LinkRun(calibration, calibration.why_not())


def cpu_reason(backend) -> str:
    """Why a CPU backend counts no link bytes."""
    return CPU_REASON.format(getattr(backend, "name", "?"))


def fields(run: LinkRun | None, cfg, launch: Callable[[int], object] | None = None,
           calls: int = 0, pass_ms: float | None = None) -> dict:
    """Row fields of one stage's link bytes: measured over launch(layer), layers 0..calls-1,
    where the run counts; else `link_reason`; {} over HBM (or with no launch where it counts:
    a row whose bytes are summed from its stages')."""
    if run is None or tier.kv_tier(cfg) == "hbm":
        return {}
    if not run.counting:
        return {"link_reason": run.reason}
    if launch is None:
        return {}
    try:
        got = link.stage_bytes(launch, calls, run.calibration, pass_ms)
    except Exception as exc:  # deliberately any: a failed window is a reason on the row,
        # never a lost row (as the sweep's DRAM bytes)
        return {"link_reason": f"link bytes not counted: {type(exc).__name__}: {exc}"[:300]}
    return {"measured_link_bytes": got.raw, "calibrated_link_bytes": got.calibrated,
            "link_factor": got.factor}


def summed(parts: list[dict]) -> dict:
    """The Quest step's link fields as the sum of its stages' (estimate, top-K, attention), or
    the first stage's reason, or {} when none carries link fields."""
    if parts and all(p.get(MEASURED[0]) is not None for p in parts):
        return {**{f: sum(p[f] for p in parts) for f in MEASURED},
                "link_factor": parts[0]["link_factor"]}
    reason = next((p["link_reason"] for p in parts if p.get("link_reason")), None)
    return {"link_reason": reason} if reason else {}

