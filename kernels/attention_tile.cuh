// The per-warp tile of decode attention (kernels/attention.cu): a ring stage of TT tokens' K and V
// rows, filled by cp.async, and the online-softmax update over it. Two implementations share one
// interface (init, issue, tile, store), picked by G, the q heads a CTA serves (a tile of
// QP_GROUPS), and the head dim D:
//   CoreTile (G <= 2, D 64 / 128 / 256): CUDA-core dot products, a token row over D/8 lanes;
//   MmaTile  (G >= 4, and D 80 / 96 / 192 at every G): tensor cores (mma m16n8k16), the q heads
//   as rows of the A operand (up to 16, rows past the group masked).
// H200, side by side: llama3-8b (G = 4) dense 32K 49.1-49.6 -> 41.4-41.5 us and shared-mode sparse
// 11.9-12.3 -> 10.0-10.1 us with MmaTile; MHA (G = 1) dense 32K 129.8 -> 130.8 us and sparse
// 13.7 -> 14.0 us, so G = 1 keeps CoreTile. (ncu, MHA dense 32K: 61.0M -> 40.3M instructions at
// the same 135 us: at G = 1 the time goes to each warp's tile latency, not to issue slots.)
#pragma once
#include "softmax_state.cuh"

// Loads per lane per tile (NL: 8 gives 16 tokens at D 128, 32 at D 64, 8 at D 256) and the
// default depth of the per-warp ring (NS), from constants.cuh; attention_kernel takes its depth
// as a template argument (this one, or a deeper ring of ATT_DEEP_STAGES).
template <int G> struct Pipe {
  static_assert(group_index(G) >= 0, "G must be one of QP_GROUPS");
  static constexpr int NL = ATT_LOADS[group_index(G)];
  static constexpr int NS = ATT_STAGES[group_index(G)];
};

// 16-byte global -> shared copy that bypasses registers and L1; src_size 0 writes zeros and
// reads nothing (masked tail slots: their NaN / huge values are never fetched).
QP_DEVICE void cp_async16(uint4* dst, const void* src, bool ok) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(src),
               "r"(ok ? 16 : 0) : "memory");
}
QP_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> QP_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// Page size: a template argument (S > 0: the variants timed on the H200, measured_variant in
// constants.cuh) or, S == 0, its log2 taken at launch (every other variant: one build serves
// every page size, so CI compiles 5 x fewer of them; a shift by a register costs what a shift
// by a constant does). NHD: the pool's layout (common.cuh, PageRows).
template <int S, bool NHD = false> struct Paging : PageRows<NHD> {
  QP_DEVICE explicit Paging(int) {}
  QP_DEVICE int page(int t) const { return t / S; }
  QP_DEVICE int slot(int t) const { return t % S; }
  QP_DEVICE int size() const { return S; }
  QP_DEVICE size_t row(int page, int slot, int kv_heads, int h) const {
    return PageRows<NHD>::row(page, slot, S, kv_heads, h);
  }
};
template <bool NHD> struct Paging<0, NHD> : PageRows<NHD> {
  int shift;
  QP_DEVICE explicit Paging(int log2_size) : shift(log2_size) {}
  QP_DEVICE int page(int t) const { return t >> shift; }
  QP_DEVICE int slot(int t) const { return t & ((1 << shift) - 1); }
  QP_DEVICE int size() const { return 1 << shift; }
  QP_DEVICE size_t row(int page, int slot, int kv_heads, int h) const {
    return PageRows<NHD>::row(page, slot, size(), kv_heads, h);
  }
};

// Token t of a split holds a valid key: its page exists and t is below the page's fill.
template <class PG> QP_DEVICE bool token_valid(const PG& pg, const int* s_valid, int nb, int t) {
  const int pl = pg.page(t);
  return pl < nb && pg.slot(t) < s_valid[pl];
}

