"""Synthetic captures: random keys (the worst case) and a drift case (the query moves on).

random: keys, values and queries i.i.d. normal; every page looks alike to the min/max bound, so
  this is the floor a real model's attention should beat.
drift: some 32-token spans carry topic A, others topic B (32 tokens: whole pages at S = 8, 16,
  32); the query of step 0 points at A, the last step's at B. Quest, which re-selects per query,
  should keep its mass recall; `stale_mass_recall` (the first step's pages reused) should fall.
"""

from __future__ import annotations

import numpy as np

from questprof.fidelity.capture import Capture

KINDS = ("random", "drift")
SPAN = 32
TOPIC_SPANS = 8  # spans per topic and layer
TOPIC_SCALE = 4.0  # topic component of a key, against unit noise per dimension


def random_capture(rng, layers: int, q_heads: int, kv_heads: int, head_dim: int,
                   length: int, steps: int) -> Capture:
    """I.i.d. normal queries [layers, steps, Hq, d], keys and values [layers, Hkv, length, d]."""
    q = rng.standard_normal((layers, steps, q_heads, head_dim), dtype=np.float32)
    k = rng.standard_normal((layers, kv_heads, length, head_dim), dtype=np.float32)
    v = rng.standard_normal((layers, kv_heads, length, head_dim), dtype=np.float32)
    return Capture(q, k, v, head_dim ** -0.5, "synthetic", "synthetic-random")


def _unit(rng, shape) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def drift_capture(rng, layers: int, q_heads: int, kv_heads: int, head_dim: int,
                  length: int, steps: int) -> Capture:
    """Random keys plus topic spans A and B; queries move from A (step 0) to B (last step)."""
    cap = random_capture(rng, layers, q_heads, kv_heads, head_dim, length, steps)
    prompt_spans = (length - steps + 1) // SPAN
    if prompt_spans < 2 * TOPIC_SPANS:
        return Capture(cap.queries, cap.keys, cap.values, cap.scaling, cap.model, "synthetic-drift")
    topics = _unit(rng, (layers, kv_heads, 2, head_dim))  # per layer and kv head: A, B
    for layer in range(layers):
        spans = rng.choice(prompt_spans, 2 * TOPIC_SPANS, replace=False)
        for i, span in enumerate(spans):
            topic = topics[layer, :, i // TOPIC_SPANS]  # [Hkv, d]
            cap.keys[layer, :, span * SPAN:(span + 1) * SPAN] += TOPIC_SCALE * topic[:, None, :]
    weight = np.linspace(0.0, 1.0, steps, dtype=np.float32) if steps > 1 else np.ones(1, np.float32)
    group = q_heads // kv_heads
    a = np.repeat(topics[:, :, 0], group, axis=1)[:, None]  # [layers, 1, Hq, d]
    b = np.repeat(topics[:, :, 1], group, axis=1)[:, None]
    w = weight[None, :, None, None]
    cap.queries[...] = 0.5 * cap.queries + TOPIC_SCALE * ((1 - w) * a + w * b)
    return Capture(cap.queries, cap.keys, cap.values, cap.scaling, cap.model, "synthetic-drift")


def synthetic_capture(kind: str, seed: int, layers: int, q_heads: int, kv_heads: int,
                      head_dim: int, length: int, steps: int) -> Capture:
    """A seeded synthetic capture of `kind` (random or drift)."""
    rng = np.random.default_rng(seed)
    make = random_capture if kind == "random" else drift_capture
    return make(rng, layers, q_heads, kv_heads, head_dim, length, steps)
