// Device code of the Quest step as one persistent kernel (quest_step.cu): its work queue and its
// three kinds of work item. The design and why: the comment at the top of quest_step.cu.
#pragma once
#include "attention_tile.cuh"
#include "estimate.cuh"
#include "topk.cuh"

// Build options (-D at build; backends/quest_step.py's StepTuning names them, and
// tests/quest_step_probe.py times each against the defaults, kernels/constants.cuh's PS_*):
//   QS_THREADS   threads per CTA (attention runs on the first ATT_WARPS warps, the same bits)
//   QS_CTAS      resident CTAs per SM that __launch_bounds__ sizes registers for
//   QS_EST_TILES estimate tiles per estimate ticket (units per atomic)
//   QS_HEAD_BLOCK KV heads whose units one estimate ticket interleaves (a page's boxes of the
//                block are contiguous: 1 = head-major, Hkv = estimate.cu's order); Hkv % it == 0
#ifndef QS_THREADS
#define QS_THREADS PS_THREADS
#endif
#ifndef QS_CTAS
#define QS_CTAS PS_CTAS_PER_SM
#endif
#ifndef QS_EST_TILES
#define QS_EST_TILES PS_EST_TILES
#endif
#ifndef QS_HEAD_BLOCK
#define QS_HEAD_BLOCK 1
#endif
constexpr int PS_NT = QS_THREADS, PS_HB = QS_HEAD_BLOCK;
static_assert(PS_NT % 32 == 0 && PS_NT >= ATT_WARPS * 32 && PS_NT <= 1024, "whole warps");
static_assert(PS_HB >= 1, "QS_HEAD_BLOCK");

enum { PS_NONE = -1, PS_ESTIMATE = 0, PS_SELECT = 1, PS_ATTEND = 2, PS_END = 3 };
// What a launch runs (its `stop` argument): every ticket, or only the estimate tickets (the select
// tickets are skipped), or the estimate and select tickets; the last two time the phases.
enum { PS_STOP_ESTIMATE = 1, PS_STOP_SELECT = 2, PS_STOP_ALL = 3 };

// Units of one estimate ticket: QS_EST_TILES tiles of the estimate (EST_UNROLL batches of one unit
// per row_lanes(D) lanes) of one block of KV heads.
template <int D> __host__ __device__ constexpr int ps_ticket_units() {
  return QS_EST_TILES * est_tile_units<D, PS_NT>();
}

// Units of a block of PS_HB KV heads, entry-major with the head fastest: unit n is entry i of
// KV head h where n = (blk nnz + i) PS_HB + h % PS_HB, blk = h / PS_HB (PS_HB 1: head-major, the
// walk of estimate_topk.cu; PS_HB = Hkv: estimate.cu's, a page's boxes contiguous). The interface
// of estimate.cuh's Walk, so load_pages, load_boxes and score_batch walk it unchanged.
struct BlockWalk {
  static constexpr bool head_major = true;  // score_batch: a unit past the end reads q head 0
  static constexpr bool polled = true;      // score_batch: scores stored for select_item's polls
  int kv_heads, nnz, limit;                 // units at or past `limit` are not this walk's
  QP_DEVICE int index(Unit u) const {
    const int blk = u.h / PS_HB;
    return (blk * nnz + u.i) * PS_HB + u.h - blk * PS_HB;
  }
  QP_DEVICE Unit unit(int n) const {
    const int e = n / PS_HB, blk = e / nnz;
    return {e - blk * nnz, blk * PS_HB + n - e * PS_HB};
  }
  QP_DEVICE Stride stride(int units) const { return {units, 0}; }
  QP_DEVICE bool valid(Unit u) const { return index(u) < limit; }
  QP_DEVICE Unit next(Unit u, Stride s) const {  // constant divisions: shifts at PS_HB 2^k
    const int r = u.h % PS_HB + s.di;
    u.i += r / PS_HB;
    u.h += r % PS_HB - u.h % PS_HB;
    if (u.i >= nnz) {  // into the next block (rare: the tile's last units)
      const int blocks = u.i / nnz;
      u.i -= blocks * nnz;
      u.h += blocks * PS_HB;
    }
    return u;
  }
};

// A ticket of the queue: its kind, its block of PS_HB KV heads and its place among the block's
// tickets of that kind (estimate: its ticket of the block; select: (q head of the block) x batch
// + request; attention: (row of the block) x splits + split).
struct Item {
  int kind, blk, j;
};