// A warp's ring of NS stages; a stage holds TT rows of D values for K, then TT for V, 16-byte
// piece c of row t at slot(t, c), a row taking RS slots (a piece: 8 16-bit values, or 16 E4M3
// codes). The tile's TT x P pieces are copied in order, 32 at a time: copy x = 32 i + l (lane l)
// is piece x % P of row x / P (with P dividing 32: piece l % P of rows l / P + (32 / P) i).
// TT = NL x 32 / (P rounded up to a power of two): for 16-bit values 32 tokens at D 64, 16 at
// D 80 to 128, 8 at D 192 and 256, so a tile is NL x 512 bytes of K (less at D 80, 96, 192);
// E4M3 caches take twice the tokens in the same bytes. SWIZZLE XORs the piece with t % 8, so the
// 8 rows an ldmatrix reads at once sit in 8 different bank groups (unswizzled, the 256-byte rows
// of D 128 put all 8 in one); rows are then padded to a multiple of 8 pieces (16-bit D 80 and 96:
// 16), except rows of 4 pieces (E4M3 at D 64), which XOR with (t / 2) % 4. CoreTile reads only
// its own lane's pieces and needs neither.
template <typename KV, int D, int G, bool SWIZZLE>
struct Ring {
  static constexpr int VP = 16 / int(sizeof(word_t<KV>));  // values per piece
  static constexpr int P = D / VP, LANES = pow2_at_least(P), TPL = 32 / LANES;
  static constexpr int NL = Pipe<G>::NL, NS = Pipe<G>::NS;
  static constexpr int TT = NL * TPL;                                        // tokens per tile
  static constexpr int RS = !SWIZZLE ? P : P == 4 ? 4 : (P + 7) / 8 * 8;   // slots per row
  static constexpr int NC = TT * P / 32;                     // copies per lane, of K and of V
  static constexpr int STAGE = 2 * TT * RS;                  // uint4 per ring stage
  static_assert(TT * P % 32 == 0, "a tile is whole rounds of 32 copies");
  static_assert(SWIZZLE || P == LANES, "the unswizzled ring needs D / 8 a power of two");
  static QP_DEVICE int slot(int t, int c) {
    return t * RS + (!SWIZZLE ? c : RS == 4 ? c ^ ((t >> 1) % 4) : c ^ (t % 8));
  }

  // Start the copies of tile tok0 into ring stage `buf`. A tile no longer than the smallest page
  // (8 tokens: 16-bit D 192 and 256) never spans two pages, tok0 being a multiple of TT: its page
  // is looked up once (without it, D 256 / G 4 needed more than 255 registers).
  template <class PG>
  static QP_DEVICE void issue(uint4* buf, const word_t<KV>* __restrict__ k,
                              const word_t<KV>* __restrict__ v, const PG& pg, const int* s_page,
                              const int* s_valid, int nb, int tok0, int kv_heads, int kv_head,
                              int lane) {
    if constexpr (TT <= QP_PAGE_SIZES[0]) {
      const int pl = pg.page(tok0), s0 = pg.slot(tok0), valid = pl < nb ? s_valid[pl] - s0 : 0;
      const size_t base = valid > 0 ? pg.row(s_page[pl], s0, kv_heads, kv_head) * D : 0;
#pragma unroll
      for (int i = 0; i < NC; ++i) {
        const int x = i * 32 + lane, tl = x / P, c = x % P;
        const bool ok = tl < valid;
        const size_t off = ok ? base + (size_t)tl * pg.stride(kv_heads) * D + c * VP : 0;
        const int at = SWIZZLE ? slot(tl, c) : x;
        cp_async16(buf + at, k + off, ok);
        cp_async16(buf + TT * RS + at, v + off, ok);
      }
    } else {
#pragma unroll
      for (int i = 0; i < NC; ++i) {
        const int x = i * 32 + lane;
        const int tl = 32 % P == 0 ? i * (32 / P) + lane / P : x / P;
        const int c = 32 % P == 0 ? lane % P : x % P;
        const int t = tok0 + tl;
        const bool ok = token_valid(pg, s_valid, nb, t);
        const size_t off = ok ? pg.row(s_page[pg.page(t)], pg.slot(t), kv_heads, kv_head) * D
                                    + c * VP : 0;
        const int at = SWIZZLE ? slot(tl, c) : x;  // = slot(tl, c) unswizzled
        cp_async16(buf + at, k + off, ok);
        cp_async16(buf + TT * RS + at, v + off, ok);
      }
    }
  }
};

