"""How sure a fidelity figure is: Wilson intervals of task accuracy, bootstrap intervals of mass
recall over prompts and decode steps, and the verdict of a setting against a floor.

NumPy only (the report imports it without torch). Intervals are 95% two-sided.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
RESAMPLES = 1000  # bootstrap draws: the 2.5th / 97.5th percentiles move < 0.002 beyond this
SEED = 0
P10 = 10.0  # the percentile over heads that the floor judges


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial share `correct`/`n` (nan, nan when n is 0)."""
    if n <= 0:
        return math.nan, math.nan
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class RecallInterval:
    """Mean and 10th percentile (over heads) of mass recall, each with its 95% interval."""

    mean: float
    mean_lo: float
    mean_hi: float
    p10: float
    p10_lo: float
    p10_hi: float
    resamples: int
    seed: int

    def columns(self, digits: int = 5) -> dict:
        """Row columns: mass_recall_lo/_hi, mass_recall_p10_lo/_hi, bootstrap, bootstrap_seed."""
        r = lambda x: None if math.isnan(x) else round(float(x), digits)  # noqa: E731
        return {"mass_recall_lo": r(self.mean_lo), "mass_recall_hi": r(self.mean_hi),
                "mass_recall_p10_lo": r(self.p10_lo), "mass_recall_p10_hi": r(self.p10_hi),
                "bootstrap": self.resamples, "bootstrap_seed": self.seed}


def _weights(rng, prompts: int, steps: int, resamples: int) -> np.ndarray:
    """Counts [R, prompts, steps] of a two-stage resample: prompts with replacement, then the
    steps of each drawn prompt with replacement (steps of one prompt move together first)."""
    drawn = rng.integers(0, prompts, (resamples, prompts))
    picked = rng.integers(0, steps, (resamples, prompts, steps))
    w = np.zeros((resamples, prompts, steps))
    r = np.arange(resamples)[:, None, None]
    np.add.at(w, (r, drawn[:, :, None], picked), 1.0)
    return w


def _per_head(values: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted mean per head [R, H] of values [P, T, H] under weights w [R, P, T]; nan-safe."""
    ok = np.isfinite(values)
    total = np.einsum("rpt,pth->rh", w, np.where(ok, values, 0.0))
    count = np.einsum("rpt,pth->rh", w, ok.astype(np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        return total / count


def recall_interval(values, resamples: int = RESAMPLES, seed: int = SEED) -> RecallInterval:
    """Bootstrap of mass recall values [prompts, steps, heads] (heads: the sparse layers' (layer,
    head) pairs): the mean over everything and the p10 over heads of each head's mean, with
    95% percentile intervals over a seeded two-stage resample of prompts and steps."""
    values = np.asarray(values, dtype=np.float64)
    prompts, steps, _ = values.shape
    head_means = _per_head(values, np.ones((1, prompts, steps)))[0]
    mean = float(np.nanmean(values)) if np.isfinite(values).any() else math.nan
    p10 = float(np.nanpercentile(head_means, P10)) if np.isfinite(head_means).any() else math.nan
    if math.isnan(mean):
        return RecallInterval(mean, mean, mean, p10, p10, p10, 0, seed)
    rng = np.random.default_rng(seed)
    heads = _per_head(values, _weights(rng, prompts, steps, resamples))   # [R, H]
    means = np.nanmean(heads, axis=1)
    p10s = np.nanpercentile(heads, P10, axis=1)
    (m_lo, m_hi), (p_lo, p_hi) = (np.nanpercentile(x, [2.5, 97.5]) for x in (means, p10s))
    return RecallInterval(mean, float(m_lo), float(m_hi), p10, float(p_lo), float(p_hi),
                          resamples, seed)


def verdict(lo, hi, floor: float) -> str:
    """'passes' (the whole interval at or above the floor), 'fails' (all of it below), 'not
    decided' (the floor inside it), or 'no interval' (none recorded: judged by the value)."""
    if lo is None or hi is None or _nan(lo) or _nan(hi):
        return "no interval"
    if lo >= floor:
        return "passes"
    if hi < floor:
        return "fails"
    return "not decided"


def _nan(x) -> bool:
    try:
        return math.isnan(float(x))
    except (TypeError, ValueError):
        return True
