// Estimate (criticality): U_p(q) = sum_j max(q_j m_pj, q_j M_pj) for every page of every request
// (docs/QUEST.md stage 2), as a product on the tensor cores.
//
// For m <= M, max(q m, q M) = q+ M + q- m exactly (q+ = max(q, 0), q- = min(q, 0)), so the bounds
// of a KV head's q group over its pages are one product [rows x 2D] . [2D x group]: a row is a
// page's box [m, M] as the summaries [N, Hkv, 2, D] store it (2D contiguous values), a column is
// a q head's [q-, q+]. A warp scores a tile of 16 rows with mma m16n8k16: rows as M, the group
// (padded to 8, or to 16 as two n-tiles) as N, 2D as K. 16-bit products are exact in fp32, so
// only the summation order differs from a loop on the CUDA cores. The CUDA-core loop it replaces
// spent G multiplies, maxes and adds per summary value and was compute-bound from 4 q heads per
// KV head (H200, 128K B8: 0.22 of the read ceiling at 7 q heads per KV head; notes/KERNELS.md).
//
// Fragments come straight from global memory. Lane l = 4g + c holds rows g and g + 8 of A; the
// columns of a k-step may be any permutation of K as long as B takes the same one, so lane c
// loads chunks c, c + 4, c + 8, ... (8 values each) of its two rows and uses chunk j's values as
// its columns of k-steps 2j and 2j + 1; B (q' = [q-, q+] of head g) takes the same chunks of q'.
// No shared memory and no shuffle: a tile is D / 8 independent 16-byte loads per lane.
//
// E4M3 summaries: 8 codes per chunk (8-byte loads), widened exactly to fp16 by e4m3x4_f16,
// which pairs codes (0, 2) and (1, 3): B takes q' in that order, and the score is multiplied by
// k_scale after the product. bf16 queries over fp16 or E4M3 summaries enter
// the fp16 tensor cores as q x 2^s, s per q head so that its largest value lies in [2^14, 2^15):
// exact for every value within 2^-28 of that head's largest (smaller ones add less than fp32
// rounding of the sum), and the score is multiplied by 2^-s. bf16 over bf16 runs bf16 mma.
//
// Work: unit = (tile of 16 rows, KV head), head-major; each warp takes a run of consecutive
// units, so q's scales (and, over E4M3 summaries, its fragments: QHeads) are found once per
// (request, KV head), and the page ids of the next unit load while this one is scored. A tile's
// rows may span requests (a row is a CSR entry, or one of its BOXES boxes): the product runs once
// per request in the tile, with that request's q, and stores only that request's rows. A group over 16 q heads (multi-query) is scored in chunks of at
// most 16 from the same A registers. Head dims over 128 load their K in two phases (registers).
#include "common.cuh"
#include "params.cuh"

enum { PER_HEAD = 0, SHARED_MAX = 1, SHARED_MEAN = 2 };

// The tensor cores' input type for queries T over summaries TS.
template <typename T, typename TS> struct EstOperand { using type = fp16; };
template <> struct EstOperand<bf16, bf16> { using type = bf16; };

// One chunk (8 values) of a row: a 16-byte load of 16-bit summaries, 8 bytes of E4M3 codes; as A
// registers (x, y) for k-step 2j and (z, w) for 2j + 1.
template <typename TS> struct Chunk {
  using raw = uint4;
  static QP_DEVICE raw load(const word_t<TS>* p) { return load16_stream(p); }
  static QP_DEVICE raw zero() { return make_uint4(0u, 0u, 0u, 0u); }
  static QP_DEVICE uint4 regs(const raw& v) { return v; }
};
template <> struct Chunk<e4m3> {
  using raw = uint2;
  static QP_DEVICE raw load(const word_t<e4m3>* p) { return load8_stream(p); }
  static QP_DEVICE raw zero() { return make_uint2(0u, 0u); }
  static QP_DEVICE uint4 regs(const raw& v) {
    uint4 r;
    e4m3x4_f16(v.x, r.x, r.y);
    e4m3x4_f16(v.y, r.z, r.w);
    return r;
  }
};

