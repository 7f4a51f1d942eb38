// Estimate (criticality): U_p(q) = sum_j max(q_j m_pj, q_j M_pj) for every page of every request
// (docs/QUEST.md stage 2). Memory-bound: each (page, KV head) box of 2*D values is read exactly
// once, and all g query heads of that KV head are scored from it (per-head writes g scores;
// shared-max and shared-mean reduce the g scores to one per KV head). G is the tile: a group g
// runs on the smallest tile >= g with the heads past g skipped; a group over 16 (multi-query) is
// scored 16 heads at a time from the same box in registers.
//
// Work unit = (CSR entry i, KV head h), unit = i * Hkv + h: KV head fastest so consecutive units
// read consecutive boxes of one page (Hkv * 2 * D * 2 bytes contiguous). A unit is served by
// LANES = D/8 lanes rounded up to a power of two (head dims 80, 96, 192 leave 6, 4, 8 of 16, 16,
// 32 lanes idle), each holding 8 dimensions of min and max (two 16-byte loads). A tile is
// EST_UNROLL * GROUPS consecutive units (one batch of EST_UNROLL units per thread).
//
// Persistent: the launcher starts one resident wave (EST_BLOCKS_PER_SM per SM, constants.cuh) and
// each block walks tiles grid-stride; a thread runs a three-stage pipeline over its tiles (page ids
// two tiles ahead, boxes one tile ahead in a second register buffer, scoring of the current one),
// so its DRAM loads never drain between batches. H200, 32K MHA: 11.1 us, where one short-lived
// block per tile took 12.9 us (2.6 waves whose loads each waited on an index load first).
// Figures and history: notes/KERNELS.md. The device code is in estimate.cuh.
#include "estimate.cuh"

// EXACT: the group is G itself, a constant in the code (tiles 1 and 2, and the measured variants
// as timed on the H200); otherwise (tiles 4, 8, 16) the group comes from the launch: smaller
// groups masked, larger ones chunked. Two builds rather than a branch in one: together they need
// more registers than EST_BLOCKS_PER_SM allows (tile 4, shared-max, bf16 spilled 12 bytes at 80).
// MODE -1: one build for the three modes, the mode from the launch (every build but the measured
// ones). TS: the summaries' storage, T's own or E4M3 (over an FP8 cache, or quest-fp8's over a
// 16-bit one: k_scale [Hkv] then scales the scores; nullptr otherwise), or fp16 over an FP8
// cache. BOXES > 1 (quest-boxes:c): summaries [N, Hkv, BOXES, 2, d], one unit per box, each
// score the largest of the page's boxes that hold keys (last_page_len, box_tokens = S / BOXES).
template <typename T, typename TS, int D, int G, int MODE, bool EXACT, int BOXES>
__global__ void __launch_bounds__(EST_THREADS, EST_BLOCKS_PER_SM[group_index(G)])
estimate_kernel(const uint16_t* __restrict__ q, const word_t<TS>* __restrict__ summ,
                const int* __restrict__ indptr, const int* __restrict__ indices,
                float* __restrict__ scores, int batch, int kv_heads, int nnz, int group, int mode,
                const float* __restrict__ k_scale, const int* __restrict__ last_page_len,
                int box_tokens) {
  grid_wait();     // the grid before may still write q or the summaries (RoPE, summary append)
  grid_release();  // empty in quest()'s build (releasing in all 3 stages: 32.0 -> 36.0 us)
  constexpr int TILE = est_tile_units<D>();
  const EstimateArgs args{group, mode, k_scale, last_page_len, box_tokens};
  estimate_tiles<T, TS, D, G, MODE, false, EXACT, EST_THREADS, BOXES>(
      q, summ, indptr, indices, scores, batch, kv_heads * BOXES, nnz, args, blockIdx.x,
      gridDim.x, (nnz * kv_heads * BOXES + TILE - 1) / TILE);
}

#ifdef QP_INSTANTIATE_ALL  // CI compiles every variant (tests/test_kernels_compile.py)
#include "instantiate.cuh"
namespace qp_instantiate {
// Summaries of a query type (T, TS): fp16 / bf16 over their own cache, or E4M3 (over an FP8 cache,
// or quest-fp8's over a 16-bit one), or fp16 over an FP8 one (summary_built). The measured
// variants: the group and the mode constants, three builds; every other: tile 1 one build (one q
// head per KV head: the three modes give the same scores), tile 2 with its group a constant,
// larger tiles with it from the launch, one build for the three modes (MODE -1;
// backends/variants.py, estimate_build). A mode from the launch cost tile 1 (bf16, D 80 / 96 /
// 192) a 4-byte spill at its 64 registers. Boxes (C > 1): T's own summaries, the general builds.
// The largest tile also has a build with its group a constant (exactly 16 q heads per KV head,
// no chunk loop: backends/variants.py).
constexpr int largest_tile = QP_GROUPS[sizeof(QP_GROUPS) / sizeof(int) - 1];
struct Estimate {
  template <int T, int TS, int D, int G, int C> static void run() {
    constexpr bool built = builds_head_dim(D) &&
        (C == 1 ? TS == T || summary_built(E4M3, TS) : TS == T && boxes_built(D, C));
    constexpr bool measured = C == 1 && T == TS && measured_variant(D, G);
    if constexpr (built && measured) {
      (void)&estimate_kernel<Tag<T>, Tag<TS>, D, G, 0, true, 1>;
      (void)&estimate_kernel<Tag<T>, Tag<TS>, D, G, 1, true, 1>;
      (void)&estimate_kernel<Tag<T>, Tag<TS>, D, G, 2, true, 1>;
    }
    if constexpr (built && G > 2) (void)&estimate_kernel<Tag<T>, Tag<TS>, D, G, -1, false, C>;
    if constexpr (built && !measured && G == 1)
      (void)&estimate_kernel<Tag<T>, Tag<TS>, D, 1, 0, true, C>;
    if constexpr (built && !measured && G == 2)
      (void)&estimate_kernel<Tag<T>, Tag<TS>, D, 2, -1, true, C>;
    if constexpr (built && C == 1 && G == largest_tile)  // a group of exactly 16 (est16)
      (void)&estimate_kernel<Tag<T>, Tag<TS>, D, G, -1, true, 1>;
  }
};
void estimate_all() {
  Cross<Estimate>::run<DTYPES, KV_DTYPES, QP_HEAD_DIMS, QP_GROUPS, QP_BOXES>();
}
}  // namespace qp_instantiate
#endif
