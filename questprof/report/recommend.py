"""What a recommendation rests on and how sure it is, in plain sentences (the report and the
command line print the same ones).

A recommendation is the fastest setting whose p10 mass recall reaches the floor (fidelity_frames.
recommend). Its sentence names the fidelity it stands on: the model and its shape, the prompts
and their length, and, when that model's shape or length is not the sweep's, that it is a proxy.
Setting rows (layer, head and step empty; fidelity/rows.py) carry 95% bootstrap intervals of
mean and p10 mass recall; a setting whose interval holds the floor is "not decided". Passkey
accuracy comes with n and a Wilson interval. Rows written before intervals existed say so.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from questprof.fidelity.stats import verdict, wilson
from questprof.report import fidelity_frames as ff
from questprof.report.frames import fmt_tokens, fmt_x

SHAPE = ("q_heads", "kv_heads", "head_dim", "layers")
INTERVAL = ["mass_recall_lo", "mass_recall_hi", "mass_recall_p10_lo", "mass_recall_p10_hi"]
TIMED = ("quest", "dense")  # stages whose rows carry the sweep's model
LISTED = 4  # settings named in a sentence before "and N more"
NOT_RECORDED = "source not recorded"


@dataclass(frozen=True)
class Model:
    """A model's name and attention shape as the rows record them (None where they do not)."""

    name: str | None
    shape: tuple | None

    def text(self) -> str:
        if self.name is None:
            return f"a model ({NOT_RECORDED})"
        if self.shape is None:
            return f"{self.name} (shape not recorded)"
        q, kv, d, layers = self.shape
        return f"{self.name} ({q} q / {kv} KV heads of {d} dims, {layers} layers)"


def _model(rows: pd.DataFrame) -> Model:
    if rows.empty or "model" not in rows or rows["model"].dropna().empty:
        return Model(None, None)
    first = rows.dropna(subset=["model"]).iloc[0]
    shape = tuple(first.get(c) for c in SHAPE)
    known = all(v is not None and not pd.isna(v) for v in shape)
    return Model(str(first["model"]), tuple(int(v) for v in shape) if known else None)


@dataclass(frozen=True)
class Basis:
    """The fidelity a recommendation rests on, and the sweep it is joined to (if any)."""

    model: Model
    source: str
    length: int
    prompts: int | None
    steps: int | None
    target: Model | None
    target_length: int | None

    @property
    def proxy(self) -> bool:
        """Whether the fidelity model's shape or length is not the sweep's."""
        if self.target is None:
            return False
        same_shape = self.model.shape is not None and self.model.shape == self.target.shape
        return not same_shape or self.length != self.target_length

    def prompts_text(self) -> str:
        what = ff_source_noun(self.source)
        count = f"{self.prompts} {what}" if self.prompts else f"{what} (count not recorded)"
        return f"{count} at {fmt_tokens(self.length)}"

    def text(self) -> str:
        """'<prompts> of <model>' and, for a proxy, what it stands in for."""
        own = f"{self.prompts_text()} of {self.model.text()}"
        if self.source == "random-tokens":
            return f"{own}: random weights, whose attention is no trained model's (timing only)"
        if self.target is None:
            return own
        if not self.proxy:
            return f"{own}: the sweep's own model at its length"
        return (f"{own}, a proxy: fidelity of {self.model.name or NOT_RECORDED} at "
                f"{fmt_tokens(self.length)} stands in for {self.target.text()} at "
                f"{fmt_tokens(self.target_length)}")


def ff_source_noun(source: str) -> str:
    return {"passkey": "passkey prompts", "natural": "natural-text prompts",
            "random-tokens": "random-token prompts (random weights)",
            "cache": "saved captures"}.get(source, f"{source} caches")


def basis(df: pd.DataFrame, source: str, length: int) -> Basis:
    """The Basis of fidelity rows of `source` at `length`, against the sweep's rows."""
    fid = df[(df["stage"] == "fidelity") & (df["source"] == source) & (df["length"] == length)]
    prompts = fid["samples"].max() if "samples" in fid else None
    steps = fid["steps"].max() if "steps" in fid else None
    if (steps is None or pd.isna(steps)) and "step" in fid:
        steps = fid["step"].max() + 1 if fid["step"].notna().any() else None
    timed = df[df["stage"].isin(TIMED) & (df["status"] == "ok")] if "status" in df else df.iloc[:0]
    target = _model(timed) if not timed.empty else None
    longest = int(ff.speed(df)["speed_length"].max()) if target is not None else None
    as_int = lambda v: None if v is None or pd.isna(v) else int(v)  # noqa: E731
    return Basis(_model(fid), source, int(length), as_int(prompts), as_int(steps), target,
                 longest)