// Halves of each 16-bit pair below / at or above zero (the sign bit is bit 15 of each half in both
// fp16 and bf16): the negative part keeps q where q < 0, the positive part where q >= 0.
QP_DEVICE uint32_t sign_mask(uint32_t w) { return ((w >> 15) & 0x00010001u) * 0xffffu; }
QP_DEVICE uint4 negative_part(uint4 v) {
  return make_uint4(v.x & sign_mask(v.x), v.y & sign_mask(v.y), v.z & sign_mask(v.z),
                    v.w & sign_mask(v.w));
}
QP_DEVICE uint4 positive_part(uint4 v) {
  return make_uint4(v.x & ~sign_mask(v.x), v.y & ~sign_mask(v.y), v.z & ~sign_mask(v.z),
                    v.w & ~sign_mask(v.w));
}

// q' pairs in the order Chunk<TS>::regs gives the summaries: natural for 16-bit, (0, 2), (1, 3),
// (4, 6), (5, 7) for E4M3.
template <typename TS> QP_DEVICE uint4 order_like(uint4 v) {
  if constexpr (is_e4m3<TS>)
    return make_uint4(__byte_perm(v.x, v.y, 0x5410), __byte_perm(v.x, v.y, 0x7632),
                      __byte_perm(v.z, v.w, 0x5410), __byte_perm(v.z, v.w, 0x7632));
  else
    return v;
}

// 2^e as a float, e in [-126, 127].
QP_DEVICE float exp2i(int e) { return __int_as_float((e + 127) << 23); }

// Shape of one build: head dim D, NT n-tiles of 8 q heads, BOXES boxes per page.
template <int D, int NT, int BOXES> struct EstShape {
  static_assert(D % 16 == 0, "a row is whole chunks of 8 per lane of a quad");
  static_assert(16 % BOXES == 0, "a page's boxes lie in one tile of 16 rows");
  static constexpr int CH = D / 16;                  // chunks per row per lane (of 2D / 8)
  static constexpr int PC = CH <= 8 ? CH : CH / 2;   // chunks per phase (registers: 2 x PC)
  static constexpr int PHASES = CH / PC;
  static_assert(PHASES * PC == CH, "phases split a lane's chunks evenly");
  // chunk j of lane c starts at element (c + 4j) * 8 of the row [m, M]
  static QP_DEVICE int offset(int c, int j) { return (c + 4 * j) * 8; }
};

// The launch's arguments: the group, the mode, k_scale [Hkv] of E4M3 summaries (nullptr
// otherwise); with BOXES > 1, last_page_len [B] and the tokens of a box.
struct EstimateArgs {
  int batch, kv_heads, nnz, group, mode;
  const float* k_scale;
  const int* last_page_len;
  int box_tokens;
};

// The q heads of one (request, KV head, chunk of q heads) as B: lane 4g + c serves head nt * 8 + g
// of each n-tile (zeros past the chunk's nq heads); only A stays in registers while its loads are
// in flight (B held in registers for a whole tile spilled at D 128). 16-bit summaries build B
// chunk by chunk inside the product from q in L1. E4M3 summaries (STAGED) build it once per
// (request, KV head) into this warp's shared memory, [nt][chunk][lane] as 16-byte words (lanes
// write and read consecutive words), and read it back per tile: over half the bytes, building B
// per tile (sign split, order, bf16 to scaled fp16) made their estimate ALU-bound (H200, 128K B8:
// 0.46 -> 0.52 of the read ceiling staged). Staged, the 16-bit builds were slower (Qwen2.5-7B
// 128K B8 37.9 -> 40.5 us, MHA 32K 11.9 -> 12.3 us). col_scale turns a column's product into
// its score: 2^-s, times k_scale for E4M3.
template <typename T, typename TS, int D, int NT, int BOXES>
struct QHeads {
  using OP = typename EstOperand<T, TS>::type;
  using S = EstShape<D, NT, BOXES>;
  static constexpr bool SCALED = !same_tag<T, OP>;  // bf16 queries on fp16 tensor cores
  static constexpr bool STAGED = is_e4m3<TS>;
  static constexpr int WORDS = STAGED ? NT * S::CH * 32 : 0;  // a warp's 16-byte words
  uint4* sh;  // this warp's WORDS words of shared memory (STAGED)
  const uint16_t* qh[NT];
  float f[NT];  // 2^s of the lane's head
  float col_scale[NT][2];