// CUDA cores: lane l holds 8 dimensions (piece c = l % LANES) of token sub = l / LANES of each
// group of TPL tokens, the pieces it copied itself, and dots them with its 8 q values. Serves
// only exact groups (G 1 or 2 q heads, never a masked tile) at D / 8 a power of two.
template <typename T, int D, int G>
struct CoreTile : Ring<T, D, G, false> {
  using R = Ring<T, D, G, false>;
  using R::LANES, R::TPL, R::NL;
  float q[G][VEC], acc[G][VEC];
  SoftmaxState state[G];  // row h: maximum (log2 units) and this lane's sum

  // q pre-scaled by log2(e)/sqrt(D): scores in log2 units.
  QP_DEVICE void init(const uint16_t* __restrict__ qb, int lane, float scale, int /*nq = G*/) {
    const int c = lane % LANES;
#pragma unroll
    for (int h = 0; h < G; ++h) {
      unpack8<T>(load16_ro(qb + (size_t)h * D + c * VEC), q[h]);
#pragma unroll
      for (int j = 0; j < VEC; ++j) { q[h][j] *= scale; acc[h][j] = 0.f; }
      state[h].init();
    }
  }

  // Online-softmax update with the tile in ring stage `buf` (masked slots hold zeros).
  template <class PG>
  QP_DEVICE void tile(const uint4* buf, const PG& pg, const int* s_valid, int nb, int tok0,
                      int lane) {
    const int sub = lane / LANES;
    float s[G][NL], x[VEC];
#pragma unroll
    for (int i = 0; i < NL; ++i) {
      unpack8<T>(buf[i * 32 + lane], x);
      const bool ok = token_valid(pg, s_valid, nb, tok0 + i * TPL + sub);
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) dot = fmaf(q[h][j], x[j], dot);
        dot = group_sum<LANES>(dot);
        s[h][i] = ok ? dot : NEG_INF;
      }
    }
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float tmax = s[h][0];
#pragma unroll
      for (int i = 1; i < NL; ++i) tmax = fmaxf(tmax, s[h][i]);
      const float m_new = fmaxf(state[h].m, across_groups_max<LANES>(tmax));
      float use;
      const float rescale = state[h].update(m_new, use);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[h][j] *= rescale;
#pragma unroll
      for (int i = 0; i < NL; ++i) {
        s[h][i] = SoftmaxState::weight(s[h][i], use);
        state[h].add(s[h][i]);
      }
    }
#pragma unroll
    for (int i = 0; i < NL; ++i) {
      unpack8<T>(buf[(NL + i) * 32 + lane], x);
#pragma unroll
      for (int h = 0; h < G; ++h)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[h][j] = fmaf(s[h][i], x[j], acc[h][j]);
    }
  }

  // This warp's (acc, m, l) of its G rows into the CTA's combine arrays.
  QP_DEVICE void store(float (*s_acc)[D], float* s_m, float* s_l, int lane, int /*nq*/) const {
    const int c = lane % LANES;
#pragma unroll
    for (int h = 0; h < G; ++h) {
      const float sum = across_groups_sum<LANES>(state[h].l);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float a = across_groups_sum<LANES>(acc[h][j]);
        if (lane < LANES) s_acc[h][c * VEC + j] = a;
      }
      if (lane == 0) { s_m[h] = state[h].m; s_l[h] = sum; }
    }
  }
};

