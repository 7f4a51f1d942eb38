// Estimate and top-K as one kernel: the selection half of the Quest step (docs/QUEST.md stages 2
// and 3), so that top-K needs no launch of its own and starts on each row as soon as that row's
// scores exist instead of after the whole estimate grid has drained.
//
// The estimate's persistent blocks score units in head-major order (unit h * nnz + i, estimate.cuh)
// and write scores exactly as estimate.cu does; each block takes a run of consecutive tiles, so its
// units fall in one or two rows (grid-stride tiles put each block in up to 16 rows at 128K, and the
// last block to finish then selected all of them one after another: 242 us against 35 + 10 us for
// the two kernels on an H200). When a block has scored its tiles, it publishes them (fence) and
// adds, per row (request b, KV head h), the units it scored to done[h * B + b];
// the block whose addition completes a row selects that row's pages with the top-K code of topk.cuh
// (its EST_THREADS threads, keys in shared memory when `cached`) for each score head of the KV head
// (g rows per-head, one in the shared modes) and leaves the count at zero for the next launch.
//
// A request without pages (a context-parallel shard can have none) has no units, so no block
// finishes its rows: block 0 writes their empty selection first, as topk.cu does.
#include "estimate.cuh"
#include "topk.cuh"

// count 0 and K x -1 in every score head's row of each request without pages.
QP_DEVICE void empty_requests(const int* __restrict__ indptr, int* __restrict__ sel,
                              int* __restrict__ count, int batch, int heads, int k_pages) {
  for (int b = 0; b < batch; ++b) {
    if (indptr[b + 1] > indptr[b]) continue;
    if (threadIdx.x == 0) count[b] = 0;
    for (int x = threadIdx.x; x < heads * k_pages; x += EST_THREADS)
      sel[((size_t)(x / k_pages) * batch + b) * k_pages + x % k_pages] = -1;
  }
}

// grid: the estimate's one resident wave; dynamic shared memory = pages * 4 bytes when `cached`.
template <typename T, int D, int G, int MODE>
__global__ void __launch_bounds__(EST_THREADS, EST_BLOCKS_PER_SM[group_index(G)])
estimate_topk_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ summ,
                     const int* __restrict__ indptr, const int* __restrict__ indices,
                     float* __restrict__ scores, int* __restrict__ sel, int* __restrict__ count,
                     int* __restrict__ done, int batch, int kv_heads, int nnz, int group,
                     int k_pages, int sinks, int window, int cached) {
  extern __shared__ uint4 dyn[];
  __shared__ TopkShared sh;
  constexpr int NT = EST_THREADS, TILE = est_tile_units<D, NT>();
  __shared__ int finished[NT], n_finished;
  grid_wait();  // the grid before may still write q or the summaries
  grid_release();
  const int rows_per_kv = MODE == PER_HEAD ? group : 1;  // score rows of a KV head
  if (blockIdx.x == 0) empty_requests(indptr, sel, count, batch, kv_heads * rows_per_kv, k_pages);
  const int units = nnz * kv_heads, tiles = (units + TILE - 1) / TILE;
  const int per_block = (tiles + gridDim.x - 1) / gridDim.x;
  const int first = blockIdx.x * per_block, end = min(first + per_block, tiles);
  if (first < end)
    // One build per tile: groups on tiles of 4 and more take the general (masked) scoring, the
    // same arithmetic as estimate.cu's, so the same bits.
    estimate_tiles<T, T, D, G, MODE, true, G <= 2, NT>(q, summ, indptr, indices, scores, batch,
                                                       kv_heads, nnz, {group, MODE, nullptr},
                                                       first, 1, end);
  // Thread j counts tiles first + j, first + j + NT, ..., one row segment of a tile per pass,
  // so a pass finishes at most NT rows.
  int t = first + threadIdx.x, u = t * TILE, stop = min(u + TILE, units);
  bool more = t < end;
  if (threadIdx.x == 0) n_finished = 0;
  while (__syncthreads_or(more)) {
    if (more) {
      __threadfence();  // after the barrier: the block's scores reach L2 before this count
      const int h = u / nnz, i = u % nnz, b = request_of(indptr, batch, i);
      const int row_first = __ldg(indptr + b), row_last = __ldg(indptr + b + 1);
      const int n = min(stop - u, row_last - i);
      if (atomicAdd(done + h * batch + b, n) + n == row_last - row_first)
        finished[atomicAdd(&n_finished, 1)] = h * batch + b;
      u += n;
      if (u >= stop) {
        t += NT;
        u = t * TILE;
        stop = min(u + TILE, units);
        more = t < end;
      }
    }
    __syncthreads();
    __threadfence();  // the other blocks' scores of a finished row are read after its count
    for (int f = 0; f < n_finished; ++f) {
      const int row = finished[f], h = row / batch, b = row % batch;
      const int row_first = indptr[b], pages = indptr[b + 1] - row_first;
      if (threadIdx.x == 0) {
        done[row] = 0;
        if (h == 0) count[b] = min(k_pages, pages);
      }
      for (int r = 0; r < rows_per_kv; ++r) {
        const int s = h * rows_per_kv + r;
        select_row<NT>(scores + (size_t)s * nnz + row_first,
                       cached ? reinterpret_cast<uint32_t*>(dyn) : nullptr, pages, k_pages, sinks,
                       window, sel + ((size_t)s * batch + b) * k_pages, sh);
      }
    }
    __syncthreads();  // every thread has read n_finished
    if (threadIdx.x == 0) n_finished = 0;
  }
}

#ifdef QP_INSTANTIATE_ALL  // CI compiles every variant (tests/test_kernels_compile.py)
#include "instantiate.cuh"
namespace qp_instantiate {
struct EstimateTopk {
  template <int T, int D, int G, int M> static void run() {
    if constexpr (builds_head_dim(D)) (void)&estimate_topk_kernel<Tag<T>, D, G, M>;
  }
};
void estimate_topk_all() {
  Cross<EstimateTopk>::run<DTYPES, QP_FUSED_HEAD_DIMS, QP_GROUPS, MODES>();
}
}  // namespace qp_instantiate
#endif