  QP_DEVICE void init(const uint16_t* __restrict__ qh0, int nq, float unit, int lane) {
    const int g = lane >> 2, c = lane & 3;
    if constexpr (STAGED) __syncwarp();  // every lane has read the heads before
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int n = nt * 8 + g;
      qh[nt] = n < nq ? qh0 + (size_t)n * D : nullptr;
      const int s = SCALED ? head_shift(qh[nt], c) : 0;
      f[nt] = exp2i(s);
      if constexpr (STAGED) {
#pragma unroll
        for (int j = 0; j < S::CH; ++j) sh[(nt * S::CH + j) * 32 + lane] = build(nt, j, c);
      }
      const float mine = exp2i(-s) * unit;  // head n's factor, on the lanes of quad g
      col_scale[nt][0] = __shfl_sync(0xffffffffu, mine, (2 * c) * 4);
      col_scale[nt][1] = __shfl_sync(0xffffffffu, mine, (2 * c + 1) * 4);
    }
    if constexpr (STAGED) __syncwarp();  // the words are read by every lane's product
  }

  // B words of n-tile nt for the lane's chunk j.
  QP_DEVICE uint4 frag(int nt, int j, int lane) const {
    if constexpr (STAGED) return sh[(nt * S::CH + j) * 32 + lane];
    else return build(nt, j, lane & 3);
  }

  // Chunk j of the lane's head as B words: q' = [q-, q+], times 2^s when SCALED, in the order
  // of Chunk<TS>::regs.
  QP_DEVICE uint4 build(int nt, int j, int c) const {
    const int off = S::offset(c, j);
    const bool neg = off < D;
    // a plain load: q's __restrict__ (estimate_kernel) gives it the read-only path
    uint4 v = qh[nt] ? load16(qh[nt] + (neg ? off : off - D)) : make_uint4(0u, 0u, 0u, 0u);
    if constexpr (SCALED) v = to_fp16(v, f[nt]);
    return order_like<TS>(neg ? negative_part(v) : positive_part(v));
  }

  // s with the head's largest |q| x 2^s in [2^14, 2^15) (0 for an all-zero head): the quad's
  // lanes read their chunks of the m half, which together cover every dim once.
  static QP_DEVICE int head_shift(const uint16_t* qh, int c) {
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < S::CH; ++j) {
      const int off = S::offset(c, j);
      if (!qh || off >= D) continue;
      float x[VEC];
      unpack8<T>(load16(qh + off), x);
#pragma unroll
      for (int e = 0; e < VEC; ++e) amax = fmaxf(amax, fabsf(x[e]));
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const int e = (int)((__float_as_uint(amax) >> 23) & 0xff) - 127;  // amax's exponent
    return amax > 0.f && amax < POS_INF ? max(-112, min(126, 14 - e)) : 0;
  }

  static QP_DEVICE uint4 to_fp16(const uint4& v, float f) {
    float x[VEC];
    unpack8<T>(v, x);
    return make_uint4(Mma<fp16>::pack(x[0] * f, x[1] * f), Mma<fp16>::pack(x[2] * f, x[3] * f),
                      Mma<fp16>::pack(x[4] * f, x[5] * f), Mma<fp16>::pack(x[6] * f, x[7] * f));
  }
};

// A registers of one phase: rows g and g + 8, PC chunks each.
template <typename TS, int PC> struct ATile {
  typename Chunk<TS>::raw r[2][PC];
};

// Rows g and g + 8 of a tile: their summaries' chunks for phase p (zeros for rows past the end).
template <typename TS, int D, int NT, int BOXES>
QP_DEVICE void load_a(ATile<TS, EstShape<D, NT, BOXES>::PC>& a,
                      const word_t<TS>* __restrict__ summ, const int (&row_base)[2], int phase,
                      int c) {
  using S = EstShape<D, NT, BOXES>;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr)
#pragma unroll
    for (int j = 0; j < S::PC; ++j)
      a.r[rr][j] = row_base[rr] >= 0
                       ? Chunk<TS>::load(summ + (size_t)row_base[rr] * 2 * D +
                                         S::offset(c, phase * S::PC + j))
                       : Chunk<TS>::zero();
}

