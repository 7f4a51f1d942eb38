// Top-K page selection of one row, by one CTA of NT threads: the device code of topk.cu (a CTA of
// TK_THREAD_OPTIONS threads per row).
// The algorithm and its figures: the comment at the top of topk.cu.
#pragma once
#include "common.cuh"

constexpr int TK_ITEMS = 8;  // positions per thread in one compaction chunk (NT * 8 per chunk)
constexpr int TK_BITS = 11, TK_BINS = 1 << TK_BITS;

QP_DEVICE uint32_t order_key(float f) {
  if (f != f) return 0u;  // NaN ranks below -inf, last, as reference.topk's lexsort puts it
  uint32_t u = __float_as_uint(f == 0.f ? 0.f : f);  // -0 and +0 are equal scores
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct Row {
  const float* scores;   // this (head, request) row of P scores
  const uint32_t* keys;  // shared-memory keys, or nullptr to recompute from scores
  int pages, sinks, window;
  QP_DEVICE bool reserved(int p) const { return p < sinks || p >= pages - window; }
  QP_DEVICE uint32_t key(int p) const { return keys ? keys[p] : order_key(__ldcg(scores + p)); }
};

struct TopkShared { uint32_t hist[TK_BINS], warp_sums[64], state[3]; };

// Phase stamps of thread 0 of each CTA (clock64) for tools/topk_latency.py, in a -DTK_TRACE
// build only: slot 0 the kernel's start, 1 the keys loaded, 2 the key range, 3-6 each pass of
// the range select, 7 the compaction. Empty in every other build.
#ifdef TK_TRACE
constexpr int TK_TRACE_CTAS = 1024, TK_TRACE_SLOTS = 16;
__device__ long long tk_trace[TK_TRACE_CTAS * TK_TRACE_SLOTS];
#define TK_STAMP(i)                                                                \
  do {                                                                             \
    const int cta_ = blockIdx.y * gridDim.x + blockIdx.x;                          \
    if (threadIdx.x == 0 && cta_ < TK_TRACE_CTAS)                                  \
      tk_trace[cta_ * TK_TRACE_SLOTS + (i)] = clock64();                           \
  } while (0)
#else
#define TK_STAMP(i) \
  do {              \
  } while (0)
#endif

// Inclusive prefix sum of x over the lanes of a warp (every lane calls it).
template <typename V>
QP_DEVICE V warp_inclusive_scan(V x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const V y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

// Exclusive prefix sum of `x` over the CTA in thread order; *total gets the sum.
template <int NT>
QP_DEVICE uint32_t block_exclusive_scan(uint32_t x, uint32_t* total, uint32_t* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // warp_sums may still be read by the previous call
  const uint32_t incl = warp_inclusive_scan(x);
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const uint32_t w = lane < NT / 32 ? warp_sums[lane] : 0, wincl = warp_inclusive_scan(w);
    warp_sums[lane] = wincl - w;
    if (lane == 31) warp_sums[32] = wincl;
  }
  __syncthreads();
  *total = warp_sums[32];
  return warp_sums[warp] + incl - x;
}

// Smallest and largest key of the row's unreserved pages, known to every thread.
template <int NT>
QP_DEVICE void key_range(const Row& row, uint32_t* lo, uint32_t* hi, uint32_t* red) {
  uint32_t kmin = 0xffffffffu, kmax = 0;
  for (int p = threadIdx.x; p < row.pages; p += NT)
    if (!row.reserved(p)) { const uint32_t k = row.key(p); kmin = min(kmin, k); kmax = max(kmax, k); }
  kmin = __reduce_min_sync(0xffffffffu, kmin);
  kmax = __reduce_max_sync(0xffffffffu, kmax);
  __syncthreads();  // red (warp_sums) may still be read by the row before
  if ((threadIdx.x & 31) == 0) { red[threadIdx.x >> 5] = kmin; red[32 + (threadIdx.x >> 5)] = kmax; }
  __syncthreads();
  kmin = red[0]; kmax = red[32];
#pragma unroll 8
  for (int w = 1; w < NT / 32; ++w) { kmin = min(kmin, red[w]); kmax = max(kmax, red[32 + w]); }
  *lo = kmin; *hi = kmax;
}

// One pass: narrow [lo, hi] to the bin holding the rem-th largest key in it; rem becomes the
// count still needed from that bin. Returns true when the bin settles the threshold (all of it
// is taken, or it holds one key value and ties go by position).
template <int NT>
QP_DEVICE bool narrow(const Row& row, uint32_t* lo, uint32_t* hi, uint32_t* rem, TopkShared& sh) {
  constexpr int PER = TK_BINS / NT;  // bins per thread in the bin scan
  const uint32_t span = *hi - *lo;
  const int s = max(0, (32 - __clz(span)) - TK_BITS);
  for (int i = threadIdx.x; i < TK_BINS; i += NT) sh.hist[i] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < row.pages; p += NT) {
    if (row.reserved(p)) continue;
    const uint32_t k = row.key(p);
    if (k >= *lo && k <= *hi) atomicAdd(sh.hist + ((k - *lo) >> s), 1u);
  }
  __syncthreads();
  const int top = TK_BINS - 1 - PER * threadIdx.x;  // bins from the largest keys down
  uint32_t h[PER], mine = 0;
#pragma unroll
  for (int j = 0; j < PER; ++j) { h[j] = sh.hist[top - j]; mine += h[j]; }
  uint32_t total;
  uint32_t above = block_exclusive_scan<NT>(mine, &total, sh.warp_sums);
  if (above < *rem && *rem <= above + mine) {
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      if (above < *rem && *rem <= above + h[j]) {
        sh.state[0] = top - j;
        sh.state[1] = *rem - above;
        sh.state[2] = h[j];
      }
      above += h[j];
    }
  }
  __syncthreads();
  const uint32_t bin = sh.state[0], need = sh.state[1], count = sh.state[2];
  const uint32_t new_lo = *lo + (bin << s);
  *hi = (uint32_t)min((unsigned long long)*hi, (unsigned long long)new_lo + (1ull << s) - 1);
  *lo = new_lo;
  *rem = need;
  return need == count || s == 0;
}