// The launch: its arguments and the order of its queue. Per block of PS_HB KV heads: its estimate
// tickets (units of the block, all requests), then one select ticket per (q head of the block,
// request); after the select tickets of block j come the attention tickets ((row, split), rows as
// selected) of block j - lag, so that the attention of early rows streams while later rows are
// still scored, and a row's selection has `lag` blocks of estimate to finish in before its
// splits are taken; the last `lag` blocks' attention tickets close the queue (lag = the number of
// blocks: every attention ticket after every estimate). state: [0] the next ticket, [1] CTAs
// finished, then ready flags per (q head, request) [Hq B], splits finished per row [Hq B].
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
  int stop;  // PS_STOP_*: the whole step, or its estimate (and select) tickets only (diagnostics)
  int lag;   // blocks between a block's selection and its attention tickets (clamped to blocks)
  // per block: estimate, estimate + select, all three kinds of tickets; blocks; queue boundaries
  int tph, head_seg, att_seg, blocks, head_end, mid_end, total;

  template <int D> QP_DEVICE void plan() {
    tph = (nnz * PS_HB + ps_ticket_units<D>() - 1) / ps_ticket_units<D>();
    head_seg = tph + batch * group * PS_HB;
    att_seg = stop == PS_STOP_ALL ? batch * group * PS_HB * splits : 0;
    blocks = kv_heads / PS_HB;
    lag = min(max(lag, 0), blocks);
    head_end = lag * head_seg;
    mid_end = head_end + (blocks - lag) * (head_seg + att_seg);
    total = mid_end + lag * att_seg;
  }
  QP_DEVICE Item item(int t) const {
    if (t < 0) return {PS_NONE, 0, 0};
    if (t >= total) return {PS_END, 0, 0};
    if (t >= mid_end) {  // the last blocks' attention
      const int u = t - mid_end, x = u / att_seg;
      return {PS_ATTEND, blocks - lag + x, u - x * att_seg};
    }
    int blk, j;
    if (t < head_end) {
      blk = t / head_seg;
      j = t - blk * head_seg;
    } else {
      const int u = t - head_end, x = u / (head_seg + att_seg);
      blk = lag + x;
      j = u - x * (head_seg + att_seg);
      if (j >= head_seg) return {PS_ATTEND, blk - lag, j - head_seg};
    }
    return {j < tph ? PS_ESTIMATE : PS_SELECT, blk, j < tph ? j : j - tph};
  }
  QP_DEVICE int kind(int t) const { return item(t).kind; }
  QP_DEVICE int* ready() const { return state + 2; }
  QP_DEVICE int* split_done() const { return ready() + q_heads * batch; }
};

// Scores hold PS_UNSCORED (constants.cuh) between launches: the launcher fills them once, and
// each select ticket puts it back in its row.
constexpr uint32_t PS_UNSCORED_BITS = uint32_t(PS_UNSCORED);

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
QP_DEVICE float load_relaxed(const float* p) {
  float v;
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}

