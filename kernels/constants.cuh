// Launch constants: the one definition shared by the kernels and their launcher.
// questprof/backends/constants.py parses this file for questprof/backends/cupy.py, so the Python
// side holds no copy. Keep to the two forms it reads (a test fails on anything else):
//   constexpr int NAME = <integer>;
//   constexpr int NAME[] = {<integer>, ...};
// Arrays indexed by group_index(G) hold one value per G of QP_GROUPS.
#pragma once

// Variants the launcher may ask for (QP_INSTANTIATE_ALL builds the same set in CI).
// QP_GROUPS are tile sizes: the q heads one CTA of attention serves, or one estimate pass scores
// from a box. A group g = q_heads / kv_heads runs on the smallest tile >= g with the rows past g
// masked (g 3 on 4, 5-7 on 8, 9-15 on 16); a group over 16 (multi-query) is cut into
// ceil(g / 16) near-equal chunks (backends/cupy.py, `plan_group`).
constexpr int QP_GROUPS[] = {1, 2, 4, 8, 16};
constexpr int QP_HEAD_DIMS[] = {64, 80, 96, 128, 192, 256};
constexpr int QP_PAGE_SIZES[] = {8, 16, 32, 64, 128};
// Variants kept as they were timed on the H200 (head dims x tiles below, 16-bit caches).
// Attention: page size a template argument (at the measured page sizes), combine arrays in static
// shared memory, q fragments with their zero rows, merges in passes of 8; estimate: the group
// and the mode constants. Every other attention variant is built once with S = 0 and takes
// log2(page size) at launch (CI compiles 5 x fewer of them), combines in its rings, drops the
// zero rows and merges in passes of 4 (registers, at D 256); every other estimate takes the group
// (tiles over 2) and the mode (tiles over 1) from the launch.
constexpr int QP_MEASURED_HEAD_DIMS[] = {64, 128};
constexpr int QP_MEASURED_GROUPS[] = {1, 2, 4, 8};
constexpr int QP_MEASURED_PAGE_SIZES[] = {8, 16, 32, 64};
// Boxes per page of the summary and estimate (1: Quest; 2 and 4: quest-boxes:c, c boxes of S / c
// consecutive tokens each). A page's boxes are scored by consecutive lane groups of one warp, so
// c boxes are built where c x row_lanes(D) <= 32 (boxes_built), for these head dims only (each
// box count adds 10 estimate builds per head dim to CI): c 2 and 4 at D 64, c 2 at D 128.
constexpr int QP_BOXES[] = {1, 2, 4};
constexpr int QP_BOX_HEAD_DIMS[] = {64, 128};

// summary.cu: threads of its CTA, one CTA per plan entry (page, written slots), striding over the
// KV heads x boxes x d / 8 runs of 8 dimensions (512 at 32 KV heads, d 128: two per thread). Not
// in the timed step and not tuned; __launch_bounds__ caps the launch at it.
constexpr int SUM_THREADS = 256;

// estimate.cu (the bound on the tensor cores): EST_WARPS warps per block, each a run of units of
// 16 rows; builds of EST_NTILES n-tiles of 8 q heads (1: groups up to 8, 2: up to 16), with
// EST_NTILE_BLOCKS resident blocks per SM, the register cap ptxas sizes them by (nvcc 13.0 sm_90,
// D 128: NT 1 fits 128 registers, NT 2 170).
constexpr int EST_WARPS = 4;
constexpr int EST_NTILES[] = {1, 2};
constexpr int EST_NTILE_BLOCKS[] = {4, 3};

// topk.cu: one CTA per (request, head) of one of these sizes, picked at launch by the rows and
// their length (backends/variants.py, topk_threads) or by QP_TUNE tk_threads.
constexpr int TK_THREAD_OPTIONS[] = {256, 512, 1024};
// topk.cu: keys per thread of the register form (select_small), built at every CTA size; 0 is
// the shared-memory form (select_row). Picked at launch by the rows and their length
// (backends/variants.py, topk_form) or by QP_TUNE tk_keys.
constexpr int TK_REG_KEYS[] = {0, 4, 8, 16};

