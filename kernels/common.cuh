// Shared helpers of the Quest kernels: storage types, 16-byte vector loads, warp reductions.
//
// Storage arrives from CuPy as uint16 bit patterns for both fp16 and bf16, and as uint8 codes for
// FP8 (e4m3). We decode the bits ourselves (cvt.f32.f16 for fp16, a 16-bit shift for bf16, bit
// moves for e4m3) instead of including cuda_fp16.h / cuda_bf16.h / cuda_fp8.h, so the same
// source builds under NVRTC with no toolkit include path and under nvcc in CI. The tag types
// name the template variants: kernel<fp16, 128, 16>.
#pragma once

#ifdef __CUDACC_RTC__  // NVRTC has no C library headers
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef decltype(sizeof(0)) size_t;
#else
#include <stdint.h>
#endif

#include "constants.cuh"

#define QP_DEVICE __device__ __forceinline__

// Programmatic dependent launch (sm_90). A grid launched with programmatic stream serialization
// may start while the previous grid of its stream still runs: work before grid_wait() must only
// read inputs that no earlier grid is still writing, and write nothing. grid_wait() returns once
// the previous grid has completed and its writes are visible; grid_release() lets the next grid
// start launching (it still waits in its own grid_wait()). Both are no-ops in a plain launch.
// Built with QP_EARLY_RELEASE=0, grid_release() is empty and the next grid launches as this one
// ends (backends/pdl.py picks the build per stage).
#ifndef QP_EARLY_RELEASE
#define QP_EARLY_RELEASE 1
#endif
QP_DEVICE void grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
QP_DEVICE void grid_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && QP_EARLY_RELEASE
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

struct fp16 {};  // IEEE half, stored as uint16 bits
struct bf16 {};  // bfloat16, stored as uint16 bits (the top half of a float32)
struct e4m3 {};  // FP8 E4M3 (OCP e4m3fn: vLLM's fp8_e4m3), stored as uint8 codes

// The storage word of a tag: 16-bit values, or 8-bit codes.
template <typename T> struct Word { using type = uint16_t; };
template <> struct Word<e4m3> { using type = unsigned char; };
template <typename T> using word_t = typename Word<T>::type;
template <typename T> constexpr bool is_e4m3 = false;
template <> constexpr bool is_e4m3<e4m3> = true;

// Four E4M3 codes (bytes 0..3 of x) as two f16x2 of their values, exactly (every E4M3 value,
// subnormals included, is an fp16 value): b02 holds bytes 0 and 2 (low, high half), b13 bytes 1
// and 3. One byte permute and two cvt.rn.f16x2.e4m3x2 (F2FP.F16.E4M3.UNPACK_B on sm_90), where
// 6 integer operations put the code's bits in an fp16's low bits (its value x 2^-8): the FP8
// attention tile went from 1,230 to 1,009 instructions per 8 KiB (nvcc 13.0, d 128, G 4) and FP8
// dense at Llama-3.1-8B 128K B8 from 581-585 to 522 us (H200, 2026-12-02). The NaN codes (0x7F,
// 0xFF) read as NaN: a cache quantized by saturation holds none.
QP_DEVICE void e4m3x4_f16(uint32_t x, uint32_t& b02, uint32_t& b13) {
  const uint32_t y = __byte_perm(x, 0u, 0x3120);  // bytes 0, 2, 1, 3
  asm("{.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, lo;\n\tcvt.rn.f16x2.e4m3x2 %1, hi;}"
      : "=r"(b02), "=r"(b13) : "r"(y));
}

template <typename T> struct Storage;

template <> struct Storage<fp16> {
  static QP_DEVICE float to_float(uint32_t bits) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)bits));
    return f;
  }
  static QP_DEVICE uint16_t from_float(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
};