// Write the chosen positions of `row` in ascending order to out: reserved pages and keys above
// hi always, keys in [lo, hi] while their rank among them is below rem.
template <int NT>
QP_DEVICE void compact(const Row& row, uint32_t lo, uint32_t hi, uint32_t rem,
                       int* __restrict__ out, uint32_t* warp_sums) {
  uint32_t sel_done = 0, eq_done = 0;
  for (int chunk = 0; chunk < row.pages; chunk += NT * TK_ITEMS) {
    const int p0 = chunk + threadIdx.x * TK_ITEMS;
    uint32_t k[TK_ITEMS];
    if (row.keys && p0 + TK_ITEMS <= row.pages) {  // two 16-byte loads, not 8 conflicting ones
      const uint4 a = *reinterpret_cast<const uint4*>(row.keys + p0);
      const uint4 b = *reinterpret_cast<const uint4*>(row.keys + p0 + 4);
      k[0] = a.x; k[1] = a.y; k[2] = a.z; k[3] = a.w; k[4] = b.x; k[5] = b.y; k[6] = b.z; k[7] = b.w;
    } else {
#pragma unroll
      for (int j = 0; j < TK_ITEMS; ++j) k[j] = p0 + j < row.pages ? row.key(p0 + j) : 0;
    }
    uint32_t eq = 0, take = 0;
#pragma unroll
    for (int j = 0; j < TK_ITEMS; ++j) {
      const int p = p0 + j;
      if (p >= row.pages) continue;
      if (row.reserved(p) || k[j] > hi) take |= 1u << j;
      else if (k[j] >= lo) eq |= 1u << j;
    }
    // One scan of (taken, tied) counts packed 16 | 16 bits (a chunk holds <= 8192 positions).
    uint32_t total;
    const uint32_t before = block_exclusive_scan<NT>((__popc(take) << 16) | __popc(eq), &total,
                                                     warp_sums);
    uint32_t rank = eq_done + (before & 0xffffu);
    uint32_t slot = sel_done + (before >> 16) + min(rank, rem) - min(eq_done, rem);
#pragma unroll
    for (int j = 0; j < TK_ITEMS; ++j) {
      if (eq >> j & 1u) { if (rank < rem) out[slot++] = p0 + j; ++rank; }
      else if (take >> j & 1u) out[slot++] = p0 + j;
    }
    const uint32_t eq_total = total & 0xffffu;
    sel_done += (total >> 16) + min(eq_done + eq_total, rem) - min(eq_done, rem);
    eq_done += eq_total;
  }
}

