// Gather: the chosen pages of a paged K/V pool copied into a staging pool in HBM, for attention
// to read there (questprof/backends/host_tier.py). The pool may live in mapped pinned host
// memory: then every load below crosses the host link, and the copy runs at the link's pace.
//
// Layouts (HND, any storage type: pages move as 16-byte words), p: GatherParams (params.cuh):
//   cache.k, cache.v  [N, Hkv, page_words]      page_words = S * d * bytes / 16
//   k_out, v_out      [B * K, Hkv, page_words]  slot b * K + j of KV head h holds page sel[h][b][j]
//   sel               [Hkv, B, K] page positions within each request, ascending, -1 padded (the
//                     shared modes' one selection per KV head)
// One block per (slot, KV head); K and V words are loaded before either is stored, so each
// thread keeps two 16-byte reads in flight over the link.
#include "params.cuh"

extern "C" __global__ void gather_pages(const GatherParams p) {
  const PagedCache& c = p.cache;
  const uint4* __restrict__ k = static_cast<const uint4*>(c.k);
  const uint4* __restrict__ v = static_cast<const uint4*>(c.v);
  uint4* __restrict__ k_out = static_cast<uint4*>(p.k_out);
  uint4* __restrict__ v_out = static_cast<uint4*>(p.v_out);
  const int slot = blockIdx.x;
  const int h = blockIdx.y;
  const int b = slot / p.k_pages;
  const int j = slot - b * p.k_pages;
  const int pos = p.sel[((long long)h * c.batch + b) * p.k_pages + j];
  if (pos < 0) return;  // a request of fewer than K pages: its slot stays unused
  const long long page = c.indices[c.indptr[b] + pos];
  const long long src = (page * c.kv_heads + h) * p.page_words;
  const long long dst = ((long long)slot * c.kv_heads + h) * p.page_words;
  for (int i = threadIdx.x; i < p.page_words; i += blockDim.x) {
    const uint4 a = k[src + i];
    const uint4 w = v[src + i];
    k_out[dst + i] = a;
    v_out[dst + i] = w;
  }
}
