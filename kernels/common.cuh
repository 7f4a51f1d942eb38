// Shared helpers of the Quest kernels: storage types, 16-byte vector loads, warp reductions.
//
// Storage arrives from CuPy as uint16 bit patterns for both fp16 and bf16. We decode the bits
// ourselves (cvt.f32.f16 for fp16, a 16-bit shift for bf16) instead of including cuda_fp16.h /
// cuda_bf16.h, so the same source builds under NVRTC with no toolkit include path and under
// nvcc in CI. The tag types name the template variants: kernel<fp16, 128, 16>.
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

// Eight 16-bit values = one 16-byte load.
constexpr int VEC = 8;

// Lanes that hold one head-dim row of D values, 8 each: D / 8 rounded up to a power of two, so
// that shuffles reduce over aligned groups. Head dims 80, 96 and 192 (10, 12 and 24 pieces) leave
// the lanes past D / 8 idle: they load nothing and add zeros.
__host__ __device__ constexpr int row_lanes(int d) {
  int lanes = 1;
  while (lanes < d / VEC) lanes *= 2;
  return lanes;
}

// Plain 16-byte global load; KV pages are read once, so no cache hints beyond the default.
QP_DEVICE uint4 load16(const uint16_t* p) { return *reinterpret_cast<const uint4*>(p); }

// Streaming 16-byte load (evict-first): KV pages of a decode step are not re-read by this launch.
QP_DEVICE uint4 load16_stream(const uint16_t* p) {
  uint4 r;
  asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
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

template <typename T>
QP_DEVICE uint4 pack8(const float in[VEC]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = (uint32_t)Storage<T>::from_float(in[2 * i]) |
           ((uint32_t)Storage<T>::from_float(in[2 * i + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

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
