// The HBM page cache over the host tier (questprof/core/page_cache.py holds its rule, the
// reference this follows slot for slot; questprof/backends/page_cache_cupy.py launches it).
// C slots per (request, KV head) in HBM, least recently selected out; K and V pages in mapped
// pinned host memory. One decode step is two launches, both on PageCacheParams (params.cuh):
//   page_cache_step  one CTA per (request, KV head): looks the step's chosen pages up in the
//                    residency table (hits), gives each miss a slot (free slots first, then the
//                    least recently chosen pages not chosen now: a sort of the C slot keys), keeps the tail page in slot
//                    C - 1 (a swap in HBM where it sat elsewhere), and writes the remapped
//                    selection (slot ids), the misses to fetch and the step's hit/miss counts;
//   page_cache_fill  one CTA per (miss, request, KV head), as gather.cu: copies each miss from
//                    mapped host memory, read in place, into its HBM slot.
// Attention then reads the slots as a cache of C pages per request (indptr b * C, the tail page
// last). The step reads its selection from sel[clock % steps] and advances the clock of its
// (request, KV head) itself, so a CUDA graph of the step replays a whole selection sequence.
#include "params.cuh"

#define PC_FREE_KEY(slot) ((unsigned long long)(slot))
#define PC_HELD_KEY(stamp, pos) (((unsigned long long)(stamp) << 32) | (unsigned)(pos))
#define PC_CHOSEN_KEY (~0ull)

// Order of the slots a miss may take: free ones by slot id, then held pages by (stamp, position)
// (stamps start at 1, so every held key sorts after every free one); pages chosen now never.
QP_DEVICE unsigned long long slot_key(const int* page, const int* stamp, int s, int t) {
  if (page[s] < 0) return PC_FREE_KEY(s);
  return stamp[s] == t ? PC_CHOSEN_KEY : PC_HELD_KEY(stamp[s], page[s]);
}

// Swap the K and V contents of slots a and z of one KV head (16-byte words): `to_z` moves a's
// words to z, `to_a` z's to a.
QP_DEVICE void swap_slots(uint4* k, uint4* v, long long a, long long z, int words, bool to_z,
                          bool to_a) {
  for (int i = threadIdx.x; i < words; i += blockDim.x) {
    const uint4 ka = k[a + i], kz = k[z + i], va = v[a + i], vz = v[z + i];
    if (to_z) k[z + i] = ka, v[z + i] = va;
    if (to_a) k[a + i] = kz, v[a + i] = vz;
  }
}

// The block's exclusive prefix count of `flag` over its threads (in thread order) and, in
// `total`, the block's count. Every thread calls it; blockDim.x a multiple of 32, at most 1024.
QP_DEVICE int block_rank(bool flag, int& total, int* warp_counts) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int before = 0;
  total = 0;
  for (int w = 0; w < warps; ++w) {
    before += w < warp ? warp_counts[w] : 0;
    total += warp_counts[w];
  }
  __syncthreads();  // warp_counts is free for the next call
  return before + __popc(ballot & ((1u << lane) - 1u));
}

// Sort n (a power of two) keys ascending in shared memory (bitonic: log2(n)^2 / 2 passes).
QP_DEVICE void block_sort(unsigned long long* keys, int n) {
  for (int k = 2; k <= n; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int l = i ^ j;
        if (l > i) {
          const unsigned long long a = keys[i], z = keys[l];
          if ((a > z) == ((i & k) == 0)) keys[i] = z, keys[l] = a;
        }
      }
      __syncthreads();
    }
}

// Where a slot id lands when the tail's slot `at` and the last slot swap pages (at < 0: none).
QP_DEVICE int swapped(int slot, int at, int last) {
  return at < 0 ? slot : slot == at ? last : slot == last ? at : slot;
}

