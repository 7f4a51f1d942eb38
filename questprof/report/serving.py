"""The serving section: what `questprof serve` measured in transformers' continuous batching,
per policy and concurrency (rows of stages 'serve', one per run with its decode steps' split,
and 'serve-request', one per request with its per-token latencies `token_ms`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from questprof.core import model
from questprof.report.figures import PALETTE
from questprof.report.html import esc, figure, table

RUN, REQUEST = "serve", "serve-request"
LEDE = ("A request mix served by transformers' continuous batching with questprof's decode "
        "attention (engine transformers: its own, the baseline), once per policy (dense; "
        "quest: Quest's selection in every layer past the dense ones; hybrid: Quest only for "
        "requests longer than the sweep's crossover) and concurrency (requests per batch); run "
        "in several rounds (serve --rounds: the order reversed every other round), each "
        "setting shows its median over them. Output lengths are forced, so every policy does "
        "the same work. Per-token latency is the gap between consecutive tokens of a request; "
        "TTFT from a request's arrival to its first token. The table's last columns are the "
        "decode steps' ragged shapes: requests, their pages and the pages read, per step.")
COLUMNS = {"policy": "policy", "engine": "engine", "concurrency": "concurrency",
           "rounds": "rounds", "requests": "requests",
           "token_p50_ms": "per token p50 ms", "token_p95_ms": "p95 ms",
           "token_p99_ms": "p99 ms", "ttft_p50_ms": "TTFT p50 ms", "ttft_p95_ms": "TTFT p95 ms",
           "tokens_per_s": "tokens/s", "steps": "decode steps",
           "step_requests_mean": "requests/step", "step_active_pages_mean": "pages/step",
           "step_pages_read_mean": "pages read/step", "crossover": "hybrid from"}

STEP_LEDE = ("Where a decode step's time goes (steps with at least one decode request; "
             "serving/step_time.py says how each part is timed): questprof's attention for the "
             "decode requests, transformers' cache reads and writes, prefill chunks of other "
             "requests (their attention and their tokens' share of the rest of the model), the "
             "rest of the model, and the Python between forwards, as shares of the steps' time. "
             "Amdahl: the limit 1 / (1 - attention share); beside dense at the same concurrency, "
             "the step speedup predicted from dense's attention share and the measured speedup "
             "of the attention part, and the step speedup measured (over rounds: from each "
             "column's median). Under transformers' own attention its time is inside the rest "
             "of the model (attention left blank).")
STEP_COLUMNS = {"policy": "policy", "engine": "engine", "concurrency": "concurrency",
                "step_ms_mean": "decode step ms", "attention_share": "attention",
                "cache_share": "cache reads/writes", "prefill_share": "prefill chunks",
                "model_rest_share": "rest of the model", "python_share": "Python between",
                "amdahl_limit": "Amdahl limit x", "amdahl_predicted": "Amdahl predicted x",
                "step_speedup": "measured x"}


SETTING = ["policy", "engine", "concurrency"]  # what one run of the grid fixes


def per_setting(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per setting: a setting run in several rounds (serve --rounds) as the median of
    each numeric column over them, their count in `rounds`."""
    runs = runs.copy()
    runs["engine"] = runs["engine"].fillna("") if "engine" in runs else ""
    if "round" not in runs or not runs.duplicated(SETTING).any():
        return runs.assign(rounds=1)
    numeric = [c for c in runs.columns if c not in SETTING and c != "round"
               and pd.api.types.is_numeric_dtype(runs[c])]
    other = [c for c in runs.columns if c not in SETTING and c not in numeric]
    groups = runs.groupby(SETTING, sort=True)
    return pd.concat([groups[numeric].median(), groups[other].first(),
                      groups.size().rename("rounds")], axis=1).reset_index()


def has_rows(df: pd.DataFrame) -> bool:
    return "stage" in df and bool((df["stage"] == RUN).any())


def _label(row) -> str:
    return f"{row['policy']}, concurrency {int(row['concurrency'])}"


def cdf_figure(requests: pd.DataFrame) -> go.Figure:
    """Per-token latency CDF, one line per (policy, concurrency)."""
    fig = go.Figure()
    for i, (key, rows) in enumerate(requests.groupby(["policy", "concurrency"], sort=True)):
        gaps = np.sort(np.concatenate([np.asarray(g, float) for g in rows["token_ms"]]))
        fig.add_trace(go.Scatter(
            x=gaps, y=np.arange(1, len(gaps) + 1) / max(len(gaps), 1), mode="lines",
            name=f"{key[0]}, concurrency {int(key[1])}", line={"shape": "hv",
                                                               "color": PALETTE[i % len(PALETTE)]}))
    fig.update_layout(title="Per-token latency, CDF", xaxis_title="ms between tokens",
                      yaxis_title="fraction of tokens", xaxis_type="log", height=380)
    return fig


