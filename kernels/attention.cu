// Decode attention straight from the paged cache (docs/QUEST.md stage 4; over all pages it is
// the dense baseline).
//
// A CTA row is (request b, j) serving up to G query heads of one KV head (G a tile of QP_GROUPS):
//   dense and shared selections: all g q heads of the KV head on the smallest tile >= g (rows
//   past g masked), so one CTA reads a KV head once for all its q heads; a group over 16
//   (multi-query, e.g. Falcon-7B's 71) is cut into ceil(g / 16) chunks of at most 16 q heads,
//   one CTA row each, and each of those re-reads the KV head: the KV bytes of such a layer are
//   read ceil(g / 16) times (71 heads: 5x), against once if one CTA could hold the whole group;
//   per-head selections with g > 1: G = 1, each q head walks its own page list.
// The row's page list (all pages, or sel positions -> kv_indices) is cut into splits of
// pages_per_split pages (grid.x) so that batch 1 x 32 heads still fills 132 SMs; each split
// keeps an online softmax and writes (o, lse) to a workspace; the row's last split to finish
// (an atomic count per row) combines them with log-sum-exp, so no merge launch follows
// (kernels/attention_merge.cuh: the old merge, or the wide one where the launch asks). With one
// split the CTA writes the final output itself.
//
// Inside a CTA, ATT_WARPS warps take tiles of TT tokens round-robin (kernels/attention_tile.cuh:
// CUDA cores for G <= 2, tensor cores for G >= 4); each warp keeps a private ring of NS tiles in
// shared memory filled by cp.async, so NS - 1 tiles (K and V) are in flight while it computes one
// (dense 32K MHA at 0.91 of the read ceiling on an H200; a tile loaded into registers and then
// computed left no loads in flight during the math: 0.74). Only valid slots of the tail page are
// fetched (zero-size copies elsewhere) and their scores are set to -inf, so NaN or huge values in
// unused slots never reach the math. Scores are kept in log2 units (scaled by log2(e)/sqrt(D));
// lse is returned in natural log. The online softmax of the tiles, the combine of the warps and
// both merges of the splits is one state (kernels/softmax_state.cuh). This is the one cp.async
// ring loop of the kernels. Figures and history: notes/KERNELS.md.
#include "attention_merge.cuh"
#include "params.cuh"

// The row's place and page tables: inputs of the step, ready before the grid before ends. Rows
// of a request: KV head j / chunks, chunk j % chunks of chunk_size q heads (the last one shorter).
// Dense and shared selections: chunks = ceil(g / 16); per-head selections: chunk_size 1, chunks g.
QP_DEVICE RowPlan plan_row(const int* __restrict__ indptr, const int* __restrict__ last_len,
                           int q_heads, int kv_heads, int chunks, int chunk_size, int sel_per_q) {
  RowPlan r;
  const int rows_per_req = kv_heads * chunks, row = blockIdx.y, j = row % rows_per_req;
  const int group = q_heads / kv_heads;
  r.b = row / rows_per_req;
  r.kv_head = j / chunks;
  const int first = (j - r.kv_head * chunks) * chunk_size;
  r.qh0 = r.kv_head * group + first;
  r.nq = min(chunk_size, group - first);
  r.sel_head = sel_per_q ? r.qh0 : r.kv_head;
  r.indptr_b = __ldg(indptr + r.b);
  r.req_pages = __ldg(indptr + r.b + 1) - r.indptr_b;
  r.tail_len = __ldg(last_len + r.b);
  r.row_pages = r.req_pages;  // a selection's count replaces it after grid_wait
  return r;
}