// Four (two) 8x8 tiles of 16-bit values from shared memory (rows given by lanes 8m..8m+7 for
// tile m); .trans hands each lane a column pair instead of a row pair.
template <bool TRANS> QP_DEVICE void ldmatrix_x4(uint32_t r[4], const uint4* row) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(row);
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
template <bool TRANS> QP_DEVICE void ldmatrix_x2(uint32_t r[2], const uint4* row) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(row);
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}
QP_DEVICE void ldmatrix_x1(uint32_t r[1], const uint4* row) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(a));
}
// N (1, 2 or 4) consecutive 16-byte pieces c0 .. c0 + N - 1 of the 8 rows t0 .. t0 + 7, non-
// transposed: lane l holds 4 bytes of row t0 + l / 4 of each piece (bytes 4 (l % 4) ..).
template <int N, class R>
QP_DEVICE void ldmatrix_rows(uint32_t r[N], const uint4* buf, int t0, int c0, int lane) {
  const uint4* row = buf + R::slot(t0 + lane % 8, c0 + lane / 8 % N);
  if constexpr (N == 4) ldmatrix_x4<false>(r, row);
  else if constexpr (N == 2) ldmatrix_x2<false>(r, row);
  else ldmatrix_x1(r, row);
}

template <bool B, typename X, typename Y> struct Pick { using type = X; };
template <typename X, typename Y> struct Pick<false, X, Y> { using type = Y; };

// Tensor cores: the q heads are rows of the 16-row A operand, tokens the N (scores) and K
// (output) dimensions; lane l holds row l/4 (and, HI, row l/4 + 8) of each accumulator, columns
// 2(l%4) and +1. Rows at or past nq (a group smaller than the tile, the last chunk of a larger
// one) get q = 0: their finite scores are computed and never stored. G <= 8 leaves rows 8..15
// zero, as the tiles timed on the H200 do; G 16 (HI) fills them, a second softmax row per lane
// at the same count of mma. ldmatrix reads K and V rows that other lanes copied (the caller syncs
// the warp after waiting). Scores are scaled to log2 units after the product, so q enters the
// tensor cores exactly as stored. A tile of 8 tokens (D 192, 256) is half a k-step of P V: the
// upper 8 tokens of A are zero and B's upper rows repeat the lower ones (finite values, times 0).
//
// E4M3 caches (KV = e4m3) keep their codes in the ring; the fp16 tensor cores read them through
// ldmatrix as 16-bit pairs, and e4m3x4_f16 turns 4 codes into two f16x2 of their values
// (exact). K: a lane holds dims 4c .. 4c+3 of its token in a 16-dim piece (c = l % 4) and gives
// the mma dims (4c, 4c+2) as k 2c, 2c+1 and (4c+1, 4c+3) as k 8+2c, 9+2c; q's A fragments are
// gathered in the same order, so the dot product is the same sum. V (.trans): a lane holds
// tokens 2c, 2c+1 at dims 2g, 2g+1 of a piece (g = l / 4); dims 2g and 2g+1 feed two output
// tiles, the even one holding dims 4c and 4c+2 in the lane's columns, the odd one 4c+1 and 4c+3.
// q (fp16 or bf16) enters as fp16 (bf16 keeps its 8 bits; saturated at +-65504); the scale of the
// scores carries k_scale, the warps' combine v_scale (attention.cu).
template <typename T, typename KV, int D, int G>
struct MmaTile : Ring<KV, D, G, true> {
  using R = Ring<KV, D, G, true>;
  using R::RS, R::TT, R::slot;
  static constexpr bool FP8 = is_e4m3<KV>;
  using MT = typename Pick<FP8, fp16, T>::type;  // the tensor cores' input type
  static_assert(TT % 16 == 0 || TT == 8, "a tile is whole k-steps of 16 tokens, or half of one");
  static_assert(D % 16 == 0, "head dims are whole k-steps of 16");
  static constexpr bool HI = G > 8;                      // rows 8..15 hold q heads
  static constexpr int NR = HI ? 2 : 1;                  // softmax rows per lane: g, g + 8
  static constexpr int NT = TT / 8, ND = D / 8, KS = D / 16;  // score tiles, output tiles, k-steps
  // A fragments of q, one per 16 dimensions: a0 .. a3 (rows g and g + 8 of k 0-7, then of k
  // 8-15), or a0 and a2 only (QW 2) where rows 8..15 are zero outside the measured builds: HMMA
  // takes A as an aligned quad of registers, so zeros kept per k-step cost D / 8 registers
  // (D 256 / G 4 spilled 4 bytes at 255 registers with them).
  static constexpr int QW = HI || (!FP8 && measured_variant(D, G)) ? 4 : 2;
  uint32_t qa[KS][QW];
  float acc[ND][4], scale;  // output tiles
  SoftmaxState state[NR];   // rows g (and g + 8): maximum (log2 units), this lane's sum

