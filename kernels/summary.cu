// Summary append / rebuild: per-dimension min and max of a page's keys (docs/QUEST.md stage 1),
// or of each of its BOXES boxes of S / BOXES consecutive slots (quest-boxes:c).
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
#include "params.cuh"

// Value of one E4M3 code as a float (exact).
QP_DEVICE float e4m3_value(uint32_t code) {
  uint32_t b02, b13;
  e4m3x4_f16(code, b02, b13);
  return Storage<fp16>::to_float(b02 & 0xffffu);
}

// x rounded to E4M3 toward -inf (UP false) or +inf, as a float on the E4M3 grid (saturating at
// +-448, which a scale of amax / 448 keeps x within). Through float32 in the same direction (the
// E4M3 grid lies on the float32 grid), then to nearest and one code back where that went past x.
template <bool UP>
QP_DEVICE float e4m3_outward(double x) {
  float f;
  if (UP) asm("cvt.rp.f32.f64 %0, %1;" : "=f"(f) : "d"(x));
  else asm("cvt.rm.f32.f64 %0, %1;" : "=f"(f) : "d"(x));
  unsigned short pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(f));
  uint32_t code = pair & 0xffu;
  const float v = e4m3_value(code);
  const bool neg = (code & 0x80u) != 0u, zero = (code & 0x7fu) == 0u;
  if (UP && v < f) code = neg && !zero ? code - 1u : min((code & 0x7fu) + 1u, 0x7eu);
  if (!UP && v > f) code = neg || zero ? min((code | 0x80u) + 1u, 0xfeu) : code - 1u;
  return e4m3_value(code);
}

// Slots [lo, hi) of box `box` (BOXES boxes of S / BOXES consecutive slots) that the plan entry's
// slots [first, end) write; lo >= hi: none.
struct BoxSlots {
  int lo, hi;
  bool merge;  // the box held keys before `first`: merge into its stored min / max
};
template <int BOXES>
QP_DEVICE BoxSlots box_slots(int box, int page_size, int first, int end) {
  const int width = page_size / BOXES, start = box * width;
  const int lo = max(first, start);
  return {lo, min(end, start + width), lo > start};
}

