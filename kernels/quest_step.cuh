// Device code of the Quest step as one persistent kernel (quest_step.cu): its work queue and its
// three kinds of work item. The design and why: the comment at the top of quest_step.cu.
#pragma once
#include "attention_tile.cuh"
#include "estimate.cuh"
#include "topk.cuh"

enum { PS_NONE = -1, PS_ESTIMATE = 0, PS_SELECT = 1, PS_ATTEND = 2, PS_END = 3 };

// Units of one estimate ticket: PS_EST_TILES tiles of the estimate (EST_UNROLL batches of one unit
// per row_lanes(D) lanes) of one KV head.
template <int D> __host__ __device__ constexpr int ps_ticket_units() {
  return PS_EST_TILES * est_tile_units<D, PS_THREADS>();
}

// The launch: its arguments and the order of its queue. Per KV head h: its estimate tickets (a
// run of units of head h, all requests), then one select ticket per (request, q head of h); after
// every KV head, the attention tickets, (row, split) with rows in the order they are selected.
// state: [0] the next ticket, [1] CTAs finished, then units scored per (KV head, request) [Hkv B],
// ready flags per (q head, request) [Hq B], splits finished per attention row [Hq B].
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
  int tph, per_head, est_end, total;  // estimate tickets per KV head, tickets per KV head, ...

  QP_DEVICE int kind(int t) const {
    if (t < 0) return PS_NONE;
    if (t >= total) return PS_END;
    if (t >= est_end) return PS_ATTEND;
    return t % per_head < tph ? PS_ESTIMATE : PS_SELECT;
  }
  QP_DEVICE int* done() const { return state + 2; }
  QP_DEVICE int* ready() const { return done() + kv_heads * batch; }
  QP_DEVICE int* split_done() const { return ready() + q_heads * batch; }
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