  QP_DEVICE uint32_t& q_at(int kk, int half, int r) { return qa[kk][half * (QW / 2) + r]; }
  struct Frag { uint32_t r[4]; };
  QP_DEVICE Frag a_frag(int kk) const {
    if constexpr (QW == 4) return {{qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3]}};
    else return {{qa[kk][0], 0u, qa[kk][1], 0u}};
  }

  QP_DEVICE void init(const uint16_t* __restrict__ qb, int lane, float scale_log2, int nq) {
    const int g = lane / 4, col = 2 * (lane % 4);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      if constexpr (FP8) {
        init_fp8(qb, kk, g, lane % 4, nq);
      } else {
        const uint16_t* row = qb + (size_t)g * D + kk * 16 + col;
        q_at(kk, 0, 0) = g < nq ? load4_ro(row) : 0u;
        q_at(kk, 1, 0) = g < nq ? load4_ro(row + 8) : 0u;
        if constexpr (QW == 4) {
          qa[kk][1] = qa[kk][3] = 0u;  // rows 8..15
          if (HI && g + 8 < nq) {
            q_at(kk, 0, 1) = load4_ro(row + 8 * D);
            q_at(kk, 1, 1) = load4_ro(row + 8 * D + 8);
          }
        }
      }
    }
#pragma unroll
    for (int n = 0; n < ND; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
    for (int r = 0; r < NR; ++r) state[r].init();
    scale = scale_log2;
  }

  // k-step kk of q over an E4M3 cache: dims 4c .. 4c+3 of rows g (and g + 8) as fp16 pairs
  // (4c, 4c+2) -> a0 / a1 and (4c+1, 4c+3) -> a2 / a3.
  QP_DEVICE void init_fp8(const uint16_t* __restrict__ qb, int kk, int g, int c, int nq) {
    if constexpr (QW == 4) qa[kk][1] = qa[kk][3] = 0u;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const int row = g + 8 * r;
      uint2 w = make_uint2(0u, 0u);
      if (row < nq)
        w = __ldg(reinterpret_cast<const uint2*>(qb + (size_t)row * D + kk * 16 + 4 * c));
      const float f0 = Storage<T>::to_float(w.x & 0xffffu), f1 = Storage<T>::to_float(w.x >> 16);
      const float f2 = Storage<T>::to_float(w.y & 0xffffu), f3 = Storage<T>::to_float(w.y >> 16);
      q_at(kk, 0, r) = pack_f16_sat(f0, f2);
      q_at(kk, 1, r) = pack_f16_sat(f1, f3);
    }
  }
  static QP_DEVICE uint32_t pack_f16_sat(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }

  // Scores of score tile j (8 tokens) over an E4M3 cache: ldmatrix of 4 (then 1 or 2) pieces of
  // 16 dims, each one k-step.
  QP_DEVICE void scores_fp8(const uint4* buf, int j, int lane, float (&s)[4]) {
#pragma unroll
    for (int kc = 0; kc < KS / 4; ++kc) {
      uint32_t b[4];
      ldmatrix_rows<4, R>(b, buf, j * 8, kc * 4, lane);
#pragma unroll
      for (int m4 = 0; m4 < 4; ++m4) {
        uint32_t lo, hi;
        e4m3x4_f16(b[m4], lo, hi);
        Mma<MT>::run(s, a_frag(kc * 4 + m4).r, lo, hi);
      }
    }
    constexpr int REST = KS % 4;  // D 80: 1, D 96: 2
    if constexpr (REST > 0) {
      uint32_t b[REST];
      ldmatrix_rows<REST, R>(b, buf, j * 8, KS / 4 * 4, lane);
#pragma unroll
      for (int m4 = 0; m4 < REST; ++m4) {
        uint32_t lo, hi;
        e4m3x4_f16(b[m4], lo, hi);
        Mma<MT>::run(s, a_frag(KS / 4 * 4 + m4).r, lo, hi);
      }
    }
  }

  // O += P V over an E4M3 cache for k-step ks: 32 dims (two pieces) per ldmatrix, four output
  // tiles (even and odd dims of each piece); D 80 ends on one piece.
  QP_DEVICE void values_fp8(const uint4* vbuf, int ks, const uint32_t (&a)[4], int lane) {
    const int row = ks * 16 + (lane / 8 % 2) * 8 + lane % 8;
#pragma unroll
    for (int cp = 0; cp < KS / 2; ++cp) {
      uint32_t b[4], e[4], o[4];
      ldmatrix_x4<true>(b, vbuf + slot(row, 2 * cp + lane / 16));
#pragma unroll
      for (int i = 0; i < 4; ++i) e4m3x4_f16(b[i], e[i], o[i]);
      Mma<MT>::run(acc[4 * cp], a, e[0], e[1]);
      Mma<MT>::run(acc[4 * cp + 1], a, o[0], o[1]);
      Mma<MT>::run(acc[4 * cp + 2], a, e[2], e[3]);
      Mma<MT>::run(acc[4 * cp + 3], a, o[2], o[3]);
    }
    if constexpr (KS % 2) {
      uint32_t b[2], e[2], o[2];
      ldmatrix_x2<true>(b, vbuf + slot(row, KS - 1));
      e4m3x4_f16(b[0], e[0], o[0]);
      e4m3x4_f16(b[1], e[1], o[1]);
      Mma<MT>::run(acc[ND - 2], a, e[0], e[1]);
      Mma<MT>::run(acc[ND - 1], a, o[0], o[1]);
    }
  }

  // Online-softmax update with the tile in ring stage `buf` (masked slots hold zeros).
  template <class PG>
  QP_DEVICE void tile(const uint4* buf, const PG& pg, const int* s_valid, int nb, int tok0,
                      int lane) {
    float s[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      if constexpr (FP8) {
        scores_fp8(buf, j, lane, s[j]);
      } else {
#pragma unroll
        for (int kc = 0; kc < D / 32; ++kc) {  // K rows as B = K^T: 32 dimensions per ldmatrix
          uint32_t b[4];
          ldmatrix_x4<false>(b, buf + slot(j * 8 + lane % 8, kc * 4 + lane / 8));
          Mma<MT>::run(s[j], a_frag(2 * kc).r, b[0], b[1]);
          Mma<MT>::run(s[j], a_frag(2 * kc + 1).r, b[2], b[3]);
        }
        if (D % 32) {  // D 80: a last k-step of 16 dimensions
          uint32_t b[2];
          ldmatrix_x2<false>(b, buf + slot(j * 8 + lane % 8, D / 32 * 4 + lane / 8 % 2));
          Mma<MT>::run(s[j], a_frag(KS - 1).r, b[0], b[1]);
        }
      }
    }
    const int col = 2 * (lane % 4);
    float tmax[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) tmax[r] = NEG_INF;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool ok = token_valid(pg, s_valid, nb, tok0 + j * 8 + col + e);
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          s[j][2 * r + e] = ok ? s[j][2 * r + e] * scale : NEG_INF;
          tmax[r] = fmaxf(tmax[r], s[j][2 * r + e]);
        }
      }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));  // the row's 4 lanes
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
      float use;
      const float rescale = state[r].update(fmaxf(state[r].m, tmax[r]), use);
