// Estimate (criticality): U_p(q) = sum_j max(q_j m_pj, q_j M_pj) for every page of every request
// (DESIGN.md stage 2). Memory-bound: each (page, KV head) box of 2*D values is read exactly once,
// and all G query heads of that KV head are scored from it (per-head writes G scores; shared-max
// and shared-mean reduce the G scores to one per KV head).
//
// Work unit = (CSR entry i, KV head h), KV head fastest so consecutive units read consecutive
// boxes of one page (Hkv * 2 * D * 2 bytes contiguous). A unit is served by LANES = D/8 lanes,
// each holding 8 dimensions of min and max (two 16-byte loads). Each thread keeps UNROLL units'
// loads in flight before it computes.
#include "common.cuh"

enum { PER_HEAD = 0, SHARED_MAX = 1, SHARED_MEAN = 2 };

constexpr int EST_THREADS = 256;
constexpr int EST_UNROLL = 4;  // 8 took 128 registers (2 blocks/SM): 15.4 us vs 12.8 at 32K, H200

template <typename T, int D, int G>
QP_DEVICE void score_heads(const uint16_t* __restrict__ q, const uint4& lo, const uint4& hi,
                           int qhead0, int c, float u[G]) {
  float m[VEC], M[VEC], x[VEC];
  unpack8<T>(lo, m);
  unpack8<T>(hi, M);
#pragma unroll
  for (int t = 0; t < G; ++t) {
    unpack8<T>(load16(q + (size_t)(qhead0 + t) * D + c * VEC), x);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += fmaxf(x[j] * m[j], x[j] * M[j]);
    u[t] = group_sum<D / VEC>(s);
  }
}

template <typename T, int D, int G, int MODE>
__global__ void __launch_bounds__(EST_THREADS)
estimate_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ summ,
                const int* __restrict__ indptr, const int* __restrict__ indices,
                float* __restrict__ scores, int batch, int kv_heads, int nnz) {
  constexpr int LANES = D / VEC, GROUPS = EST_THREADS / LANES;
  const int c = threadIdx.x % LANES, group = threadIdx.x / LANES;
  const long total = (long)nnz * kv_heads;
  long unit[EST_UNROLL];
  uint4 lo[EST_UNROLL], hi[EST_UNROLL];
#pragma unroll
  for (int r = 0; r < EST_UNROLL; ++r) {  // all loads first: 2 * UNROLL 16-byte loads in flight
    unit[r] = ((long)blockIdx.x * EST_UNROLL + r) * GROUPS + group;
    lo[r] = hi[r] = make_uint4(0, 0, 0, 0);
    if (unit[r] < total) {
      const int i = (int)(unit[r] / kv_heads), h = (int)(unit[r] % kv_heads);
      const uint16_t* box = summ + ((size_t)__ldg(indices + i) * kv_heads + h) * 2 * D + c * VEC;
      lo[r] = load16_stream(box);
      hi[r] = load16_stream(box + D);
    }
  }
#pragma unroll
  for (int r = 0; r < EST_UNROLL; ++r) {
    // Units past the end still shuffle (full-warp masks) but write nothing.
    const bool valid = unit[r] < total;
    const long v_unit = valid ? unit[r] : 0;
    const int i = (int)(v_unit / kv_heads), h = (int)(v_unit % kv_heads);
    const int b = request_of(indptr, batch, i);
    float u[G];
    score_heads<T, D, G>(q, lo[r], hi[r], (b * kv_heads + h) * G, c, u);
    if (MODE == PER_HEAD) {
#pragma unroll
      for (int t = 0; t < G; ++t)
        if (valid && c == t % LANES) scores[(size_t)(h * G + t) * nnz + i] = u[t];
    } else if (valid && c == 0) {
      float v = u[0];
#pragma unroll
      for (int t = 1; t < G; ++t) v = MODE == SHARED_MAX ? fmaxf(v, u[t]) : v + u[t];
      scores[(size_t)h * nnz + i] = MODE == SHARED_MEAN ? v / G : v;
    }
  }
}

#ifdef QP_INSTANTIATE_ALL  // CI compiles every variant (tests/test_kernels_compile.py)
#define QP_EST(T, D, G, M) template __global__ void estimate_kernel<T, D, G, M>( \
    const uint16_t*, const uint16_t*, const int*, const int*, float*, int, int, int);
#define QP_EST_G(T, D, M) QP_EST(T, D, 1, M) QP_EST(T, D, 2, M) QP_EST(T, D, 4, M) QP_EST(T, D, 8, M)
#define QP_EST_M(T, D) QP_EST_G(T, D, 0) QP_EST_G(T, D, 1) QP_EST_G(T, D, 2)
QP_EST_M(fp16, 64) QP_EST_M(fp16, 128) QP_EST_M(bf16, 64) QP_EST_M(bf16, 128)
#endif
