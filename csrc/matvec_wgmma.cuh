// MK_WGMMA_B (A/B switch, session 27, default off; variant.KernelVariant.wgmma_b; needs MK_W_TMA): a matvec pass at
// one n-tile (batch <= 8) whose x is staged whole runs its chunks on Hopper's warpgroup MMA instead of ldmatrix +
// mma.sync: the weights, as MK_W_TMA lands them ([column group][16 rows][128 B], 128-byte swizzled), are wgmma's B
// operand (N = the M-tile's 16 rows) read by descriptor, and x' = the normalised activations is its A operand (M =
// 64: rows 0..B-1 are the tokens, the rest alias other bytes of x' and are dropped) from a compact K-major layout
// without swizzle, [K / 8][B][16 B] (core matrices B * 16 bytes apart along K). No fragments, no ldmatrix: per
// chunk each warpgroup issues one wgmma.m64n16k16 per k-step of its half of the chunk's columns, one commit group
// a chunk, and frees the previous chunk's slot once that chunk's group has completed (wait_group 1).
//
// Why: the consumers of a one-M-tile chunk (qkv_rope, o_proj, down at 1B batch 1, on the dependency chain with their
// weights already resident) take ~0.6-0.9 us per 32 KB chunk in the phase traces (bench/NOTES.md sessions 23-24)
// against ~0.13 us of ldmatrix bandwidth; bench/wgmma_probe.py (modes 3-5) prices the pattern alone first.
// The tensor work is 4-8x the useful (M = 64 rows for <= 8 tokens): 64 m64n16k16 a chunk are 512 cycles at the
// dense peak.
//
// The producer walks a wgmma pass M-tile-major (every column step of M-tile 0, then of M-tile 1, ..: producer.cuh)
// so that one accumulator set serves the pass's M-tiles in turn; the sums are the default path's products in
// another order (fp32): within tolerance of it, not bitwise. Everything below is compiled out of other builds.
#pragma once
#include "common.cuh"
#include "weight_tma.cuh"
#include "matvec_plan.cuh"
#include "x_frags.cuh"
#include "wgmma.cuh"

