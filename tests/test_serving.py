"""The serving loop's pieces that need no model: latency figures from known timestamps, the
per-cache-page summaries as transformers writes slots, Quest's selection against the float64
reference, the request mixes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from questprof.core import reference
from questprof.core.config import ConfigError
from questprof.serving.latency import cdf, percentiles_ms, summarize, token_gaps_ms
from questprof.serving.loop import Served
from questprof.serving.mixes import named_mix, read_trace
from questprof.serving.paged_attention import (
    PageSummaries,
    Policy,
    kept_tokens,
    select_pages,
)


def test_latency_of_known_timestamps():
    """Two requests: gaps 10, 20 ms and 30 ms; TTFT 5 and 50 ms; 5 tokens over 0.1 s."""
    served = [Served(0, 4, (1, 2, 3), added=1.000, timestamps=(1.005, 1.015, 1.035)),
              Served(1, 9, (4, 5), added=1.020, timestamps=(1.070, 1.100))]
    s = summarize(served)
    assert np.allclose(token_gaps_ms(served[0].timestamps), [10, 20])
    assert s.token["p50_ms"] == pytest.approx(20.0)
    assert s.token["p95_ms"] == pytest.approx(20 + 0.9 * 10)  # linear between 20 and 30
    assert s.token["p99_ms"] == pytest.approx(20 + 0.98 * 10)
    assert s.ttft["p50_ms"] == pytest.approx(27.5)
    assert s.tokens == 5 and s.tokens_per_s == pytest.approx(5 / 0.100)
    fields = s.fields()
    assert fields["token_p95_ms"] == s.token["p95_ms"] and "p95_ms" not in fields


def test_percentiles_of_nothing_and_cdf():
    assert all(np.isnan(v) for v in percentiles_ms([]).values())
    x, y = cdf([3.0, 1.0, 2.0])
    assert list(x) == [1, 2, 3] and np.allclose(y, [1 / 3, 2 / 3, 1])


def test_page_summaries_follow_writes_and_reuse():
    """Slots written in pieces give each page the min/max of its keys; a page whose slot 0 is
    written again (a freed page reused) forgets its old keys."""
    rng = np.random.default_rng(0)
    size, keys = 4, rng.standard_normal((10, 2, 3))
    slots = np.array([8, 9, 10, 11, 12, 0, 1, 2, 13, 3])  # pages 2, 3 and 0, out of order
    table = PageSummaries(size)
    table.write(slots[:5], keys[:5])
    table.write(slots[5:], keys[5:])
    for page in (0, 2, 3):
        mine = keys[slots // size == page]
        assert np.array_equal(table.box[page, :, 0], mine.min(axis=0))
        assert np.array_equal(table.box[page, :, 1], mine.max(axis=0))
    new = rng.standard_normal((1, 2, 3))
    table.write(np.array([8]), new)  # page 2 reused by another request
    assert np.array_equal(table.box[2, :, 0], new[0]) and np.array_equal(table.box[2, :, 1], new[0])
    request = np.array([8, 9, 10, 11, 0, 1])  # a request's tokens: page 2 then page 0
    assert np.array_equal(table.of(request), table.box[[2, 0]])


@pytest.mark.parametrize("length,k_pages", [(1, 1), (15, 2), (16, 4), (17, 3), (40, 10)])
def test_select_pages_is_the_reference_top_k(length, k_pages):
    """The bound and top-K of the serving decode are core.reference's estimate and topk (the
    tail page in, ties to the lower page), for tail lengths 1, S-1, S, S+1 and a budget past P."""
    rng = np.random.default_rng(length)
    size, kv_heads, q_heads, d = 4, 2, 4, 8
    keys = rng.standard_normal((length, kv_heads, d))
    table = PageSummaries(size)
    table.write(np.arange(length), keys)
    q = rng.standard_normal((q_heads, d))
    box = table.of(np.arange(length))
    got = select_pages(q, box, k_pages)
    pages = len(box)
    scores = reference.estimate(q[None], box, np.array([0, pages]), np.arange(pages))
    sel, count = reference.topk(scores, np.array([0, pages]), k_pages)
    assert np.array_equal(got, sel[:, 0, : count[0]])
    keep = kept_tokens(got, pages, size, length)
    assert keep.shape == (q_heads, length) and keep[:, -1].all()  # the tail page always in


def test_policy_checks():
    assert not Policy("dense", 16, 64).sparse(5, 10_000)
    quest = Policy("quest", 16, 64, dense_layers=2)
    assert not quest.sparse(1, 10_000) and quest.sparse(2, 10) and quest.k_pages == 4
    hybrid = Policy("hybrid", 16, 64, crossover=1000)
    assert hybrid.sparse(3, 1000) and not hybrid.sparse(3, 999)  # Quest wins from 1000 on
    with pytest.raises(ValueError, match="crossover"):
        Policy("hybrid", 16, 64)
    with pytest.raises(ValueError, match="unknown policy"):
        Policy("sparse", 16, 64)


def test_trace_and_named_mixes(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": 40, "output": 6}\n\n{"prompt": 9, "output": 2, "arrival": 0.5}\n')
    specs = read_trace(path)
    assert [(s.prompt, s.output, s.arrival) for s in specs] == [(40, 6, 0.0), (9, 2, 0.5)]
    path.write_text('{"prompt": 40, "output": 6}\n{"prompt": 40}\n')
    with pytest.raises(ConfigError, match="line 2"):
        read_trace(path)
    mix = named_mix("log-uniform", [2048, 131072], 200, 8, seed=1)
    lengths = np.array([s.prompt for s in mix])
    assert lengths.min() >= 2048 and lengths.max() <= 131072
    assert 0.35 < np.mean(lengths < 16384) < 0.65  # half the doublings lie below 16K
    assert named_mix("uniform", [10, 20], 5, 3) == named_mix("uniform", [10, 20], 5, 3)
    with pytest.raises(ConfigError, match="names no lengths"):
        named_mix("uniform", None, 5, 3)
    json.dumps([s.__dict__ for s in mix])  # rows can carry them



@pytest.mark.parametrize("line, said", [
    ('{"prompt": 64.5, "output": 2}', "whole numbers"),
    ('{"prompt": "64", "output": 2}', "whole numbers"),
    ('{"prompt": true, "output": 2}', "whole numbers"),
    ('{"prompt": 64, "output": 2, "arrival": "soon"}', "whole numbers"),
    ('{"prompt": 64, "output": 2, "arrival": 1e308}', "arrival 0 to 86,400 s"),
    ('{"prompt": 100000000000000000000000, "output": 2}', "1 to 16,777,216 tokens"),
    ('{"prompt": 64, "output": 0}', "1 to 16,777,216 tokens"),
])
def test_a_trace_line_holds_whole_token_counts_and_a_sane_arrival(tmp_path, line, said):
    """64.5, "64" and true were rounded or cast into requests; an arrival of 1e308 s overflowed
    the feeder thread's sleep and the run waited for ever; 10^23 tokens failed inside NumPy."""
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=said):
        read_trace(path)

