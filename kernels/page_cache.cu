// The HBM page cache over the host tier (questprof/core/page_cache.py holds its rule, the
// reference this follows slot for slot; questprof/backends/page_cache_cupy.py launches it).
// C slots per (request, KV head) in HBM, least recently selected out; K and V pages in mapped
// pinned host memory. One decode step is two launches, both on PageCacheParams (params.cuh):
//   page_cache_step  one CTA per (request, KV head): looks the step's chosen pages up in the
//                    residency table (hits), gives each miss a slot (free slots first, then the
//                    least recently chosen pages not chosen now), keeps the tail page in slot
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

// Thread 0: the tail page to slot C - 1 (the reference's _tail_swap); returns the slot it left
// (-1: none) and whether the tail's and the other page's contents move.
QP_DEVICE int tail_to_last(int* page, int* stamp, int* resident, const int* missed, int n_miss,
                           int tail, int C, bool& tail_moves, bool& other_moves) {
  const int at = resident[tail], last = C - 1;
  if (at == last || at < 0) return -1;  // at < 0: a selection without its tail (refused on the host)
  const int other = page[last];
  bool other_new = false;
  for (int m = 0; m < n_miss; ++m) other_new |= missed[m] == other;
  tail_moves = !(n_miss > 0 && missed[n_miss - 1] == tail);  // sel ascending: the tail is last
  other_moves = other >= 0 && !other_new;
  page[last] = tail, page[at] = other;
  const int st = stamp[last];
  stamp[last] = stamp[at], stamp[at] = st;
  resident[tail] = last;
  if (other >= 0) resident[other] = at;
  return at;
}

extern "C" __global__ void __launch_bounds__(PC_THREADS) page_cache_step(const PageCacheParams p) {
  const PagedCache& c = p.cache;
  const int b = blockIdx.x, h = blockIdx.y, C = p.capacity, K = p.k_pages;
  const long long row = (long long)h * c.batch + b;
  int* page = p.slot_page + row * C;
  int* stamp = p.slot_stamp + row * C;
  int* resident = p.resident + (long long)h * p.nnz + c.indptr[b];
  const int tail = c.indptr[b + 1] - c.indptr[b] - 1;
  const int t = p.clock[row] + 1;
  const int* sel = p.sel + (((long long)((t - 1) % p.steps) * c.kv_heads + h) * c.batch + b) * K;
  extern __shared__ unsigned long long pc_keys[];           // [C]
  int* missed = reinterpret_cast<int*>(pc_keys + C);        // [K] positions of the misses
  int* dest = missed + K;                                   // [K] the slot of each miss
  int* is_miss = dest + K;                                  // [K]
  __shared__ int s_hits, s_misses, s_at;
  __shared__ bool s_tail_moves, s_other_moves;
  if (threadIdx.x == 0) s_hits = 0, s_misses = 0;
  __syncthreads();
  for (int j = threadIdx.x; j < K; j += blockDim.x) {  // hits take the step's stamp
    const int pos = sel[j], slot = pos >= 0 ? resident[pos] : -1;
    is_miss[j] = pos >= 0 && slot < 0;
    if (slot >= 0) stamp[slot] = t, atomicAdd(&s_hits, 1);
  }
  __syncthreads();
  for (int j = threadIdx.x; j < K; j += blockDim.x) {  // a miss's rank: misses before it (K small)
    if (!is_miss[j]) continue;
    int rank = 0;
    for (int i = 0; i < j; ++i) rank += is_miss[i];
    missed[rank] = sel[j];
    atomicAdd(&s_misses, 1);
  }
  for (int s = threadIdx.x; s < C; s += blockDim.x) pc_keys[s] = slot_key(page, stamp, s, t);
  __syncthreads();
  const int n_miss = s_misses;
  for (int s = threadIdx.x; s < C; s += blockDim.x) {  // the n_miss first slots in key order
    const unsigned long long key = pc_keys[s];
    if (key == PC_CHOSEN_KEY) continue;
    int rank = 0;
    for (int i = 0; i < C && rank < n_miss; ++i) rank += pc_keys[i] < key;
    if (rank < n_miss) dest[rank] = s;
  }
  __syncthreads();
  for (int m = threadIdx.x; m < n_miss; m += blockDim.x) {  // evict, then place the miss
    const int s = dest[m], old = page[s];
    if (old >= 0) resident[old] = -1;
  }
  __syncthreads();
  for (int m = threadIdx.x; m < n_miss; m += blockDim.x) {
    const int s = dest[m];
    page[s] = missed[m], stamp[s] = t, resident[missed[m]] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bool tail_moves = false, other_moves = false;
    s_at = tail_to_last(page, stamp, resident, missed, n_miss, tail, C, tail_moves, other_moves);
    s_tail_moves = tail_moves, s_other_moves = other_moves;
  }
  __syncthreads();
  if (s_at >= 0 && (s_tail_moves || s_other_moves)) {
    const long long slot0 = (long long)b * C;
    swap_slots(static_cast<uint4*>(p.k_slots), static_cast<uint4*>(p.v_slots),
               ((slot0 + s_at) * c.kv_heads + h) * p.page_words,
               ((slot0 + C - 1) * c.kv_heads + h) * p.page_words, p.page_words, s_tail_moves,
               s_other_moves);
  }
  for (int j = threadIdx.x; j < K; j += blockDim.x)
    p.slot_sel[row * K + j] = sel[j] >= 0 ? resident[sel[j]] : -1;
  for (int m = threadIdx.x; m < n_miss; m += blockDim.x) {
    p.fetch[row * K + m] = missed[m];
    p.fetch_slot[row * K + m] = resident[missed[m]];
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
