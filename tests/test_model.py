"""The byte / FLOP / rho / Amdahl model against the paper's numbers and hand counts."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from questprof.core import model
from questprof.core.config import Config, ModelShape

MIB = 1024**2
ONE_HEAD = ModelShape("one-head", layers=1, q_heads=1, kv_heads=1, head_dim=128, dtype="fp16",
                      dense_layers=0)
GQA = ModelShape("gqa", layers=32, q_heads=32, kv_heads=8, head_dim=128, dtype="bf16")


def cfg(shape=ONE_HEAD, length=65536, batch=1, page_size=16, budget=4096, mode="per-head"):
    return Config(shape, length, batch, page_size, budget, mode)


def test_paper_rho_at_64k():
    p = model.pages(65536, 16)
    k = model.k_pages(4096, 16, p)
    assert (p, k) == (4096, 256)
    assert model.rho(16, k, p) == 1 / 8
    assert model.quest_rho(cfg()) == 1 / 8


def test_paper_bytes_one_head_64k():
    work = model.stage_work(cfg())
    assert work["dense"].read == 32 * MIB
    assert work["estimate"].read == 2 * MIB
    assert work["attention"].read == 2 * MIB
    assert not work["attention"].bound


def test_amdahl_paper_numbers():
    assert round(model.amdahl_step_time(0.6, 7.03), 3) == 0.485
    assert round(model.amdahl_speedup(0.6, 7.03), 2) == 2.06
    assert round(model.amdahl_speedup(0.4, 7.03), 2) == 1.52
    assert model.amdahl_speedup(0.0, 7.03) == 1.0
    assert model.amdahl_speedup(1.0, 7.03) == pytest.approx(7.03)
    with pytest.raises(ValueError):
        model.amdahl_speedup(1.5, 2.0)


def test_tail_page_counts_valid_tokens_only():
    c = cfg(length=65536 + 5)
    assert c.pages == 4097 and model.last_page_len(c.length, 16) == 5
    work = model.stage_work(c)
    vec = 128 * 2
    assert work["dense"].read == 2 * vec * (65536 + 5)
    assert work["attention"].read == 2 * vec * (255 * 16 + 5)  # 255 full pages + the tail's 5
    assert work["estimate"].read == 2 * vec * 4097
    assert work["attention"].flops == 4 * 128 * (255 * 16 + 5)


@pytest.mark.parametrize("length, fresh", [(65536 + 1, True), (65536 + 2, False), (65536, False)])
def test_summary_append_reads_old_box_unless_fresh_page(length, fresh):
    work = model.stage_work(cfg(length=length))["summary"]
    vec = 256
    assert work.read == vec + (0 if fresh else 2 * vec)
    assert work.write == 2 * vec


def test_gqa_per_head_bound_and_measured_union():
    c = cfg(GQA, mode="per-head")
    k, g = 256, 4
    assert model.union_pages_bound(c) == g * (k - 1) + 1  # the tail page is shared
    vec = 128 * 2
    bound = model.stage_work(c)["attention"]
    assert bound.bound
    assert bound.read == 8 * 2 * vec * ((g * (k - 1)) * 16 + 16)
    measured = model.stage_work(c, union_pages=300)["attention"]
    assert not measured.bound
    assert measured.read == 8 * 2 * vec * (299 * 16 + 16)
    assert measured.flops == bound.flops == 32 * 4 * 128 * k * 16  # each q head its own K pages
    with pytest.raises(ValueError):
        model.stage_work(c, union_pages=10)  # fewer pages than one head selects


def test_gqa_bound_capped_at_all_pages():
    c = cfg(GQA, length=8192, budget=4096)  # P = 512, K = 256, g(K-1)+1 = 1021 > P
    assert model.union_pages_bound(c) == 512
    assert model.stage_work(c)["attention"].read == model.stage_work(c)["dense"].read


@pytest.mark.parametrize("mode", ["shared-max", "shared-mean"])
def test_shared_modes_read_k_pages_per_kv_head(mode):
    c = cfg(GQA, batch=3, mode=mode)
    work = model.stage_work(c)
    vec = 256
    assert not work["attention"].bound
    assert work["attention"].read == 3 * 8 * 2 * vec * 256 * 16
    assert work["estimate"].write == 8 * 3 * 4096 * 4   # scores [Hkv, nnz] float32
    assert work["topk"].write == (8 * 3 * 256 + 3) * 4  # sel [Hkv, B, K] + count [B]
    assert model.quest_rho(c) == 1 / 8


@pytest.mark.parametrize("q_heads,reads", [(16, 1), (17, 2), (32, 2), (71, 5), (128, 8)])
def test_groups_over_16_read_the_kv_head_once_per_chunk(q_heads, reads):
    """Attention cuts a group over 16 q heads into ceil(g / 16) chunks, one CTA row each, and
    each re-reads the KV head's pages: dense and the shared modes count those re-reads; the
    estimate (one read of a box scores every chunk) and per-head rows (the union) do not."""
    shape = ModelShape("g", layers=4, q_heads=q_heads, kv_heads=1, head_dim=64, dtype="bf16")
    assert model.kv_reads(shape) == reads
    one = ModelShape("g1", layers=4, q_heads=1, kv_heads=1, head_dim=64, dtype="bf16")
    for mode in ("shared-max", "shared-mean"):
        c, base = cfg(shape, length=4096 + 3, mode=mode), cfg(one, length=4096 + 3, mode=mode)
        work, ref = model.stage_work(c), model.stage_work(base)
        assert work["dense"].read == reads * ref["dense"].read == reads * 2 * 128 * (4096 + 3)
        assert work["attention"].read == reads * ref["attention"].read
        assert work["estimate"].read == ref["estimate"].read
    per_head = model.stage_work(cfg(shape, length=4096 + 3))["attention"]
    union = model.union_pages_bound(cfg(shape, length=4096 + 3))
    assert per_head.read == 2 * 128 * ((union - 1) * 16 + 3)  # the union, read once


def test_the_chunk_is_the_kernels_largest_tile():
    from questprof.backends.variants import GROUPS, plan_group

    assert model.GROUP_CHUNK == GROUPS[-1]
    for g in (1, 16, 17, 71, 128):
        shape = ModelShape("g", layers=4, q_heads=g, kv_heads=1, head_dim=64, dtype="bf16")
        assert model.kv_reads(shape) == plan_group(g).chunks


def test_per_head_scores_have_one_row_per_q_head():
    work = model.stage_work(cfg(GQA, batch=2))
    assert work["estimate"].write == 32 * 2 * 4096 * 4
    assert work["estimate"].read == 2 * 8 * 2 * 256 * 4096  # summaries read once per KV head
    assert work["estimate"].flops == 3 * 128 * 32 * 2 * 4096


def test_dense_budget_is_flagged():
    c = cfg(length=4096, budget=4096)
    assert c.is_dense_budget and model.is_dense(c.k_pages, c.pages)
    assert model.rho(16, c.k_pages, c.pages) == 1 / 16 + 1
    assert not cfg().is_dense_budget


def test_quest_total_and_intensity():
    c = cfg(GQA, batch=4)
    work = model.stage_work(c)
    quest = model.quest_work(c)
    assert quest.stage == "quest" and quest.bound
    for name in ("read", "unmodelled_read", "write", "flops"):
        parts = sum(getattr(work[s], name) for s in model.QUEST_STAGES)
        assert getattr(quest, name) == parts
    dense = work["dense"]
    assert model.intensity(dense) == dense.flops / (dense.total_read + dense.write)
    # decode attention is memory bound: about one FLOP per byte per q head in the group
    assert 3 < model.intensity(dense) < 5


def test_weight_bytes_of_known_models():
    longchat = ModelShape("lc", 32, 32, 32, 128, "fp16", intermediate=11008, vocab=32000)
    assert model.mlp_width(ModelShape("x", 32, 32, 32, 128, "fp16")) == 11008
    assert model.weight_params(longchat) == 32 * (4 * 4096**2 + 3 * 4096 * 11008) + 32000 * 4096
    llama3 = ModelShape("l3", 32, 32, 8, 128, "bf16", intermediate=14336, vocab=128256)
    assert 7.4e9 < model.weight_params(llama3) < 7.6e9  # 8.03e9 less the 0.53e9 embedding
    assert model.weight_bytes(llama3, 4) == model.weight_bytes(llama3, 16) / 4


def test_step_attention_time_keeps_dense_layers():
    assert model.step_attention_time(GQA, dense_time=10.0, quest_time=2.0) == 2 * 10 + 30 * 2


def test_kv_pool_bytes():
    c = cfg(batch=2)
    assert model.kv_pool_bytes(c) == 2 * 4096 * 256 * (2 * 16 + 2)


@settings(max_examples=200, deadline=None)
@given(length=st.integers(1, 300_000), s=st.sampled_from([8, 16, 32, 64]),
       k=st.integers(1, 1024), batch=st.integers(1, 8))
def test_quest_rho_matches_formula_up_to_the_tail(length, s, k, batch):
    c = cfg(length=length, batch=batch, page_size=s, budget=k * s)
    p = c.pages
    exact = model.quest_rho(c)
    if length % s == 0:
        assert exact == pytest.approx(model.rho(s, k, p), rel=1e-12)
    kk = min(k, p)
    tokens = (kk - 1) * s + model.last_page_len(length, s)
    assert exact == pytest.approx((p + tokens) / length, rel=1e-12)
    assert math.isfinite(model.intensity(model.stage_work(c)["attention"]))