// acc[nt] += A . B over phase p's chunks (two k-steps each).
template <typename T, typename TS, int D, int NT, int BOXES>
QP_DEVICE void product(float (&acc)[NT][4], const ATile<TS, EstShape<D, NT, BOXES>::PC>& a,
                       const QHeads<T, TS, D, NT, BOXES>& qs, int p, int lane) {
  using S = EstShape<D, NT, BOXES>;
  using OP = typename EstOperand<T, TS>::type;
#pragma unroll
  for (int j = 0; j < S::PC; ++j) {
    const uint4 lo = Chunk<TS>::regs(a.r[0][j]), hi = Chunk<TS>::regs(a.r[1][j]);
    const uint32_t s0[4] = {lo.x, hi.x, lo.y, hi.y}, s1[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint4 b = qs.frag(nt, p * S::PC + j, lane);
      Mma<OP>::run(acc[nt], s0, b.x, b.y);
      Mma<OP>::run(acc[nt], s1, b.z, b.w);
    }
  }
}

// Summary rows (page, KV head, box) of rows g and g + 8 of tile t: -1 past the last row.
template <int BOXES>
QP_DEVICE void row_bases(const int* __restrict__ indices, int rows, int kv_heads, int h, int t,
                         int g, int (&base)[2]) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = t * 16 + g + 8 * rr;
    base[rr] = r < rows ? (__ldg(indices + r / BOXES) * kv_heads + h) * BOXES + r % BOXES : -1;
  }
}

// Whether box `box` of entry i of request b holds a key: every box of a full page; of the
// request's tail page, those that start before its last_page_len tokens.
template <int BOXES>
QP_DEVICE bool box_holds_keys(const int* __restrict__ indptr, const EstimateArgs& args, int b,
                              int i, int box) {
  if (BOXES == 1 || box == 0 || __ldg(indptr + b + 1) != i + 1) return true;
  return box * args.box_tokens < __ldg(args.last_page_len + b);
}

// Request of entry i, carried across a warp's units (binary search only when i leaves it).
struct Request {
  int b = 0, begin = 0, end = 0;
  QP_DEVICE void seek(const int* __restrict__ indptr, int batch, int i) {
    if (i >= begin && i < end) return;
    b = request_of(indptr, batch, i);
    begin = __ldg(indptr + b);
    end = __ldg(indptr + b + 1);
  }
};

// Scores of rows g and g + 8 (rr) for request b after a chunk's product: per-head stores each
// valid column; the shared modes fold the columns (and the chunks, into v) and store once.
template <int NT, int BOXES>
QP_DEVICE void finish_chunk(const float (&acc)[NT][4], const float (&col_scale)[NT][2],
                            const int* __restrict__ indptr, float* __restrict__ scores,
                            const EstimateArgs& args, int b, int h, int t, int head0, int nq,
                            bool first_chunk, float (&v)[2], int lane) {
  const int g = lane >> 2, c = lane & 3, rows = args.nnz * BOXES;
  const int begin = __ldg(indptr + b), end = __ldg(indptr + b + 1);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = t * 16 + g + 8 * rr, i = r / BOXES, box = r % BOXES;
    const bool mine = r < rows && i >= begin && i < end;
    const bool keys = !mine || box_holds_keys<BOXES>(indptr, args, b, i, box);
    float s[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[nt][e] = keys ? acc[nt][2 * rr + e] * col_scale[nt][e] : NEG_INF;
#pragma unroll
        for (int o = 4; o < 4 * BOXES; o <<= 1)  // the page's boxes: rows of lanes 4 apart
          s[nt][e] = fmaxf(s[nt][e], __shfl_xor_sync(0xffffffffu, s[nt][e], o));
      }
    const bool store = mine && box == 0;
    if (args.mode == PER_HEAD) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = nt * 8 + 2 * c + e;
          if (store && n < nq) scores[(size_t)(h * args.group + head0 + n) * args.nnz + i] = s[nt][e];
        }
      continue;
    }
    const bool max_mode = args.mode == SHARED_MAX;
    float x = max_mode ? NEG_INF : 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (nt * 8 + 2 * c + e < nq) x = max_mode ? fmaxf(x, s[nt][e]) : x + s[nt][e];
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      const float y = __shfl_xor_sync(0xffffffffu, x, o);
      x = max_mode ? fmaxf(x, y) : x + y;
    }
    v[rr] = first_chunk ? x : max_mode ? fmaxf(v[rr], x) : v[rr] + x;
  }
}

