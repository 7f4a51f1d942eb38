// The merge of a row's splits (kernels/attention.cu): each split of a CTA row writes a partial
// (o, lse in log2 units) to a workspace, and the row's last split to finish combines them by
// log-sum-exp in float32. Two merges, picked at launch (QP_TUNE merge=old|wide,
// backends/variants.py):
//   merge_splits (old): one pass with a running maximum per output, PB outputs x CH splits per
//     round; each round's loads wait for the round before (qwen at 64 splits: 16 rounds).
//   merge_wide: every split's lse first (one round of 8 loads per thread up to splits x G 1024),
//     the maxima and weights once per q head, then the partial outputs as float4 with no dependency
//     between loads, spread over all 128 threads (q heads x D / 4 columns x slices of the splits).
// Both read the partials through L2 (__ldcg): other CTAs of this launch wrote them just before.
#pragma once
#include "attention_tile.cuh"

// A CTA row: request b and up to G q heads qh0 .. qh0 + nq - 1 of one KV head (one chunk of its
// group), reading the page list of selection head sel_head.
struct RowPlan {
  int b, kv_head, qh0, nq, sel_head, row_pages, req_pages, tail_len, indptr_b;
};

// True in the CTA that is the last of its row's splits to finish (every thread gets it); that
// CTA then reads the others' partials. Thread 0 counts the CTA in with one acq_rel atomic, which
// releases the CTA's partials (written before the barrier) and acquires the others'; the last CTA
// resets the count for the next launch. Against a separate merge launch: sparse 32K 13.9 -> 13.4
// us on an H200; one acq_rel atomic against fence + atomic + fence: 13.6 -> 13.3 us.
QP_DEVICE bool last_split(int splits, int* __restrict__ row_done) {
  __shared__ int s_last;
  __syncthreads();  // every thread's partials are written
  if (threadIdx.x == 0) {
    int done;  // release the CTA's partials, acquire the other CTAs' (one atomic, no fences)
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;"
                 : "=r"(done) : "l"(row_done + blockIdx.y) : "memory");
    s_last = done == splits - 1;
    if (s_last) row_done[blockIdx.y] = 0;
  }
  __syncthreads();
  return s_last;
}

