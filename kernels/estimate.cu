// Estimate (criticality): U_p(q) = sum_j max(q_j m_pj, q_j M_pj) for every page of every request
// (docs/QUEST.md stage 2). Memory-bound: each (page, KV head) box of 2*D values is read exactly
// once, and all G query heads of that KV head are scored from it (per-head writes G scores;
// shared-max and shared-mean reduce the G scores to one per KV head).
//
// Work unit = (CSR entry i, KV head h), unit = i * Hkv + h: KV head fastest so consecutive units
// read consecutive boxes of one page (Hkv * 2 * D * 2 bytes contiguous). A unit is served by
// LANES = D/8 lanes, each holding 8 dimensions of min and max (two 16-byte loads). A tile is
// EST_UNROLL * GROUPS consecutive units (one batch of EST_UNROLL units per thread).
//
// Persistent: the launcher starts one resident wave (EST_BLOCKS_PER_SM per SM, constants.cuh) and
// each block walks tiles grid-stride; a thread runs a three-stage pipeline over its tiles (page ids
// two tiles ahead, boxes one tile ahead in a second register buffer, scoring of the current one),
// so its DRAM loads never drain between batches. H200, 32K MHA: 11.1 us, where one short-lived
// block per tile took 12.9 us (2.6 waves whose loads each waited on an index load first).
// Figures and history: notes/KERNELS.md.
#include "common.cuh"

enum { PER_HEAD = 0, SHARED_MAX = 1, SHARED_MEAN = 2 };

struct Unit { int i, h; };     // CSR entry and KV head of unit i * Hkv + h
struct Stride { int di, dh; }; // a fixed step in units as (entries, heads), dh < Hkv
struct Box { uint4 lo, hi; };  // one lane's 8 dimensions of a box's min and max

// A thread's units advance by fixed strides, so (i, h) advance by adds with one carry instead of
// a 64-bit division per unit.
struct Walk {
  int kv_heads, nnz;
  QP_DEVICE Unit unit(int n) const { return {n / kv_heads, n % kv_heads}; }
  QP_DEVICE Stride stride(int units) const { return {units / kv_heads, units % kv_heads}; }
  QP_DEVICE bool valid(Unit u) const { return u.i < nnz; }  // i < nnz <=> unit < nnz * Hkv
  QP_DEVICE Unit next(Unit u, Stride s) const {
    u.i += s.di;
    u.h += s.dh;
    if (u.h >= kv_heads) { u.h -= kv_heads; ++u.i; }
    return u;
  }
};

// Request of entry i, carried: a thread's entries only grow, so it searches kv_indptr again only
// when an entry passes the current request's end (batch 1: once, with no loads).
struct Request {
  int b = 0, end = 0;
  QP_DEVICE void seek(const int* __restrict__ indptr, int batch, int i) {
    if (i < end) return;
    b = request_of(indptr, batch, i);
    end = b + 1 < batch ? __ldg(indptr + b + 1) : 0x7fffffff;
  }
};

QP_DEVICE void load_pages(const int* __restrict__ indices, const Walk& walk, Stride within, Unit u,
                          int page[EST_UNROLL]) {
#pragma unroll
  for (int r = 0; r < EST_UNROLL; ++r, u = walk.next(u, within))
    page[r] = walk.valid(u) ? __ldg(indices + u.i) : 0;
}

template <int D>
QP_DEVICE void load_boxes(const uint16_t* __restrict__ summ, const Walk& walk, Stride within,
                          const int page[EST_UNROLL], Unit u, int c, Box box[EST_UNROLL]) {
#pragma unroll
  for (int r = 0; r < EST_UNROLL; ++r, u = walk.next(u, within)) {
    box[r].lo = box[r].hi = make_uint4(0, 0, 0, 0);
    if (walk.valid(u)) {
      const uint16_t* p = summ + ((size_t)page[r] * walk.kv_heads + u.h) * 2 * D + c * VEC;
      box[r].lo = load16_stream(p);
      box[r].hi = load16_stream(p + D);
    }
  }
}

template <typename T, int D, int G>
QP_DEVICE void score_heads(const uint16_t* __restrict__ q, const Box& box, int qhead0, int c,
                           float u[G]) {
  float m[VEC], M[VEC], x[VEC];
  unpack8<T>(box.lo, m);
  unpack8<T>(box.hi, M);
#pragma unroll
  for (int t = 0; t < G; ++t) {
    unpack8<T>(load16(q + (size_t)(qhead0 + t) * D + c * VEC), x);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += fmaxf(x[j] * m[j], x[j] * M[j]);
    u[t] = group_sum<D / VEC>(s);
  }
}

