// L2_PREFETCH task (MK_CHAIN_PREFETCH=<KB per gate_up task>, an A/B experiment; 0 = compiled out): run by
// the consumers of an SM with no task on the layer's qkv -> attention -> o_proj chain, once down(l-1) is
// done. It asks L2 for the gate_up weight rows that the other SMs' rings will not hold when gate_up
// becomes ready, so their later bulk copies hit L2 (mk_plugin/persistent/prefetch.py: why, and which
// SMs; prefetch_ranges is this function's Python mirror). A prefetch writes nothing and completes on
// nothing; the task signals nothing, so no release fence of this SM waits for it.
#pragma once
#include "matvec.cuh"

namespace mk {

#if MK_CHAIN_PREFETCH
// cp.async.bulk.prefetch.L2: `bytes` (multiple of 16) from a 16-byte aligned global address into L2.
__device__ __forceinline__ void prefetch_l2(const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// Units of a gate_up task of n units whose chunks the ring holds when it starts: those touched by the
// producer's first NUM_STAGES chunks (producer_loop's order: passes of upp units; k0; M-tile).
__device__ __forceinline__ int ring_units(int n, int nt) {
  const int upp = (ACC_TILES / nt) / 2, kc = chunk_cols_for(nt), kch = (H + kc - 1) / kc;
  int c = NUM_STAGES, touched = 0;
  for (int p = 0; p < n && c > 0; p += upp) {
    const int mt = min(upp, n - p) * 2;
    touched = p + (min(c, mt) + 1) / 2;
    c -= mt * kch;
  }
  return min(touched, n);
}

// Tasks j0 .. j0 + jn - 1 of the layer's `parts` gate_up tasks (tasks.split_units); per task and matrix
// (gate rows, up rows) the units past ring_units first, then the held ones, MK_CHAIN_PREFETCH KB per task
// in all: one prefetch per (task, matrix, part), spread over the consumer threads.
__device__ __forceinline__ void l2_prefetch_task(const Params& P, const Task& t) {
  const int j0 = t.arg0, jn = t.arg1, parts = t.arg2;
  const int base = (I / UNIT) / parts, extra = (I / UNIT) % parts;
  const size_t row_bytes = (size_t)H * sizeof(elem_t), half = (size_t)MK_CHAIN_PREFETCH * 512;
  const char* w = reinterpret_cast<const char*>(weight_ptr(P, t.layer, LP_GATE_UP));
  for (int i = threadIdx.x; i < 4 * jn; i += CONSUMER_THREADS) {
    const int j = j0 + i % jn, up = (i / jn) & 1, wrapped = i / (2 * jn);
    const int s = j * base + min(j, extra), n = base + (j < extra ? 1 : 0);
    const int skip = ring_units(n, batch_ntiles(P.batch));
    const size_t first = (size_t)(n - skip) * UNIT * row_bytes;
    const int lo = wrapped ? s : s + skip;
    const size_t size = wrapped ? min(half > first ? half - first : 0, (size_t)skip * UNIT * row_bytes) : min(half, first);
    if (size > 0) prefetch_l2(w + ((size_t)(up ? I : 0) + (size_t)lo * UNIT) * row_bytes, (unsigned)size);
  }
}
#endif

}  // namespace mk