def throughput_figure(runs: pd.DataFrame) -> go.Figure:
    """Tokens per second against concurrency, one line per policy."""
    fig = go.Figure()
    for i, (name, rows) in enumerate(runs.groupby("policy", sort=True)):
        rows = rows.sort_values("concurrency")
        fig.add_trace(go.Scatter(x=rows["concurrency"], y=rows["tokens_per_s"], name=name,
                                 mode="lines+markers", line={"color": PALETTE[i % len(PALETTE)]}))
    fig.update_layout(title="Throughput against concurrency", xaxis_title="requests per batch",
                      yaxis_title="tokens/s", height=340)
    return fig


def _shown(runs: pd.DataFrame) -> pd.DataFrame:
    """The table's rows, rounded for reading."""
    out = runs.sort_values(["policy", "concurrency"]).copy()
    for col in COLUMNS:
        if col not in out:
            out[col] = None
        elif out[col].dtype.kind == "f" and col != "crossover":
            out[col] = out[col].map(lambda v: f"{v:.3g}" if pd.notna(v) else "")
    out["crossover"] = out["crossover"].map(lambda v: "" if pd.isna(v) else int(v))
    return out


def amdahl(runs: pd.DataFrame) -> pd.DataFrame:
    """Runs with each decode step's split and Amdahl's figures (core.model.amdahl_speedup):
    the limit 1 / (1 - f) of a step whose attention share is f, and for a policy beside dense
    at the same concurrency, the step speedup Amdahl predicts from dense's share and the
    measured speedup of the attention part, and the step speedup measured."""
    out = runs.copy()
    f = out["attention_share"]
    out["amdahl_limit"] = 1.0 / (1.0 - f)
    attention = f * out["step_ms_mean"]
    dense = out[out["policy"] == "dense"].set_index("concurrency")
    predicted, measured = [], []
    for row, ms in zip(out.itertuples(), attention):
        base = dense.loc[row.concurrency] if row.concurrency in dense.index else None
        if base is None or row.policy == "dense" or not ms > 0:
            predicted.append(np.nan)
            measured.append(np.nan)
            continue
        speedup = base["attention_share"] * base["step_ms_mean"] / ms
        predicted.append(model.amdahl_speedup(base["attention_share"], speedup))
        measured.append(base["step_ms_mean"] / row.step_ms_mean)
    out["amdahl_predicted"], out["step_speedup"] = predicted, measured
    return out


GRAPHS_NOTE = ("Runs of transformers' CUDA graphs (serve --cuda-graph, engine '{}') have no "
               "step parts: a replayed graph calls none of the hooks that time a forward, so "
               "their tokens are timed and their steps are not.")


def step_section(runs: pd.DataFrame) -> str:
    """The table of where a decode step's time goes, per run ('' for runs without it), and a
    line for runs of CUDA graphs (none: serving/step_time.py says why)."""
    engines = runs["engine"].astype(str) if "engine" in runs else pd.Series(dtype=str)
    graphs = sorted(set(engines[engines.str.endswith(":graphs")]))
    note = f"<p>{esc(GRAPHS_NOTE.format(', '.join(graphs)))}</p>" if graphs else ""
    runs = runs[~engines.isin(graphs)] if graphs else runs  # rows before e745118 had parts
    runs = runs.dropna(subset=["step_ms_mean"]) if "step_ms_mean" in runs else runs[:0]
    if runs.empty:
        return note
    shown = amdahl(runs).sort_values(["policy", "concurrency"])
    for col in tuple(STEP_COLUMNS)[3:]:
        shown[col] = shown[col].map(lambda v: f"{v:.3g}" if pd.notna(v) else "")
    return f"<p>{STEP_LEDE}</p>" + table(shown, STEP_COLUMNS, "serving-steps",
                                          numeric=tuple(STEP_COLUMNS)[2:]) + note


def section(df: pd.DataFrame) -> str:
    """The tables (a setting's median over rounds), the latency CDF (every round's tokens)
    and throughput against concurrency."""
    runs = per_setting(df[df["stage"] == RUN])
    requests = df[(df["stage"] == REQUEST) & df["token_ms"].notna()]
    html = table(_shown(runs), COLUMNS, "serving", numeric=tuple(COLUMNS)[2:])
    html += step_section(runs)
    if len(requests):
        html += figure(cdf_figure(requests), "serving-cdf")
    return html + figure(throughput_figure(runs), "serving-throughput")


def sections(df: pd.DataFrame, meta: dict) -> list[tuple[str, str, str, str]]:
    """[(anchor, title, lede, html)] of the serving section; [] without serve rows."""
    if not has_rows(df):
        return []
    return [("serving", "Serving: latency per token in a continuous-batching loop", LEDE,
             section(df))]