// One CTA per (request, KV head). Every global round trip is one pass of the block: the
// selection and its residency, the slots' pages and stamps, the free or evicted slots' owners,
// then the tail; the misses are ranked by a ballot scan and the slots they take found by a sort
// of the C slot keys in shared memory (no loop of one thread over K or C entries).
extern "C" __global__ void __launch_bounds__(PC_THREADS) page_cache_step(const PageCacheParams p) {
  const PagedCache& c = p.cache;
  const int b = blockIdx.x, h = blockIdx.y, C = p.capacity, K = p.k_pages, last = C - 1;
  const long long row = (long long)h * c.batch + b;
  int* page = p.slot_page + row * C;
  int* stamp = p.slot_stamp + row * C;
  int* resident = p.resident + (long long)h * p.nnz + c.indptr[b];
  const int tail = c.indptr[b + 1] - c.indptr[b] - 1;
  const int t = p.clock[row] + 1;
  const int* sel = p.sel + (((long long)((t - 1) % p.steps) * c.kv_heads + h) * c.batch + b) * K;
  int n = 1;  // the sort's length: C rounded up to a power of two
  while (n < C) n <<= 1;
  extern __shared__ unsigned long long pc_keys[];           // [n] slot keys, sorted
  int* missed = reinterpret_cast<int*>(pc_keys + n);        // [K] positions of the misses
  int* dest = missed + K;                                   // [K] the slot of each miss
  int* slot_of = dest + K;                                  // [K] sel j's slot; -2 - rank: a miss
  __shared__ int warp_counts[PC_THREADS / 32];
  __shared__ int s_tail_j, s_at, s_hits, s_misses;
  __shared__ bool s_last_new, s_tail_moves, s_other_moves;
  if (threadIdx.x == 0) s_tail_j = -1, s_last_new = false, s_hits = 0, s_misses = 0;
  __syncthreads();
  // hits take the step's stamp; misses get their rank among the misses (selection order)
  for (int base = 0; base < K; base += blockDim.x) {
    const int j = base + threadIdx.x;
    const int pos = j < K ? sel[j] : -1, slot = pos >= 0 ? resident[pos] : -1;
    const bool miss = pos >= 0 && slot < 0;
    if (slot >= 0) stamp[slot] = t;
    if (pos == tail) s_tail_j = j;
    int hits, misses;
    const int rank = block_rank(miss, misses, warp_counts);
    block_rank(slot >= 0, hits, warp_counts);
    if (miss) missed[s_misses + rank] = pos;
    if (j < K) slot_of[j] = miss ? -2 - (s_misses + rank) : slot;
    __syncthreads();
    if (threadIdx.x == 0) s_hits += hits, s_misses += misses;
    __syncthreads();
  }
  const int n_miss = s_misses;
  for (int s = threadIdx.x; s < n; s += blockDim.x)
    pc_keys[s] = s < C ? slot_key(page, stamp, s, t) : PC_CHOSEN_KEY;
  __syncthreads();
  block_sort(pc_keys, n);
  // the n_miss first slots in key order: free ones carry their slot id, held ones their page
  for (int m = threadIdx.x; m < n_miss; m += blockDim.x) {
    const unsigned long long key = pc_keys[m];
    const bool held = key >> 32;
    const int old = held ? (int)(unsigned)key : -1;
    const int s = held ? resident[old] : (int)key;
    dest[m] = s;
    if (s == last) s_last_new = true;
  }
  __syncthreads();
  for (int m = threadIdx.x; m < n_miss; m += blockDim.x) {  // evict, then place the miss
    const unsigned long long key = pc_keys[m];
    if (key >> 32) resident[(unsigned)key] = -1;
  }
  __syncthreads();
  for (int m = threadIdx.x; m < n_miss; m += blockDim.x) {
    const int s = dest[m];
    page[s] = missed[m], stamp[s] = t, resident[missed[m]] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // the tail page to slot C - 1 (the reference's _tail_swap)
    const int tj = s_tail_j;  // the host refuses a selection without its tail
    const int sj = tj >= 0 ? slot_of[tj] : -1;
    const int at = tj < 0 ? resident[tail] : sj >= 0 ? sj : dest[-2 - sj];
    s_at = -1;
    if (at >= 0 && at != last) {
      const int other = page[last];
      const int st = stamp[last];
      s_tail_moves = tj < 0 || sj >= 0;  // a tail fetched now is fetched into the last slot
      s_other_moves = other >= 0 && !s_last_new;
      page[last] = tail, page[at] = other;
      stamp[last] = stamp[at], stamp[at] = st;
      resident[tail] = last;
      if (other >= 0) resident[other] = at;
      s_at = at;
    }
  }
  __syncthreads();
  const int at = s_at;
  if (at >= 0 && (s_tail_moves || s_other_moves)) {
    const long long slot0 = (long long)b * C;
    swap_slots(static_cast<uint4*>(p.k_slots), static_cast<uint4*>(p.v_slots),
               ((slot0 + at) * c.kv_heads + h) * p.page_words,
               ((slot0 + last) * c.kv_heads + h) * p.page_words, p.page_words, s_tail_moves,
               s_other_moves);
  }
  for (int j = threadIdx.x; j < K; j += blockDim.x) {
    const int sj = slot_of[j];
    p.slot_sel[row * K + j] = sj == -1 ? -1 : swapped(sj >= 0 ? sj : dest[-2 - sj], at, last);
  }
  for (int m = threadIdx.x; m < n_miss; m += blockDim.x) {
    p.fetch[row * K + m] = missed[m];
    p.fetch_slot[row * K + m] = swapped(dest[m], at, last);
  }
  if (threadIdx.x == 0) {
    p.clock[row] = t;
    p.step_counts[row * 2] = s_hits, p.step_counts[row * 2 + 1] = n_miss;
    p.total_counts[row * 2] += s_hits, p.total_counts[row * 2 + 1] += n_miss;
  }
}

// grid (B * K, Hkv): block (b * K + m, h) copies the m-th miss of (b, h), if the step had one.
extern "C" __global__ void __launch_bounds__(PC_FILL_THREADS) page_cache_fill(const PageCacheParams p) {
  const PagedCache& c = p.cache;
  const int b = blockIdx.x / p.k_pages, m = blockIdx.x - b * p.k_pages, h = blockIdx.y;
  const long long row = (long long)h * c.batch + b;
  if (m >= p.step_counts[row * 2 + 1]) return;
  const long long page = c.indices[c.indptr[b] + p.fetch[row * p.k_pages + m]];
  const long long slot = (long long)b * p.capacity + p.fetch_slot[row * p.k_pages + m];
  const uint4* __restrict__ k = static_cast<const uint4*>(c.k);
  const uint4* __restrict__ v = static_cast<const uint4*>(c.v);
  uint4* __restrict__ k_out = static_cast<uint4*>(p.k_slots);
  uint4* __restrict__ v_out = static_cast<uint4*>(p.v_slots);
  const long long src = (page * c.kv_heads + h) * p.page_words;
  const long long dst = (slot * c.kv_heads + h) * p.page_words;
  for (int i = threadIdx.x; i < p.page_words; i += blockDim.x) {
    const uint4 a = k[src + i];
    const uint4 w = v[src + i];
    k_out[dst + i] = a;
    v_out[dst + i] = w;
  }
}