def intervals(df: pd.DataFrame) -> pd.DataFrame:
    """Setting rows' intervals per (source, length, page_size, budget, mode); empty without."""
    if not set(INTERVAL) <= set(df.columns):
        return pd.DataFrame(columns=ff.SETTING + INTERVAL)
    rows = df[(df["stage"] == "fidelity") & df["head"].isna() & df["step"].isna()
              & df["mass_recall_p10_lo"].notna()]
    return rows[ff.SETTING + INTERVAL].drop_duplicates(ff.SETTING)


def frontier(df: pd.DataFrame, floor: float) -> pd.DataFrame:
    """fidelity_frames.frontier with each setting's intervals and its verdict at the floor."""
    table = ff.frontier(df)
    if table.empty:
        return table
    got = intervals(df).rename(columns={"length": "fidelity_length"})
    table = table.merge(got, on=["source", "fidelity_length"] + ff.JOIN, how="left")
    table["verdict"] = [verdict(lo, hi, floor) for lo, hi in
                        zip(table["mass_recall_p10_lo"], table["mass_recall_p10_hi"])]
    return table


def fmt_recall(row) -> str:
    """'0.946 (95% interval 0.931-0.958)', or the value with 'interval not recorded'."""
    value = row.get("mass_recall_p10")
    lo, hi = row.get("mass_recall_p10_lo"), row.get("mass_recall_p10_hi")
    if lo is None or hi is None or pd.isna(lo) or pd.isna(hi):
        return f"{value:.3f} (interval not recorded)"
    return f"{value:.3f} (95% interval {lo:.3f}-{hi:.3f})"


def fmt_share(share, n) -> str:
    """'12/20 (60%, 95% interval 39-78%)' from a share of n prompts."""
    if share is None or pd.isna(share) or not n or pd.isna(n):
        return "–"
    n = int(n)
    k = int(round(float(share) * n))
    lo, hi = wilson(k, n)
    return f"{k}/{n} ({k / n:.0%}, 95% interval {lo:.0%}-{hi:.0%})"


def setting_name(row) -> str:
    return (f"page {int(row['page_size'])}, budget {fmt_tokens(row['budget'])}, "
            f"{row['mode']}")


def _speed_text(row: dict, measured: bool) -> str:
    if measured:
        return f"{fmt_x(row['speedup'])} at {fmt_tokens(row['speed_length'])} (measured speedup)"
    return (f"{fmt_x(row['rank'])} by the byte formula 1/rho at "
            f"{fmt_tokens(row['fidelity_length'])} (no speed rows)")


def _listed(rows: pd.DataFrame) -> str:
    names = [f"{setting_name(r)} ({r['mass_recall_p10']:.3f}, "
             f"{r['mass_recall_p10_lo']:.3f}-{r['mass_recall_p10_hi']:.3f})"
             for _, r in rows.head(LISTED).iterrows()]
    more = f" and {len(rows) - LISTED} more" if len(rows) > LISTED else ""
    return "; ".join(names) + more


def _ranked(table: pd.DataFrame, measured: bool) -> pd.DataFrame:
    rank = table["speedup"] if measured else table.apply(ff._formula_speed, axis=1)
    return table.assign(rank=rank).sort_values("rank", ascending=False)


def _row(table: pd.DataFrame, setting: dict) -> dict:
    hit = table
    for key in ff.JOIN:
        hit = hit[hit[key] == setting[key]]
    return hit.iloc[0].to_dict()


def _how_sure(table: pd.DataFrame, best: dict, floor: float, measured: bool) -> list[str]:
    """Whether the floor decides the recommended setting, and which settings it cannot tell."""
    ranked = _ranked(table, measured)
    same = (ranked[ff.JOIN] == pd.Series({k: best[k] for k in ff.JOIN})).all(axis=1)
    others = ranked[~same & (ranked["verdict"] == "not decided")]
    lines = []
    if best["verdict"] == "no interval":
        return ["How sure: these rows carry no intervals (written before questprof recorded "
                "them); run questprof fidelity again for 95% intervals."]
    if best["verdict"] == "not decided":
        decided = ranked[ranked["verdict"] == "passes"]
        first = (f" The fastest setting whose whole interval clears it: "
                 f"{setting_name(decided.iloc[0])}, "
                 f"{_speed_text(decided.iloc[0].to_dict(), measured)}."
                 if not decided.empty else " No setting's whole interval clears it.")
        lines.append(f"Not decided: the floor {floor:g} lies inside this setting's 95% "
                     f"interval, so the sample cannot tell whether it keeps the floor.{first}")
    else:
        lines.append(f"Decided: its whole 95% interval clears the floor {floor:g}.")
    if not others.empty:
        lines.append(f"Indistinguishable from the floor (their intervals hold {floor:g}): "
                     f"{_listed(others)}.")
    return lines


