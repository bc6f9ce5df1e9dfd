// MK_ACT_LL: gate_up hands ACT to down as flagged 8-byte words instead of a counter.
//
// Word (b, c) of the launch's act_ll array (in the counters allocation, zeroed with the counters each step)
// holds ACT[b, 2c], ACT[b, 2c + 1] in its low 32 bits (lower column in the low half) and layer + 1 in its high
// 32 bits. A gate_up task stores the words of its columns with one relaxed 8-byte store each (single-copy
// atomic: a reader sees the values and the flag of one store together), so it needs no release, and its fence
// (which waits for the SM's in-flight weight copies) and the release gate after it go; a down task's staging
// polls the words it reads until each carries its layer's flag, which is its dependency wait and its
// activation load in one round trip. The plain ACT stores stay (the VM comparisons, the bisection buffers).
// Ordering beyond ACT: down's other inputs (RESID, written by o_proj) were released by o_proj before any
// gate_up of the layer started and are read through L2 (ld.global.cg), as every in-launch buffer is.
// Used only where encoding's act_ll_eligible holds (down uncut over K, ACT staged whole, its gate_up in the
// same launch) and the same predicate holds in the kernel (act_ll_on), on both sides of the hand-off.
#pragma once
#include "common.cuh"

namespace mk {

__device__ __forceinline__ unsigned act_ll_flag(int layer) { return (unsigned)layer + 1u; }

__device__ __forceinline__ void st_relaxed_gpu_u64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Two words (four columns) in one 16-byte load; each 8-byte element is a single-copy-atomic access.
__device__ __forceinline__ void ld_relaxed_gpu_u64x2(const unsigned long long* p, unsigned long long& a,
                                                     unsigned long long& b) {
  asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

// Whether task t of this launch hands ACT over (gate_up) or takes it (down) through the words: the same
// test on both sides, so a gate_up skips its release exactly when its readers skip their wait.
__device__ __forceinline__ bool act_ll_task(const Params& P, const Task& t) {
  return MK_ACT_LL && P.act_ll != nullptr && (t.opcode == OP_GATE_UP || (t.opcode == OP_DOWN && t.arg2 == 0));
}

// gate_up's words for its accumulator tile (the lane layout of gate_up_epilogue: element e is column
// col0 + (lane >> 2) + 8 (e >> 1) of request nt * 8 + 2 (lane & 3) + (e & 1)); bits[e] are the stored ACT
// values. Lanes of even (lane >> 2) pair their column with the next one's (lane ^ 4). Called by the whole warp.
__device__ __forceinline__ void act_ll_store(const Params& P, int layer, int col0, int nt, int lane,
                                             const unsigned (&bits)[4]) {
  const unsigned long long flag = (unsigned long long)act_ll_flag(layer) << 32;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const unsigned hi = __shfl_xor_sync(0xffffffffu, bits[e], 4);
    const int b = nt * 8 + (lane & 3) * 2 + (e & 1);
    const int col = col0 + (lane >> 2) + (e >> 1) * 8;
    if (((lane >> 2) & 1) == 0 && b < P.batch)
      st_relaxed_gpu_u64(P.act_ll + ((size_t)b * I + col) / 2, flag | (bits[e] & 0xFFFFu) | (hi << 16));
  }
}

// down's staging (stage_x's layout: rows of K * 2 + 16 bytes, K = I): poll every word until it carries
// the layer's flag, then store its two values. A thread's U loads of a round are in flight together, and
// so are its reloads of the stale ones (back to back first, then with a short sleep), until the budget runs
// out: then the failure is recorded, the CTA's abort flag set (the consumers leave at the next task
// boundary) and the staging finishes on whatever was read. Ends with consumer_sync().
__device__ __forceinline__ bool act_ll_fresh(unsigned long long a, unsigned long long c, unsigned flag) {
  return (unsigned)(a >> 32) == flag && (unsigned)(c >> 32) == flag;
}

__device__ __forceinline__ void stage_x_ll(const Smem& S, const Params& P, unsigned char* xs, int layer, int B) {
  constexpr int WPR = I / 4;   // 16-byte loads per row (four columns)
  constexpr int ROWB = I * 2 + 16;
  constexpr int U = 8;
  const unsigned flag = act_ll_flag(layer);
  const int total = B * WPR;
  for (int base = threadIdx.x; base < total; base += U * CONSUMER_THREADS) {
    unsigned long long a[U], c[U];
    unsigned stale = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int idx = base + u * CONSUMER_THREADS;
      a[u] = c[u] = (unsigned long long)flag << 32;
      if (idx < total) ld_relaxed_gpu_u64x2(P.act_ll + 2 * (size_t)idx, a[u], c[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) stale |= act_ll_fresh(a[u], c[u], flag) ? 0u : 1u << u;
    if (stale) {
      const unsigned long long t0 = global_ns();
      for (unsigned polls = 1; stale; ++polls) {
        if (polls > (MK_ACT_LL == 3 ? 0u : 64u)) __nanosleep(128);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if ((stale >> u) & 1u) ld_relaxed_gpu_u64x2(P.act_ll + 2 * (size_t)(base + u * CONSUMER_THREADS), a[u], c[u]);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (act_ll_fresh(a[u], c[u], flag)) stale &= ~(1u << u);
        if (stale && (polls & 15) == 0) {
          const unsigned long long waited = global_ns() - t0;
          int fail = ld_relaxed_gpu_s32(P.err) != 0;   // a wait elsewhere failed: nothing here can finish
          if (!fail && waited > P.budget_ns) {
            int seen = 0;   // the flag of a stale word (unrolled: a runtime index would put a[] in local memory)
#pragma unroll
            for (int u = U - 1; u >= 0; --u)
              if ((stale >> u) & 1u) seen = (int)((unsigned)(a[u] >> 32) != flag ? a[u] >> 32 : c[u] >> 32);
            watchdog_record(P, ERR_ACT_TIMEOUT, *S.cur_task(), -1, (int)flag, seen, waited);
            fail = 1;
          }
          if (fail) {
            *S.abort_flag() = 1;
            break;
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int idx = base + u * CONSUMER_THREADS;
      if (idx >= total) continue;
      const int b = idx / WPR, kv = idx - b * WPR;
      *reinterpret_cast<uint2*>(xs + (size_t)b * ROWB + kv * 8) = make_uint2((unsigned)a[u], (unsigned)c[u]);
    }
  }
  consumer_sync();
}

}  // namespace mk