template <> struct Storage<bf16> {
  static QP_DEVICE float to_float(uint32_t bits) { return __uint_as_float(bits << 16); }
  static QP_DEVICE uint16_t from_float(float f) {  // round to nearest even, NaN stays NaN
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};

// Eight 16-bit values = one 16-byte load (eight E4M3 codes: 8 bytes).
constexpr int VEC = 8;

// Lanes that hold one head-dim row of D values, 8 each: D / 8 rounded up to a power of two, so
// that shuffles reduce over aligned groups. Head dims 80, 96 and 192 (10, 12 and 24 pieces) leave
// the lanes past D / 8 idle: they load nothing and add zeros.
__host__ __device__ constexpr int pow2_at_least(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}
__host__ __device__ constexpr int row_lanes(int d) { return pow2_at_least(d / VEC); }

// Plain 16-byte global load; KV pages are read once, so no cache hints beyond the default.
QP_DEVICE uint4 load16(const uint16_t* p) { return *reinterpret_cast<const uint4*>(p); }

// 16 / 4 bytes that no grid writes while this one runs, through the read-only path
// (ld.global.nc): what nvcc chose itself for a __restrict__ kernel parameter. A pointer taken from
// a params struct (kernels/params.cuh) loses that after any asm with a memory clobber
// (cp.async, griddepcontrol), so the kernels say it where they did before.
QP_DEVICE uint4 load16_ro(const uint16_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
QP_DEVICE uint32_t load4_ro(const uint16_t* p) {
  return __ldg(reinterpret_cast<const unsigned int*>(p));
}

// Streaming 16-byte load (evict-first): KV pages of a decode step are not re-read by this launch.
QP_DEVICE uint4 load16_stream(const uint16_t* p) {
  uint4 r;
  asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// Streaming 8-byte load: eight E4M3 codes.
QP_DEVICE uint2 load8_stream(const unsigned char* p) {
  uint2 r;
  asm volatile("ld.global.cs.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

template <typename T>
QP_DEVICE void unpack8(const uint4& v, float out[VEC]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = Storage<T>::to_float(w[i] & 0xffffu);
    out[2 * i + 1] = Storage<T>::to_float(w[i] >> 16);
  }
}

// Eight E4M3 codes as floats (exact).
QP_DEVICE void unpack8_e4m3(const uint2& v, float out[VEC]) {
  const uint32_t w[2] = {v.x, v.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    uint32_t b02, b13;
    e4m3x4_f16(w[i], b02, b13);
    out[4 * i] = Storage<fp16>::to_float(b02 & 0xffffu);
    out[4 * i + 1] = Storage<fp16>::to_float(b13 & 0xffffu);
    out[4 * i + 2] = Storage<fp16>::to_float(b02 >> 16);
    out[4 * i + 3] = Storage<fp16>::to_float(b13 >> 16);
  }
}

template <typename T>
QP_DEVICE uint4 pack8(const float in[VEC]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = (uint32_t)Storage<T>::from_float(in[2 * i]) |
           ((uint32_t)Storage<T>::from_float(in[2 * i + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Eight values as eight E4M3 codes (exact for values on the E4M3 grid).
QP_DEVICE uint2 pack8_e4m3(const float in[VEC]) {
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    unsigned short pair;  // code of in[2i + 1] in the high byte, of in[2i] in the low one
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair)
        : "f"(in[2 * i + 1]), "f"(in[2 * i]));
    w[i / 2] |= (uint32_t)pair << (16 * (i % 2));
  }
  return make_uint2(w[0], w[1]);
}

// Eight values of storage T at p (16-bit values, or E4M3 codes), and back.
template <typename T>
QP_DEVICE void read8(const word_t<T>* p, float out[VEC]) {
  if constexpr (is_e4m3<T>) unpack8_e4m3(*reinterpret_cast<const uint2*>(p), out);
  else unpack8<T>(load16(p), out);
}
template <typename T>
QP_DEVICE void write8(word_t<T>* p, const float in[VEC]) {
  if constexpr (is_e4m3<T>) *reinterpret_cast<uint2*>(p) = pack8_e4m3(in);
  else *reinterpret_cast<uint4*>(p) = pack8<T>(in);
}

// fp16 bits of x rounded toward -inf (UP false) or +inf: through float32 in the same direction,
// which rounds as one step would (the fp16 grid lies on the float32 grid).
template <bool UP>
QP_DEVICE uint16_t f16_outward(double x) {
  float f;
  unsigned short h;
  if (UP) {
    asm("cvt.rp.f32.f64 %0, %1;" : "=f"(f) : "d"(x));
    asm("cvt.rp.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  } else {
    asm("cvt.rm.f32.f64 %0, %1;" : "=f"(f) : "d"(x));
    asm("cvt.rm.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  }
  return h;
}

// c += a (16x16) * b (16x8) on the tensor cores (mma m16n8k16), fp32 accumulate; float pairs ->
// 16-bit pairs. attention_tile.cuh's MmaTile and estimate.cu use it.
// One definition for both storage types: TY is the PTX type name (f16, bf16).
template <typename T> struct Mma;
#define QP_MMA(TAG, TY)                                                                       \
  template <> struct Mma<TAG> {                                                               \
    static QP_DEVICE void run(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {     \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, "  \
                   "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                                   \
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                           \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));           \
    }                                                                                         \
    static QP_DEVICE uint32_t pack(float lo, float hi) {                                      \
      uint32_t r;                                                                             \
      asm("cvt.rn." TY "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));                    \
      return r;                                                                               \
    }                                                                                         \
  };
QP_MMA(fp16, "f16")
QP_MMA(bf16, "bf16")
#undef QP_MMA

template <typename A, typename B> constexpr bool same_tag = false;
template <typename A> constexpr bool same_tag<A, A> = true;

// Sum / max over aligned groups of WIDTH lanes (WIDTH a power of two <= 32).
template <int WIDTH>
QP_DEVICE float group_sum(float x) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Sum / max across the lane bits above a group of WIDTH lanes (the other groups of the warp).
template <int WIDTH>
QP_DEVICE float across_groups_max(float x) {
#pragma unroll
  for (int o = WIDTH; o < 32; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

template <int WIDTH>
QP_DEVICE float across_groups_sum(float x) {
#pragma unroll
  for (int o = WIDTH; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Request of CSR entry i: the b with indptr[b] <= i < indptr[b + 1] (binary search, B small).
QP_DEVICE int request_of(const int* __restrict__ indptr, int batch, int i) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (__ldg(indptr + mid) <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
// Where a token's D values sit in a K or V pool: head-major pages (NHD false: [N, Hkv, S, D], one
// page of one head a contiguous S x D block, ours) or token-major ones (true: [N, S, Hkv, D], the
// blocks of transformers' and vLLM's paged caches, read in place). row() counts rows of D values
// from the pool's start; a page's consecutive slots of one head are stride() rows apart.
template <bool NHD> struct PageRows {
  static QP_DEVICE size_t row(int page, int slot, int size, int kv_heads, int h) {
    return NHD ? ((size_t)page * size + slot) * kv_heads + h
               : ((size_t)page * kv_heads + h) * size + slot;
  }
  static QP_DEVICE int stride(int kv_heads) { return NHD ? kv_heads : 1; }
};
// +-infinity, named once: a masked score and the maximum of a row with no key (NEG_INF), the
// identities of a min / max. __builtin_bit_cast is a constant expression under nvcc and NVRTC
// (NVRTC 13.0 has no __builtin_huge_valf, and __int_as_float is not constexpr).
constexpr float POS_INF = __builtin_bit_cast(float, 0x7f800000u);
constexpr float NEG_INF = -POS_INF;
