// The online-softmax state of one row, in log2 units (scores scaled by log2(e)/sqrt(D)), shared by
// every place that folds scores or partial results into a softmax: the attention tiles' updates
// (attention_tile.cuh, CUDA-core and tensor-core), the combine of a CTA's warps (attention.cu)
// and both merges of a row's splits (attention_merge.cuh). As FlashInfer's state_t, it holds the
// running maximum m and the sum l of 2^(s - m); the output accumulator stays with its caller,
// whose register layout differs per tile (8 dims a lane, mma fragments, float4 columns).
//
// Every operation is the arithmetic its callers wrote by hand before (same exp2f, same
// expressions, so nvcc contracts the same multiply-adds: the PTX of attention.cu's instances is
// the same, notes/KERNELS.md). Two finishes differ on purpose, kept as two operations: `lse2`
// (a split's partial, log2 units, as the combine always wrote it) and `lse` (a merged row,
// natural log, as both merges wrote it). They agree wherever l > 0, but are not the same PTX.
#pragma once
#include "common.cuh"

struct SoftmaxState {
  float m, l;  // running maximum (log2 units), sum of 2^(s - m) over the keys folded in

  // No key yet: m -inf, l 0.
  QP_DEVICE void init() {
    m = NEG_INF;
    l = 0.f;
  }

  // What the weights of a row with maximum `max` subtract: the maximum, or 0 while it is -inf (a
  // row with no key so far), so 2^(s - offset) stays finite (0 for s = -inf), never NaN.
  static QP_DEVICE float offset(float max) { return max == NEG_INF ? 0.f : max; }

  // The weight 2^(s - use) of a score s (or of a partial's lse) against offset `use`.
  static QP_DEVICE float weight(float s, float use) { return exp2f(s - use); }

  // The row's maximum rises to m_new (fmaxf of m and the new scores, as the caller reduced them):
  // l is rescaled and the factor returned, for the caller's accumulator; `use` gets the offset
  // the new scores' weights subtract. The caller then adds their weights: add(w).
  QP_DEVICE float update(float m_new, float& use) {
    use = offset(m_new);
    const float rescale = exp2f(m - use);
    l *= rescale;
    m = m_new;
    return rescale;
  }

  QP_DEVICE void add(float w) { l += w; }

  // Fold in another state (m_o, l_o) once this state's m is the maximum of both and `use` its
  // offset: returns the other's weight, for its accumulator (the combine of a CTA's warps).
  QP_DEVICE float merge(const float& m_o, const float& l_o, float use) {
    const float f = weight(m_o, use);
    l += l_o * f;
    return f;
  }

  // An output from its accumulator: a / l, 0 for a row with no key.
  QP_DEVICE float out(float a) const { return l > 0.f ? a / l : 0.f; }

  // Log-sum-exp in log2 units, a split's partial: m + log2 l, -inf for a row with no key.
  QP_DEVICE float lse2() const { return l > 0.f ? m + log2f(l) : m; }

  // Log-sum-exp in natural log, a merged row's: (offset + log2 l) ln 2, -inf for a row with no
  // key (m itself, not scaled).
  QP_DEVICE float lse() const { return l > 0.f ? (offset(m) + log2f(l)) * LN2 : m; }
};