// Combine the 4 warps' states through shared memory and write (o, lse) of this split. SCALE_O:
// the outputs times o_scale (E4M3 caches: v_scale); MEASURED: a build
// timed on the H200.
template <typename T, int D, int G, bool SCALE_O, bool MEASURED, class St>
QP_DEVICE void combine(const St& st, const RowPlan& r, int q_heads, int splits, float o_scale,
                       uint16_t* __restrict__ out, float* __restrict__ lse,
                       float* __restrict__ ws_o, float* __restrict__ ws_lse,
                       int* __restrict__ row_done, float (*s_acc)[G][D], float (*s_m)[G],
                       float (*s_l)[G], const MergeArgs& mg) {
  st.store(s_acc[threadIdx.x / 32], s_m[threadIdx.x / 32], s_l[threadIdx.x / 32], threadIdx.x % 32,
           r.nq);
  __syncthreads();
  for (int idx = threadIdx.x; idx < r.nq * D; idx += blockDim.x) {
    const int h = idx / D, dim = idx % D;
    SoftmaxState row{s_m[0][h], 0.f};  // the warps' maximum, then their sums merged
#pragma unroll
    for (int w = 1; w < ATT_WARPS; ++w) row.m = fmaxf(row.m, s_m[w][h]);
    const float use = SoftmaxState::offset(row.m);
    float A = 0.f;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) {
      const float f = row.merge(s_m[w][h], s_l[w][h], use);
      A += s_acc[w][h][dim] * f;
    }
    float o = row.out(A);
    if (SCALE_O) o *= o_scale;
    const float lse2 = row.lse2();
    if (splits == 1) {
      const size_t qh = (size_t)r.b * q_heads + r.qh0 + h;
      out[qh * D + dim] = Storage<T>::from_float(o);
      if (dim == 0) lse[qh] = lse2 * LN2;
    } else {
      const size_t slot = ((size_t)blockIdx.y * splits + blockIdx.x) * G + h;
      ws_o[slot * D + dim] = o;
      if (dim == 0) ws_lse[slot] = lse2;
    }
  }
  if (splits > 1 && last_split(splits, row_done)) {
    if (mg.merge && WideMerge<G, D>::scratch(splits) <= mg.floats)
      merge_wide<T, G, D>(ws_o, ws_lse, out, lse, splits, q_heads, r, mg.scratch);
    else
      merge_splits<T, G, D, MEASURED ? 8 : 4>(ws_o, ws_lse, out, lse, splits, q_heads, r);
  }
}

// The variants timed on the H200 (fp16 / bf16 caches at measured_variant's head dims and tiles).
template <typename T, typename KV, int D, int G>
constexpr bool measured_build = same_tag<T, KV> && measured_variant(D, G);

// The combine arrays: static shared memory for the variants timed on the H200, the warps' rings
// for the others (G 16 at D 256 would need 64 KiB more), after a barrier: every warp has
// finished reading its ring.
template <typename T, typename KV, int D, int G, int NS, class St>
QP_DEVICE void finish(const St& st, const RowPlan& r, int q_heads, int splits, float o_scale,
                      uint16_t* __restrict__ out, float* __restrict__ lse,
                      float* __restrict__ ws_o, float* __restrict__ ws_lse,
                      int* __restrict__ row_done, uint4* ring, int merge) {
  constexpr bool SCALE_O = is_e4m3<KV>;
  const MergeArgs mg{reinterpret_cast<float*>(ring), attention_ring_bytes<KV, D, G, NS>() / 4,
                     merge};
  if constexpr (!measured_build<T, KV, D, G>) {
    static_assert(ATT_WARPS * G * D * 4 <= attention_ring_bytes<KV, D, G, NS>(),
                  "rings hold the arrays");
    __shared__ float s_m[ATT_WARPS][G], s_l[ATT_WARPS][G];
    __syncthreads();
    combine<T, D, G, SCALE_O, false>(st, r, q_heads, splits, o_scale, out, lse, ws_o, ws_lse,
                                     row_done, reinterpret_cast<float (*)[G][D]>(ring), s_m,
                                     s_l, mg);
  } else {
    __shared__ float s_acc[ATT_WARPS][G][D], s_m[ATT_WARPS][G], s_l[ATT_WARPS][G];
    combine<T, D, G, SCALE_O, true>(st, r, q_heads, splits, o_scale, out, lse, ws_o, ws_lse,
                                    row_done, s_acc, s_m, s_l, mg);
  }
}

