// Device code of the Quest step as one persistent kernel (quest_step.cu): its estimate share, its
// work queue and the queue's two kinds of work item. The design and why: the comment at the top
// of quest_step.cu.
#pragma once
#include "attention_tile.cuh"
#include "estimate.cuh"
#include "topk.cuh"

// Build options (-D at build; backends/quest_step.py's StepTuning names them, and
// tools/quest_step_probe.py times each against the defaults, kernels/constants.cuh's PS_*):
//   QS_THREADS   threads per CTA (attention runs on the first ATT_WARPS warps, the others
//                prefetch its next ticket's page ids when there are others)
//   QS_CTAS      resident CTAs per SM that __launch_bounds__ sizes registers for
#ifndef QS_THREADS
#define QS_THREADS PS_THREADS
#endif
#ifndef QS_CTAS
#define QS_CTAS PS_CTAS_PER_SM
#endif
constexpr int PS_NT = QS_THREADS;
static_assert(PS_NT % 32 == 0 && PS_NT >= ATT_WARPS * 32 && PS_NT <= 1024, "whole warps");

enum { PS_SELECT = 1, PS_ATTEND = 2, PS_END = 3 };
// What a launch runs (its `stop` argument): everything, or only the estimate, or the estimate
// and the select tickets; the last two time the phases.
enum { PS_STOP_ESTIMATE = 1, PS_STOP_SELECT = 2, PS_STOP_ALL = 3 };

// A timeline of one launch for tools/quest_step_probe.py (trace nullptr: nothing is recorded):
// per CTA its start, the end of its estimate share and its end, [3 x grid]; then per ticket its
// start, its middle (select: every score of the row has arrived; attention: the row is ready)
// and its end [3 x tickets]; nanoseconds of %globaltimer, thread 0 of the CTA.
struct Trace {
  unsigned long long* at;
  QP_DEVICE static unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
  QP_DEVICE void cta(int what) const {
    if (at && threadIdx.x == 0) at[3 * blockIdx.x + what] = now();
  }
  QP_DEVICE void ticket(int t, int what, bool me) const {  // me: the thread that records
    if (at && me) at[3 * gridDim.x + 3 * t + what] = now();
  }
};

// The launch: its arguments, its estimate CTAs and its queue. CTAs 0 .. queue_ctas - 1 start on
// the queue; the others score their share of the estimate first (grid-stride over head-major
// tiles, so KV head 0's rows complete first, then head 1's, ...) and join the queue after it.
// The queue: one select ticket per (q head, request), KV head by KV head, then the attention
// tickets ((row, split), rows in the same order). state: [0] the next ticket, [1] CTAs finished,
// then ready flags per (q head, request) [Hq B] (one line each), splits finished per row [Hq B].
struct Step {
  const uint16_t *q, *summ, *k, *v;
  const int *indptr, *indices, *last_len;
  float* scores;
  int *sel, *count;
  uint16_t* out;
  float *lse, *ws_o, *ws_lse;
  int* state;
  int batch, q_heads, kv_heads, group, nnz, k_pages, sinks, window, splits, split_pages,
      page_shift;
  float scale_log2;
  int stop;        // PS_STOP_*: the whole step, or its estimate (and select tickets) only
  int queue_ctas;  // CTAs that start on the queue (at most gridDim.x - 1: one CTA estimates)
  Trace trace;     // the launch's timeline, or nothing (tools/quest_step_probe.py)
  int selects, total;  // select tickets; all tickets

  QP_DEVICE void plan() {
    queue_ctas = min(max(queue_ctas, 0), (int)gridDim.x - 1);
    selects = stop >= PS_STOP_SELECT ? batch * q_heads : 0;
    total = selects + (stop == PS_STOP_ALL ? batch * q_heads * splits : 0);
  }
  QP_DEVICE int kind(int t) const {
    return t >= total ? PS_END : t >= selects ? PS_ATTEND : PS_SELECT;
  }
  // A row's ready flag has a 128-byte line of its own: hundreds of CTAs poll the first rows'
  // flags while the last rows' selections write theirs.
  QP_DEVICE int* ready(int row) const { return state + PS_LINE * (1 + row); }
  QP_DEVICE int* split_done() const { return state + PS_LINE * (1 + q_heads * batch); }
};

QP_DEVICE int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
QP_DEVICE void store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
QP_DEVICE int add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v)
               : "memory");
  return old;
}
QP_DEVICE int load_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
QP_DEVICE float load_relaxed(const float* p) {
  float v;
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}

