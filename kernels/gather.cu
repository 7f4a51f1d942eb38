// Gather: the chosen pages of a paged K/V pool copied into a staging pool in HBM, for attention
// to read there (questprof/backends/host_tier.py). The pool may live in mapped pinned host
// memory: then every load below crosses the host link, and the copy runs at the link's pace.
//
// Layouts (HND, any storage type: pages move as 16-byte words):
//   k, v       [N, Hkv, page_words]      page_words = S * d * bytes / 16
//   k_out, v_out [B * K, Hkv, page_words] slot b * K + j of KV head h holds page sel[h][b][j]
//   sel        [Hkv, B, K] page positions within each request, ascending, -1 padded (the
//              shared modes' one selection per KV head)
// One block per (slot, KV head); K and V words are loaded before either is stored, so each
// thread keeps two 16-byte reads in flight over the link.

extern "C" __global__ void gather_pages(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                        uint4* __restrict__ k_out, uint4* __restrict__ v_out,
                                        const int* __restrict__ sel,
                                        const int* __restrict__ kv_indptr,
                                        const int* __restrict__ kv_indices, int batch,
                                        int k_pages, int kv_heads, int page_words) {
    const int slot = blockIdx.x;
    const int h = blockIdx.y;
    const int b = slot / k_pages;
    const int j = slot - b * k_pages;
    const int pos = sel[((long long)h * batch + b) * k_pages + j];
    if (pos < 0) return;  // a request of fewer than K pages: its slot stays unused
    const long long page = kv_indices[kv_indptr[b] + pos];
    const long long src = (page * kv_heads + h) * page_words;
    const long long dst = ((long long)slot * kv_heads + h) * page_words;
    for (int i = threadIdx.x; i < page_words; i += blockDim.x) {
        const uint4 a = k[src + i];
        const uint4 c = v[src + i];
        k_out[dst + i] = a;
        v_out[dst + i] = c;
    }
}
