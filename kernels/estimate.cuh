// Device code of the estimate (estimate.cu; estimate_topk.cu scores with it too): the work units,
// the walk over them and the pipelined loop of one persistent block. Design and figures: estimate.cu.
#pragma once
#include "common.cuh"

enum { PER_HEAD = 0, SHARED_MAX = 1, SHARED_MEAN = 2 };

struct Unit { int i, h; };     // CSR entry and KV head of unit i * Hkv + h
struct Stride { int di, dh; }; // a fixed step in units as (entries, heads)

// One lane's 8 dimensions of a box's min and max: 16 bytes each of 16-bit summaries, 8 of E4M3
// codes (summaries of an FP8 cache in scaled units).
template <typename TS> struct Box {
  uint4 lo, hi;
  static QP_DEVICE uint4 zero() { return make_uint4(0, 0, 0, 0); }
  static QP_DEVICE uint4 load(const word_t<TS>* p) { return load16_stream(p); }
  static QP_DEVICE void unpack(const uint4& v, float out[VEC]) { unpack8<TS>(v, out); }
};
template <> struct Box<e4m3> {
  uint2 lo, hi;
  static QP_DEVICE uint2 zero() { return make_uint2(0, 0); }
  static QP_DEVICE uint2 load(const word_t<e4m3>* p) { return load8_stream(p); }
  static QP_DEVICE void unpack(const uint2& v, float out[VEC]) { unpack8_e4m3(v, out); }
};

// A thread's units advance by fixed strides, so (i, h) advance by adds with one carry instead of
// a 64-bit division per unit. HEAD_MAJOR = false: unit i * Hkv + h (KV head fastest, a page's
// boxes contiguous; estimate.cu); true: unit h * nnz + i (a head's rows finish together;
// estimate_topk.cu).
template <bool HEAD_MAJOR, bool POLLED = false>
struct Walk {
  static constexpr bool head_major = HEAD_MAJOR;
  // POLLED: another CTA of the grid polls each score as it is stored (quest_step.cuh); else the
  // scores are read by a later grid, or behind a fence
  static constexpr bool polled = POLLED;
  int kv_heads, nnz, limit;  // head-major: units at or past `limit` are not this walk's
  QP_DEVICE Unit unit(int n) const {
    return HEAD_MAJOR ? Unit{n % nnz, n / nnz} : Unit{n / kv_heads, n % kv_heads};
  }
  QP_DEVICE Stride stride(int units) const {
    return HEAD_MAJOR ? Stride{units % nnz, units / nnz} : Stride{units / kv_heads, units % kv_heads};
  }
  QP_DEVICE bool valid(Unit u) const {
    return HEAD_MAJOR ? u.h * nnz + u.i < limit : u.i < nnz;  // grid-stride: limit = all units
  }
  QP_DEVICE Unit next(Unit u, Stride s) const {
    u.i += s.di;
    u.h += s.dh;
    if (HEAD_MAJOR && u.i >= nnz) { u.i -= nnz; ++u.h; }
    if (!HEAD_MAJOR && u.h >= kv_heads) { u.h -= kv_heads; ++u.i; }
    return u;
  }
};

// Request of entry i, carried: a thread's entries mostly stay in one request, so it searches
// kv_indptr again only when an entry leaves the current request's [begin, end) (batch 1: once,
// with no loads; head-major walks come back to lower entries at each new head).
struct Request {
  int b = 0, begin = 0, end = 0;
  QP_DEVICE void seek(const int* __restrict__ indptr, int batch, int i) {
    if (i >= begin && i < end) return;
    b = request_of(indptr, batch, i);
    begin = b > 0 ? __ldg(indptr + b) : 0;
    end = b + 1 < batch ? __ldg(indptr + b + 1) : 0x7fffffff;
  }
};

template <class W>
QP_DEVICE void load_pages(const int* __restrict__ indices, const W& walk, Stride within, Unit u,
                          int page[EST_UNROLL]) {
#pragma unroll
  for (int r = 0; r < EST_UNROLL; ++r, u = walk.next(u, within))
    page[r] = walk.valid(u) ? __ldg(indices + u.i) : 0;
}