def test_longbench_mix_draws_the_published_task_lengths():
    """Each request is one task's published average (words x tokens per word), tasks drawn in
    proportion to their samples; --lengths keeps the tasks inside it, or says none is left."""
    from questprof.serving.mixes import (CODE_TOKENS_PER_WORD, LONGBENCH, TOKENS_PER_WORD,
                                         longbench_tokens)
    assert longbench_tokens()["NarrativeQA"] == round(18409 * TOKENS_PER_WORD)
    assert longbench_tokens()["LCC"] == round(1235 * CODE_TOKENS_PER_WORD)  # code: its own ratio
    mix = named_mix("longbench", None, 4000, 8, seed=2)
    lengths = np.array([s.prompt for s in mix])
    assert set(lengths) <= set(longbench_tokens().values())
    code = {longbench_tokens()[t] for t in ("LCC", "RepoBench-P")}
    share = np.isin(lengths, list(code)).mean()
    samples = sum(n for _, n in LONGBENCH.values())
    assert abs(share - 1000 / samples) < 0.03  # 1,000 of the samples are the two code tasks
    inside = named_mix("longbench", [8192, 16384], 50, 8)
    assert all(8192 <= s.prompt <= 16384 for s in inside)
    with pytest.raises(ConfigError, match="no task"):
        named_mix("longbench", [100, 200], 5, 3)


def test_hybrid_takes_its_crossover_from_hbm_per_head_rows_only(tmp_path):
    """serve decodes per-head from HBM: a sweep of the host tier has no crossover for it (the
    crossover of any sweep at the page size and budget was taken before)."""
    import dataclasses

    from questprof.backends.numpy import NumpyBackend
    from questprof.commands import sweep
    from questprof.commands.serve import crossover_from
    from questprof.core.config import ConfigError
    from questprof.core.scenarios import expand, load_scenario

    smoke = load_scenario("smoke")
    points = [dataclasses.replace(c, kv_tier="host", mode="per-head")
              for c in expand(smoke, lengths="256,1000", budgets="64")]
    sweep.run_sweep(smoke, points, NumpyBackend(), tmp_path, opts=sweep.Options(repeats=1,
                                                                                  warmup=0))
    with pytest.raises(ConfigError, match="no Quest/dense pair"):
        crossover_from(tmp_path, 16, 64)