namespace mk {

#if MK_WGMMA_B
static_assert(MK_W_TMA, "MK_WGMMA_B reads the weights in MK_W_TMA's 128-byte swizzled chunk layout");

// Where x' starts in the scratch: after the staged rows and the norm weight row of a norm-fused op (whose x' is
// computed from them), at 0 for o_proj / down / lm_head (x' = x, staged straight into the compact layout).
__device__ __forceinline__ int wgb_xa_off(int K, int B, bool norm) {
  return norm ? ((B + 1) * (K * 2 + 16) + 127) / 128 * 128 : 0;
}

// The pass's sums, [warpgroup][M-tile][lane][4] floats (see wgb_chunks), after x' in the scratch.
constexpr int WGB_SUM_BYTES = 2 * ACC_TILES * 32 * 16;
__device__ __forceinline__ int wgb_sum_off(int K, int B, bool norm) {
  return (wgb_xa_off(K, B, norm) + B * K * 2 + 15) / 16 * 16;
}

// Whether a pass of this task takes the wgmma path (the producer and the consumers decide alike): one n-tile, x
// staged whole, whole chunks only (no k-step predicate around a wgmma: ptxas serialises wgmma in a divergent
// path), and x' and the sums fit the scratch after what the norm needs.
__device__ __forceinline__ bool wgb_pass(int K, int B, bool norm) {
  return batch_ntiles(B) == 1 && K % CHUNK_COLS == 0 && staged_fits(K, B, norm) &&
         wgb_sum_off(K, B, norm) + WGB_SUM_BYTES <= UNION_BYTES - STAGE_PART_BYTES;
}

// x' of the pass into the compact layout at xs + wgb_xa_off: unit (k8, b) at (k8 * B + b) * 16. A norm-fused op
// stages x and its norm weights whole first (stage_x: rstd as the default path computes it) and normalises from
// them with the default's rounding (norm_pair); the others copy x straight in. Ends with consumer_sync, x' visible
// to the async proxy.
struct WgbStaged {
  unsigned xa;       // x' (shared-memory address)
  unsigned r[4];     // the epilogue's early loads (matvec_task's rres: o_proj / down residuals, qkv's cos|sin)
};

// A pass's start: the epilogue's early loads, as matvec_task's (their round trips overlap the staging), then x'.
// Out of line (no wgmma in it, so the call is safe: nothing is in flight then): inlined, it and mk_decode's other
// paths spilled at 8B with the table's switches.
__device__ __noinline__ WgbStaged wgb_stage(const Smem S, const Params& P, const Task t, int p0, int mt,
                                            unsigned char* xs, const elem_t* x, const elem_t* nw, int K, int ldx,
                                            int warp, int lane) {
  WgbStaged st{0u, {0u, 0u, 0u, 0u}};
  if ((t.opcode == OP_O_PROJ || t.opcode == OP_DOWN) && t.arg2 == 0 && warp < mt)
    residual_prefetch(P, t, p0, warp, 0, lane, st.r);
  else if (t.opcode == OP_QKV_ROPE && warp < mt)
    rope_prefetch(S, P, p0, warp, 0, lane, st.r);
  const int B = P.batch, vpr = K / 8;
  float* rstd = S.rstd();
  unsigned char* xa = xs + wgb_xa_off(K, B, nw != nullptr);
  if (nw != nullptr) {
    stage_x(xs, x, nw, rstd, K, ldx, B, warp, lane);   // ends with consumer_sync
    const int rowb = K * 2 + 16;
    for (int idx = threadIdx.x; idx < B * vpr; idx += CONSUMER_THREADS) {
      const int kv = idx / B, b = idx - kv * B;
      uint4 v = *reinterpret_cast<const uint4*>(xs + (size_t)b * rowb + kv * 16);
      const uint4 w = *reinterpret_cast<const uint4*>(xs + (size_t)B * rowb + kv * 16);
      const float r = rstd[b];
      v.x = norm_pair(v.x, r, w.x);
      v.y = norm_pair(v.y, r, w.y);
      v.z = norm_pair(v.z, r, w.z);
      v.w = norm_pair(v.w, r, w.w);
      *reinterpret_cast<uint4*>(xa + (size_t)idx * 16) = v;
    }
  } else {
    constexpr int U = 4;   // the loads of a round in flight together, as stage_x
    for (int base = threadIdx.x; base < B * vpr; base += U * CONSUMER_THREADS) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = base + u * CONSUMER_THREADS, kv = idx / B, b = idx - kv * B;
        v[u] = idx < B * vpr ? ld_cg_v4(x + (size_t)b * ldx + kv * 8) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = base + u * CONSUMER_THREADS;
        if (idx < B * vpr) *reinterpret_cast<uint4*>(xa + (size_t)idx * 16) = v[u];
      }
    }
  }
  wg_fence_proxy();   // each writer's generic stores before the wgmmas' async-proxy reads
  consumer_sync();
  st.xa = smem_addr(xa);
  return st;
}