// Lanes past D / 8 (head dims 80, 96, 192: row_lanes pads to 16, 16, 32) load the row's last
// piece again (the same 16 bytes as its own lane: no extra traffic, and no branch, which cost
// the G 2 builds more than their 64 registers) and add zero.
template <int D>
QP_DEVICE bool lane_in_row(int c) { return row_lanes(D) == D / VEC || c < D / VEC; }
template <int D>
QP_DEVICE int piece(int c) { return row_lanes(D) == D / VEC ? c : min(c, D / VEC - 1); }

template <typename TS, int D, class W>
QP_DEVICE void load_boxes(const word_t<TS>* __restrict__ summ, const W& walk, Stride within,
                          const int page[EST_UNROLL], Unit u, int c, Box<TS> box[EST_UNROLL]) {
#pragma unroll
  for (int r = 0; r < EST_UNROLL; ++r, u = walk.next(u, within)) {
    box[r].lo = box[r].hi = Box<TS>::zero();
    if (walk.valid(u)) {
      const word_t<TS>* p =
          summ + ((size_t)page[r] * walk.kv_heads + u.h) * 2 * D + piece<D>(c) * VEC;
      box[r].lo = Box<TS>::load(p);
      box[r].hi = Box<TS>::load(p + D);
    }
  }
}

// Tile of G q heads: the first nq score (nq < G for a group smaller than the tile, or the last
// chunk of a group over 16). EXACT: the group is G (nq = G, known to the compiler).
template <bool EXACT>
QP_DEVICE bool head_in_tile(int t, int nq) { return EXACT || t < nq; }

// Scores u[t] of q heads qhead0 + t from one box (t < nq; the others are left unset). q is of
// storage T, the box of TS; E4M3 boxes are in units of 2^-8 of k_scale: `unit` (their value in
// the keys' scale, k_scale[h] x E4M3_UNIT) multiplies the sum, as U_p(q) is linear in the box.
template <typename T, typename TS, int D, int G, bool EXACT>
QP_DEVICE void score_heads(const uint16_t* __restrict__ q, const Box<TS>& box, int qhead0, int c,
                           int nq, float unit, float u[G]) {
  float m[VEC], M[VEC], x[VEC];
  Box<TS>::unpack(box.lo, m);
  Box<TS>::unpack(box.hi, M);
#pragma unroll
  for (int t = 0; t < G; ++t) {
    if (!head_in_tile<EXACT>(t, nq)) continue;  // uniform over the grid: the shuffles stay full
    unpack8<T>(load16(q + (size_t)(qhead0 + t) * D + piece<D>(c) * VEC), x);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += fmaxf(x[j] * m[j], x[j] * M[j]);
    u[t] = group_sum<row_lanes(D)>(lane_in_row<D>(c) ? s : 0.f);
    if (is_e4m3<TS>) u[t] *= unit;
  }
}

// The launch's arguments beyond the page tables: the group, the mode when MODE is -1, and
// k_scale [Hkv] for E4M3 summaries (an FP8 cache's, or the summaries' own scale over a 16-bit
// cache: quest-fp8); with BOXES > 1 boxes per page, last_page_len [B] and the tokens of a box.
struct EstimateArgs {
  int group, mode;
  const float* k_scale;
  const int* last_page_len = nullptr;
  int box_tokens = 0;
};