// page_cache.cu: the step's CTA (one per (request, KV head): its passes run over K chosen pages
// and C slots, whose keys it sorts in shared memory) and the fill's (one per miss, one 16-byte
// word of K and one of V per thread at S 16, d 128, as gather.cu). A table of C slots takes
// 8 n + 12 K bytes of shared memory, n = C rounded up to a power of two: C <= PC_MAX_SLOTS keeps
// it under 48 KiB. PC_THREADS is a multiple of 32 (the step's ballot scan).
constexpr int PC_THREADS = 256;
constexpr int PC_FILL_THREADS = 256;
constexpr int PC_MAX_SLOTS = 2048;

// attention.cu and attention_tile.cuh.
constexpr int ATT_WARPS = 4;
constexpr int ATT_MAX_PAGES = 512;  // pages of one split staged in shared memory
// Per-warp cp.async ring: loads per lane per tile (NL) and stages (NS). Shared memory per CTA =
// ATT_WARPS x NS x 8 KiB: 96 KiB for G <= 4 (2 CTAs per SM), 64 KiB for G 8, whose combine
// arrays take 16 KiB more, and for G 16 (combine arrays in the ring).
constexpr int ATT_LOADS[] = {8, 8, 8, 8, 8};
constexpr int ATT_STAGES[] = {3, 3, 3, 2, 2};
// Deeper rings, for launches of few rows at one CTA per SM (issue 24; H200, 2026-12-01, commit
// ab138da: Qwen2.5-7B and the G 16 shape dense at 0.46-0.57 of the read ceiling at 1 CTA per SM,
// whose 4 warps of 2-stage rings hold 32 KiB in flight). attention_kernel's NS: ATT_STAGES, or
// (QP_TUNE stages=N) one of these, built at these head dims and tiles only, page size at launch:
// 4 caches x 3 tiles x 2 = 24 builds more.
// 6 stages of 8 KiB x 4 warps = 192 KiB of ring: 1 CTA per SM, with the 20 KiB of static combine
// arrays of the measured tile 8 under the 227 KiB a CTA may take.
constexpr int ATT_DEEP_STAGES[] = {4, 6};
constexpr int ATT_DEEP_HEAD_DIMS[] = {128};
constexpr int ATT_DEEP_GROUPS[] = {4, 8, 16};

// attention.cu over token-major pages (NHD: [N, S, Hkv, d], the blocks of transformers' and
// vLLM's paged caches, read in place): built for 16-bit caches at these head dims, every tile,
// the tile's own ring, the page size at launch (backends/variants.py, layout_problem).
constexpr int ATT_NHD_HEAD_DIMS[] = {64, 128};

// Position of G in QP_GROUPS, -1 when G is not built (used in constant expressions only).
__host__ __device__ constexpr int group_index(int g) {
  for (int i = 0; i < int(sizeof(QP_GROUPS) / sizeof(QP_GROUPS[0])); ++i)
    if (QP_GROUPS[i] == g) return i;
  return -1;
}

// Whether `value` is in `table` (constant expressions: measured_variant, the instantiation).
template <int N>
__host__ __device__ constexpr bool qp_contains(const int (&table)[N], int value) {
  for (int i = 0; i < N; ++i)
    if (table[i] == value) return true;
  return false;
}

// c boxes per page built for head dim d (QP_BOXES, QP_BOX_HEAD_DIMS; c 1 everywhere).
__host__ __device__ constexpr bool boxes_built(int d, int c) {
  int lanes = 1;
  while (lanes < d / 8) lanes *= 2;  // row_lanes (common.cuh), which includes this file
  return c == 1 || (qp_contains(QP_BOXES, c) && qp_contains(QP_BOX_HEAD_DIMS, d) &&
                    lanes * c <= 32);
}

// An attention variant timed on the H200 (QP_MEASURED_*).
__host__ __device__ constexpr bool measured_variant(int d, int g) {
  return qp_contains(QP_MEASURED_HEAD_DIMS, d) && qp_contains(QP_MEASURED_GROUPS, g);
}