// Units past the end still shuffle (full-warp masks) but write nothing.
template <typename T, int D, int G, int MODE>
QP_DEVICE void score_batch(const uint16_t* __restrict__ q, const int* __restrict__ indptr,
                           float* __restrict__ scores, int batch, const Walk& walk, Stride within,
                           const Box box[EST_UNROLL], Unit u, int c, Request& req) {
  constexpr int LANES = D / VEC;
#pragma unroll
  for (int r = 0; r < EST_UNROLL; ++r, u = walk.next(u, within)) {
    const bool valid = walk.valid(u);
    if (valid) req.seek(indptr, batch, u.i);
    float s[G];
    score_heads<T, D, G>(q, box[r], (req.b * walk.kv_heads + u.h) * G, c, s);
    if (MODE == PER_HEAD) {
#pragma unroll
      for (int t = 0; t < G; ++t)
        if (valid && c == t % LANES) scores[(size_t)(u.h * G + t) * walk.nnz + u.i] = s[t];
    } else if (valid && c == 0) {
      float v = s[0];
#pragma unroll
      for (int t = 1; t < G; ++t) v = MODE == SHARED_MAX ? fmaxf(v, s[t]) : v + s[t];
      scores[(size_t)u.h * walk.nnz + u.i] = MODE == SHARED_MEAN ? v / G : v;
    }
  }
}

template <typename T, int D, int G, int MODE>
__global__ void __launch_bounds__(EST_THREADS, EST_BLOCKS_PER_SM[group_index(G)])
estimate_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ summ,
                const int* __restrict__ indptr, const int* __restrict__ indices,
                float* __restrict__ scores, int batch, int kv_heads, int nnz) {
  grid_wait();     // the grid before may still write q or the summaries (RoPE, summary append)
  grid_release();  // empty in quest()'s build (releasing in all 3 stages: 32.0 -> 36.0 us)
  constexpr int LANES = D / VEC, GROUPS = EST_THREADS / LANES, TILE = EST_UNROLL * GROUPS;
  const int c = threadIdx.x % LANES;
  const Walk walk{kv_heads, nnz};
  const Stride within = walk.stride(GROUPS), across = walk.stride(gridDim.x * TILE);
  const long tiles = ((long)nnz * kv_heads + TILE - 1) / TILE;
  // now: the tile being scored; ahead: its boxes in flight; ahead2: its page ids in flight.
  Unit now = walk.unit(blockIdx.x * TILE + threadIdx.x / LANES);
  Unit ahead = walk.next(now, across), ahead2 = walk.next(ahead, across);
  int first[EST_UNROLL], page[EST_UNROLL];
  Box a[EST_UNROLL], b[EST_UNROLL];
  load_pages(indices, walk, within, now, first);  // both tiles' ids before any box load waits
  load_pages(indices, walk, within, ahead, page);
  load_boxes<D>(summ, walk, within, first, now, c, a);
  Request req;
  // Two buffers swap roles each step (no register copies, which would wait on their loads).
  auto step = [&](const Box (&cur)[EST_UNROLL], Box (&nxt)[EST_UNROLL]) {
    load_boxes<D>(summ, walk, within, page, ahead, c, nxt);
    load_pages(indices, walk, within, ahead2, page);
    score_batch<T, D, G, MODE>(q, indptr, scores, batch, walk, within, cur, now, c, req);
    now = ahead;
    ahead = ahead2;
    ahead2 = walk.next(ahead2, across);
  };
  for (long t = blockIdx.x; t < tiles; t += 2L * gridDim.x) {  // block-uniform: shuffles stay full
    step(a, b);
    if (t + gridDim.x >= tiles) break;
    step(b, a);
  }
}

#ifdef QP_INSTANTIATE_ALL  // CI compiles every variant (tests/test_kernels_compile.py)
#define QP_EST(T, D, G, M) template __global__ void estimate_kernel<T, D, G, M>( \
    const uint16_t*, const uint16_t*, const int*, const int*, float*, int, int, int);
#define QP_EST_G(T, D, M) QP_EST(T, D, 1, M) QP_EST(T, D, 2, M) QP_EST(T, D, 4, M) QP_EST(T, D, 8, M)
#define QP_EST_M(T, D) QP_EST_G(T, D, 0) QP_EST_G(T, D, 1) QP_EST_G(T, D, 2)
QP_EST_M(fp16, 64) QP_EST_M(fp16, 128) QP_EST_M(bf16, 64) QP_EST_M(bf16, 128)
#endif