// The K best of `pages` scores (a row written by an earlier grid: read through L2) into
// out[0, k_pages), -1 padded. `keys`: shared memory for `pages` keys, or nullptr to re-read the
// scores in every pass. Every thread of the CTA calls it.
template <int NT>
QP_DEVICE void select_row(const float* scores, uint32_t* keys, int pages, int k_pages, int sinks,
                          int window, int* __restrict__ out, TopkShared& sh) {
  const int chosen = min(k_pages, pages);
  for (int p = chosen + threadIdx.x; p < k_pages; p += NT) out[p] = -1;
  if (pages <= k_pages) {  // every page is chosen
    for (int p = threadIdx.x; p < pages; p += NT) out[p] = p;
    return;
  }
  Row row{scores, nullptr, pages, sinks, max(window, 1)};
  if (keys) {
    __syncthreads();  // the row before may still read the keys
    for (int base = 0; base < pages; base += NT * 8) {  // 8 loads in flight per thread
      float f[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int p = base + j * NT + threadIdx.x;
        f[j] = p < pages ? __ldcg(scores + p) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int p = base + j * NT + threadIdx.x;
        if (p < pages) keys[p] = order_key(f[j]);
      }
    }
    __syncthreads();  // keys are read by every thread from here on
  }
  TK_STAMP(1);
  row.keys = keys;
  uint32_t rem = k_pages - sinks - row.window, lo = 0xffffffffu, hi = 0xffffffffu;
  if (rem > 0) {  // else only reserved pages: the empty rank test below takes none of [lo, hi]
    key_range<NT>(row, &lo, &hi, sh.warp_sums);
    TK_STAMP(2);
    for (int pass = 0;; ++pass) {
      const bool settled = narrow<NT>(row, &lo, &hi, &rem, sh);
      TK_STAMP(3 + min(pass, 3));
      if (settled) break;
    }
  }
  compact<NT>(row, lo, hi, rem, out, sh.warp_sums);
  TK_STAMP(7);
}

// Rows of at most NT x R pages, their keys in registers: thread t holds positions [t R, t R + R),
// so the compaction's one scan yields ascending positions as compact's does. The same range
// select (bins, passes, ties) as select_row, so the same pages, in a shorter chain: 16-byte
// loads of the scores, no keys in shared memory, two histograms that alternate (a pass zeroes
// the next one's), the warps' partial sums read as 16-byte words by every thread rather than
// scanned by one warp: 3 barriers a pass, 1 for the range, 1 for the compaction (select_row:
// about 17 for a 2048-page row of 2 passes). H200, 2026-12-02 at fe065b0, tools/topk_latency.py,
// us per launch: 32 rows of 2048 pages 3.55 at 512 x 4 against 5.06 for select_row; 8192-page
// rows at 512 x 16 8.08 against 9.94 (64 rows) and 13.23 against 14.66 (256 rows)
// (notes/KERNELS.md). Once per CTA.
struct SmallShared {
  uint32_t hist[2][TK_BINS];
  __align__(16) uint32_t red[2][32];
  __align__(16) uint32_t warps[2][32];
  __align__(16) uint32_t scan[32];
  uint32_t state[2][3];
};

// Sum of the first `n` of the NW words of `words` (16-byte reads; every thread of the CTA).
template <int NW>
QP_DEVICE uint32_t sum_before(const uint32_t* words, int n) {
  uint32_t total = 0;
#pragma unroll
  for (int i = 0; i < NW; i += 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(words + i);
    total += (i < n ? v.x : 0u) + (i + 1 < n ? v.y : 0u) + (i + 2 < n ? v.z : 0u) +
             (i + 3 < n ? v.w : 0u);
  }
  return total;
}

