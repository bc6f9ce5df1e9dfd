// MK_FMA_B1 (A/B switch, session 41; 0 = compiled out): the chunk loop of a batch-1 pass of at most FMA_B1_MT M-tiles
// on the CUDA cores. Same sum as the tensor-core loop, y[row] = sum_k W[row, k] * x'[k] (x' = x, or round(x * rstd *
// w) for norm-fused ops, as norm_pair rounds it), accumulated in fp32 from the exact bf16 products; only the order of
// the additions differs (fixed: bitwise repeatable).
//
// Why: at batch 1 the chain's tasks (qkv_rope, o_proj; down too) are one-M-tile passes whose weights are resident in
// the ring before their wait ends, and their chunks cost ~0.95 us each (phase traces, 1B b1) against ~0.44 us for the
// bare ldmatrix + mma.sync loop (bench/wgmma_probe.py): a one-M-tile chunk pays the activation fragments' build (the
// norm, the padding, the predicates) for 8 HMMAs a warp. Here thread t (of 256) owns the 8 columns 8 (t % 128) .. +7
// of the chunk's 1024 and rows 8 (t / 128) .. +7 of each M-tile: per chunk and M-tile 8 LDS.128 of weight rows (a
// warp reads 512 contiguous bytes of one row: no bank conflicts) and 64 FFMA over 8 independent sums; x' is built
// once per 1024 columns for all the pass's M-tiles. At the end each warp's 8 row sums are reduced across its lanes
// (reduce-scatter: 9 shuffles an M-tile) into the tensor-core loop's accumulator layout, so the cross-warp reduction
// and the epilogues after it are unchanged.
#pragma once
#include "common.cuh"
#include "matvec_plan.cuh"

