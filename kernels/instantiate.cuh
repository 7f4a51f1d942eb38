// Every variant the launcher may ask for, built from the tables of constants.cuh (CI compiles
// each kernels/*.cu with QP_INSTANTIATE_ALL; tests/test_kernels_compile.py checks that the
// instances in the object are exactly those the tables name). No list of variants is written out:
// a new head dim, tile or page size is a row in constants.cuh.
//
// Cross<F>::run<A, B, ...>() calls F::run<a, b, ...>() for every a of array A, b of B, ...;
// F::run takes the address of its kernel instance, which makes nvcc build it.
// QP_INSTANTIATE_HEAD_DIM=d keeps head dim d only, so CI can build the head dims in parallel.
#pragma once
#include "common.cuh"

#ifndef QP_INSTANTIATE_HEAD_DIM
#define QP_INSTANTIATE_HEAD_DIM 0  // every head dim
#endif

namespace qp_instantiate {

enum { FP16 = 0, BF16 = 1, E4M3 = 2 };
constexpr int DTYPES[] = {FP16, BF16};             // queries and outputs (storage tags, by number)
constexpr int KV_DTYPES[] = {FP16, BF16, E4M3};    // K / V caches and their summaries
constexpr int MODES[] = {0, 1, 2};                 // estimate.cu: per-head, shared-max, -mean

template <int CODE> struct TagOf;
template <> struct TagOf<FP16> { using type = fp16; };
template <> struct TagOf<BF16> { using type = bf16; };
template <> struct TagOf<E4M3> { using type = e4m3; };
template <int CODE> using Tag = typename TagOf<CODE>::type;

// Caches and summaries (core/layout.py, check_cache_dtypes): an fp16 / bf16 cache keeps
// summaries of its own type; an E4M3 cache keeps E4M3 or fp16 summaries.
constexpr bool summary_built(int kv, int summ) {
  return kv == E4M3 ? summ == E4M3 || summ == FP16 : summ == kv;
}

// quest-fp8: E4M3 summaries (rounded outward, a scale per KV head) over an fp16 / bf16 cache.
constexpr bool fp8_selector(int kv, int summ) { return kv != E4M3 && summ == E4M3; }

constexpr bool builds_head_dim(int d) {
  return QP_INSTANTIATE_HEAD_DIM == 0 || d == QP_INSTANTIATE_HEAD_DIM;
}

template <int... I> struct Seq {};
template <int N, int... I> struct MakeSeq : MakeSeq<N - 1, N - 1, I...> {};
template <int... I> struct MakeSeq<0, I...> { using type = Seq<I...>; };
template <int N> constexpr int size_of(const int (&)[N]) { return N; }

template <class F, int... Fixed>
struct Cross {
  template <const auto&... Arrays>
  static void run() {
    if constexpr (sizeof...(Arrays) == 0) F::template run<Fixed...>();
    else first<Arrays...>(typename MakeSeq<size_of(head<Arrays...>())>::type{});
  }
  template <const auto& A, const auto&... Rest>
  static constexpr const auto& head() { return A; }
  template <const auto& A, const auto&... Rest, int... I>
  static void first(Seq<I...>) { (Cross<F, Fixed..., A[I]>::template run<Rest...>(), ...); }
};

}  // namespace qp_instantiate
