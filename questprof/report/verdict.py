"""The one sentence atop "At a glance": on this machine, for this model, Quest at one page size
and budget is X times faster than dense attention at the longest length, and the whole decode
step Y times.

The setting is the one the fidelity floor recommends, else the fastest at the longest length;
the batch is the smallest timed (decode's latency case, the Quest paper's). Y is the e2e row of
that very point where one was measured; else Amdahl's law over the share of a dense step that
attention takes, measured by an e2e row at that batch and length, or else modelled from the
bytes a step reads (the weights at 16 bits and every layer's K and V); the first dense_layers
stay dense under Quest either way.
"""

from __future__ import annotations

import pandas as pd

from questprof.core import model
from questprof.core.config import ConfigError, config_from_dict
from questprof.report.frames import CURVE, outcome, fmt_tokens, fmt_x


def _point(pairs: pd.DataFrame, pick: dict | None) -> pd.Series | None:
    """The pairs row the sentence speaks of (see the module's docstring)."""
    rows = pairs.dropna(subset=["speedup"])
    if pick is not None:
        rows = rows[(rows["page_size"] == pick["page_size"]) & (rows["budget"] == pick["budget"])
                    & (rows["mode"] == pick["mode"])]
    if rows.empty:
        return None
    rows = rows[rows["batch"] == rows["batch"].min()]
    rows = rows[rows["length"] == rows["length"].max()]
    return rows.sort_values("speedup", ascending=False).iloc[0]


def _same(rows: pd.DataFrame, point: pd.Series, keys) -> pd.DataFrame:
    for key in keys:
        if key in rows:
            rows = rows[rows[key] == point[key]]
    return rows


def _plain(value):
    """A row's value as the dataclasses take it: 2.0 (a column with gaps) as 2."""
    if hasattr(value, "item"):
        value = value.item()
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _step(point: pd.Series, df: pd.DataFrame) -> tuple[float, str] | None:
    """(Y, how it was found) for the point, None when the rows cannot say."""
    e2e = df[(df["stage"] == "e2e") & (df["status"] == "ok")] if "stage" in df else df.iloc[0:0]
    exact = _same(e2e, point, [*CURVE[1:], "length"])
    if "measured_speedup" in exact and exact["measured_speedup"].notna().any():
        return float(exact["measured_speedup"].dropna().iloc[0]), "measured"
    timed = df[(df["stage"] == "quest") & (df["status"] == "ok")]
    row = _same(timed, point, [*CURVE[1:], "length"])
    try:
        cfg = config_from_dict({k: _plain(v) for k, v in row.iloc[0].dropna().items()})
    except (IndexError, KeyError, TypeError, ValueError, ConfigError):  # rows without a shape
        return None
    shape, speedup = cfg.model, float(point["speedup"])
    attention = shape.layers / (shape.dense_layers + (shape.layers - shape.dense_layers) / speedup)
    share = _same(e2e, point, ["batch", "length"])
    if "attention_fraction" in share and share["attention_fraction"].notna().any():
        fraction = float(share["attention_fraction"].dropna().iloc[0])
        how = f"Amdahl over attention's measured share of a dense step there, {fraction:.0%}"
    else:
        kv = shape.layers * model.stage_work(cfg)["dense"].read
        fraction = kv / (kv + model.weight_bytes(shape, 16))
        how = (f"modelled: Amdahl over attention's share of the bytes a dense step reads, "
               f"{fraction:.0%}")
    return model.amdahl_speedup(fraction, attention), how


def _faster(point: pd.Series) -> str:
    """'is 3.21 times faster than', or a tie or a loss said as such."""
    state, x = outcome(point), float(point["speedup"])
    if state == "tie":
        return f"ties ({fmt_x(x)}, within the p20..p80 spreads) with"
    if state == "loss":
        return f"is slower ({fmt_x(x)}) than"
    return f"is {x:.2f} times faster than"


def sentence(pairs: pd.DataFrame, df: pd.DataFrame, meta: dict, pick: dict | None) -> str | None:
    """The verdict, None when no point has both a Quest and a dense time."""
    point = _point(pairs, pick)
    if point is None:
        return None
    machine = (meta.get("machine") or {}).get("gpu")
    where = f"this machine ({machine})" if machine else "this machine (the CPU, NumPy)"
    name = point.get("shape") or meta.get("scenario") or "this model"
    head = (f"On {where}, for {name}, Quest at page {int(point['page_size'])}, budget "
            f"{fmt_tokens(point['budget'])} {_faster(point)} dense attention at "
            f"{fmt_tokens(point['length'])} tokens (batch {int(point['batch'])})")
    step = _step(point, df)
    if step is None:
        return head + "; the whole decode step was not measured."
    slower = " (slower)" if step[0] < 1 else ""
    return head + f", and the whole decode step {step[0]:.2f} times{slower} ({step[1]})."