// grid (splits, B * kv_heads * chunks), block 128; the launch's AttentionParams
// (kernels/params.cuh). sel == nullptr: dense over all pages.
// row_done [B * kv_heads * chunks] int32 must be 0 at launch, and is 0 again when the kernel ends.
// count is [B], or [Hs, B] when count_per_head (selections of different sizes per head); a row
// with no page writes out = 0 and lse = -inf, a partial that a log-sum-exp merge ignores.
// S = 0: the page size is 1 << page_shift (otherwise page_shift is unused). KV: the cache's
// storage, T's own or E4M3 codes with k_scale, v_scale [Hkv] (nullptr for 16-bit caches):
// key = e4m3(k) x k_scale[h], folded into the score as q.(s k) = s (q.k), value likewise into
// the output.
// Minimum CTAs per SM: none for the measured builds (as timed); 2 for the others (page size at
// launch included), the count their shared memory allows, so ptxas does not spill a few bytes to
// fit a register count for 4 or 8 (D 80 / G 8 spilled 4 bytes at 128 registers, D 256 / G 1 at
// 64, D 128 / G 2 / S 0 at 96, without it).
// NS: stages of each warp's ring, ATT_STAGES[G] or (QP_TUNE stages=N, S 0 builds of the deep
// tables of constants.cuh) a deeper one; the launcher sizes the dynamic shared memory for it and
// plans the CTAs per SM it leaves room for (backends/variants.py, attention_launch).
// merge: 1 = the wide merge of the splits (QP_TUNE merge=wide) where its scratch fits the ring,
// 0 = the old one (attention_merge.cuh).
// attention_kernel's body, over its params' fields (the kernel below unpacks them). A pointer read
// from a params struct is not known read-only past an asm with a memory clobber (cp.async,
// griddepcontrol), so the loads nvcc made ld.global.nc through __restrict__ kernel parameters
// say so (__ldg, load16_ro, load4_ro).
template <typename T, typename KV, int D, int S, int G, int NS, bool NHD = false>
QP_DEVICE void attention_run(const uint16_t* __restrict__ q, const word_t<KV>* __restrict__ k,
                              const word_t<KV>* __restrict__ v, const int* __restrict__ indptr,
                              const int* __restrict__ indices, const int* __restrict__ last_len,
                              const int* __restrict__ sel, const int* __restrict__ count,
                              int batch, int q_heads, int kv_heads, int chunks, int chunk_size,
                              int sel_per_q, int k_sel, int count_per_head, int pages_per_split,
                              int page_shift, float scale_log2, uint16_t* __restrict__ out,
                              float* __restrict__ lse, float* __restrict__ ws_o,
                              float* __restrict__ ws_lse, int* __restrict__ row_done,
                              const float* __restrict__ k_scale,
                              const float* __restrict__ v_scale, int merge) {
  using St = Tile<T, KV, D, G>;
  static_assert(NS >= 2, "a ring holds the tile computed and at least one in flight");
  const Paging<S, NHD> pg(page_shift);
  // ATT_WARPS x NS stages x STAGE (the launcher sizes it). 128-byte aligned: dynamic shared memory
  // starts after the static arrays, and at 48 mod 128 every warp's 512-byte cp.async took twice
  // the L2 requests (dense 32K 161 us against 131 us aligned, on an H200).
  extern __shared__ __align__(128) uint4 att_ring[];
  __shared__ int s_page[ATT_MAX_PAGES], s_valid[ATT_MAX_PAGES];
  constexpr int PER_THREAD = ATT_MAX_PAGES / (ATT_WARPS * 32);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Before grid_wait, only the step's inputs (page tables, q): under programmatic dependent
  // launch this runs while top-K still selects. The selection and its count come after.
  RowPlan r = plan_row(indptr, last_len, q_heads, kv_heads, chunks, chunk_size, sel_per_q);
  St st;
  float o_scale = 1.f;
  if constexpr (is_e4m3<KV>) {  // the cache's scales: inputs of the step too
    scale_log2 *= __ldg(k_scale + r.kv_head);
    o_scale = __ldg(v_scale + r.kv_head);
  }
  st.init(q + ((size_t)r.b * q_heads + r.qh0) * D, lane, scale_log2, r.nq);
  grid_wait();
  grid_release();  // empty in quest()'s build (the next layer's estimate launches as this ends)
  // The split's positions and the row's count load together (L2 loads: the grid before wrote
  // them), so the chain to the first KV byte is positions | count -> page ids -> KV.
  const int splits = gridDim.x, p_begin = blockIdx.x * pages_per_split;
  const int* row_sel = sel ? sel + ((size_t)r.sel_head * batch + r.b) * k_sel : nullptr;
  int pos[PER_THREAD];
#pragma unroll
  for (int u = 0; u < PER_THREAD; ++u) {
    const int i = threadIdx.x + u * ATT_WARPS * 32, p = p_begin + i;
    pos[u] = row_sel && i < pages_per_split && p < k_sel ? __ldcg(row_sel + p) : p;
  }
  if (sel) r.row_pages = __ldcg(count + (count_per_head ? (size_t)r.sel_head * batch + r.b : r.b));
  const int nb = max(0, min(r.row_pages, p_begin + pages_per_split) - p_begin);  // <= ATT_MAX_PAGES
#pragma unroll
  for (int u = 0; u < PER_THREAD; ++u) {
    const int i = threadIdx.x + u * ATT_WARPS * 32;
    if (i < nb) {
      s_page[i] = __ldg(indices + r.indptr_b + pos[u]);
      s_valid[i] = pos[u] == r.req_pages - 1 ? r.tail_len : pg.size();
    }
  }
  __syncthreads();
  // Warp w takes tiles w, w + 4, ...; NS - 1 tiles are in flight while one is computed.
  const int tiles = (nb * pg.size() + St::TT - 1) / St::TT;
  const int mine = tiles > warp ? (tiles - warp + ATT_WARPS - 1) / ATT_WARPS : 0;
  uint4* ring = att_ring + (size_t)warp * NS * St::STAGE;
#pragma unroll
  for (int j = 0; j < NS - 1; ++j) {
    if (j < mine)
      st.issue(ring + j * St::STAGE, k, v, pg, s_page, s_valid, nb,
               (warp + j * ATT_WARPS) * St::TT, kv_heads, r.kv_head, lane);
    cp_async_commit();
  }
  for (int j = 0; j < mine; ++j) {
    const int ahead = j + NS - 1;
    __syncwarp();  // every lane's reads of the stage refilled below are done
    if (ahead < mine)
      st.issue(ring + (ahead % NS) * St::STAGE, k, v, pg, s_page, s_valid, nb,
               (warp + ahead * ATT_WARPS) * St::TT, kv_heads, r.kv_head, lane);
    cp_async_commit();
    cp_async_wait<NS - 1>();  // this lane's copies of tile j have landed,
    __syncwarp();             // and every lane's (MmaTile reads rows other lanes copied)
    st.tile(ring + (j % NS) * St::STAGE, pg, s_valid, nb, (warp + j * ATT_WARPS) * St::TT,
            lane);
  }
  finish<T, KV, D, G, NS>(st, r, q_heads, splits, o_scale, out, lse, ws_o, ws_lse, row_done,
                          att_ring, merge);
}

