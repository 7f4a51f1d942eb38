// Summary append / rebuild: per-dimension min and max of a page's keys (docs/QUEST.md stage 1).
//
// One CTA per plan entry (page, [first, end) slots written). Each thread owns 8 dimensions of one
// KV head and walks the written slots with 16-byte loads, so a warp reads whole key rows.
// first == 0 re-initialises the page (fresh or reused physical page, or a rebuild); otherwise the
// new keys merge into the stored min/max. Only slots [first, end) are read: unused tail slots are
// never touched, whatever they hold. min/max of stored values are exact, so the result equals the
// float64 reference bit for bit.
#include "common.cuh"

template <typename T, int D>
__global__ void __launch_bounds__(256)
summary_kernel(const uint16_t* __restrict__ k, uint16_t* __restrict__ summ,
               const int* __restrict__ page_ids, const int* __restrict__ first,
               const int* __restrict__ end, int kv_heads, int page_size) {
  constexpr int CHUNKS = D / VEC;
  const int page = page_ids[blockIdx.x];
  const int lo_slot = first[blockIdx.x], hi_slot = end[blockIdx.x];
  for (int idx = threadIdx.x; idx < kv_heads * CHUNKS; idx += blockDim.x) {
    const int h = idx / CHUNKS, c = idx % CHUNKS;
    const size_t head = (size_t)page * kv_heads + h;
    const uint16_t* keys = k + head * page_size * D + c * VEC;
    uint16_t* out = summ + head * 2 * D + c * VEC;
    float lo[VEC], hi[VEC], x[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) { lo[j] = __int_as_float(0x7f800000); hi[j] = -lo[j]; }
    if (lo_slot > 0) {  // merge into the page's existing box
      unpack8<T>(load16(out), lo);
      unpack8<T>(load16(out + D), hi);
    }
#pragma unroll 4
    for (int s = lo_slot; s < hi_slot; ++s) {
      unpack8<T>(load16(keys + (size_t)s * D), x);
#pragma unroll
      for (int j = 0; j < VEC; ++j) { lo[j] = fminf(lo[j], x[j]); hi[j] = fmaxf(hi[j], x[j]); }
    }
    *reinterpret_cast<uint4*>(out) = pack8<T>(lo);
    *reinterpret_cast<uint4*>(out + D) = pack8<T>(hi);
  }
}

#ifdef QP_INSTANTIATE_ALL  // CI compiles every variant (tests/test_kernels_compile.py)
#include "instantiate.cuh"
namespace qp_instantiate {
struct Summary {
  template <int T, int D> static void run() {
    if constexpr (builds_head_dim(D)) (void)&summary_kernel<Tag<T>, D>;
  }
};
void summary_all() { Cross<Summary>::run<DTYPES, QP_HEAD_DIMS>(); }
}  // namespace qp_instantiate
#endif