// Thread 0 waits until *p >= want, then acquires it (relaxed polls: an acquire load per poll
// would order, and slow, the SM's other loads each time). What it waits on is done by a CTA that
// never waits on this one (the queue's order, the estimate's static shares), so the wait ends; a
// bug must not hang the GPU: after 2^26 polls the kernel traps.
constexpr long long PS_MAX_POLLS = 1ll << 26;
QP_DEVICE void wait_at_least(const int* p, int want) {
  unsigned sleep = 64;  // backing off to 1 us: a few polls per waiting CTA and microsecond
  for (long long n = 0; load_relaxed(p) < want; ++n) {
    if (n == PS_MAX_POLLS) __trap();
    __nanosleep(sleep);
    sleep = min(2 * sleep, 1024u);
  }
  (void)load_acquire(p);
}

// The next ticket, known to every thread (two barriers: the slot is free again on return).
QP_DEVICE int take_ticket(const Step& s, int* slot) {
  if (threadIdx.x == 0) *slot = atomicAdd(s.state, 1);
  __syncthreads();
  const int t = *slot;
  __syncthreads();
  return t;
}

// Scores hold PS_UNSCORED (constants.cuh) between launches: the launcher fills them once, and
// each select ticket puts it back in its row.
constexpr uint32_t PS_UNSCORED_BITS = uint32_t(PS_UNSCORED);

// ---- the estimate ----

// This CTA's share of the estimate: estimate.cuh's persistent loop (estimate.cu's arithmetic, the
// same bits) over head-major tiles, grid-stride over the estimate CTAs, each score stored for the
// select tickets' polls. No ticket, barrier or fence per tile: a queue of estimate tickets (one
// atomic, one barrier and a fence each) made this phase 1.6-2.6x the estimate kernel's 11.3 us at
// 32K on an H200 (2026-12-01, f966723 and ccd2a71), where the estimate kernel on the same 2 x 256
// threads per SM takes 12.1.
template <typename T, int D, int G>
QP_DEVICE void estimate_share(const Step& s) {
  constexpr int TILE = est_tile_units<D, PS_NT>();
  const int ctas = gridDim.x - s.queue_ctas, tiles = (s.nnz * s.kv_heads + TILE - 1) / TILE;
  if ((int)blockIdx.x - s.queue_ctas >= tiles) return;
  estimate_tiles<T, T, D, G, PER_HEAD, true, (G <= 2), PS_NT, 1, true>(
      s.q, s.summ, s.indptr, s.indices, s.scores, s.batch, s.kv_heads, s.nnz,
      {s.group, PER_HEAD, nullptr}, (int)blockIdx.x - s.queue_ctas, ctas, tiles);
}

// ---- select tickets ----

// TopkShared, then the row's keys, in the bytes of the attention rings (dynamic shared memory).
constexpr int PS_KEYS_AT = (int(sizeof(TopkShared)) + 15) / 16;  // uint4

// The scores of one row into shared-memory keys (or, keys nullptr, only waited for), each as soon
// as an estimate share has stored it (a relaxed load until it is no longer PS_UNSCORED: one word,
// written once, needs no fence), then PS_UNSCORED again in the row for the next launch.
template <int NT>
QP_DEVICE void poll_row(float* row, int pages, uint32_t* keys) {
  constexpr int IN_FLIGHT = 16;  // a 2048-page row on 128 threads in one round
  for (int base = 0; base < pages; base += NT * IN_FLIGHT) {
    float f[IN_FLIGHT];
    bool missing = false;
#pragma unroll
    for (int j = 0; j < IN_FLIGHT; ++j) {
      const int p = base + j * NT + threadIdx.x;
      f[j] = p < pages ? load_relaxed(row + p) : 0.f;
    }
    unsigned sleep = 64;  // backing off to 1 us, as wait_at_least
    for (long long n = 0;; ++n) {  // the missing ones again, all in flight at once
#pragma unroll
      for (int j = 0; j < IN_FLIGHT; ++j) missing |= __float_as_uint(f[j]) == PS_UNSCORED_BITS;
      if (!missing) break;
      if (n == PS_MAX_POLLS) __trap();
      __nanosleep(sleep);
      sleep = min(2 * sleep, 1024u);
      missing = false;
#pragma unroll
      for (int j = 0; j < IN_FLIGHT; ++j)
        if (__float_as_uint(f[j]) == PS_UNSCORED_BITS)
          f[j] = load_relaxed(row + base + j * NT + threadIdx.x);
    }
    if (keys) {
#pragma unroll
      for (int j = 0; j < IN_FLIGHT; ++j) {
        const int p = base + j * NT + threadIdx.x;
        if (p < pages) keys[p] = order_key(f[j]);
      }
    }
  }
}
QP_DEVICE void unscore_row(float* row, int pages, int nt) {
  for (int p = threadIdx.x; p < pages; p += nt) row[p] = __uint_as_float(PS_UNSCORED_BITS);
}