// The shared modes' score of rows g and g + 8, once every chunk of the group is folded in.
template <int BOXES>
QP_DEVICE void store_shared(const float (&v)[2], const int* __restrict__ indptr,
                            float* __restrict__ scores, const EstimateArgs& args, int b, int h,
                            int t, int lane) {
  const int g = lane >> 2, rows = args.nnz * BOXES;
  const int begin = __ldg(indptr + b), end = __ldg(indptr + b + 1);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = t * 16 + g + 8 * rr, i = r / BOXES;
    if ((lane & 3) == 0 && r < rows && i >= begin && i < end && r % BOXES == 0)
      scores[(size_t)h * args.nnz + i] =
          args.mode == SHARED_MEAN ? v[rr] / args.group : v[rr];
  }
}

// One unit (tile t of KV head h) for every request whose rows it holds. A stays in registers
// across requests and chunks of q heads when one phase holds it; the q heads' scales stay across
// units of the same request and KV head (heads_key) when one chunk holds the group.
template <typename T, typename TS, int D, int NT, int BOXES>
QP_DEVICE void score_unit(const uint16_t* __restrict__ q, const word_t<TS>* __restrict__ summ,
                          const int* __restrict__ indptr, float* __restrict__ scores,
                          const EstimateArgs& args, int h, int t, const int (&base)[2],
                          Request& req, QHeads<T, TS, D, NT, BOXES>& qs, int& heads_key,
                          int lane) {
  using S = EstShape<D, NT, BOXES>;
  const int rows = args.nnz * BOXES, c = lane & 3;
  const int chunks = (args.group + 15) / 16, size = (args.group + chunks - 1) / chunks;
  const int i_last = min(t * 16 + 15, rows - 1) / BOXES;
  req.seek(indptr, args.batch, t * 16 / BOXES);
  const int b_first = req.b;
  const int b_last = i_last < req.end ? b_first : request_of(indptr, args.batch, i_last);
  ATile<TS, S::PC> a;
  if constexpr (S::PHASES == 1) load_a<TS, D, NT, BOXES>(a, summ, base, 0, c);
  for (int b = b_first; b <= b_last; ++b) {
    float v[2] = {0.f, 0.f};
    for (int ch = 0; ch < chunks; ++ch) {
      const int head0 = ch * size, nq = min(size, args.group - head0);
      const int key = chunks > 1 ? -1 : b * args.kv_heads + h;
      if (key < 0 || key != heads_key) {
        const float unit = is_e4m3<TS> ? __ldg(args.k_scale + h) : 1.f;
        qs.init(q + ((size_t)(b * args.kv_heads + h) * args.group + head0) * D, nq, unit, lane);
      }
      heads_key = key;
      float acc[NT][4] = {};
#pragma unroll
      for (int p = 0; p < S::PHASES; ++p) {
        if constexpr (S::PHASES > 1) load_a<TS, D, NT, BOXES>(a, summ, base, p, c);
        product<T, TS, D, NT, BOXES>(acc, a, qs, p, lane);
      }
      finish_chunk<NT, BOXES>(acc, qs.col_scale, indptr, scores, args, b, h, t, head0, nq,
                              ch == 0, v, lane);
    }
    if (args.mode != PER_HEAD) store_shared<BOXES>(v, indptr, scores, args, b, h, t, lane);
  }
}

