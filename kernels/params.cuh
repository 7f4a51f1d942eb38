// What each kernel is launched with: one struct, passed by value (FlashInfer's params structs).
// PagedCache is the paged cache as every kernel reads it (core.layout.PagedKV); each kernel's
// params hold it and what that launch adds. The host builds them once per launch as NumPy
// structured scalars of the same layout (questprof/backends/params.py); tests/test_params.py
// compares every field's offset and every struct's size with what nvcc lays out here.
// Pointers the launch does not use are null; a field's comment says when.
#pragma once
#include "common.cuh"

struct PagedCache {
  const void* k;              // [N, Hkv, S, d] of the cache's storage (keys()): 16-bit or E4M3
  const void* v;              // [N, Hkv, S, d], as k
  const int* indptr;          // [B + 1]: request b's pages are indices[indptr[b] .. indptr[b + 1])
  const int* indices;         // [nnz]: physical page ids
  const int* last_page_len;   // [B]: valid slots of each request's last page
  const float* k_scale;       // [Hkv]: an E4M3 cache's scales (null for 16-bit caches)
  const float* v_scale;       // [Hkv], as k_scale
  int batch, kv_heads, page_size;
  int page_shift;             // log2(page_size)

  template <typename KV> QP_DEVICE const word_t<KV>* keys() const {
    return static_cast<const word_t<KV>*>(k);
  }
  template <typename KV> QP_DEVICE const word_t<KV>* values() const {
    return static_cast<const word_t<KV>*>(v);
  }
};

// summary.cu: one CTA per plan entry (page_ids[i], slots [first[i], end[i])).
struct SummaryParams {
  PagedCache cache;
  void* summ;                 // [N, Hkv, (boxes,) 2, d] summaries of the kernel's storage
  const float* summ_scale;    // [Hkv]: E4M3 summaries' scale over a 16-bit cache (else null)
  const int* page_ids;
  const int* first;
  const int* end;
};

// estimate.cu: scores [Hs, nnz] of summaries summ under queries q (q is the kernel's second
// argument, a __restrict__ pointer: estimate.cu says why).
struct EstimateParams {
  PagedCache cache;
  const void* summ;           // [N, Hkv, (boxes,) 2, d]
  const float* summ_scale;    // [Hkv]: E4M3 summaries' scale (else null)
  float* scores;              // [Hs, nnz]
  int nnz, group, mode;
  int box_tokens;             // tokens of a box (page_size / boxes)
};

// topk.cu: per (request, score head) the K best pages of scores [Hs, nnz].
struct TopkParams {
  PagedCache cache;
  const float* scores;
  int* sel;                   // [Hs, B, K]
  int* count;                 // [B], or [Hs, B] for a dynamic rule
  int nnz, k_pages, sinks, window;
  int cached;                 // keys kept in shared memory
  int rule;                   // RULE_* of topk.cuh
  double param, scaling;      // the rule's parameter; the logits' scaling of the bounds
};

// gather.cu: each KV head's chosen pages (sel [Hkv, B, K], shared modes) of the cache's pool into a
// staging pool of B x K slots, [B * K, Hkv, page_words] 16-byte words each of K and V.
struct GatherParams {
  PagedCache cache;           // the pool the pages come from (k, v, indptr, indices, batch, kv_heads)
  void* k_out;                // [B * K, Hkv, page_words]: slot b * K + j holds page sel[h][b][j]
  void* v_out;
  const int* sel;             // [Hkv, B, K] page positions within each request, -1 padded
  int k_pages;
  int page_words;             // S * d * bytes / 16
};

// page_cache.cu: both launches of the HBM page cache's step (page_cache_step, page_cache_fill).
// Tables per (request, KV head) row = h * B + b; slot s of row (b, h) is [b * C + s][h] of the slots.
struct PageCacheParams {
  PagedCache cache;           // the host tier's pool: k, v in mapped host memory, page tables
  void* k_slots;              // [B * C, Hkv, page_words] the cache's K pages in HBM
  void* v_slots;              // [B * C, Hkv, page_words]
  const int* sel;             // [steps, Hkv, B, K] each step's positions, ascending, -1 padded
  int* slot_sel;              // [Hkv, B, K] out: the step's chosen slots (-1 where sel is)
  int* slot_page;             // [Hkv, B, C] the position each slot holds, -1 free
  int* slot_stamp;            // [Hkv, B, C] the step that last chose it
  int* resident;              // [Hkv, nnz] the slot of each page position, -1 none
  int* clock;                 // [Hkv, B] steps run; step t reads sel[(t - 1) % steps]
  int* fetch;                 // [Hkv, B, K] out: positions of the step's misses
  int* fetch_slot;            // [Hkv, B, K] out: their slots
  int* step_counts;           // [Hkv, B, 2] out: the step's hits and misses
  long long* total_counts;    // [Hkv, B, 2] hits and misses since the host last zeroed them
  int steps, k_pages, capacity, nnz;
  int page_words;             // S * d * bytes / 16
};

// attention.cu: out [B, Hq, d] and lse [B, Hq] over all pages (sel null) or a selection.
struct AttentionParams {
  PagedCache cache;
  const uint16_t* q;          // [B, Hq, d]
  const int* sel;             // [Hs, B, k_sel] positions, or null (dense)
  const int* count;           // [B] or [Hs, B] (count_per_head)
  uint16_t* out;
  float* lse;
  float* ws_o;                // [rows, splits, G, d] partials (null with one split)
  float* ws_lse;              // [rows, splits, G]
  int* row_done;              // [rows] splits done, 0 between launches
  int q_heads, chunks, chunk_size, sel_per_q, k_sel, count_per_head, pages_per_split;
  int merge;                  // 1: the wide merge of the splits
  float scale_log2;           // log2(e) / sqrt(d)
};
