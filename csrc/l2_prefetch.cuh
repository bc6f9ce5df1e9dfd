// L2_PREFETCH task (MK_CHAIN_L2 = T gate_up M-tiles a task, an A/B experiment; 0 = compiled out, and the program has
// no such task): run by the consumers of an SM with no task on the layer's qkv_rope -> attention -> o_proj chain, once
// down(l-1) is done. It asks L2 for whole rows of the layer's gate_up tasks' M-tiles CHAIN_L2_FROM .. + T - 1 (their
// first pass), which those SMs' tiled copies (MK_W_TMA) then read at L2's rate (mk_plugin/persistent/prefetch.py: why,
// which SMs, and prefetch_ranges, this function's Python mirror). A prefetch writes nothing and completes on nothing;
// the task signals nothing, so no release fence of an SM on the chain waits for it.
#pragma once
#include "matvec.cuh"

namespace mk {

#if MK_CHAIN_L2
// prefetch.CHAIN_L2_FROM (tests/test_chain_l2.py checks the two agree): the tables' gate_ahead 2 issues M-tiles 0, 1
constexpr int CHAIN_L2_FROM = 2;

// cp.async.bulk.prefetch.L2: `bytes` (a multiple of 16) from a 16-byte aligned global address into L2.
__device__ __forceinline__ void prefetch_l2(const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// Gate_up tasks j0 .. j0 + jn - 1 of the layer's `parts` (tasks.split_units(0, I / UNIT, parts) order): per task and
// M-tile, one prefetch of the tile's 16 whole rows (16 x K elements, contiguous), spread over the consumer threads.
__device__ __forceinline__ void l2_prefetch_task(const Params& P, const Task& t) {
  WeightPlan wp;
  if (!weight_plan(P, OP_GATE_UP, t.layer, wp)) return;
  const int j0 = t.arg0, jn = t.arg1, parts = t.arg2;
  constexpr int units = I / UNIT;
  const int base = units / parts, extra = units % parts;
  const int upp = (ACC_TILES / batch_ntiles(P.batch)) / 2;   // units of a pass (WeightPlan.mtpu = 2)
  const unsigned tile_bytes = (unsigned)(UNIT * wp.K * (int)sizeof(elem_t));
  for (int i = threadIdx.x; i < jn * MK_CHAIN_L2; i += CONSUMER_THREADS) {
    const int j = j0 + i / MK_CHAIN_L2, m = CHAIN_L2_FROM + i % MK_CHAIN_L2;
    const int s = j * base + min(j, extra), n = base + (j < extra ? 1 : 0);
    if (m >= min(upp, n) * 2) continue;
    prefetch_l2(wp.w + (size_t)weight_row(OP_GATE_UP, s, m * 16) * wp.K, tile_bytes);
  }
}
#endif

}  // namespace mk
