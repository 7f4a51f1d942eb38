// The Quest step (docs/QUEST.md stages 2-4: estimate -> top-K -> sparse attention) as one
// persistent kernel, so that the selection of early rows overlaps the estimate of later rows, and
// the attention of early rows overlaps the selection of later ones. In three kernels (even with
// programmatic dependent launch) every row's scores complete when the estimate ends, top-K then
// runs with memory idle and attention ramps up after it: 32 us at 32K MHA batch 1 on an H200,
// against 17.6 us for a plain cold read of the same 64 MiB (notes/KERNELS.md).
//
// One resident wave (PS_CTAS_PER_SM CTAs of PS_THREADS per SM; quest_step.cuh's QS_* options
// change both):
//   the estimate: every CTA but the first `queue_ctas` scores a static share of it, estimate.cuh's
//     persistent loop over head-major tiles grid-stride across those CTAs (so KV head 0's rows
//     complete first, then head 1's, ...), into the scores a three-kernel step writes (the same
//     bits); each score is stored where select tickets poll it, with no fence or count;
//   then a queue of tickets taken in order with one atomic counter:
//   select tickets, one per (q head, request), KV head by KV head: the CTA loads the row's scores
//     as they arrive (polling each until it is no longer PS_UNSCORED), selects with topk.cuh's
//     select_row (the same selection as topk.cu, ties included), puts PS_UNSCORED back and sets
//     the row's ready flag (release). The first queue_ctas CTAs take them while the estimate runs;
//   attention tickets, (row, split) in the same row order, about att_waves per CTA: the CTA waits
//     for the row's flag, takes its next ticket, runs the split's pages with attention_tile.cuh's
//     CUDA-core tile (four warps, cp.async rings of PS_STAGES stages) and writes a partial (o,
//     lse); the row's last split merges (as attention.cu). In a CTA of more than four warps the
//     others take the next ticket meanwhile and, when its row is selected, load its page ids
//     (32K B1 36.5 -> 31.1 us on an H200, 2026-12-01).
// Deadlock: the estimate shares never wait; a select ticket waits only on them, an attention
// ticket only on a select ticket taken before it, whose CTA runs it without waiting on anything
// later; so any grid of at most one resident wave is safe (tests force 1 and 3 CTAs). A CTA
// takes its next ticket only after its wait: waiting while holding a later ticket would chain
// the waits (2026-12-01: a step of 105 us against 38 at 32K). Waits trap after 2^26 polls
// instead of hanging the GPU. The launch's `stop` runs only the estimate (and select) tickets,
// and `trace` records a timeline: tools/quest_step_probe.py times and traces the phases.
//
// State (flags, counts, the ticket) lives in a buffer that the launcher zeroes once, the scores in
// one it fills with PS_UNSCORED once: the merging split resets its count, each select ticket its
// row of scores, and the last CTA to finish the rest, so CUDA-graph replays need no memset. Built
// for 16-bit caches at PS_HEAD_DIMS and per-head selection (any mode for one q head per KV head),
// the estimate's tile G of PS_GROUPS; attention runs each q head as its own row (tile 1), as the
// three-kernel step runs per-head selections. Other shapes take three kernels.
#include "quest_step.cuh"

// grid: one resident wave at most (any size of it works); block QS_THREADS; dynamic shared memory
// ps_ring_bytes<T, D>(). state as Step says, zero at launch and zero again at the end; scores
// [Hq, nnz] PS_UNSCORED at launch and at the end (stop PS_STOP_ESTIMATE: scores written); ws_o
// [Hq B, splits, D] and ws_lse [Hq B, splits] when splits > 1; trace nullptr or Trace's words.
template <typename T, int D, int G>
__global__ void __launch_bounds__(PS_NT, QS_CTAS)
quest_step_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ summ,
                  const uint16_t* __restrict__ k, const uint16_t* __restrict__ v,
                  const int* __restrict__ indptr, const int* __restrict__ indices,
                  const int* __restrict__ last_len, float* scores, int* sel,
                  int* __restrict__ count, uint16_t* __restrict__ out, float* __restrict__ lse,
                  float* ws_o, float* ws_lse, int* state, int batch, int q_heads, int kv_heads,
                  int nnz, int k_pages, int sinks, int window, int splits, int split_pages,
                  int page_shift, float scale_log2, int stop, int queue_ctas,
                  unsigned long long* trace) {
  static_assert(ps_ring_bytes<T, D>() >= PS_KEYS_AT * 16 + 1024, "room for top-K's keys");
  static_assert(QS_CTAS * (ps_ring_bytes<T, D>() + 3 * 1024) <= 228 * 1024,
                "QS_CTAS CTAs fit an H200 SM's shared memory");
  extern __shared__ __align__(128) uint4 ps_smem[];
  __shared__ AttPages s_att;
  __shared__ int s_slot, s_last;
  __shared__ float s_m[ATT_WARPS], s_l[ATT_WARPS];
  grid_wait();     // the grid before may still write q, the summaries or the state
  grid_release();  // the next grid's CTAs find room only as this one's leave
  Step s{q, summ, k, v, indptr, indices, last_len, scores, sel, count, out, lse, ws_o, ws_lse,
         state, batch, q_heads, kv_heads, q_heads / kv_heads, nnz, k_pages, sinks, window, splits,
         split_pages, page_shift, scale_log2, stop, queue_ctas, {trace}};
  s.plan();
  constexpr int KEYS_CAP = (ps_ring_bytes<T, D>() - PS_KEYS_AT * 16) / 4;
  const Trace& tr = s.trace;
  tr.cta(0);
  if ((int)blockIdx.x >= s.queue_ctas) estimate_share<T, D, G>(s);
  tr.cta(1);
  int t = take_ticket(s, &s_slot);
  for (; t < s.selects; t = take_ticket(s, &s_slot)) {  // block-uniform
    tr.ticket(t, 0, threadIdx.x == 0);
    select_item<PS_NT>(s, t, ps_smem, KEYS_CAP);
    tr.ticket(t, 2, threadIdx.x == 0);
  }
  int cur = 0;  // the buffer of s_att holding the running ticket's pages
  bool have = false;
  while (t < s.total) {  // attention, block-uniform; the next ticket is taken after the wait
    tr.ticket(t, 0, threadIdx.x == 0);
    attend_item<T, D>(s, t - s.selects, have, s_att, cur, ps_smem, s_m, s_l, &s_last);
    tr.ticket(t, 2, threadIdx.x == 0);
    t = s_att.next;
    have = s_att.next_ready;
    cur ^= have;  // a prefetched ticket's pages are in the other buffer
    __syncthreads();  // every thread has read next before the next ticket rewrites it
  }
  tr.cta(2);
  // The last CTA to finish resets the ticket, the counts and the flags for the next launch.
  if (threadIdx.x == 0) s_last = add_acq_rel(state + 1, 1) == (int)gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;
  for (int i = threadIdx.x; i < q_heads * batch; i += PS_NT) *s.ready(i) = 0;
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