QP_DEVICE int load_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Thread 0 waits until *p >= want, then acquires it (relaxed polls: an acquire load per poll
// would order, and slow, the SM's other loads each time). A producer holds an earlier ticket and
// never waits, so the wait ends; a bug must not hang the GPU: after 2^26 polls the kernel traps.
constexpr long long PS_MAX_POLLS = 1ll << 26;
QP_DEVICE void wait_at_least(const int* p, int want) {
  for (long long n = 0; load_relaxed(p) < want; ++n) {
    if (n == PS_MAX_POLLS) __trap();
    __nanosleep(128);
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

// ---- estimate tickets ----

template <typename T> using PsBoxes = Box<T>[QS_EST_TILES][EST_UNROLL];
using PsPages = int[QS_EST_TILES][EST_UNROLL];

// Ticket t as this thread's estimate work: whether it is an estimate ticket, the walk of its
// block (ending at the block's last unit) and this thread's first unit of each of its tiles,
// decoded once per ticket (the divisions of Step::item and BlockWalk::unit).
struct EstTicket {
  bool est;
  BlockWalk walk;
  Unit u[QS_EST_TILES];
};
template <int D> QP_DEVICE EstTicket est_ticket(const Step& s, int t) {
  const Item it = s.item(t);
  EstTicket e{it.kind == PS_ESTIMATE, BlockWalk{s.kv_heads, s.nnz, 0}, {}};
  if (!e.est) return e;
  const int block_units = s.nnz * PS_HB;
  e.walk.limit = (it.blk + 1) * block_units;
  const int n0 = it.blk * block_units + it.j * ps_ticket_units<D>() +
                 (int)threadIdx.x / row_lanes(D);
#pragma unroll
  for (int x = 0; x < QS_EST_TILES; ++x)
    e.u[x] = e.walk.unit(n0 + x * est_tile_units<D, PS_NT>());
  return e;
}

template <int D>
QP_DEVICE void est_pages(const Step& s, const EstTicket& e, Stride within, PsPages& pg) {
#pragma unroll
  for (int x = 0; x < QS_EST_TILES; ++x) load_pages(s.indices, e.walk, within, e.u[x], pg[x]);
}

template <typename T, int D>
QP_DEVICE void est_boxes(const Step& s, const EstTicket& e, Stride within, const PsPages& pg,
                         int c, PsBoxes<T>& bx) {
#pragma unroll
  for (int x = 0; x < QS_EST_TILES; ++x)
    load_boxes<T, D>(s.summ, e.walk, within, pg[x], e.u[x], c, bx[x]);
}

// Per-head scores, the arithmetic of estimate.cu (the same bits): tiles 1 and 2 with the group a
// constant, larger tiles with it from the launch (a smaller group masked).
template <typename T, int D, int G>
QP_DEVICE void est_score(const Step& s, const EstTicket& e, Stride within, const PsBoxes<T>& bx,
                         int c, Request& req) {
  const EstimateArgs args{s.group, PER_HEAD, nullptr};
#pragma unroll
  for (int x = 0; x < QS_EST_TILES; ++x)
    score_batch<T, T, D, G, PER_HEAD, (G <= 2), 1>(s.q, s.indptr, s.scores, s.batch, e.walk,
                                                   within, bx[x], e.u[x], c, req, args);
}

// Estimate tickets from t0 on, pipelined as estimate.cu's tiles are (page ids two tickets ahead,
// boxes one ahead in a second register buffer), while the tickets this CTA takes are estimate
// tickets; the next ticket is taken three tickets ahead, so its atomic's latency is hidden too.
// Nothing is published: each score is its own signal (select_item polls for it), so no fence
// waits here on the loads in flight (a fence per ticket made this phase 1.9-2.6x the estimate
// kernel's 11.3 us at 32K on an H200, 2026-12-01, f966723).
// Returns the first ticket taken that is not an estimate ticket (nothing is taken after it).
template <typename T, int D, int G>
QP_DEVICE int estimate_run(const Step& s, int t0, int* fifo, int* slot) {
  constexpr int LANES = row_lanes(D);
  const int c = threadIdx.x % LANES;
  const Stride within = BlockWalk{s.kv_heads, s.nnz, 0}.stride(PS_NT / LANES);
  PsPages first, pg;
  PsBoxes<T> a, b;
  // The next two tickets' atomics run while this ticket's page ids, then boxes, load.
  EstTicket e0 = est_ticket<D>(s, t0);
  est_pages<D>(s, e0, within, first);
  int t1 = take_ticket(s, slot);
  EstTicket e1 = est_ticket<D>(s, t1);
  if (e1.est) est_pages<D>(s, e1, within, pg);
  est_boxes<T, D>(s, e0, within, first, c, a);
  int t2 = e1.est ? take_ticket(s, slot) : PS_NONE;
  EstTicket e2 = est_ticket<D>(s, t2);
  Request req;
  int parity = 0;
  // Two buffers swap roles each step (no register copies, which would wait on their loads).
  auto advance = [&](const PsBoxes<T>& cur, PsBoxes<T>& nxt) {
    if (e1.est) est_boxes<T, D>(s, e1, within, pg, c, nxt);
    if (e2.est) est_pages<D>(s, e2, within, pg);
    int taken = PS_NONE;
    if (threadIdx.x == 0 && e2.est) taken = atomicAdd(s.state, 1);
    est_score<T, D, G>(s, e0, within, cur, c, req);
    if (threadIdx.x == 0) fifo[parity] = taken;
    __syncthreads();  // fifo[parity] is read before it is reused
    t0 = t1;
    e0 = e1;
    t1 = t2;
    e1 = e2;
    t2 = fifo[parity];
    e2 = est_ticket<D>(s, t2);
    parity ^= 1;
  };
  for (;;) {  // block-uniform: the tickets come through shared memory
    advance(a, b);
    if (!e0.est) break;
    advance(b, a);
    if (!e0.est) break;
  }
  return t0;
}

// ---- select tickets ----

// TopkShared, then the row's keys, in the bytes of the attention rings (dynamic shared memory).
constexpr int PS_KEYS_AT = (int(sizeof(TopkShared)) + 15) / 16;  // uint4

// The scores of one row into shared-memory keys (or, keys nullptr, only waited for), each as soon
// as its estimate ticket has stored it (a relaxed load until it is no longer PS_UNSCORED: one
// word, written once, needs no fence), then PS_UNSCORED again in the row for the next launch.
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
    for (long long n = 0;; ++n) {  // the missing ones again, all in flight at once
#pragma unroll
      for (int j = 0; j < IN_FLIGHT; ++j) missing |= __float_as_uint(f[j]) == PS_UNSCORED_BITS;
      if (!missing) break;
      if (n == PS_MAX_POLLS) __trap();
      __nanosleep(32);
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

// Select ticket (blk, w): the K pages of one q head's row by topk.cuh (the selection of topk.cu,
// bit for bit) from its scores as they arrive, then its ready flag (release).
template <int NT>
QP_DEVICE void select_item(const Step& s, Item it, uint4* smem, int keys_cap) {
  const int r = it.j / s.batch, b = it.j % s.batch, qh = it.blk * PS_HB * s.group + r;
  const int first = __ldg(s.indptr + b), pages = __ldg(s.indptr + b + 1) - first;
  if (threadIdx.x == 0 && qh == 0) s.count[b] = min(s.k_pages, pages);
  float* row = s.scores + (size_t)qh * s.nnz + first;
  uint32_t* keys = pages <= keys_cap ? reinterpret_cast<uint32_t*>(smem + PS_KEYS_AT) : nullptr;
  __syncthreads();  // the ticket before may still read the shared keys
  poll_row<NT>(row, pages, keys);
  if (keys) unscore_row(row, pages, NT);  // each thread's own positions: read above
  __syncthreads();  // every score has arrived (and the keys are written)
  select_row<NT>(row, keys, pages, s.k_pages, s.sinks, s.window,
                 s.sel + ((size_t)qh * s.batch + b) * s.k_pages,
                 *reinterpret_cast<TopkShared*>(smem), keys != nullptr);
  __syncthreads();  // every thread's positions are written (and the scores read)
  if (!keys) unscore_row(row, pages, NT);
  if (threadIdx.x == 0) {
    __threadfence();
    store_release(s.ready() + qh * s.batch + b, 1);
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

// Attention ticket a: split a % splits of row a / splits (KV head h, request b, q head h g + r),
// once the row's selection is ready; the last split of a row to finish merges them (one acq_rel
// atomic, as attention.cu).
template <typename T, int D>
QP_DEVICE void attend_item(const Step& s, int a, uint4* ring, int* s_page, int* s_valid,
                           float* s_m, float* s_l, int* s_last, int& next) {
  using St = Tile<T, T, D, 1>;
  static_assert(!tensor_tile<T, D, 1>(), "one q head per row: the CUDA-core tile");
  const int ar = a / s.splits, split = a % s.splits, per_kv = s.batch * s.group;
  const int h = ar / per_kv, b = ar % per_kv / s.group, qh = h * s.group + ar % s.group;
  const size_t qg = (size_t)b * s.q_heads + qh;
  const int first = __ldg(s.indptr + b), req_pages = __ldg(s.indptr + b + 1) - first;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Paging<0> pg(s.page_shift);
  St st;
  st.init(s.q + qg * D, lane, s.scale_log2, 1);  // an input: before the wait
  if (threadIdx.x == 0) {  // the next ticket only once this one runs: a CTA waiting here on
    wait_at_least(s.ready() + qh * s.batch + b, 1);  // a later ticket would delay its block's
    next = atomicAdd(s.state, 1);                     // selection by this wait, and so on
  }
  __syncthreads();
  const int p_begin = split * s.split_pages;
  const int nb = max(0, min(min(s.k_pages, req_pages), p_begin + s.split_pages) - p_begin);
  const int* row_sel = s.sel + ((size_t)qh * s.batch + b) * s.k_pages + p_begin;
  for (int i = threadIdx.x; i < nb; i += PS_NT) {  // nb <= PS_MAX_SPLIT_PAGES
    const int pos = __ldcg(row_sel + i);  // written by another CTA of this launch: L2
    s_page[i] = __ldg(s.indices + first + pos);
    s_valid[i] = pos == req_pages - 1 ? __ldg(s.last_len + b) : pg.size();
  }
  __syncthreads();
  // Warp w takes tiles w, w + 4, ... (attention.cu's order: the same online softmax);
  // PS_STAGES - 1 tiles in flight while one is computed.
  const int tiles = (nb * pg.size() + St::TT - 1) / St::TT;
  const int mine = tiles > warp && warp < ATT_WARPS ? (tiles - warp + ATT_WARPS - 1) / ATT_WARPS
                                                    : 0;
  uint4* wring = ring + (size_t)warp * PS_STAGES * St::STAGE;
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
  combine_split<T, D>(s, st, ar, split, qg, ring, s_m, s_l);
  if (s.splits == 1) return;
  __syncthreads();  // every thread's partial is written
  if (threadIdx.x == 0) {
    *s_last = add_acq_rel(s.split_done() + ar, 1) == s.splits - 1;
    if (*s_last) s.split_done()[ar] = 0;
  }
  __syncthreads();
  if (*s_last) merge_row<T, D>(s, ar, qg);
}

// Bytes of the attention rings (dynamic shared memory): ATT_WARPS rings of PS_STAGES stages.
template <typename T, int D> __host__ __device__ constexpr int ps_ring_bytes() {
  return ATT_WARPS * PS_STAGES * Tile<T, T, D, 1>::STAGE * 16;
}
