// Estimate (criticality): U_p(q) = sum_j max(q_j m_pj, q_j M_pj) for every page of every request
// (docs/QUEST.md stage 2). Memory-bound: each (page, KV head) box of 2*D values is read exactly
// once, and all G query heads of that KV head are scored from it (per-head writes G scores;
// shared-max and shared-mean reduce the G scores to one per KV head).
//
// Work unit = (CSR entry i, KV head h), unit = i * Hkv + h: KV head fastest so consecutive units
// read consecutive boxes of one page (Hkv * 2 * D * 2 bytes contiguous). A unit is served by
// LANES = D/8 lanes, each holding 8 dimensions of min and max (two 16-byte loads). A tile is
// EST_UNROLL * GROUPS consecutive units (one batch of EST_UNROLL units per thread).
//
// Persistent: the launcher starts one resident wave (EST_BLOCKS_PER_SM per SM, constants.cuh) and
// each block walks tiles grid-stride; a thread runs a three-stage pipeline over its tiles (page ids
// two tiles ahead, boxes one tile ahead in a second register buffer, scoring of the current one),
// so its DRAM loads never drain between batches. H200, 32K MHA: 11.1 us, where one short-lived
// block per tile took 12.9 us (2.6 waves whose loads each waited on an index load first).
// Figures and history: notes/KERNELS.md. The device code is in estimate.cuh.
#include "estimate.cuh"

template <typename T, int D, int G, int MODE>
__global__ void __launch_bounds__(EST_THREADS, EST_BLOCKS_PER_SM[group_index(G)])
estimate_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ summ,
                const int* __restrict__ indptr, const int* __restrict__ indices,
                float* __restrict__ scores, int batch, int kv_heads, int nnz) {
  grid_wait();     // the grid before may still write q or the summaries (RoPE, summary append)
  grid_release();  // empty in quest()'s build (releasing in all 3 stages: 32.0 -> 36.0 us)
  constexpr int TILE = est_tile_units<D>();
  estimate_tiles<T, D, G, MODE, false>(q, summ, indptr, indices, scores, batch, kv_heads, nnz,
                                       blockIdx.x, gridDim.x, (nnz * kv_heads + TILE - 1) / TILE);
}

#ifdef QP_INSTANTIATE_ALL  // CI compiles every variant (tests/test_kernels_compile.py)
#define QP_EST(T, D, G, M) template __global__ void estimate_kernel<T, D, G, M>( \
    const uint16_t*, const uint16_t*, const int*, const int*, float*, int, int, int);
#define QP_EST_G(T, D, M) QP_EST(T, D, 1, M) QP_EST(T, D, 2, M) QP_EST(T, D, 4, M) QP_EST(T, D, 8, M)
#define QP_EST_M(T, D) QP_EST_G(T, D, 0) QP_EST_G(T, D, 1) QP_EST_G(T, D, 2)
QP_EST_M(fp16, 64) QP_EST_M(fp16, 128) QP_EST_M(bf16, 64) QP_EST_M(bf16, 128)
#endif
