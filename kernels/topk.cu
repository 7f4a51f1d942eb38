// Top-K page selection per (request, head) (docs/QUEST.md stage 3), exactly as reference.topk:
// the K best pages by score, tail page (and optional sinks / local window) always in and counted
// in the budget, ties to the lower position, output in ascending positions, -1 padded.
//
// One CTA of NT threads per (request, head). Scores become order-preserving uint32 keys (held in
// shared memory when the row fits, else re-read from global/L2). The threshold is found by a
// range select: a histogram of NB bins over the keys in [lo, hi] (bin = (key - lo) >> s, s the
// fewest bits that fit the range into NB bins), the bin holding the rem-th largest key becomes
// the next [lo, hi]. Starting from the row's own min/max, random scores need 2 passes and no
// row more than 3 (32 bits / 11). A final pass in position order takes the chosen pages (reserved,
// above the range, or in it with a low enough rank) and compacts them with one block prefix sum,
// which yields ascending positions for free.
//
// Bins over the row's own range spread the keys, so plain shared atomics do: fixed 8-bit digits
// from the top of the key needed 4 passes and warp-aggregated atomics (scores share their top
// bits), 16.9 us against 9.0-9.6 us now for 8192 pages x 32 heads on an H200 (notes/KERNELS.md).
// The device code is in topk.cuh. Dynamic budgets (quest-gap,
// quest-topp) select K_max pages so, then keep a data-dependent count of them per row
// (dynamic_select in topk.cuh).
#include "params.cuh"
#include "topk.cuh"

// grid (B, Hs), NT threads (TK_THREAD_OPTIONS); R > 0 (TK_REG_KEYS): rows of at most NT x R
// pages select with their keys in registers (select_small), longer ones as R 0 does. R 0:
// dynamic shared memory = pages * 4 bytes when `cached`; at least k_pages * 16 for a dynamic
// budget (rule, DynamicRule in topk.cuh): count is then [Hs, B], one per row, else [B].
// The kernel's body, over its params' fields (the kernel below unpacks them; read-only loads:
// kernels/common.cuh, load16_ro).
template <int NT, int R>
QP_DEVICE void topk_run(const float* __restrict__ scores, const int* __restrict__ indptr,
                        int* __restrict__ sel, int* __restrict__ count, int batch, int nnz,
                        int k_pages, int sinks, int window, int cached, int rule, double param,
                        double scaling, TopkShared& sh, SmallShared* small) {
  extern __shared__ uint4 dyn[];  // uint4: the compaction reads keys 16 bytes at a time
  const int b = blockIdx.x, h = blockIdx.y;
  // page tables: ready before estimate
  const int start = __ldg(indptr + b), pages = __ldg(indptr + b + 1) - start;
  // Scores come from the grid before (estimate); L2 loads (__ldcg) below, never the read-only
  // path, since that grid may still have been writing them when this one started.
  grid_wait();
  grid_release();  // attention's CTAs load q and their row plan on the free SMs meanwhile
  if (rule == RULE_FIXED && h == 0 && threadIdx.x == 0) count[b] = min(k_pages, pages);
  const float* row = scores + (size_t)h * nnz + start;
  int* out = sel + ((size_t)h * batch + b) * k_pages;
  if (R > 0 && pages <= NT * R)
    select_small<NT, (R > 0 ? R : 1)>(row, pages, k_pages, sinks, window, out, *small);
  else
    select_row<NT>(row, cached ? reinterpret_cast<uint32_t*>(dyn) : nullptr, pages, k_pages,
                   sinks, window, out, sh);
  if (rule == RULE_FIXED) return;
  const int n = dynamic_select<NT>(row, pages, k_pages, {rule, param, scaling}, out, dyn, sh);
  if (threadIdx.x == 0) count[(size_t)h * batch + b] = n;
}

// select_small's shared memory and dynamic_select's, which runs after it (its first barrier
// ends every read of the first).
union SmallOrRow {
  TopkShared row;
  SmallShared small;
};

// p: kernels/params.cuh (TopkParams).
template <int NT, int R>
__global__ void __launch_bounds__(NT)
topk_kernel(const TopkParams p) {
  if constexpr (R > 0) {
    __shared__ SmallOrRow sh;
    topk_run<NT, R>(p.scores, p.cache.indptr, p.sel, p.count, p.cache.batch, p.nnz, p.k_pages,
                    p.sinks, p.window, p.cached, p.rule, p.param, p.scaling, sh.row, &sh.small);
  } else {
    __shared__ TopkShared sh;
    topk_run<NT, R>(p.scores, p.cache.indptr, p.sel, p.count, p.cache.batch, p.nnz, p.k_pages,
                    p.sinks, p.window, p.cached, p.rule, p.param, p.scaling, sh, nullptr);
  }
}

#ifdef QP_INSTANTIATE_ALL  // CI compiles every variant (tests/test_kernels_compile.py)
#include "instantiate.cuh"
namespace qp_instantiate {
// Every thread count once (CI's head-dim parts build it in the first one only).
struct Topk {
  template <int NT, int R> static void run() {
    if constexpr (builds_head_dim(QP_HEAD_DIMS[0])) (void)&topk_kernel<NT, R>;
  }
};
void topk_all() { Cross<Topk>::run<TK_THREAD_OPTIONS, TK_REG_KEYS>(); }
}  // namespace qp_instantiate
#endif