// Select ticket t (q head t / B, request t % B): the K pages of one q head's row by topk.cuh (the
// selection of topk.cu, bit for bit) from its scores as they arrive, then its ready flag (release).
template <int NT>
QP_DEVICE void select_item(const Step& s, int t, uint4* smem, int keys_cap) {
  const int qh = t / s.batch, b = t % s.batch;
  const int first = __ldg(s.indptr + b), pages = __ldg(s.indptr + b + 1) - first;
  if (threadIdx.x == 0 && qh == 0) s.count[b] = min(s.k_pages, pages);
  float* row = s.scores + (size_t)qh * s.nnz + first;
  uint32_t* keys = pages <= keys_cap ? reinterpret_cast<uint32_t*>(smem + PS_KEYS_AT) : nullptr;
  __syncthreads();  // the ticket before may still read the shared keys
  poll_row<NT>(row, pages, keys);
  if (keys) unscore_row(row, pages, NT);  // each thread's own positions: read above
  __syncthreads();  // every score has arrived (and the keys are written)
  s.trace.ticket(t, 1, threadIdx.x == 0);
  select_row<NT>(row, keys, pages, s.k_pages, s.sinks, s.window,
                 s.sel + ((size_t)qh * s.batch + b) * s.k_pages,
                 *reinterpret_cast<TopkShared*>(smem), keys != nullptr);
  __syncthreads();  // every thread's positions are written (and the scores read)
  if (!keys) unscore_row(row, pages, NT);
  if (threadIdx.x == 0) {
    __threadfence();
    store_release(s.ready(qh * s.batch + b), 1);
  }
}

// ---- attention tickets ----

// The row's splits merged by log-sum-exp: merge_splits of attention.cu at one q head per row
// (one output per thread, 8 splits per load round), so the same bits as the three-kernel step
// when the splits are the same.
template <typename T, int D>
QP_DEVICE void merge_row(const Step& s, int ar, size_t qg) {
  constexpr int CH = 8;
  static_assert(D <= PS_NT, "one output per thread");
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int dim = threadIdx.x;
  float M = NEG_INF, W = 0.f, A = 0.f;
  for (int s0 = 0; s0 < s.splits; s0 += CH) {
    float l[CH], o[CH];
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const bool ok = dim < D && s0 + j < s.splits;
      const size_t at = (size_t)ar * s.splits + s0 + j;
      l[j] = ok ? __ldcg(s.ws_lse + at) : NEG_INF;  // empty split: lse -inf, weight 0
      o[j] = ok ? __ldcg(s.ws_o + at * D + dim) : 0.f;
    }
    float m = M;
#pragma unroll
    for (int j = 0; j < CH; ++j) m = fmaxf(m, l[j]);
    const float m_use = m == NEG_INF ? 0.f : m;
    const float scale = exp2f(M - m_use);
    W *= scale;
    A *= scale;
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const float w = exp2f(l[j] - m_use);
      W += w;
      A = fmaf(w, o[j], A);
    }
    M = m;
  }
  if (dim >= D) return;
  const float M_use = M == NEG_INF ? 0.f : M;
  s.out[qg * D + dim] = Storage<T>::from_float(W > 0.f ? A / W : 0.f);
  if (dim == 0) s.lse[qg] = W > 0.f ? (M_use + log2f(W)) * LN2 : M;
}