// Row blockIdx.y's outputs from its splits' partials, by the whole CTA: one pass with a running
// maximum per output, each thread's PB outputs x CH splits loaded together, so 33 splits of
// G = 4 (llama3-8b dense, batch 1) cost 5 dependent loads, not 20. More than PASS outputs per
// thread go in passes of PASS, to stay in registers: 8 in the measured builds (as timed), 4 in the
// others (D 256 / G 4 spilled 4 bytes at 255 registers with 8).
// L2 loads (__ldcg): the partials were written by other CTAs of this launch, so not through the
// read-only cache.
template <typename T, int G, int D, int PASS>
QP_DEVICE void merge_splits(const float* ws_o, const float* ws_lse, uint16_t* __restrict__ out,
                            float* __restrict__ lse, int splits, int q_heads, const RowPlan& r) {
  constexpr int THREADS = ATT_WARPS * 32, PER = (G * D + THREADS - 1) / THREADS;
  constexpr int PB = PER < PASS ? PER : PASS, CH = PB >= 8 ? 4 : 8;
  const int row = blockIdx.y, n_out = r.nq * D;
#pragma unroll 1
  for (int i0 = 0; i0 < PER; i0 += PB) {
    SoftmaxState st[PB];  // each output's maximum and sum of weights
    float A[PB];
#pragma unroll
    for (int i = 0; i < PB; ++i) { st[i].init(); A[i] = 0.f; }
    for (int s0 = 0; s0 < splits; s0 += CH) {
      float l[PB][CH], o[PB][CH];
#pragma unroll
      for (int i = 0; i < PB; ++i) {
        const int idx = threadIdx.x + (i0 + i) * THREADS, h = idx / D, dim = idx % D;
#pragma unroll
        for (int j = 0; j < CH; ++j) {
          const bool ok = idx < n_out && s0 + j < splits;
          const size_t at = ((size_t)row * splits + s0 + j) * G + h;
          l[i][j] = ok ? __ldcg(ws_lse + at) : NEG_INF;  // empty split: lse -inf, weight 0
          o[i][j] = ok ? __ldcg(ws_o + at * D + dim) : 0.f;
        }
      }
#pragma unroll
      for (int i = 0; i < PB; ++i) {
        float m = st[i].m;
#pragma unroll
        for (int j = 0; j < CH; ++j) m = fmaxf(m, l[i][j]);
        float use;  // 0 for a row with no page at all so far
        A[i] *= st[i].update(m, use);  // m was -inf: sum and A 0, the factor 0
#pragma unroll
        for (int j = 0; j < CH; ++j) {
          const float w = SoftmaxState::weight(l[i][j], use);
          st[i].add(w);
          A[i] = fmaf(w, o[i][j], A[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < PB; ++i) {
      const int idx = threadIdx.x + (i0 + i) * THREADS, h = idx / D, dim = idx % D;
      if (idx >= n_out) continue;
      const size_t qh = (size_t)r.b * q_heads + r.qh0 + h;
      out[qh * D + dim] = Storage<T>::from_float(st[i].out(A[i]));
      if (dim == 0) lse[qh] = st[i].lse();
    }
  }
}


// The wide merge's work of a tile of G q heads: a head's D outputs are D / 4 float4 columns,
// COLS of them per split. Fewer columns than threads cut the splits into SLICES interleaved
// slices (thread t: column t % COLS, slice t / COLS; G 1 at D 128: 32 columns x 4 slices), more
// give each thread CPT columns (t, t + 128, ...; G 16 at D 128: 4). A thread issues LOADS float4
// loads a round (32; 16 where slices share the splits), SB splits x CPT columns: at D 128, 33
// splits of G 4 take 2 rounds (the old merge 5), G 8 3 (9); 16 splits of G 16 2 (8). How many
// stay in flight is ptxas' choice (its registers); not yet measured.
// Scratch (floats of the CTA's ring, free once the row's last split has counted itself in): every
// split's lse, then weight, per tile row [splits][G]; the rows' sums [G]; slices 1 .. SLICES - 1's
// sums [SLICES - 1][COLS] float4, 16-byte aligned. backends/variants.py (merge_scratch) counts the
// same floats, and asks for the wide merge only where they fit the ring.
template <int G, int D> struct WideMerge {
  static constexpr int THREADS = ATT_WARPS * 32, COLS = G * D / 4;
  static constexpr int SLICES = COLS >= THREADS ? 1 : THREADS / COLS;
  static constexpr int CPT = (COLS + THREADS - 1) / THREADS;
  static constexpr int LOADS = SLICES > 1 ? 16 : 32;  // 32 with slices: D 64 / G 2 spilled 12 B
  static constexpr int SB = LOADS / CPT > 0 ? LOADS / CPT : 1;
  static_assert(D % 4 == 0, "a float4 column never straddles two q heads");
  __host__ __device__ static constexpr int sums_at(int splits) {
    return (splits * G + G + 3) / 4 * 4;
  }
  __host__ __device__ static constexpr int scratch(int splits) {
    return sums_at(splits) + (SLICES - 1) * COLS * 4;
  }
};

// Row blockIdx.y's outputs from its splits' partials by the wide merge (WideMerge above); the
// caller checks that WideMerge<G, D>::scratch(splits) floats fit `scratch`. Same arithmetic as
// merge_splits (log2 units, a row with no page at all: out 0, lse -inf), another summation order.
template <typename T, int G, int D>
QP_DEVICE void merge_wide(const float* ws_o, const float* ws_lse, uint16_t* __restrict__ out,
                          float* __restrict__ lse, int splits, int q_heads, const RowPlan& r,
                          float* scratch) {
  using M = WideMerge<G, D>;
  const int n = splits * G, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* s_w = scratch;                  // [splits][G]: lse, then 2^(lse - max)
  float* s_sum = scratch + n;            // [G]
  float4* s_red = reinterpret_cast<float4*>(scratch + M::sums_at(splits));
  const float* row_lse = ws_lse + (size_t)blockIdx.y * n;  // the row's splits x G, contiguous
  for (int i0 = threadIdx.x; i0 < n; i0 += 8 * M::THREADS) {  // 8 independent loads a round
    float l[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * M::THREADS;
      l[u] = i < n ? __ldcg(row_lse + i) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u)
      if (i0 + u * M::THREADS < n) s_w[i0 + u * M::THREADS] = l[u];
  }
  __syncthreads();
  for (int h = warp; h < r.nq; h += ATT_WARPS) {  // a warp per q head: max, weights, sum
    SoftmaxState row;  // the splits' maximum, then the sum of their weights
    row.init();
    for (int s = lane; s < splits; s += 32) row.m = fmaxf(row.m, s_w[s * G + h]);
    row.m = across_groups_max<1>(row.m);
    const float use = SoftmaxState::offset(row.m);  // a row with no page at all: weights 0
    for (int s = lane; s < splits; s += 32) {
      const float w = SoftmaxState::weight(s_w[s * G + h], use);  // an empty split: weight 0
      s_w[s * G + h] = w;
      row.add(w);
    }
    row.l = across_groups_sum<1>(row.l);
    if (lane == 0) {
      s_sum[h] = row.l;
      lse[(size_t)r.b * q_heads + r.qh0 + h] = row.lse();
    }
  }
  __syncthreads();
  const int slice = M::SLICES == 1 ? 0 : threadIdx.x / M::COLS;
  int col[M::CPT];
  bool on[M::CPT];
  float4 acc[M::CPT];
#pragma unroll
  for (int k = 0; k < M::CPT; ++k) {
    col[k] = M::SLICES == 1 ? threadIdx.x + k * M::THREADS : threadIdx.x % M::COLS;
    on[k] = slice < M::SLICES && col[k] < M::COLS && col[k] * 4 / D < r.nq;
    acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const float4* row_o =
      reinterpret_cast<const float4*>(ws_o) + (size_t)blockIdx.y * splits * M::COLS;
  for (int s0 = slice; s0 < splits; s0 += M::SB * M::SLICES) {
    float4 o[M::SB][M::CPT];
#pragma unroll
    for (int j = 0; j < M::SB; ++j)  // every load of the round issued before any is used
#pragma unroll
      for (int k = 0; k < M::CPT; ++k) {
        const int s = s0 + j * M::SLICES;
        o[j][k] = on[k] && s < splits ? __ldcg(row_o + (size_t)s * M::COLS + col[k])
                                      : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
    for (int j = 0; j < M::SB; ++j)
#pragma unroll
      for (int k = 0; k < M::CPT; ++k) {
        const int s = s0 + j * M::SLICES;
        if (!on[k] || s >= splits) continue;
        const float w = s_w[s * G + col[k] * 4 / D];
        acc[k].x = fmaf(w, o[j][k].x, acc[k].x);
        acc[k].y = fmaf(w, o[j][k].y, acc[k].y);
        acc[k].z = fmaf(w, o[j][k].z, acc[k].z);
        acc[k].w = fmaf(w, o[j][k].w, acc[k].w);
      }
  }
  if constexpr (M::SLICES > 1) {  // slices 1 .. SLICES - 1 hand their sums to slice 0
    if (slice >= 1 && slice < M::SLICES) s_red[(slice - 1) * M::COLS + col[0]] = acc[0];
    __syncthreads();
    if (slice == 0)
      for (int t = 1; t < M::SLICES; ++t) {
        const float4 x = s_red[(t - 1) * M::COLS + col[0]];
        acc[0].x += x.x;
        acc[0].y += x.y;
        acc[0].z += x.z;
        acc[0].w += x.w;
      }
  }
  if (slice != 0) return;
#pragma unroll
  for (int k = 0; k < M::CPT; ++k) {
    if (!on[k]) continue;
    const int h = col[k] * 4 / D, dim = col[k] * 4 % D;
    const SoftmaxState row{0.f, s_sum[h]};  // only its sum divides
    uint16_t* o = out + ((size_t)r.b * q_heads + r.qh0 + h) * D + dim;
    o[0] = Storage<T>::from_float(row.out(acc[k].x));
    o[1] = Storage<T>::from_float(row.out(acc[k].y));
    o[2] = Storage<T>::from_float(row.out(acc[k].z));
    o[3] = Storage<T>::from_float(row.out(acc[k].w));
  }
}

// Which merge the row's last split runs: the wide one where the launch asks for it (merge != 0)
// and its scratch fits the `floats` of the ring, else the old one (variants.attention_launch asks
// only where it fits).
struct MergeArgs {
  float* scratch;
  int floats;
  int merge;
};