namespace mk {

#if MK_FMA_B1
static_assert(!MK_W_TMA, "MK_FMA_B1 reads the per-row copies' chunk layout (16 rows of row_bytes_for(1))");
static_assert(!MK_RSTD_EPI, "MK_FMA_B1 applies the norm with rstd as the fragment build does");
constexpr int FMA_B1_MT = 4;   // M-tiles a pass may have to take this loop (32 fp32 sums a thread)

__device__ __forceinline__ uint4 lds_v4(unsigned addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}

// sum += W's 8 bf16 (or fp16) values . x'
__device__ __forceinline__ float dot8(const uint4& w, const float (&x)[8], float sum) {
  sum = fmaf(lo_f(w.x), x[0], sum);
  sum = fmaf(hi_f(w.x), x[1], sum);
  sum = fmaf(lo_f(w.y), x[2], sum);
  sum = fmaf(hi_f(w.y), x[3], sum);
  sum = fmaf(lo_f(w.z), x[4], sum);
  sum = fmaf(hi_f(w.z), x[5], sum);
  sum = fmaf(lo_f(w.w), x[6], sum);
  return fmaf(hi_f(w.w), x[7], sum);
}

// The warp's 8 row sums v[r] (each over this lane's columns) reduced over the 32 lanes: lane l returns row l >> 2's
// total (halves exchanged by lane bits 4, 3, 2, then the quad summed), a fixed order.
__device__ __forceinline__ float fma_b1_reduce(const float (&v)[8], int lane) {
  const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
  float h[4], q[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = (b4 ? v[i + 4] : v[i]) + __shfl_xor_sync(0xffffffffu, b4 ? v[i] : v[i + 4], 16);
#pragma unroll
  for (int i = 0; i < 2; ++i) q[i] = (b3 ? h[i + 2] : h[i]) + __shfl_xor_sync(0xffffffffu, b3 ? h[i] : h[i + 2], 8);
  float s = (b2 ? q[1] : q[0]) + __shfl_xor_sync(0xffffffffu, b2 ? q[0] : q[1], 4);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  return s + __shfl_xor_sync(0xffffffffu, s, 1);
}

// The pass's chunks (K / 1024 columns x mt M-tiles, chunk `it` onwards) from x staged whole at xs (row 0 = x, row 1 =
// the norm weights when `norm`; rows of K * 2 + 16 bytes: stage_x), with the same ring waits and releases as the
// tensor-core loop. Leaves the sums in acc[m][0] as mma.m16n8k16's C fragment (batch column 0: lanes 4j, e 0 for row
// j, e 2 for row j + 8; every other entry 0) and returns the next chunk number.
template <int MT>
__device__ __forceinline__ unsigned fma_b1_chunks(const Smem& S, const Params& P, const unsigned char* xs, int K,
                                                  bool norm, int mt, unsigned it, int warp, int lane,
                                                  float (&acc)[MT][1][4], unsigned long long& wait_cycles) {
  constexpr int KC = chunk_cols_for(1), RB = row_bytes_for(1), SEGS = KC / 8;
  static_assert(SEGS * 2 == CONSUMER_THREADS, "two row groups of 8 x SEGS threads cover a 16-row M-tile chunk");
  const int t = warp * 32 + lane, c = t % SEGS, rg = t / SEGS;
  const unsigned xs_a = smem_addr(xs);
  const unsigned nw_a = xs_a + (unsigned)(K * 2 + 16);
  const float r0 = norm ? S.rstd()[0] : 0.f;
  float f[FMA_B1_MT][8];
#pragma unroll
  for (int m = 0; m < FMA_B1_MT; ++m)
#pragma unroll
    for (int r = 0; r < 8; ++r) f[m][r] = 0.f;
  for (int k0 = 0; k0 < K; k0 += KC) {
    const bool ok = k0 + 8 * c < K;   // K is a multiple of 16: a segment is wholly in or out
    float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (ok) {
      uint4 v = lds_v4(xs_a + (unsigned)(2 * (k0 + 8 * c)));
      if (norm) {
        const uint4 w = lds_v4(nw_a + (unsigned)(2 * (k0 + 8 * c)));
        v = make_uint4(norm_pair(v.x, r0, w.x), norm_pair(v.y, r0, w.y), norm_pair(v.z, r0, w.z),
                       norm_pair(v.w, r0, w.w));
      }
      x[0] = lo_f(v.x); x[1] = hi_f(v.x); x[2] = lo_f(v.y); x[3] = hi_f(v.y);
      x[4] = lo_f(v.z); x[5] = hi_f(v.z); x[6] = lo_f(v.w); x[7] = hi_f(v.w);
    }
#pragma unroll
    for (int m = 0; m < FMA_B1_MT; ++m) {
      if (m >= mt) break;
      const int slot = it % NUM_STAGES;
      const long long c0 = clock64();
      // not OK (this CTA is stopping): read whatever the slot holds, keep going, do not free the slot (matvec.cuh)
      const int ws = chunk_wait(S, P, slot, it);
      wait_cycles += clock64() - c0;
      if (ok) {
        const unsigned base = S.ring(slot) + (unsigned)(rg * 8 * RB + c * 16);
        uint4 w[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) w[r] = lds_v4(base + (unsigned)(r * RB));
#pragma unroll
        for (int r = 0; r < 8; ++r) f[m][r] = dot8(w[r], x, f[m][r]);
      }
      if (ws == WAIT_OK) mbar_arrive(S.empty_bar(slot));   // each thread releases its own reads
      ++it;
    }
  }
#pragma unroll
  for (int m = 0; m < FMA_B1_MT; ++m) {
    if (m >= mt) break;
    const float s = fma_b1_reduce(f[m], lane);
    const bool col0 = (lane & 3) == 0;
    acc[m][0][0] = col0 && rg == 0 ? s : 0.f;
    acc[m][0][1] = 0.f;
    acc[m][0][2] = col0 && rg == 1 ? s : 0.f;
    acc[m][0][3] = 0.f;
  }
  return it;
}
#endif

}  // namespace mk