// Thread 0 waits until *p >= want (acquire). A producer holds an earlier ticket and never waits,
// so the wait ends; a bug must not hang the GPU: after 2^26 polls (~1 minute) the kernel traps.
constexpr long long PS_MAX_POLLS = 1ll << 26;
QP_DEVICE void wait_at_least(const int* p, int want) {
  for (long long n = 0; load_acquire(p) < want; ++n) {
    if (n == PS_MAX_POLLS) __trap();
    __nanosleep(64);
  }
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

template <typename T> using PsBoxes = Box<T>[PS_EST_TILES][EST_UNROLL];
using PsPages = int[PS_EST_TILES][EST_UNROLL];

// The walk of ticket t (head-major units, ending at its KV head's last entry) and this thread's
// first unit in it.
struct EstTicket {
  Walk<true> walk;
  int n0;
};
template <int D> QP_DEVICE EstTicket est_ticket(const Step& s, int t) {
  const int h = t / s.per_head, j = t % s.per_head;
  return {Walk<true>{s.kv_heads, s.nnz, (h + 1) * s.nnz},
          h * s.nnz + j * ps_ticket_units<D>() + (int)threadIdx.x / row_lanes(D)};
}
template <int D> QP_DEVICE Unit est_unit(const EstTicket& e, int x) {
  return e.walk.unit(e.n0 + x * est_tile_units<D, PS_THREADS>());
}

template <int D>
QP_DEVICE void est_pages(const Step& s, int t, Stride within, PsPages& pg) {
  const EstTicket e = est_ticket<D>(s, t);
#pragma unroll
  for (int x = 0; x < PS_EST_TILES; ++x)
    load_pages(s.indices, e.walk, within, est_unit<D>(e, x), pg[x]);
}

template <typename T, int D>
QP_DEVICE void est_boxes(const Step& s, int t, Stride within, const PsPages& pg, int c,
                         PsBoxes<T>& bx) {
  const EstTicket e = est_ticket<D>(s, t);
#pragma unroll
  for (int x = 0; x < PS_EST_TILES; ++x)
    load_boxes<T, D>(s.summ, e.walk, within, pg[x], est_unit<D>(e, x), c, bx[x]);
}

// Per-head scores, the arithmetic of estimate.cu (the same bits): tiles 1 and 2 with the group a
// constant, larger tiles with it from the launch (a smaller group masked).
template <typename T, int D, int G>
QP_DEVICE void est_score(const Step& s, int t, Stride within, const PsBoxes<T>& bx, int c,
                         Request& req) {
  const EstTicket e = est_ticket<D>(s, t);
  const EstimateArgs args{s.group, PER_HEAD, nullptr};
#pragma unroll
  for (int x = 0; x < PS_EST_TILES; ++x)
    score_batch<T, T, D, G, PER_HEAD, (G <= 2), 1>(s.q, s.indptr, s.scores, s.batch, e.walk,
                                                   within, bx[x], est_unit<D>(e, x), c, req,
                                                   args);
}

// Thread 0, after a barrier behind every thread's scores of ticket t: publish them (fence) and add
// the units they cover to their rows' counts, a request at a time.
template <int D> QP_DEVICE void est_count(const Step& s, int t) {
  const int h = t / s.per_head, end = min((t % s.per_head + 1) * ps_ticket_units<D>(), s.nnz);
  int i = t % s.per_head * ps_ticket_units<D>();
  __threadfence();
  while (i < end) {
    const int b = request_of(s.indptr, s.batch, i), n = min(end, __ldg(s.indptr + b + 1)) - i;
    atomicAdd(s.done() + h * s.batch + b, n);
    i += n;
  }
}

// Estimate tickets from t0 on, pipelined as estimate.cu's tiles are (page ids two tickets ahead,
// boxes one ahead in a second register buffer), while the tickets this CTA takes are estimate
// tickets; the next ticket is taken three tickets ahead, so its atomic's latency is hidden too.
// Returns the first ticket taken that is not an estimate ticket (nothing is taken after it).
template <typename T, int D, int G>
QP_DEVICE int estimate_run(const Step& s, int t0, int* fifo, int* slot) {
  constexpr int LANES = row_lanes(D);
  const int c = threadIdx.x % LANES;
  const Stride within = Walk<true>{s.kv_heads, s.nnz, 0}.stride(PS_THREADS / LANES);
  auto est = [&](int t) { return s.kind(t) == PS_ESTIMATE; };
  PsPages first, pg;
  PsBoxes<T> a, b;
  // The next two tickets' atomics run while this ticket's page ids, then boxes, load.
  est_pages<D>(s, t0, within, first);
  int t1 = take_ticket(s, slot);
  if (est(t1)) est_pages<D>(s, t1, within, pg);
  est_boxes<T, D>(s, t0, within, first, c, a);
  int t2 = est(t1) ? take_ticket(s, slot) : PS_NONE;
  Request req;
  int scored = PS_NONE, parity = 0;
  // Two buffers swap roles each step (no register copies, which would wait on their loads).
  auto advance = [&](const PsBoxes<T>& cur, PsBoxes<T>& nxt) {
    if (est(t1)) est_boxes<T, D>(s, t1, within, pg, c, nxt);
    if (est(t2)) est_pages<D>(s, t2, within, pg);
    int taken = PS_NONE;
    if (threadIdx.x == 0) {
      if (est(t2)) taken = atomicAdd(s.state, 1);
      if (scored != PS_NONE) est_count<D>(s, scored);
    }
    est_score<T, D, G>(s, t0, within, cur, c, req);
    if (threadIdx.x == 0) fifo[parity] = taken;
    __syncthreads();  // the scores of t0 are written; fifo[parity] is read before it is reused
    scored = t0;
    t0 = t1;
    t1 = t2;
    t2 = fifo[parity];
    parity ^= 1;
  };
  for (;;) {  // block-uniform: the tickets come through shared memory
    advance(a, b);
    if (!est(t0)) break;
    advance(b, a);
    if (!est(t0)) break;
  }
  if (threadIdx.x == 0) est_count<D>(s, scored);
  return t0;
}

// ---- select tickets ----

// TopkShared, then the row's keys, in the bytes of the attention rings (dynamic shared memory).
constexpr int PS_KEYS_AT = (int(sizeof(TopkShared)) + 15) / 16;  // uint4

// Select ticket t: once every unit of (KV head, request) is scored, the K pages of one q head's
// row by topk.cuh (the selection of topk.cu, bit for bit), then its ready flag (release).
template <int NT>
QP_DEVICE void select_item(const Step& s, int t, uint4* smem, int keys_cap) {
  const int h = t / s.per_head, w = t % s.per_head - s.tph, r = w / s.batch, b = w % s.batch;
  const int qh = h * s.group + r, first = __ldg(s.indptr + b);
  const int pages = __ldg(s.indptr + b + 1) - first;
  if (threadIdx.x == 0) wait_at_least(s.done() + h * s.batch + b, pages);
  __syncthreads();
  if (threadIdx.x == 0 && qh == 0) s.count[b] = min(s.k_pages, pages);
  uint32_t* keys = pages <= keys_cap ? reinterpret_cast<uint32_t*>(smem + PS_KEYS_AT) : nullptr;
  select_row<NT>(s.scores + (size_t)qh * s.nnz + first, keys, pages, s.k_pages, s.sinks, s.window,
                 s.sel + ((size_t)qh * s.batch + b) * s.k_pages,
                 *reinterpret_cast<TopkShared*>(smem));
  __syncthreads();  // every thread's positions are written
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
  static_assert(D <= PS_THREADS, "one output per thread");
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

// The four warps' states into one (combine of attention.cu at one q head), written as the final
// output (one split) or as the split's partial.
template <typename T, int D, class St>
QP_DEVICE void combine_split(const Step& s, const St& st, int ar, int split, size_t qg,
                             uint4* ring, float* s_m, float* s_l) {
  float (*s_acc)[D] = reinterpret_cast<float (*)[D]>(ring);
  __syncthreads();  // every warp is done with its ring, which now holds the combine arrays
  st.store(s_acc + threadIdx.x / 32, s_m + threadIdx.x / 32, s_l + threadIdx.x / 32,
           threadIdx.x % 32, 1);
  __syncthreads();
  for (int dim = threadIdx.x; dim < D; dim += PS_THREADS) {
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
                           float* s_m, float* s_l, int* s_last) {
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
  if (threadIdx.x == 0) wait_at_least(s.ready() + qh * s.batch + b, 1);
  __syncthreads();
  const int p_begin = split * s.split_pages;
  const int nb = max(0, min(min(s.k_pages, req_pages), p_begin + s.split_pages) - p_begin);
  const int* row_sel = s.sel + ((size_t)qh * s.batch + b) * s.k_pages + p_begin;
  for (int i = threadIdx.x; i < nb; i += PS_THREADS) {  // nb <= PS_MAX_SPLIT_PAGES
    const int pos = __ldcg(row_sel + i);  // written by another CTA of this launch: L2
    s_page[i] = __ldg(s.indices + first + pos);
    s_valid[i] = pos == req_pages - 1 ? __ldg(s.last_len + b) : pg.size();
  }
  __syncthreads();
  // Warp w takes tiles w, w + 4, ... (attention.cu's order: the same online softmax);
  // PS_STAGES - 1 tiles in flight while one is computed.
  const int tiles = (nb * pg.size() + St::TT - 1) / St::TT;
  const int mine = tiles > warp ? (tiles - warp + ATT_WARPS - 1) / ATT_WARPS : 0;
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