template <typename T, typename KV, int D, int S, int G, int NS, bool NHD = false>
__global__ void __launch_bounds__(ATT_WARPS * 32, measured_build<T, KV, D, G> && S > 0 ? 0 : 2)
attention_kernel(const __grid_constant__ AttentionParams p) {
  const PagedCache& c = p.cache;
  attention_run<T, KV, D, S, G, NS, NHD>(
      p.q, c.keys<KV>(), c.values<KV>(), c.indptr, c.indices, c.last_page_len, p.sel, p.count,
      c.batch, p.q_heads, c.kv_heads, p.chunks, p.chunk_size, p.sel_per_q, p.k_sel,
      p.count_per_head, p.pages_per_split, c.page_shift, p.scale_log2, p.out, p.lse, p.ws_o,
      p.ws_lse, p.row_done, c.k_scale, c.v_scale, p.merge);
}

#ifdef QP_INSTANTIATE_ALL  // CI compiles every variant (tests/test_kernels_compile.py)
#include "instantiate.cuh"
namespace qp_instantiate {
// Page size as a template argument only for the measured variants at the measured page sizes;
// one S 0 build per (D, G) serves the other page sizes (backends/variants.py, page_template).
// E4M3 caches: every head dim and tile, under fp16 and bf16 queries, page size at launch.
constexpr bool fixed_page(int d, int g, int s) {
  return measured_variant(d, g) && qp_contains(QP_MEASURED_PAGE_SIZES, s);
}
constexpr bool any_page_at_launch(int d, int g) {
  for (int s : QP_PAGE_SIZES)
    if (!fixed_page(d, g, s)) return true;
  return false;
}
struct Attention {
  template <int T, int KV, int D, int G, int S> static void run() {
    constexpr int NS = ATT_STAGES[group_index(G)];
    if constexpr (builds_head_dim(D) && KV == T && fixed_page(D, G, S))
      (void)&attention_kernel<Tag<T>, Tag<KV>, D, S, G, NS>;
    constexpr bool at_launch = KV == E4M3 || (KV == T && any_page_at_launch(D, G));
    if constexpr (builds_head_dim(D) && S == QP_PAGE_SIZES[0] && at_launch)
      (void)&attention_kernel<Tag<T>, Tag<KV>, D, 0, G, NS>;
  }
};
// Deeper rings (QP_TUNE stages=N): the caches above at the deep tables' head dims and tiles, one
// S 0 build per depth that is not the tile's own.
struct AttentionDeep {
  template <int T, int KV, int D, int G, int NS> static void run() {
    if constexpr (builds_head_dim(D) && (KV == T || KV == E4M3) &&
                  NS != ATT_STAGES[group_index(G)])
      (void)&attention_kernel<Tag<T>, Tag<KV>, D, 0, G, NS>;
  }
};
// Token-major pages (NHD): 16-bit caches at ATT_NHD_HEAD_DIMS, page size at launch.
struct AttentionNhd {
  template <int T, int D, int G> static void run() {
    if constexpr (builds_head_dim(D))
      (void)&attention_kernel<Tag<T>, Tag<T>, D, 0, G, ATT_STAGES[group_index(G)], true>;
  }
};
void attention_all() {
  Cross<Attention>::run<DTYPES, KV_DTYPES, QP_HEAD_DIMS, QP_GROUPS, QP_PAGE_SIZES>();
  Cross<AttentionNhd>::run<DTYPES, ATT_NHD_HEAD_DIMS, QP_GROUPS>();
  Cross<AttentionDeep>::run<DTYPES, KV_DTYPES, ATT_DEEP_HEAD_DIMS, ATT_DEEP_GROUPS,
                            ATT_DEEP_STAGES>();
}
}  // namespace qp_instantiate
#endif