// One pass's chunks, M-tile-major. After M-tile m's last chunk, warps 0 and 4 (whose D rows 0..7 are the tokens
// lane / 4, at columns 8 j + 2 (lane % 4) (+ 1) in d[0], d[1], d[4], d[5]) store them to sums[wg][m][lane].
// Returns the chunk count after the pass.
__device__ __forceinline__ unsigned wgb_chunks(const Smem& S, const Params& P, unsigned xa, float4* sums, int K, int B,
                                               int mt, unsigned it, int warp, int lane,
                                               unsigned long long& wait_cycles) {
  const int wg = warp >> 2;
  const unsigned lbo = (unsigned)B * 16;
  unsigned long long wc = 0;   // in a register: the caller's counter is in memory (its address goes to matvec_task)
  WgTimeout to;   // a slow wait's timeout, recorded after the M-tile's last group (no wait_group may sit in a
                  // branch the warpgroup's threads take apart: wait_group is .aligned)
  for (int m = 0; m < mt; ++m) {
    float d[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int prev = -1;     // the previous chunk's slot (none yet: -1) and whether this thread's wait for it succeeded
    bool pok = false;
    for (int k0 = 0; k0 < K; k0 += CHUNK_COLS) {
      const int slot = it % NUM_STAGES;
      const long long c0 = clock64();
      const int ws = wg_slot_wait(S, P, slot, it, to);
      wc += clock64() - c0;
      const unsigned sb = S.ring(slot) + wg * (W_CHUNK_KG / 2) * W_KG_BYTES;   // this warpgroup's half of the columns
      const unsigned a0 = xa + (unsigned)((k0 / 8 + wg * (CHUNK_COLS / 16)) * B * 16);
      wg_fence();
#pragma unroll
      for (int j = 0; j < CHUNK_COLS / 32; ++j)   // k-step j of the half: 16 columns, 2 core matrices of x'
        wg_mma_m64n16(d, wg_desc_plain(a0 + (unsigned)(2 * j * B * 16), lbo), wg_desc_sw128(sb + (j >> 2) * W_KG_BYTES + (j & 3) * 32));
      wg_chunk_issued(S, slot, ws, prev, pok);
      ++it;
    }
    wg_chunks_drained(S, prev, pok);
    wg_record(S, P, to);
    if ((warp & 3) == 0) sums[(wg * ACC_TILES + m) * 32 + lane] = make_float4(d[0], d[1], d[4], d[5]);
  }
  wait_cycles += wc;
  return it;
}

// The pass's sums to the epilogue's tiles: warp m takes M-tile m in the mma accumulator layout matvec_epilogue reads
// (v[e]: row lane / 4 + 8 (e >> 1), token 2 (lane % 4) + (e & 1)), the two warpgroups' halves of the columns added
// in a fixed order. Tokens past B stay 0.
__device__ __forceinline__ void wgb_tile(const float4* sums, int m, int lane, int B, float (&v)[4]) {
  const float* f = reinterpret_cast<const float*>(sums);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int row = (lane >> 2) + 8 * (e >> 1), tok = 2 * (lane & 3) + (e & 1);
    const int dl = 4 * tok + ((row & 7) >> 1), r = (row & 1) + 2 * (row >> 3);
    v[e] = tok < B ? f[(m * 32 + dl) * 4 + r] + f[((ACC_TILES + m) * 32 + dl) * 4 + r] : 0.f;
  }
}
// The pass's epilogue, after every wgmma of the pass has completed (out of line, as wgb_stage).
__device__ __noinline__ void wgb_epilogue(const Smem S, const Params& P, const Task t, int p0, int mt, int mtpu,
                                          const float4* sums, int warp, int lane, unsigned r0, unsigned r1,
                                          unsigned r2, unsigned r3) {
  if (warp < mt && !(mtpu == 2 && (warp & 1))) {
    const unsigned rres[4] = {r0, r1, r2, r3};
    float v[4], vu[4] = {0.f, 0.f, 0.f, 0.f};
    wgb_tile(sums, warp, lane, P.batch, v);
    if (mtpu == 2) wgb_tile(sums, warp + 1, lane, P.batch, vu);
    matvec_epilogue(S, P, t, p0, warp, 0, lane, v, vu, rres);
  }
}

// A whole wgmma task (matvec_dispatch, megakernel.cu: inlined into mk_decode, since ptxas serialises the wgmma of a
// called function, C7510): matvec_task's passes with the stage, chunk loop and sums of this file, the epilogue and
// the K-split merge as there. (No MK_TRACE_PHASES phases for these tasks.)
__device__ __forceinline__ unsigned wgb_task(const Smem& S, const Params& P, const Task& t, const WeightPlan& wp,
                                             const elem_t* x, const elem_t* nw, unsigned it, int warp, int lane,
                                             unsigned long long& wait_cycles) {
  const int B = P.batch, upp = ACC_TILES / wp.mtpu, uend = t.arg0 + t.arg1;
  unsigned char* xs = reinterpret_cast<unsigned char*>(S.scratch());
  float4* sums = reinterpret_cast<float4*>(xs + wgb_sum_off(wp.K, B, nw != nullptr));
  for (int p0 = t.arg0; p0 < uend; p0 += upp) {
    const int mt = min(upp, uend - p0) * wp.mtpu;
    const WgbStaged st = wgb_stage(S, P, t, p0, mt, xs, x, nw, wp.K, wp.ldx, warp, lane);
    it = wgb_chunks(S, P, st.xa, sums, wp.K, B, mt, it, warp, lane, wait_cycles);
    consumer_sync();   // every M-tile's sums are in
    wgb_epilogue(S, P, t, p0, mt, wp.mtpu, sums, warp, lane, st.r[0], st.r[1], st.r[2], st.r[3]);
    consumer_sync();   // the epilogue's reads of the sums before the next pass's stage
  }
  if (is_ksplit(t)) ksplit_merge(S, P, t);   // o_proj.cuh: the last part of the range adds the parts
  return it;
}
#endif

}  // namespace mk