#pragma unroll
      for (int n = 0; n < ND; ++n) { acc[n][2 * r] *= rescale; acc[n][2 * r + 1] *= rescale; }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        s[j][2 * r] = SoftmaxState::weight(s[j][2 * r], use);
        s[j][2 * r + 1] = SoftmaxState::weight(s[j][2 * r + 1], use);
        state[r].add(s[j][2 * r] + s[j][2 * r + 1]);
      }
    }
#pragma unroll
    for (int ks = 0; ks < (TT + 15) / 16; ++ks) {  // O += P V, 16 tokens per step
      uint32_t a[4] = {Mma<MT>::pack(s[2 * ks][0], s[2 * ks][1]), 0u, 0u, 0u};
      if (HI) a[1] = Mma<MT>::pack(s[2 * ks][2], s[2 * ks][3]);
      if constexpr (TT >= 16) {
        a[2] = Mma<MT>::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]);
        if (HI) a[3] = Mma<MT>::pack(s[2 * ks + 1][2], s[2 * ks + 1][3]);
      }
      if constexpr (FP8) {
        values_fp8(buf + TT * RS, ks, a, lane);
      } else {
        const int row = TT >= 16 ? ks * 16 + (lane / 8 % 2) * 8 + lane % 8 : lane % 8;
#pragma unroll
        for (int np = 0; np < ND / 2; ++np) {  // V rows as B: two 8-dimension tiles per ldmatrix
          uint32_t b[4];
          ldmatrix_x4<true>(b, buf + TT * RS + slot(row, 2 * np + lane / 16));
          Mma<MT>::run(acc[2 * np], a, b[0], b[1]);
          Mma<MT>::run(acc[2 * np + 1], a, b[2], b[3]);
        }
      }
    }
  }

  // This warp's (acc, m, l) of its first nq rows into the CTA's combine arrays.
  QP_DEVICE void store(float (*s_acc)[D], float* s_m, float* s_l, int lane, int nq) const {
    const int g = lane / 4, col = 2 * (lane % 4);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float sum = state[r].l + __shfl_xor_sync(0xffffffffu, state[r].l, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int at = g + 8 * r;
      if (at >= nq) continue;
#pragma unroll
      for (int n = 0; n < ND; ++n) {  // E4M3: the even / odd tiles of a 16-dim piece
        const int d0 = FP8 ? n / 2 * 16 + 2 * col + n % 2 : n * 8 + col;
        s_acc[at][d0] = acc[n][2 * r];
        s_acc[at][d0 + (FP8 ? 2 : 1)] = acc[n][2 * r + 1];
      }
      if (lane % 4 == 0) { s_m[at] = state[r].m; s_l[at] = sum; }
    }
  }
};

// Tensor cores for G >= 4, at every G where D / 8 is not a power of two (80, 96, 192: the
// CUDA-core tile's shuffles need aligned power-of-two lane groups), and over E4M3 caches.
template <typename KV, int D, int G>
__host__ __device__ constexpr bool tensor_tile() {
  return G >= 4 || row_lanes(D) != D / VEC || is_e4m3<KV>;
}
template <typename T, typename KV, int D, int G>
using Tile = typename Pick<tensor_tile<KV, D, G>(), MmaTile<T, KV, D, G>, CoreTile<T, D, G>>::type;

// Dynamic shared memory of a CTA: the warps' rings of NS stages (the table's ATT_STAGES, or a
// deeper ring of ATT_DEEP_STAGES). backends/variants.py computes the same bytes
// (tests/test_kernels_compile.py compares them for every cache type, head dim, tile and depth).
template <typename KV, int D, int G, int NS = Pipe<G>::NS>
__host__ __device__ constexpr int attention_ring_bytes() {
  using R = Ring<KV, D, G, tensor_tile<KV, D, G>()>;
  return ATT_WARPS * NS * R::STAGE * 16;
}