// BOXES: min / max boxes per page ([N, Hkv, BOXES, 2, d]; quest-boxes:c), 1 for Quest's one.
// The kernel's body, over its params' fields (the kernel below unpacks them; read-only loads:
// kernels/common.cuh, load16_ro).
// k_scale: the cache's scales (E4M3 cache) or the summaries' (E4M3 over a 16-bit cache).
// NHD: the keys' pages token-major ([N, S, Hkv, d], attention_tile.cuh's Paging says so), read
// in place; the summaries keep their own layout.
template <typename K, typename TS, int D, int BOXES, bool NHD = false>
QP_DEVICE void summary_run(const word_t<K>* __restrict__ k, word_t<TS>* __restrict__ summ,
                           const int* __restrict__ page_ids, const int* __restrict__ first,
                           const int* __restrict__ end, int kv_heads, int page_size,
                           const float* __restrict__ k_scale) {
  constexpr int CHUNKS = D / VEC;
  constexpr bool SAME = same_tag<K, TS>;  // summaries in the keys' own units
  const int page = page_ids[blockIdx.x];
  const int first_slot = first[blockIdx.x], end_slot = end[blockIdx.x];
  for (int idx = threadIdx.x; idx < kv_heads * BOXES * CHUNKS; idx += blockDim.x) {
    const int h = idx / (BOXES * CHUNKS), box = idx / CHUNKS % BOXES, c = idx % CHUNKS;
    const BoxSlots slots = box_slots<BOXES>(box, page_size, first_slot, end_slot);
    if (slots.lo >= slots.hi) continue;  // the plan writes no slot of this box
    const size_t head = (size_t)page * kv_heads + h;
    const word_t<K>* keys = k + PageRows<NHD>::row(page, 0, page_size, kv_heads, h) * D + c * VEC;
    word_t<TS>* out = summ + (head * BOXES + box) * 2 * D + c * VEC;
    float lo[VEC], hi[VEC], x[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) { lo[j] = POS_INF; hi[j] = NEG_INF; }
    if (SAME && slots.merge) {  // merge into the box's stored min / max
      read8<TS>(out, lo);
      read8<TS>(out + D, hi);
    }
#pragma unroll 4
    for (int s = slots.lo; s < slots.hi; ++s) {
      read8<K>(keys + (size_t)s * PageRows<NHD>::stride(kv_heads) * D, x);
#pragma unroll
      for (int j = 0; j < VEC; ++j) { lo[j] = fminf(lo[j], x[j]); hi[j] = fmaxf(hi[j], x[j]); }
    }
    if constexpr (!SAME && is_e4m3<K>) {  // fp16 over E4M3: scale, round outward
      const double scale = (double)k_scale[h];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        lo[j] = Storage<fp16>::to_float(f16_outward<false>(lo[j] * scale));
        hi[j] = Storage<fp16>::to_float(f16_outward<true>(hi[j] * scale));
      }
    }
    if constexpr (!SAME && !is_e4m3<K>) {  // E4M3 over fp16 / bf16 (quest-fp8): codes of
      const double scale = (double)k_scale[h];  // key / scale rounded outward
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        lo[j] = e4m3_outward<false>(lo[j] / scale);
        hi[j] = e4m3_outward<true>(hi[j] / scale);
      }
    }
    if (!SAME && slots.merge) {  // merge the rounded box into the stored one
      read8<TS>(out, x);
#pragma unroll
      for (int j = 0; j < VEC; ++j) lo[j] = fminf(lo[j], x[j]);
      read8<TS>(out + D, x);
#pragma unroll
      for (int j = 0; j < VEC; ++j) hi[j] = fmaxf(hi[j], x[j]);
    }
    write8<TS>(out, lo);
    write8<TS>(out + D, hi);
  }
}

template <typename K, typename TS, int D, int BOXES, bool NHD = false>
__global__ void __launch_bounds__(SUM_THREADS)
summary_kernel(const SummaryParams p) {
  const PagedCache& c = p.cache;
  summary_run<K, TS, D, BOXES, NHD>(c.keys<K>(), static_cast<word_t<TS>*>(p.summ), p.page_ids,
                               p.first, p.end, c.kv_heads, c.page_size,
                               is_e4m3<K> ? c.k_scale : p.summ_scale);
}

#ifdef QP_INSTANTIATE_ALL  // CI compiles every variant (tests/test_kernels_compile.py)
#include "instantiate.cuh"
namespace qp_instantiate {
// fp16 and bf16 caches with their own summaries; E4M3 caches with E4M3 or fp16 summaries. The
// selectors' forms (selector_summary_built): fp16 / bf16 caches with E4M3 summaries
// (quest-fp8), and BOXES of QP_BOXES boxes per page of their own summaries (quest-boxes:c).
struct Summary {
  template <int K, int TS, int D, int C> static void run() {
    if constexpr (builds_head_dim(D) && C == 1 && (summary_built(K, TS) || fp8_selector(K, TS)))
      (void)&summary_kernel<Tag<K>, Tag<TS>, D, 1>;
    if constexpr (builds_head_dim(D) && C > 1 && K == TS && K != E4M3 && boxes_built(D, C))
      (void)&summary_kernel<Tag<K>, Tag<TS>, D, C>;
  }
};
// Token-major pages (NHD): 16-bit caches with their own summaries, ATT_NHD_HEAD_DIMS.
struct SummaryNhd {
  template <int K, int D> static void run() {
    if constexpr (builds_head_dim(D)) (void)&summary_kernel<Tag<K>, Tag<K>, D, 1, true>;
  }
};
void summary_all() {
  Cross<Summary>::run<KV_DTYPES, KV_DTYPES, QP_HEAD_DIMS, QP_BOXES>();
  Cross<SummaryNhd>::run<DTYPES, ATT_NHD_HEAD_DIMS>();
}
}  // namespace qp_instantiate
#endif