// Exclusive prefix sum of x over the CTA in thread order, in one barrier: each warp's total goes
// to words[warp] (NW words, 16-byte aligned, not read since the barrier before), then every
// thread adds those of the warps before its own.
template <int NW>
QP_DEVICE uint32_t scan_one_barrier(uint32_t x, uint32_t* words) {
  const uint32_t incl = warp_inclusive_scan(x);
  if ((threadIdx.x & 31) == 31) words[threadIdx.x >> 5] = incl;
  __syncthreads();
  return incl - x + sum_before<NW>(words, threadIdx.x >> 5);
}

template <int NT, int R>
QP_DEVICE void select_small(const float* scores, int pages, int k_pages, int sinks, int window,
                            int* __restrict__ out, SmallShared& sh) {
  constexpr int NW = NT / 32, PER = TK_BINS / NT;
  static_assert(NW % 4 == 0 && NW <= 32 && TK_BINS % NT == 0, "16-byte reads of warp words");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chosen = min(k_pages, pages);
  for (int p = chosen + threadIdx.x; p < k_pages; p += NT) out[p] = -1;
  if (pages <= k_pages) {  // every page is chosen
    for (int p = threadIdx.x; p < pages; p += NT) out[p] = p;
    return;
  }
  window = max(window, 1);
  const int p0 = threadIdx.x * R;
  float f[R];
  if (R % 4 == 0 && (reinterpret_cast<size_t>(scores) & 15) == 0 && p0 + R <= pages) {
#pragma unroll
    for (int j = 0; j < R; j += 4) {
      const float4 x = __ldcg(reinterpret_cast<const float4*>(scores + p0 + j));
      f[j] = x.x; f[j + 1] = x.y; f[j + 2] = x.z; f[j + 3] = x.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < R; ++j) f[j] = p0 + j < pages ? __ldcg(scores + p0 + j) : 0.f;
  }
  uint32_t key[R], live = 0, kept = 0;  // bits j: an unreserved / a reserved page at p0 + j
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int p = p0 + j;
    key[j] = order_key(f[j]);
    if (p < pages) {
      if (p < sinks || p >= pages - window) kept |= 1u << j;
      else live |= 1u << j;
    }
  }
  for (int i = threadIdx.x; i < TK_BINS; i += NT) sh.hist[0][i] = 0;
  TK_STAMP(1);
  uint32_t rem = k_pages - sinks - window, lo = 0xffffffffu, hi = 0xffffffffu;
  if (rem > 0) {  // else only reserved pages: the rank test below takes none of [lo, hi]
    uint32_t kmin = 0xffffffffu, kmax = 0;
#pragma unroll
    for (int j = 0; j < R; ++j)
      if (live >> j & 1u) { kmin = min(kmin, key[j]); kmax = max(kmax, key[j]); }
    kmin = __reduce_min_sync(0xffffffffu, kmin);
    kmax = __reduce_max_sync(0xffffffffu, kmax);
    if (lane == 0) { sh.red[0][warp] = kmin; sh.red[1][warp] = kmax; }
    __syncthreads();  // the warps' ranges; hist[0] zeroed
#pragma unroll
    for (int w = 0; w < NW; w += 4) {
      const uint4 a = *reinterpret_cast<const uint4*>(sh.red[0] + w);
      const uint4 z = *reinterpret_cast<const uint4*>(sh.red[1] + w);
      lo = min(lo, min(min(a.x, a.y), min(a.z, a.w)));
      hi = w == 0 ? max(max(z.x, z.y), max(z.z, z.w)) : max(hi, max(max(z.x, z.y), max(z.z, z.w)));
    }
    TK_STAMP(2);
    for (int pass = 0;; ++pass) {
      const int b = pass & 1;
      const int s = max(0, (32 - __clz(hi - lo)) - TK_BITS);
#pragma unroll
      for (int j = 0; j < R; ++j)
        if ((live >> j & 1u) && key[j] >= lo && key[j] <= hi)
          atomicAdd(sh.hist[b] + ((key[j] - lo) >> s), 1u);
      for (int i = threadIdx.x; i < TK_BINS; i += NT) sh.hist[b ^ 1][i] = 0;
      __syncthreads();  // the histogram is complete
      const int top = TK_BINS - 1 - PER * threadIdx.x;  // bins from the largest keys down
      uint32_t h[PER], mine = 0;
#pragma unroll
      for (int j = 0; j < PER; ++j) { h[j] = sh.hist[b][top - j]; mine += h[j]; }
      uint32_t above = scan_one_barrier<NW>(mine, sh.warps[b]);  // every warp's count
      if (above < rem && rem <= above + mine) {
#pragma unroll
        for (int j = 0; j < PER; ++j) {
          if (above < rem && rem <= above + h[j]) {
            sh.state[b][0] = top - j;
            sh.state[b][1] = rem - above;
            sh.state[b][2] = h[j];
          }
          above += h[j];
        }
      }
      __syncthreads();  // the bin is known
      const uint32_t bin = sh.state[b][0], need = sh.state[b][1], count = sh.state[b][2];
      const uint32_t new_lo = lo + (bin << s);
      hi = (uint32_t)min((unsigned long long)hi, (unsigned long long)new_lo + (1ull << s) - 1);
      lo = new_lo;
      rem = need;
      TK_STAMP(3 + min(pass, 3));
      if (need == count || s == 0) break;
    }
  }
  uint32_t take = 0, eq = 0;