// T: the queries' storage (fp16, bf16); TS: the summaries' (T's own, E4M3 over an FP8 cache or
// quest-fp8's over a 16-bit one, or fp16 over an FP8 cache); D: head dim; NT: n-tiles of 8 q heads
// (1: chunks of up to 8, 2: up to 16); BOXES: boxes per page (quest-boxes:c; summaries [N, Hkv,
// BOXES, 2, D], each score the largest over the page's boxes that hold keys). The grid is at most
// one resident wave (EST_NTILE_BLOCKS per SM, constants.cuh); warp w scores units [U w / W,
// U (w + 1) / W) of the U = Hkv x tiles units.
// The kernel's body, over its params' fields and q (the kernel below unpacks them).
template <typename T, typename TS, int D, int NT, int BOXES>
QP_DEVICE void estimate_run(const uint16_t* __restrict__ q, const word_t<TS>* __restrict__ summ,
                            const int* __restrict__ indptr, const int* __restrict__ indices,
                            float* __restrict__ scores, int batch, int kv_heads, int nnz,
                            int group, int mode, const float* __restrict__ k_scale,
                            const int* __restrict__ last_page_len, int box_tokens) {
  const EstimateArgs args{batch, kv_heads, nnz, group, mode, k_scale, last_page_len, box_tokens};
  const int lane = threadIdx.x & 31, g = lane >> 2;
  const int warps = gridDim.x * EST_WARPS, w = blockIdx.x * EST_WARPS + (threadIdx.x >> 5);
  const int rows = nnz * BOXES, tiles = (rows + 15) / 16;
  const long long units = (long long)tiles * kv_heads;
  const int u0 = (int)(units * w / warps), u1 = (int)(units * (w + 1) / warps);
  // Page tables are ready before the step: the first unit's page ids load before grid_wait.
  int base[2], next[2];
  if (u0 < u1) row_bases<BOXES>(indices, rows, kv_heads, u0 / tiles, u0 % tiles, g, base);
  grid_wait();     // the grid before may still write q or the summaries (RoPE, summary append)
  grid_release();  // empty in quest()'s build (backends/cupy.py, QUEST_EARLY_RELEASE)
  extern __shared__ uint4 est_frags[];  // EST_WARPS x QHeads::WORDS (the launcher sizes it)
  Request req;
  QHeads<T, TS, D, NT, BOXES> qs;
  qs.sh = est_frags + (threadIdx.x >> 5) * QHeads<T, TS, D, NT, BOXES>::WORDS;
  int heads_key = -1;
  for (int u = u0; u < u1; ++u) {
    if (u + 1 < u1) row_bases<BOXES>(indices, rows, kv_heads, (u + 1) / tiles, (u + 1) % tiles, g, next);
    score_unit<T, TS, D, NT, BOXES>(q, summ, indptr, scores, args, u / tiles, u % tiles, base,
                                    req, qs, heads_key, lane);
    base[0] = next[0];
    base[1] = next[1];
  }
}

// q [B, Hq, d] comes beside the params as a __restrict__ kernel argument: nvcc then loads it
// through the read-only path with the chunk offsets as immediates ([q + 64], [q + 128], ...),
// as when every pointer was an argument (05797cf). From the struct, __ldg's asm took an or, a
// widening multiply and an add per load (16-bit estimate +3.3-5.9% against 05797cf), a plain
// load lost the read-only path (+5.8-11.1%); q as an argument won back -0.1 to 1.0 points of
// the first (within what two calls differ by), and 2.7-5.4% remain unexplained (H200, 2026-12-02, benches of
// tests/fixtures/bench-gqa.toml side by side; notes/KERNELS.md).
template <typename T, typename TS, int D, int NT, int BOXES>
__global__ void __launch_bounds__(EST_WARPS * 32, EST_NTILE_BLOCKS[NT - 1])
estimate_kernel(const EstimateParams p, const uint16_t* __restrict__ q) {
  const PagedCache& c = p.cache;
  estimate_run<T, TS, D, NT, BOXES>(q, static_cast<const word_t<TS>*>(p.summ), c.indptr,
                                    c.indices, p.scores, c.batch, c.kv_heads, p.nnz, p.group,
                                    p.mode, p.summ_scale, c.last_page_len, p.box_tokens);
}

#ifdef QP_INSTANTIATE_ALL  // CI compiles every variant (tests/test_kernels_compile.py)
#include "instantiate.cuh"
namespace qp_instantiate {
// Summaries of a query type (T, TS): fp16 / bf16 over their own cache, E4M3 (over an FP8 cache,
// or quest-fp8's over a 16-bit one), or fp16 over an FP8 one (summary_built); n-tiles 1 and 2;
// boxes (C > 1) of T's own summaries where boxes_built.
struct Estimate {
  template <int T, int TS, int D, int NT, int C> static void run() {
    constexpr bool built = builds_head_dim(D) &&
        (C == 1 ? TS == T || summary_built(E4M3, TS) : TS == T && boxes_built(D, C));
    if constexpr (built) (void)&estimate_kernel<Tag<T>, Tag<TS>, D, NT, C>;
  }
};
void estimate_all() {
  Cross<Estimate>::run<DTYPES, KV_DTYPES, QP_HEAD_DIMS, EST_NTILES, QP_BOXES>();
}
}  // namespace qp_instantiate
#endif
