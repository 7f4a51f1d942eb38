// The Quest step (docs/QUEST.md stages 2-4: estimate -> top-K -> sparse attention) as one
// persistent kernel, so that the selection of early rows overlaps the estimate of later rows, and
// the attention of early rows overlaps the selection of later ones. In three kernels (even with
// programmatic dependent launch) every row's scores complete when the estimate ends, top-K then
// runs with memory idle and attention ramps up after it: 32 us at 32K MHA batch 1 on an H200,
// against 17.6 us for a plain cold read of the same 64 MiB (notes/KERNELS.md).
//
// One resident wave (PS_CTAS_PER_SM CTAs of PS_THREADS per SM; the QS_* build options of
// quest_step.cuh change both) takes tickets of one work queue in order with an atomic counter
// (kernels/quest_step.cuh, Step):
//   estimate tickets: PS_EST_TILES tiles of (page, KV head) units of one block of QS_HEAD_BLOCK KV
//     heads (default 1: head-major, the units of KV head 0 for every request, then head 1, ...),
//     scored with estimate.cuh's device code into the scores a three-kernel step writes (the same
//     bits); the CTA publishes them (fence) and adds the units to a per-(block, request) count;
//   select tickets, after each block's estimate tickets: one per (q head of that block,
//     request); the CTA waits for the count to reach the request's units, selects the row with
//     topk.cuh's select_row (the same selection as topk.cu, ties included) and sets the row's ready
//     flag (release);
//   attention tickets, after every estimate and select ticket: (q head row, split) in the order
//     the rows are selected; the CTA waits for the row's flag (acquire), runs the split's pages
//     with attention_tile.cuh's CUDA-core tile (four warps, cp.async rings of PS_STAGES stages)
//     and writes a partial (o, lse); the row's last split merges (as attention.cu).
// Deadlock: a ticket only waits on tickets before it, whose CTAs hold them, run, and never wait on
// a later ticket; so any grid size is safe (tests force 1 and 3 CTAs). A CTA takes estimate
// tickets three ahead (their atomics and loads in flight), but no ticket while it selects or
// waits: a held ticket of a later row would wait out the selection (rows would complete a
// selection apart). Waits trap after 2^26 polls instead of hanging the GPU.
// The launch's `stop` runs only the estimate (and select) tickets: tests/quest_step_probe.py
// times the phases of each build that way (at 36da913 the step took 53.6 / 146.5 us at 32K / 128K
// B1 on an H200 against 31.9 / 67.5 for three kernels, estimate alone 11.4 / 35.1).
//
// State (counts, flags, the ticket) lives in a buffer that the launcher zeroes once: the merging
// split resets its count, and the last CTA to finish resets the rest, so CUDA-graph replays need
// no memset. Built for 16-bit caches at PS_HEAD_DIMS and per-head selection (any mode for one q
// head per KV head), the estimate's tile G of PS_GROUPS; attention runs each q head as its own row
// (tile 1), as the three-kernel step runs per-head selections. Other shapes take three kernels.
#include "quest_step.cuh"

// grid: one resident wave at most (any size works); block QS_THREADS; dynamic shared memory
// ps_ring_bytes<T, D>(). state as Step says, zero at launch and zero again at the end; ws_o
// [Hq B, splits, D] and ws_lse [Hq B, splits] when splits > 1.
template <typename T, int D, int G>
__global__ void __launch_bounds__(PS_NT, QS_CTAS)
quest_step_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ summ,
                  const uint16_t* __restrict__ k, const uint16_t* __restrict__ v,
                  const int* __restrict__ indptr, const int* __restrict__ indices,
                  const int* __restrict__ last_len, float* scores, int* sel,
                  int* __restrict__ count, uint16_t* __restrict__ out, float* __restrict__ lse,
                  float* ws_o, float* ws_lse, int* state, int batch, int q_heads, int kv_heads,
                  int nnz, int k_pages, int sinks, int window, int splits, int split_pages,
                  int page_shift, float scale_log2, int stop, int lag) {
  static_assert(ps_ring_bytes<T, D>() >= PS_KEYS_AT * 16 + 1024, "room for top-K's keys");
  static_assert(QS_CTAS * (ps_ring_bytes<T, D>() + 3 * 1024) <= 228 * 1024,
                "QS_CTAS CTAs fit an H200 SM's shared memory");
  extern __shared__ __align__(128) uint4 ps_smem[];
  __shared__ int s_page[PS_MAX_SPLIT_PAGES], s_valid[PS_MAX_SPLIT_PAGES];
  __shared__ int s_slot, s_fifo[2], s_last;
  __shared__ float s_m[ATT_WARPS], s_l[ATT_WARPS];
  grid_wait();     // the grid before may still write q, the summaries or the state
  grid_release();  // the next grid's CTAs find room only as this one's leave
  Step s{q, summ, k, v, indptr, indices, last_len, scores, sel, count, out, lse, ws_o, ws_lse,
         state, batch, q_heads, kv_heads, q_heads / kv_heads, nnz, k_pages, sinks, window, splits,
         split_pages, page_shift, scale_log2, stop, lag};
  s.plan<D>();
  constexpr int KEYS_CAP = (ps_ring_bytes<T, D>() - PS_KEYS_AT * 16) / 4;
  int t = take_ticket(s, &s_slot);
  while (t < s.total) {  // block-uniform
    const Item it = s.item(t);
    if (it.kind == PS_ESTIMATE) {
      t = estimate_run<T, D, G>(s, t, s_fifo, &s_slot);
    } else if (it.kind == PS_SELECT) {
      if (s.stop >= PS_STOP_SELECT) select_item<PS_NT>(s, it, ps_smem, KEYS_CAP);
      t = take_ticket(s, &s_slot);
    } else {  // attention: the next ticket's atomic runs meanwhile (taken after the wait)
      int next = 0;
      attend_item<T, D>(s, it.blk * s.att_seg + it.j, ps_smem, s_page, s_valid, s_m, s_l,
                        &s_last, next);
      if (threadIdx.x == 0) s_slot = next;
      __syncthreads();
      t = s_slot;
      __syncthreads();
    }
  }
  // The last CTA to finish resets the ticket, the counts and the flags for the next launch.
  if (threadIdx.x == 0) s_last = add_acq_rel(state + 1, 1) == (int)gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;
  for (int i = threadIdx.x; i < q_heads * batch; i += PS_NT) s.ready()[i] = 0;
  if (threadIdx.x == 0) state[0] = state[1] = 0;
}

#ifdef QP_INSTANTIATE_ALL  // CI compiles every variant (tests/test_kernels_compile.py)
#include "instantiate.cuh"
namespace qp_instantiate {
struct QuestStep {
  template <int T, int D, int G> static void run() {
    if constexpr (builds_head_dim(D)) (void)&quest_step_kernel<Tag<T>, D, G>;
  }
};
void quest_step_all() { Cross<QuestStep>::run<DTYPES, PS_HEAD_DIMS, PS_GROUPS>(); }
}  // namespace qp_instantiate
#endif