#pragma unroll
  for (int j = 0; j < R; ++j) {
    if (kept >> j & 1u) take |= 1u << j;
    else if (live >> j & 1u) {
      if (key[j] > hi) take |= 1u << j;
      else if (key[j] >= lo) eq |= 1u << j;
    }
  }
  // One scan of (taken, tied) counts packed 16 | 16 bits (a row of at most 65535 pages).
  const uint32_t packed = (__popc(take) << 16) | __popc(eq);
  const uint32_t before = scan_one_barrier<NW>(packed, sh.scan);
  uint32_t rank = before & 0xffffu, slot = (before >> 16) + min(rank, rem);
#pragma unroll
  for (int j = 0; j < R; ++j) {
    if (eq >> j & 1u) { if (rank < rem) out[slot++] = p0 + j; ++rank; }
    else if (take >> j & 1u) out[slot++] = p0 + j;
  }
  TK_STAMP(7);
}

// Dynamic budgets (quest-gap:t, quest-topp:p; core/selection.py gap, top_p): after select_row has
// chosen K_max = k_pages pages, keep the tail page and the first n of the other chosen ones in
// bound order (score descending, ties to the lower position, as reference.topk ranks them).
// gap: n = the first r + 1 where (U_(r) - U_(r+1)) x scaling > t, else all of them; top-p: the
// fewest n whose softmax mass over the row's bounds (x scaling), the tail's included, reaches p.
// Arithmetic in double, as the NumPy reference: the gap is bit for bit its own.
enum { RULE_FIXED = 0, RULE_GAP = 1, RULE_TOP_P = 2 };
struct DynamicRule {
  int rule;
  double param, scaling;
};

// Sum of x over the CTA (every thread gets it); red: 32 doubles of shared memory.
template <int NT>
QP_DEVICE double block_sum_f64(double x, double* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  __syncthreads();  // red may still be read by the previous call
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < NT / 32; ++w) total += red[w];
  return total;
}

// Exclusive prefix sum of x over the CTA in thread order; red: 32 doubles of shared memory.
template <int NT>
QP_DEVICE double block_exclusive_scan_f64(double x, double* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const double incl = warp_inclusive_scan(x);
  double excl = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == 0) excl = 0.0;
  __syncthreads();
  if (lane == 31) red[warp] = incl;
  __syncthreads();
  for (int w = 0; w < warp; ++w) excl += red[w];
  return excl;
}