// BOXES boxes of one page are units of consecutive lane groups (the walk's heads are KV head x
// BOXES + box, and tiles and batches hold whole multiples of BOXES units), all in one warp
// (row_lanes(D) x BOXES <= 32, boxes_built): the page's bound is their largest, by shuffles.
template <int LANES, int BOXES>
QP_DEVICE float box_max(float x) {
#pragma unroll
  for (int o = LANES; o < LANES * BOXES; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Whether box `box` of CSR entry i holds a key: every box of a full page; of the request's tail
// page, those that start before its last_page_len tokens (an empty box bounds nothing).
template <int BOXES>
QP_DEVICE bool box_holds_keys(const int* __restrict__ indptr, const EstimateArgs& args, int b,
                              int i, int box) {
  if (BOXES == 1 || box == 0 || __ldg(indptr + b + 1) != i + 1) return true;
  return box * args.box_tokens < __ldg(args.last_page_len + b);
}

// A score, stored so that another CTA of the grid may poll it (a walk's `polled`: a relaxed
// store, the same instruction cost as a plain one) or as data for a later grid.
template <bool POLLED> QP_DEVICE void store_score(float* p, float v) {
  if constexpr (POLLED)  // no "memory" clobber: nothing is ordered by it, loads may move past
    asm volatile("st.relaxed.gpu.global.f32 [%0], %1;" :: "l"(p), "f"(v));
  else *p = v;
}

// Units past the end still shuffle (full-warp masks) but write nothing. A group larger than the
// largest tile (over 16 q heads, multi-query) is scored in chunks of G heads from the box in
// registers, so the box is still read once; smaller tiles take one pass. EXACT: group == G.
// MODE -1: the mode from the launch. BOXES > 1: the walk's head h is KV head h / BOXES, box
// h % BOXES; each q head's score is the largest over the page's boxes before the mode reduces.
template <typename T, typename TS, int D, int G, int MODE, bool EXACT, int BOXES, class W>
QP_DEVICE void score_batch(const uint16_t* __restrict__ q, const int* __restrict__ indptr,
                           float* __restrict__ scores, int batch, const W& walk, Stride within,
                           const Box<TS> box[EST_UNROLL], Unit u, int c, Request& req,
                           const EstimateArgs& args) {
  constexpr int LANES = row_lanes(D);
  constexpr bool CHUNKED = !EXACT && G == QP_GROUPS[sizeof(QP_GROUPS) / sizeof(int) - 1];
  const int g = EXACT ? G : args.group, mode = MODE >= 0 ? MODE : args.mode;
#pragma unroll
  for (int r = 0; r < EST_UNROLL; ++r, u = walk.next(u, within)) {
    const bool valid = walk.valid(u);
    if (valid) req.seek(indptr, batch, u.i);
    // Units past the end still score (full-warp shuffles): head-major ones can have h >= Hkv,
    // so they read q's head 0 instead of past its end (grid-stride ones keep h < Hkv).
    const int hv = W::head_major && !valid ? 0 : u.h, h = hv / BOXES, slot = hv % BOXES;
    const bool keys = !valid || box_holds_keys<BOXES>(indptr, args, req.b, u.i, slot);
    const float unit = is_e4m3<TS> ? __ldg(args.k_scale + h) * E4M3_UNIT : 1.f;
    float v = 0.f;  // shared modes: max or sum over the group so far
    for (int h0 = 0; h0 < (CHUNKED ? g : 1); h0 += G) {  // chunks of G heads (the largest tile)
      const int nq = CHUNKED ? min(G, g - h0) : g;
      float s[G];
      score_heads<T, TS, D, G, EXACT>(q, box[r], (req.b * (walk.kv_heads / BOXES) + h) * g + h0,
                                      c, nq, unit, s);
      if constexpr (BOXES > 1) {
#pragma unroll
        for (int t = 0; t < G; ++t)
          if (head_in_tile<EXACT>(t, nq))
            s[t] = box_max<LANES, BOXES>(keys ? s[t] : -__int_as_float(0x7f800000));
      }
      if (mode == PER_HEAD) {
#pragma unroll
        for (int t = 0; t < G; ++t)
          if (valid && slot == 0 && head_in_tile<EXACT>(t, nq) && c == t % LANES)
            store_score<W::polled>(scores + (size_t)(h * g + h0 + t) * walk.nnz + u.i, s[t]);
      } else {
#pragma unroll
        for (int t = 0; t < G; ++t)
          if (head_in_tile<EXACT>(t, nq))
            v = h0 + t == 0 ? s[t] : mode == SHARED_MAX ? fmaxf(v, s[t]) : v + s[t];
      }
    }
    if (mode != PER_HEAD && valid && slot == 0 && c == 0)
      store_score<W::polled>(scores + (size_t)h * walk.nnz + u.i, mode == SHARED_MEAN ? v / g : v);
  }
}

// Units per tile of a block of NT threads: EST_UNROLL batches of GROUPS = NT / LANES units, one
// unit per LANES = row_lanes(D) lanes.
template <int D, int NT = EST_THREADS>
__host__ __device__ constexpr int est_tile_units() { return EST_UNROLL * (NT / row_lanes(D)); }

// Tiles first, first + step, ... (< end) of this block, scored in the order of Walk<HEAD_MAJOR>
// (quest_step.cu: head-major and grid-stride over its estimate CTAs):
// estimate.cu walks grid-stride (first blockIdx.x, step gridDim.x), estimate_topk.cu a block of
// consecutive tiles (step 1), so that each block's units fall in one or two rows. EXACT: the
// group is the tile G, a constant (the code of the G 1, 2, 4, 8 builds timed on the H200);
// otherwise the group comes from the launch (a smaller group masked, a larger one chunked).
// BOXES > 1 (grid-stride walks only): kv_heads counts KV heads x BOXES, one unit per box.
// POLLED: the scores are stored for polls by other CTAs of the grid (Walk).
template <typename T, typename TS, int D, int G, int MODE, bool HEAD_MAJOR, bool EXACT,
          int NT = EST_THREADS, int BOXES = 1, bool POLLED = false>
QP_DEVICE void estimate_tiles(const uint16_t* __restrict__ q, const word_t<TS>* __restrict__ summ,
                              const int* __restrict__ indptr, const int* __restrict__ indices,
                              float* __restrict__ scores, int batch, int kv_heads, int nnz,
                              const EstimateArgs& args, int first, int step, int end) {
  constexpr int LANES = row_lanes(D), GROUPS = NT / LANES, TILE = est_tile_units<D, NT>();
  static_assert(BOXES == 1 || (!HEAD_MAJOR && LANES * BOXES <= 32 && GROUPS % BOXES == 0),
                "a page's boxes must be units of one warp (boxes_built)");
  const int c = threadIdx.x % LANES;
  const Walk<HEAD_MAJOR, POLLED> walk{kv_heads, nnz, min(end * TILE, nnz * kv_heads)};
  const Stride within = walk.stride(GROUPS), across = walk.stride(step * TILE);
  // now: the tile being scored; ahead: its boxes in flight; ahead2: its page ids in flight.
  Unit now = walk.unit(first * TILE + threadIdx.x / LANES);
  Unit ahead = walk.next(now, across), ahead2 = walk.next(ahead, across);
  int first_pages[EST_UNROLL], page[EST_UNROLL];
  Box<TS> a[EST_UNROLL], b[EST_UNROLL];
  load_pages(indices, walk, within, now, first_pages);  // both tiles' ids before any box load waits
  load_pages(indices, walk, within, ahead, page);
  load_boxes<TS, D>(summ, walk, within, first_pages, now, c, a);
  Request req;
  // Two buffers swap roles each step (no register copies, which would wait on their loads).
  auto advance = [&](const Box<TS> (&cur)[EST_UNROLL], Box<TS> (&nxt)[EST_UNROLL]) {
    load_boxes<TS, D>(summ, walk, within, page, ahead, c, nxt);
    load_pages(indices, walk, within, ahead2, page);
    score_batch<T, TS, D, G, MODE, EXACT, BOXES>(q, indptr, scores, batch, walk, within, cur,
                                                 now, c, req, args);
    now = ahead;
    ahead = ahead2;
    ahead2 = walk.next(ahead2, across);
  };
  for (int t = first; t < end; t += 2 * step) {  // block-uniform: shuffles stay full
    advance(a, b);
    if (t + step >= end) break;
    advance(b, a);
  }
}