// The ATT_WARPS warps' states into one (combine of attention.cu at one q head), written as the final
// output (one split) or as the split's partial.
template <typename T, int D, class St>
QP_DEVICE void combine_split(const Step& s, const St& st, int ar, int split, size_t qg,
                             uint4* ring, float* s_m, float* s_l) {
  float (*s_acc)[D] = reinterpret_cast<float (*)[D]>(ring);
  __syncthreads();  // every warp is done with its ring, which now holds the combine arrays
  if (threadIdx.x < ATT_WARPS * 32)  // the warps past ATT_WARPS (QS_THREADS > 128) attend nothing
    st.store(s_acc + threadIdx.x / 32, s_m + threadIdx.x / 32, s_l + threadIdx.x / 32,
             threadIdx.x % 32, 1);
  __syncthreads();
  for (int dim = threadIdx.x; dim < D; dim += PS_NT) {
    float M = s_m[0];
#pragma unroll
    for (int w = 1; w < ATT_WARPS; ++w) M = fmaxf(M, s_m[w]);
    const float M_use = M == -__int_as_float(0x7f800000) ? 0.f : M;
    float L = 0.f, A = 0.f;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) {
      const float f = exp2f(s_m[w] - M_use);
      L += s_l[w] * f;
      A += s_acc[w][dim] * f;
    }
    const float o = L > 0.f ? A / L : 0.f;
    const float lse2 = L > 0.f ? M + log2f(L) : M;
    if (s.splits == 1) {
      s.out[qg * D + dim] = Storage<T>::from_float(o);
      if (dim == 0) s.lse[qg] = lse2 * LN2;
    } else {
      const size_t slot = (size_t)ar * s.splits + split;
      s.ws_o[slot * D + dim] = o;
      if (dim == 0) s.ws_lse[slot] = lse2;
    }
  }
}

// Attention ticket a: split a % splits of row a / splits (KV head h, request b, q head h g + r).
struct AttSplit {
  int ar, split, h, b, qh, first, req_pages, nb;
  size_t qg;
  const int* row_sel;  // the split's positions in the row's selection
  QP_DEVICE AttSplit(const Step& s, int a) {
    ar = a / s.splits;
    split = a % s.splits;
    const int per_kv = s.batch * s.group;
    h = ar / per_kv;
    b = ar % per_kv / s.group;
    qh = h * s.group + ar % s.group;
    qg = (size_t)b * s.q_heads + qh;
    first = __ldg(s.indptr + b);
    req_pages = __ldg(s.indptr + b + 1) - first;
    const int p_begin = split * s.split_pages;
    nb = max(0, min(min(s.k_pages, req_pages), p_begin + s.split_pages) - p_begin);
    row_sel = s.sel + ((size_t)qh * s.batch + b) * s.k_pages + p_begin;
  }
  QP_DEVICE int* ready(const Step& s) const { return s.ready(qh * s.batch + b); }
};

// The page ids and valid tokens of two attention tickets (the one running, the CTA's next), and
// the CTA's next ticket: whether its pages are already in the other buffer.
struct AttPages {
  int page[2][PS_MAX_SPLIT_PAGES], valid[2][PS_MAX_SPLIT_PAGES];
  int next, next_ready;
};

// Threads t0, t0 + nt, ... load the split's page ids (its selected positions, written by another
// CTA of this launch: L2) and valid tokens; nb <= PS_MAX_SPLIT_PAGES.
QP_DEVICE void split_pages(const Step& s, const AttSplit& x, int* page, int* valid, int t0,
                           int nt) {
  for (int i = t0; i < x.nb; i += nt) {
    const int pos = __ldcg(x.row_sel + i);
    page[i] = __ldg(s.indices + x.first + pos);
    valid[i] = pos == x.req_pages - 1 ? __ldg(s.last_len + x.b) : 1 << s.page_shift;
  }
}

// CTAs of more than ATT_WARPS warps prefetch: while the attention warps stream this ticket, the
// others take the CTA's next ticket and, when its row is already selected, load its page ids
// into the other buffer, so the next ticket starts on its K and V at once. Per ticket the chain
// (selection, page ids, K and V, partial, merge) was about 7.5 us at 32K on an H200 (2026-12-01
// timeline), two of its round trips the page ids'.
constexpr bool PS_PREFETCH = PS_NT >= 2 * ATT_WARPS * 32;

QP_DEVICE void prefetch_next(const Step& s, AttPages& pp, int other) {
  constexpr int NT = PS_NT - ATT_WARPS * 32;  // the prefetching threads
  const int pt = (int)threadIdx.x - ATT_WARPS * 32;
  if (pt == 0) {  // the next ticket only once this one runs (its row is ready): no chained waits
    const int n = atomicAdd(s.state, 1);
    int ok = 0;
    if (s.kind(n) == PS_ATTEND) ok = load_acquire(AttSplit(s, n - s.selects).ready(s)) >= 1;
    pp.next = n;
    pp.next_ready = ok;
  }
  asm volatile("bar.sync 1, %0;" :: "r"(NT) : "memory");  // the prefetching warps only
  if (pp.next_ready)
    split_pages(s, AttSplit(s, pp.next - s.selects), pp.page[other], pp.valid[other], pt, NT);
}