// Non-tail pages n that the rule keeps of `rest` chosen ones whose scores in rank order are
// sval[0, rest) (shared memory); every thread returns it. The row's tail page scores u_tail.
template <int NT>
QP_DEVICE int rule_pages(const float* scores, int pages, int rest, const float* sval,
                         float u_tail, const DynamicRule& rule, uint32_t* state, double* red) {
  const double s = rule.scaling;
  if (threadIdx.x == 0) *state = rest;
  __syncthreads();
  if (rule.rule == RULE_GAP) {
    for (int r = threadIdx.x; r + 1 < rest; r += NT)
      if ((double)sval[r] * s - (double)sval[r + 1] * s > rule.param) atomicMin(state, r + 1u);
    __syncthreads();
    return *state;
  }
  const double top = fmax((double)sval[0], (double)u_tail);  // rank 0: the largest non-tail
  double z = 0.0;
  for (int p = threadIdx.x; p < pages; p += NT) z += exp(((double)__ldcg(scores + p) - top) * s);
  z = block_sum_f64<NT>(z, red);
  // Ranks [r0, r1) per thread, in order: cum_j = w_tail + sum_{r < j} w_r, n = #{j : cum_j < p}.
  const int per = (rest + NT - 1) / NT, r0 = min(rest, threadIdx.x * per), r1 = min(rest, r0 + per);
  double mine = 0.0;
  for (int r = r0; r < r1; ++r) mine += exp(((double)sval[r] - top) * s) / z;
  double cum = exp(((double)u_tail - top) * s) / z + block_exclusive_scan_f64<NT>(mine, red);
  if (threadIdx.x == 0) *state = 0;
  __syncthreads();
  uint32_t below = 0;
  for (int r = r0; r < r1; ++r) {
    below += cum < rule.param;
    cum += exp(((double)sval[r] - top) * s) / z;
  }
  if (below) atomicAdd(state, below);
  __syncthreads();
  return *state;
}

// After select_row (out[0, chosen) ascending, the tail page last): rewrite out[0, K) with the
// pages the rule keeps, ascending, -1 padded; returns their count (every thread). smem: 16 bytes
// per page of k_pages (keys, positions, ranks, scores by rank), the row's keys no longer needed.
template <int NT>
QP_DEVICE int dynamic_select(const float* scores, int pages, int k_pages, const DynamicRule& rule,
                             int* __restrict__ out, void* smem, TopkShared& sh) {
  __shared__ double red[32];
  const int chosen = min(k_pages, pages), rest = chosen - 1;
  if (rest <= 0) return chosen;  // the tail page alone, or no page
  uint32_t* key = reinterpret_cast<uint32_t*>(smem);
  int* pos = reinterpret_cast<int*>(key + k_pages);
  int* rank = pos + k_pages;
  float* sval = reinterpret_cast<float*>(rank + k_pages);
  __syncthreads();  // select_row's writes of out (and reads of its keys) are done
  for (int j = threadIdx.x; j < rest; j += NT) {
    pos[j] = out[j];
    key[j] = order_key(__ldcg(scores + pos[j]));
  }
  __syncthreads();
  for (int j = threadIdx.x; j < rest; j += NT) {  // O(rest^2 / NT): 1 pass at K 256
    uint32_t r = 0;
    const uint32_t kj = key[j];
    for (int i = 0; i < rest; ++i) r += key[i] > kj || (key[i] == kj && i < j);
    rank[j] = r;
    sval[r] = __ldcg(scores + pos[j]);
  }
  __syncthreads();
  const int n = rule_pages<NT>(scores, pages, rest, sval, __ldcg(scores + pages - 1), rule,
                               sh.state, red);
  // Compact the kept pages in position order: thread t owns positions [t * per, (t + 1) * per).
  const int per = (rest + NT - 1) / NT, j0 = min(rest, (int)threadIdx.x * per);
  const int j1 = min(rest, j0 + per);
  uint32_t kept = 0, total;
  for (int j = j0; j < j1; ++j) kept += rank[j] < n;
  uint32_t slot = block_exclusive_scan<NT>(kept, &total, sh.warp_sums);
  for (int j = j0; j < j1; ++j)
    if (rank[j] < n) out[slot++] = pos[j];
  for (int j = n + threadIdx.x; j < chosen; j += NT) out[j] = j == n ? pages - 1 : -1;
  return n + 1;
}
