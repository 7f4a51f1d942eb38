"""Result rows of fidelity: per (setting, layer, head) over decode steps, per (setting, step).

A `head` row holds each metric's mean over the decode steps (and prompts) of one q head of one
layer, plus `mass_recall_worst_step`; a `step` row holds the mean over the sparse layers' heads
at one decode step, plus `mass_recall_p10` over those heads; a `setting` row (layer, head and
step empty) holds the mean and the 10th percentile over heads of mass recall with their 95%
bootstrap intervals over prompts and steps (fidelity.stats), the prompts (`samples`) and the
decode `steps`. Passkey rows (stage 'passkey') hold the share of prompts answered right with
dense and with Quest attention.
"""

from __future__ import annotations

import warnings

import numpy as np

from questprof.core.layout import pages_for
from questprof.fidelity.evaluate_selectors import selector_fields
from questprof.fidelity.metrics import METRICS
from questprof.fidelity.stats import recall_interval

STAGE = "fidelity"
TASK_STAGE = "passkey"
DIGITS = 5  # metrics rounded to 5 decimals: rows.jsonl stays a few MB for 3 lengths x 45 settings


def _round(x) -> float | None:
    x = float(x)
    return None if np.isnan(x) else round(x, DIGITS)


def base_row(meta: dict, length: int, page_size: int, budget: int, mode: str) -> dict:
    """Key fields shared by the rows of one setting (meta: scenario, model, shape, source...)."""
    pages = pages_for(length, page_size)
    return {**meta, "length": int(length), "batch": 1, "page_size": page_size,
            "budget": budget, "k_pages": budget // page_size, "pages": pages, "status": "ok",
            "reason": "budget covers every page" if budget // page_size >= pages else None,
            "mode": mode}


def head_rows(base: dict, metrics: np.ndarray, dense_layers: int) -> list[dict]:
    """Rows per (layer, head) from metrics [samples, layers, steps, len(METRICS), Hq]."""
    mean = np.nanmean(metrics, axis=(0, 2))                   # [layers, M, Hq]
    worst = np.nanmin(metrics[:, :, :, 0], axis=(0, 2))        # mass_recall, [layers, Hq]
    rows = []
    for layer in range(mean.shape[0]):
        for head in range(mean.shape[2]):
            row = {**base, "stage": STAGE, "layer": layer, "head": head, "step": None,
                   "dense_layer": layer < dense_layers}
            row.update({m: _round(mean[layer, i, head]) for i, m in enumerate(METRICS)})
            row["mass_recall_worst_step"] = _round(worst[layer, head])
            rows.append(row)
    return rows


def step_rows(base: dict, metrics: np.ndarray, dense_layers: int) -> list[dict]:
    """Rows per decode step over the sparse layers' heads (all layers when none is sparse)."""
    sparse = _sparse(metrics, dense_layers)
    rows = []
    for step in range(sparse.shape[2]):
        at = sparse[:, :, step]                                   # [samples, layers, M, Hq]
        row = {**base, "stage": STAGE, "layer": None, "head": None, "step": step,
               "dense_layer": False}
        row.update({m: _round(np.nanmean(at[:, :, i])) for i, m in enumerate(METRICS)})
        recall = at[:, :, 0].mean(axis=0).ravel()                # per (layer, head)
        row["mass_recall_p10"] = _round(np.nanpercentile(recall, 10))
        rows.append(row)
    return rows


def _sparse(metrics: np.ndarray, dense_layers: int) -> np.ndarray:
    """The sparse layers of metrics [samples, layers, ...] (all layers when none is sparse)."""
    return metrics[:, dense_layers:] if metrics.shape[1] > dense_layers else metrics


def setting_row(base: dict, metrics: np.ndarray, dense_layers: int) -> dict:
    """The row of one setting: mass recall's mean and p10 over the sparse layers' heads, each
    with its bootstrap interval over prompts and steps."""
    recall = _sparse(metrics, dense_layers)[:, :, :, 0]              # [samples, L, steps, Hq]
    samples, layers, steps, heads = recall.shape
    values = recall.transpose(0, 2, 1, 3).reshape(samples, steps, layers * heads)
    got = recall_interval(values)
    row = {**base, "stage": STAGE, "layer": None, "head": None, "step": None,
           "dense_layer": False, "steps": steps, "mass_recall": _round(got.mean),
           "mass_recall_p10": _round(got.p10)}
    return {**row, **got.columns(DIGITS)}


def metric_rows(meta: dict, length: int, metrics: dict, dense_layers: int) -> list[dict]:
    """The head, step and setting rows of one length from {setting: metrics [samples, layers,
    steps, M, Hq]} (evaluate.evaluate_batch, prompts along the first axis)."""
    rows = []
    with warnings.catch_warnings():  # mass_bound is NaN but for branch and bound: no warning
        warnings.simplefilter("ignore", RuntimeWarning)
        for key, stacked in metrics.items():
            page_size, budget, mode = key[:3]
            base = {**base_row(meta, length, page_size, budget, mode), "samples": len(stacked)}
            base.update(selector_fields(key, stacked, base["pages"], dense_layers))
            rows += head_rows(base, stacked, dense_layers) + step_rows(base, stacked, dense_layers)
            rows.append(setting_row(base, stacked, dense_layers))
    return rows


def task_row(meta: dict, length: int, page_size: int, budget: int, mode: str,
             dense: list, quest: list) -> dict:
    """The passkey row of one setting: share of prompts right with dense and with Quest."""
    row = {**base_row(meta, length, page_size, budget, mode), "stage": TASK_STAGE,
           "layer": None, "head": None, "step": None, "samples": len(dense)}
    row["passkey_dense_correct"] = float(np.mean(dense)) if dense else None
    row["passkey_quest_correct"] = float(np.mean(quest)) if quest else None
    return row


def divergence_fields(answers: list) -> dict:
    """Where a setting's answers leave dense's (task_answers.Answer per prompt):
    `dense_agreement` (share of prompts whose tokens all equal dense's), `first_divergence`
    (per prompt, '|'-joined, '-' where none within the steps), `first_divergence_median` (over
    the prompts that diverge; None when none does) and `forced_match` (teacher-forced: share of
    steps whose argmax equals dense's, mean over prompts; None when not run)."""
    seen = [a.first_divergence for a in answers]
    diverged = [s for s in seen if s is not None]
    forced = [a.forced_match for a in answers if a.forced_match is not None]
    return {"dense_agreement": float(np.mean([s is None for s in seen])) if seen else None,
            "first_divergence": "|".join("-" if s is None else str(s) for s in seen),
            "first_divergence_median": float(np.median(diverged)) if diverged else None,
            "forced_match": _round(np.mean(forced)) if forced else None}
