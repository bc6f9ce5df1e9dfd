// Hopper's warpgroup MMA (wgmma.mma_async) as the A/B switch MK_WGMMA_A uses it (matvec_wgmma_a.cuh): both operands
// read from shared memory by descriptor, D in registers, one warpgroup (4 warps) per instruction. Compiled out of
// builds without it.
//
// A call or a divergent branch between a wgmma and the wait_group that retires it makes ptxas serialise every
// wgmma of the function (info line C7510 / C7520: tests/test_csrc_compile.py fails on it), so the callers inline
// their chunk loops into mk_decode and keep the waits on warpgroup-uniform paths.
#pragma once
#include "common.cuh"

namespace mk {

#if MK_WGMMA_A
// Generic-proxy shared-memory writes (st.shared, cp.async) before the wgmmas' async-proxy reads of them: each
// writer fences its own writes, then a barrier.
__device__ __forceinline__ void wg_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Before a warpgroup's first wgmma on accumulator registers that other instructions wrote.
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Until at most N of this warpgroup's commit groups are still in flight (their shared-memory reads done).
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Shared-memory matrix descriptor, K-major, with the 128-byte swizzle: 8-row atoms of 8 x 128 bytes 1024 apart (the
// tensor map's SWIZZLE_128B layout), the start advanced 32 bytes per k-step inside an atom's 128-byte lines.
__device__ __forceinline__ unsigned long long wg_desc_sw128(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}

// D[64 x 16] += A[64 x 16] B[16 x 16]^T (both K-major), fp32 accumulators: warp w % 4 of the warpgroup holds rows
// 16 (w % 4) + lane / 4 (+ 8), n-tile j's columns 8 j + 2 (lane % 4) (+ 1) in d[4 j .. 4 j + 3], the mma.m16n8
// accumulator layout per n-tile.
__device__ __forceinline__ void wg_mma_m64n16(float (&d)[8], unsigned long long da, unsigned long long db) {
#if MK_DTYPE_BF16
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, "
               "p, 1, 1, 0, 0;\n\t}"
#else
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, "
               "p, 1, 1, 0, 0;\n\t}"
#endif
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "l"(da), "l"(db));
}

// After a chunk's wgmmas: commit them as one group, wait until the previous chunk's group has read its slot and free
// that slot (pok: this thread's wait for it succeeded), then remember this chunk's. Not OK (this CTA is stopping): a
// slot whose copy may still be landing is never freed. The loop's last slot: wg_chunks_drained.
__device__ __forceinline__ void wg_chunk_issued(const Smem& S, int slot, int ws, int& prev, bool& pok) {
  wg_commit();
  wg_wait<1>();
  if (prev >= 0 && pok) mbar_arrive(S.empty_bar(prev));
  prev = slot;
  pok = ws == WAIT_OK;
}
// Every group of the loop has completed (its shared-memory reads done); the last chunk's slot freed.
__device__ __forceinline__ void wg_chunks_drained(const Smem& S, int prev, bool pok) {
  wg_wait<0>();
  if (prev >= 0 && pok) mbar_arrive(S.empty_bar(prev));
}

// A ring slot's full-barrier wait for a wgmma chunk loop: ring_wait's slow path inline (watchdog_record is a call, and
// no wgmma group may be in flight across a call), a timeout stopping the CTA at once and recorded by wg_record after
// the loop's last wait_group. Not OK (this CTA is stopping): the caller computes on whatever the slot holds and never
// frees it (its copy may still be landing).
struct WgTimeout {
  unsigned chunk = ~0u;   // the chunk whose wait timed out (its slot: chunk % NUM_STAGES), ~0: none
};
__device__ __forceinline__ int wg_slot_wait(const Smem& S, const Params& P, int slot, unsigned it, WgTimeout& to) {
  int ws = WAIT_OK;
  if (!mbar_try_wait(S.full_bar(slot), (it / NUM_STAGES) & 1)) {
    unsigned long long waited = 0;
    ws = mbar_wait_slow(S.full_bar(slot), (it / NUM_STAGES) & 1, S.abort_flag(), P.budget_ns, waited);
    if (ws == WAIT_TIMEOUT) {
      to.chunk = it;
      *S.abort_flag() = 1;
    }
  }
  return ws;
}
// As ring_wait records a timeout (once no wgmma group is in flight), but with the budget as the time waited (the wait
// gave up after it; the measured figure, a few polls more, would hold a 64-bit register across the chunk loop).
__device__ __forceinline__ void wg_record(const Smem& S, const Params& P, WgTimeout& to) {
  if (to.chunk != ~0u) {
    watchdog_record(P, ERR_MBAR_TIMEOUT, *S.cur_task(), MBAR_TAG_FULL + (int)(to.chunk % NUM_STAGES),
                    (int)((to.chunk / NUM_STAGES) & 1), (int)to.chunk, P.budget_ns);
    to.chunk = ~0u;
  }
}
#endif

}  // namespace mk