// Attention ticket a, its pages in buffer `cur` already when `have` (prefetched: its row was
// ready then); the last split of a row to finish merges them (one acq_rel atomic, as
// attention.cu). Leaves the CTA's next ticket in pp (visible after this returns).
template <typename T, int D>
QP_DEVICE void attend_item(const Step& s, int a, bool have, AttPages& pp, int cur, uint4* ring,
                           float* s_m, float* s_l, int* s_last) {
  using St = Tile<T, T, D, 1>;
  static_assert(!tensor_tile<T, D, 1>(), "one q head per row: the CUDA-core tile");
  const AttSplit x(s, a);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nb = x.nb, h = x.h;
  const int* s_page = pp.page[cur];
  const int* s_valid = pp.valid[cur];
  const Paging<0> pg(s.page_shift);
  St st;
  st.init(s.q + x.qg * D, lane, s.scale_log2, 1);  // an input: before the wait
  if (threadIdx.x == 0) {  // the next ticket only once this one runs: a CTA waiting here on
    if (!have) wait_at_least(x.ready(s), 1);  // a later ticket would delay that ticket's row
    if (!PS_PREFETCH) {                        // by this wait, and so on
      pp.next = atomicAdd(s.state, 1);
      pp.next_ready = 0;
    }
  }
  __syncthreads();
  s.trace.ticket(s.selects + a, 1, threadIdx.x == 0);
  if (!have) {
    split_pages(s, x, pp.page[cur], pp.valid[cur], threadIdx.x, PS_NT);
    __syncthreads();
  }
  if (PS_PREFETCH && warp >= ATT_WARPS) prefetch_next(s, pp, cur ^ 1);
  // Warp w takes tiles w, w + 4, ... (attention.cu's order: the same online softmax);
  // PS_STAGES - 1 tiles in flight while one is computed.
  const int tiles = (nb * pg.size() + St::TT - 1) / St::TT;
  const int mine = tiles > warp && warp < ATT_WARPS ? (tiles - warp + ATT_WARPS - 1) / ATT_WARPS
                                                    : 0;
  uint4* wring = ring + (size_t)min(warp, ATT_WARPS - 1) * PS_STAGES * St::STAGE;
#pragma unroll
  for (int j = 0; j < PS_STAGES - 1; ++j) {
    if (j < mine)
      st.issue(wring + j * St::STAGE, s.k, s.v, pg, s_page, s_valid, nb,
               (warp + j * ATT_WARPS) * St::TT, s.kv_heads, h, lane);
    cp_async_commit();
  }
  for (int j = 0; j < mine; ++j) {
    const int ahead = j + PS_STAGES - 1;
    __syncwarp();  // every lane's reads of the stage refilled below are done
    if (ahead < mine)
      st.issue(wring + (ahead % PS_STAGES) * St::STAGE, s.k, s.v, pg, s_page, s_valid, nb,
               (warp + ahead * ATT_WARPS) * St::TT, s.kv_heads, h, lane);
    cp_async_commit();
    cp_async_wait<PS_STAGES - 1>();
    __syncwarp();
    st.tile(wring + (j % PS_STAGES) * St::STAGE, pg, s_valid, nb,
            (warp + j * ATT_WARPS) * St::TT, lane);
  }
  combine_split<T, D>(s, st, x.ar, x.split, x.qg, ring, s_m, s_l);
  if (s.splits == 1) return;
  __syncthreads();  // every thread's partial is written
  if (threadIdx.x == 0) {
    *s_last = add_acq_rel(s.split_done() + x.ar, 1) == s.splits - 1;
    if (*s_last) s.split_done()[x.ar] = 0;
  }
  __syncthreads();
  if (*s_last) merge_row<T, D>(s, x.ar, x.qg);
}

// Bytes of the attention rings (dynamic shared memory): ATT_WARPS rings of PS_STAGES stages.
template <typename T, int D> __host__ __device__ constexpr int ps_ring_bytes() {
  return ATT_WARPS * PS_STAGES * Tile<T, T, D, 1>::STAGE * 16;
}
