// Summary append / rebuild: per-dimension min and max of a page's keys (docs/QUEST.md stage 1).
//
// One CTA per plan entry (page, [first, end) slots written). Each thread owns 8 dimensions of one
// KV head and walks the written slots with 16-byte loads (8-byte over an FP8 cache), so a warp
// reads whole key rows. first == 0 re-initialises the page (fresh or reused physical page, or a
// rebuild); otherwise the new keys merge into the stored min/max. Only slots [first, end) are
// read: unused tail slots are never touched, whatever they hold. min/max of stored values are
// exact, so the result equals the float64 reference bit for bit.
//
// Summaries of K storage TS (template K, TS): the keys' own type (fp16, bf16, or E4M3 codes in
// scaled units: the min / max codes, exact), or fp16 over an E4M3 cache: the dequantized min /
// max (code x k_scale[h], exact in double) rounded outward, min toward -inf and max toward +inf,
// so that U_p(q) still bounds q.k of the keys attention reads.
#include "common.cuh"

template <typename K, typename TS, int D>
__global__ void __launch_bounds__(256)
summary_kernel(const word_t<K>* __restrict__ k, word_t<TS>* __restrict__ summ,
               const int* __restrict__ page_ids, const int* __restrict__ first,
               const int* __restrict__ end, int kv_heads, int page_size,
               const float* __restrict__ k_scale) {
  constexpr int CHUNKS = D / VEC;
  constexpr bool SAME = same_tag<K, TS>;  // summaries in the keys' own units
  const int page = page_ids[blockIdx.x];
  const int lo_slot = first[blockIdx.x], hi_slot = end[blockIdx.x];
  for (int idx = threadIdx.x; idx < kv_heads * CHUNKS; idx += blockDim.x) {
    const int h = idx / CHUNKS, c = idx % CHUNKS;
    const size_t head = (size_t)page * kv_heads + h;
    const word_t<K>* keys = k + head * page_size * D + c * VEC;
    word_t<TS>* out = summ + head * 2 * D + c * VEC;
    float lo[VEC], hi[VEC], x[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) { lo[j] = __int_as_float(0x7f800000); hi[j] = -lo[j]; }
    if (SAME && lo_slot > 0) {  // merge into the page's existing box
      read8<TS>(out, lo);
      read8<TS>(out + D, hi);
    }
#pragma unroll 4
    for (int s = lo_slot; s < hi_slot; ++s) {
      read8<K>(keys + (size_t)s * D, x);
#pragma unroll
      for (int j = 0; j < VEC; ++j) { lo[j] = fminf(lo[j], x[j]); hi[j] = fmaxf(hi[j], x[j]); }
    }
    if constexpr (!SAME) {  // fp16 over E4M3: scale, round outward, then merge
      const double scale = (double)k_scale[h] * E4M3_UNIT;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        lo[j] = Storage<fp16>::to_float(f16_outward<false>(lo[j] * scale));
        hi[j] = Storage<fp16>::to_float(f16_outward<true>(hi[j] * scale));
      }
      if (lo_slot > 0) {
        read8<TS>(out, x);
#pragma unroll
        for (int j = 0; j < VEC; ++j) lo[j] = fminf(lo[j], x[j]);
        read8<TS>(out + D, x);
#pragma unroll
        for (int j = 0; j < VEC; ++j) hi[j] = fmaxf(hi[j], x[j]);
      }
    }
    write8<TS>(out, lo);
    write8<TS>(out + D, hi);
  }
}

#ifdef QP_INSTANTIATE_ALL  // CI compiles every variant (tests/test_kernels_compile.py)
#include "instantiate.cuh"
namespace qp_instantiate {
// fp16 and bf16 caches with their own summaries; E4M3 caches with E4M3 or fp16 summaries.
struct Summary {
  template <int K, int TS, int D> static void run() {
    if constexpr (builds_head_dim(D) && summary_built(K, TS))
      (void)&summary_kernel<Tag<K>, Tag<TS>, D>;
  }
};
void summary_all() { Cross<Summary>::run<KV_DTYPES, KV_DTYPES, QP_HEAD_DIMS>(); }
}  // namespace qp_instantiate
#endif
