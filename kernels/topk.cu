// Top-K page selection per (request, head) (DESIGN.md stage 3), exactly as reference.topk:
// the K best pages by score, tail page (and optional sinks / local window) always in and counted
// in the budget, ties to the lower position, output in ascending positions, -1 padded.
//
// One CTA of 1024 threads per (request, head). Scores become order-preserving uint32 keys (held in
// shared memory when the row fits, else re-read from global/L2). A radix select over the key bits,
// 8 bits per pass from the top, finds the threshold prefix and how many keys equal to it are still
// needed; a pass stops early when its whole bin is taken. A final pass in position order flags the
// chosen pages (reserved, above the threshold, or equal to it with a low enough rank) and compacts
// them with block prefix sums, which yields ascending positions for free.
#include "common.cuh"

constexpr int TK_THREADS = 1024;
constexpr int TK_ITEMS = 8;  // positions per thread in one compaction chunk (8192 per chunk)
constexpr int TK_EMPTY = 256;  // "no bin": a position that does not take part in a pass

QP_DEVICE uint32_t order_key(float f) {
  uint32_t u = __float_as_uint(f == 0.f ? 0.f : f);  // -0 and +0 are equal scores
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct Row {
  const float* scores;   // this (head, request) row of P scores
  const uint32_t* keys;  // shared-memory keys, or nullptr to recompute from scores
  int pages, sinks, window;
  QP_DEVICE bool reserved(int p) const { return p < sinks || p >= pages - window; }
  QP_DEVICE uint32_t key(int p) const { return keys ? keys[p] : order_key(__ldg(scores + p)); }
};

// Exclusive prefix sum of `x` over the CTA in thread order; *total gets the sum.
QP_DEVICE uint32_t block_exclusive_scan(uint32_t x, uint32_t* total, uint32_t* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // warp_sums may still be read by the previous call
  uint32_t incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    uint32_t y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    uint32_t w = warp_sums[lane], wincl = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      uint32_t y = __shfl_up_sync(0xffffffffu, wincl, o);
      if (lane >= o) wincl += y;
    }
    warp_sums[lane] = wincl - w;
    if (lane == 31) warp_sums[32] = wincl;
  }
  __syncthreads();
  *total = warp_sums[32];
  return warp_sums[warp] + incl - x;
}

// Count keys matching (prefix, mask) into 256 bins of the next 8 bits (warp-aggregated atomics:
// scores of one row share their top bits, so plain atomics would serialise on a few bins).
QP_DEVICE void histogram(const Row& row, uint32_t prefix, uint32_t mask, int shift, uint32_t* hist) {
  for (int base = 0; base < row.pages; base += TK_THREADS) {
    const int p = base + threadIdx.x;
    uint32_t bin = TK_EMPTY;
    if (p < row.pages && !row.reserved(p)) {
      const uint32_t key = row.key(p);
      if ((key & mask) == prefix) bin = (key >> shift) & 0xffu;
    }
    const uint32_t peers = __match_any_sync(0xffffffffu, bin);
    if (bin != TK_EMPTY && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(hist + bin, __popc(peers));
  }
}

// Warp 0: the bin (from the top) holding the rem-th largest key; state = {bin, rem left, bin count}.
QP_DEVICE void pick_bin(const uint32_t* hist, uint32_t rem, uint32_t* state) {
  const int lane = threadIdx.x;
  uint32_t local[8], sum = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) { local[j] = hist[255 - 8 * lane - j]; sum += local[j]; }
  uint32_t incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    uint32_t y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  uint32_t above = incl - sum;
  if (above < rem && rem <= incl) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (above + local[j] >= rem) {
        state[0] = 255 - 8 * lane - j; state[1] = rem - above; state[2] = local[j];
        break;
      }
      above += local[j];
    }
  }
}