def _passkey(df: pd.DataFrame, b: Basis, setting: dict) -> list[str]:
    task = df[(df["stage"] == "passkey") & (df["length"] == b.length)] if "stage" in df else df
    for key in ff.JOIN:
        task = task[task[key] == setting[key]] if not task.empty else task
    if task.empty:
        return []
    row = task.iloc[-1]
    n = row.get("samples")
    return [f"Passkey at {fmt_tokens(b.length)} with this setting: Quest "
            f"{fmt_share(row.get('passkey_quest_correct'), n)}, dense "
            f"{fmt_share(row.get('passkey_dense_correct'), n)}."]


def _versus(rec: dict, measured: bool) -> list[str]:
    best, fastest = rec["setting"], rec["fastest"]
    if fastest is None or all(best[k] == fastest[k] for k in ff.JOIN):
        return ["It is also the fastest setting."]
    return [f"The fastest outright, {setting_name(fastest)}, "
            f"{_speed_text(fastest, measured)}, misses the floor (p10 "
            f"{fastest['mass_recall_p10']:.3f})."]


def advice(df: pd.DataFrame, floor: float) -> list[str]:
    """The recommendation under `floor` as sentences; [] without fidelity rows."""
    rec = ff.recommend(df, floor) if ff.has_fidelity(df) else None
    if rec is None:
        return []
    table = frontier(df, floor)
    b = basis(df, table["source"].iloc[0], int(table["fidelity_length"].iloc[0]))
    lines = [f"Fidelity floor: 10th-percentile mass recall over the sparse layers' heads "
             f"≥ {floor:g}."]
    if rec["setting"] is None:
        return lines + [f"No measured setting with a budget below the context reaches it on "
                        f"{b.text()}; raise the budget (below the context) or lower "
                        "--min-recall."]
    best = {**rec["setting"], **_row(table, rec["setting"])}
    lines.append(f"Recommended: {setting_name(best)}: {_speed_text(best, rec['measured'])}; "
                 f"p10 mass recall {fmt_recall(best)} on {b.text()}.")
    return (lines + _how_sure(table, best, floor, rec["measured"]) + _passkey(df, b, best)
            + _versus(rec, rec["measured"]))


def unmeasured(df: pd.DataFrame, where: str | None) -> list[str]:
    """Speed rows without fidelity rows: say the ranking is by speed alone, and the command
    that adds a real model's fidelity to the directory `where`."""
    speed = ff.speed(df)
    if ff.has_fidelity(df) or speed.empty:
        return []
    timed = df[df["stage"].isin(TIMED)]
    length = min(int(timed["length"].max()), 8192)  # SmolLM2-135M's context is 8k
    join = lambda xs: ",".join(str(int(x)) for x in sorted(set(xs)))  # noqa: E731
    modes = sorted(set(speed["mode"]))
    mode = "" if modes == ["per-head"] else f" --mode {','.join(modes)}"
    command = (f"questprof fidelity --source passkey --model smollm2 --lengths "
               f"{fmt_tokens(length)} --page-size {join(speed['page_size'])} --budget "
               f"{join(speed['budget'])}{mode} --out {where or 'DIR'}")
    return ["Ranked by speed alone: what each setting loses in attention was not measured "
            "(no fidelity rows in this directory).",
            f"Add real-model fidelity to this directory with: {command}",
            f"With --model PATH (a transformers folder or .gguf file of {_shaped(timed)}) it "
            "measures that model instead of SmolLM2-135M as a proxy."]


def _shaped(timed: pd.DataFrame) -> str:
    """'a model of the shape timed here: ...': a scenario (smoke) names a shape, not a model."""
    shape = _model(timed).shape
    if shape is None:
        return "a model of the shape timed here"
    q, kv, d, layers = shape
    return f"a model of the shape timed here: {q} q / {kv} KV heads of {d} dims, {layers} layers"