// Write the chosen positions of `row` in ascending order to out; returns nothing (count is known).
QP_DEVICE void compact(const Row& row, uint32_t prefix, uint32_t mask, uint32_t rem,
                       int* __restrict__ out, uint32_t* warp_sums) {
  uint32_t sel_done = 0, eq_done = 0;
  for (int chunk = 0; chunk < row.pages; chunk += TK_THREADS * TK_ITEMS) {
    const int p0 = chunk + threadIdx.x * TK_ITEMS;
    uint32_t eq = 0, take = 0, n_eq = 0, n_take = 0, total;
#pragma unroll
    for (int j = 0; j < TK_ITEMS; ++j) {
      const int p = p0 + j;
      if (p >= row.pages) continue;
      if (row.reserved(p)) { take |= 1u << j; continue; }
      const uint32_t km = row.key(p) & mask;
      if (km > prefix) take |= 1u << j;
      else if (km == prefix) { eq |= 1u << j; ++n_eq; }
    }
    uint32_t rank = eq_done + block_exclusive_scan(n_eq, &total, warp_sums);
    eq_done += total;
#pragma unroll
    for (int j = 0; j < TK_ITEMS; ++j)
      if (eq >> j & 1u) { if (rank < rem) take |= 1u << j; ++rank; }
    n_take = __popc(take);
    uint32_t slot = sel_done + block_exclusive_scan(n_take, &total, warp_sums);
    sel_done += total;
#pragma unroll
    for (int j = 0; j < TK_ITEMS; ++j)
      if (take >> j & 1u) out[slot++] = p0 + j;
  }
}

// grid (B, Hs); dynamic shared memory = pages * 4 bytes when `cached`, else 0.
extern "C" __global__ void __launch_bounds__(TK_THREADS)
topk_kernel(const float* __restrict__ scores, const int* __restrict__ indptr,
            int* __restrict__ sel, int* __restrict__ count, int batch, int nnz, int k_pages,
            int sinks, int window, int cached) {
  extern __shared__ uint32_t keys[];
  __shared__ uint32_t hist[256], warp_sums[33], state[3];
  const int b = blockIdx.x, h = blockIdx.y;
  const int start = indptr[b], pages = indptr[b + 1] - start;
  int* out = sel + ((size_t)h * batch + b) * k_pages;
  const int chosen = min(k_pages, pages);
  if (h == 0 && threadIdx.x == 0) count[b] = chosen;
  for (int p = chosen + threadIdx.x; p < k_pages; p += TK_THREADS) out[p] = -1;
  if (pages <= k_pages) {  // every page is chosen
    for (int p = threadIdx.x; p < pages; p += TK_THREADS) out[p] = p;
    return;
  }
  Row row{scores + (size_t)h * nnz + start, nullptr, pages, sinks, max(window, 1)};
  if (cached) {
    for (int base = 0; base < pages; base += TK_THREADS * 8) {  // 8 loads in flight per thread
      float f[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int p = base + j * TK_THREADS + threadIdx.x;
        f[j] = p < pages ? __ldg(row.scores + p) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int p = base + j * TK_THREADS + threadIdx.x;
        if (p < pages) keys[p] = order_key(f[j]);
      }
    }
    row.keys = keys;
    __syncthreads();  // keys are read by every thread from here on
  }
  uint32_t prefix = 0, mask = 0, rem = k_pages - sinks - row.window;
  for (int shift = 24; rem > 0 && shift >= 0; shift -= 8) {
    if (threadIdx.x < 256) hist[threadIdx.x] = 0;
    __syncthreads();
    histogram(row, prefix, mask, shift, hist);
    __syncthreads();
    if (threadIdx.x < 32) pick_bin(hist, rem, state);
    __syncthreads();
    prefix |= state[0] << shift;
    mask |= 0xffu << shift;
    const bool whole_bin = state[1] == state[2];
    rem = state[1];
    if (whole_bin) break;  // uniform: every key with this prefix is chosen
    __syncthreads();  // state and hist are rewritten by the next pass
  }
  compact(row, prefix, mask, rem, out, warp_sums);
}
