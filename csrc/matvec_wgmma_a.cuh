// MK_WGMMA_A = R (A/B switch, session 28, default 0 = off; variant.KernelVariant.wgmma_a; needs MK_W_TMA): a matvec
// task at two n-tiles (batch 9..16) runs on Hopper's warpgroup MMA with the weights as wgmma's A operand (M = 64 rows,
// four M-tiles: a row block) and x' = the normalised activations as its B operand (N = 16 tokens), both read from
// shared memory by descriptor: no fragments, no ldmatrix, one m64n16k16 per 16 columns, row block and warpgroup. A
// pass holds up to R row blocks (R = 1, 2 or 4: 4 R M-tiles, 8 R accumulator registers a thread), so x is staged once
// per 64 R rows instead of once per 64 (the default path's pass): 8B batch 16's gate_up stages x in 2 passes at R = 4
// instead of 4.
//
// Why: at batch 16 the consumers, not the copies, bound the chunk loop (bench/NOTES.md sessions 11-27: 8B batch 16's
// qkv / o_proj chunks take 1.1-1.3 us where the copy needs 1.0; ring depth, copy size and in-flight caps measured
// out). Per 32 KB chunk the register-fed path issues 128 mma.m16n8k16 and 64 ldmatrix.x4 over 8 warps; this path 16
// wgmma (8 per warpgroup), the useful tensor work exactly (64 rows x 256 columns x 16 tokens), issued async.
// bench/wgmma_probe.py's mode 2 is this pattern alone (its x layout is this one's).
//
// Chunk geometry (this path only; the producer walks it alike: wga_produce): a chunk is one row block of the pass (up
// to 4 M-tiles of 16 rows) x 256 columns, 32 KB, in the order (column step, row block), laid out as [column group
// 0..3][row 0..63][128 B] with the tensor map's 128-byte swizzle: M-tile m's box (MK_W_TMA's one-column-group map:
// 16 rows x 64 columns, 2 KB) lands at g * 8 KB + m * 2 KB, so the 8-row atoms of all 64 rows are 1024 bytes apart,
// the K-major SW128 layout wgmma reads.
// A row block of mt < 4 M-tiles copies mt boxes per group; the rows past them hold stale bytes whose sums are dropped.
// Warpgroup g takes the chunk's column groups 2g, 2g + 1 (k-steps 8g .. 8g + 7); the two halves' sums are added in
// the epilogue in a fixed order (deterministic; the default path's products in another fp32 order: within
// tolerance of it, not bitwise).
//
// x's staging (its geometry, copies, waits, normalisation, MK_WGA_X and MK_WGA_NWS): csrc/wga_x.cuh.
#pragma once
#include "common.cuh"
#include "weight_tma.cuh"
#include "matvec_plan.cuh"
#include "x_frags.cuh"
#include "wgmma.cuh"
#include "wga_x.cuh"

namespace mk {

#if MK_WGMMA_A
// ---- producer: a task's passes, each column step's row blocks, mt x 4 boxes of 16 rows x 64 columns a chunk ----
__device__ __forceinline__ bool wga_produce(const Smem& S, const Params& P, const Task& t, int mtpu, int klo, int khi,
                                            const void* wmap_one, unsigned& it, int ti, int lane, unsigned gate_at) {
  const int upp = WGA_MT / mtpu, uend = t.arg0 + t.arg1;
  for (int p0 = t.arg0; p0 < uend; p0 += upp) {
    const int mt = min(upp, uend - p0) * mtpu;
    for (int k0 = klo; k0 < khi; k0 += WGA_KC) {
      for (int m0 = 0; m0 < mt; m0 += WGA_BT) {
        const int mb = min(WGA_BT, mt - m0);   // the row block's M-tiles
        const int slot = it % NUM_STAGES;
        if (producer_slot_wait(S, P, it, ti, gate_at) != WAIT_OK) return false;
        if (lane == 0) {
          if (MK_DIAG & 2)
            mbar_arrive(S.full_bar(slot));
          else
            mbar_arrive_expect_tx(S.full_bar(slot), (unsigned)(mb * WGA_GROUPS * W_KG_BYTES));
        }
        __syncwarp();
        if (!(MK_DIAG & 2) && lane < mb * WGA_GROUPS) {   // lane = (M-tile, column group)
          const int m = lane / WGA_GROUPS, g = lane % WGA_GROUPS;
          tma_w(S.ring(slot) + g * WGA_GROUP_BYTES + m * W_KG_BYTES, wmap_one, t.opcode == OP_QKV_ROPE,
                diag_row(weight_row(t.opcode, p0, (m0 + m) * 16), diag_fold(t.opcode, 0)), k0 / W_KG_COLS + g,
                S.full_bar(slot));
        }
        ++it;
      }
    }
  }
  return true;
}


// A pass's start, out of line (nothing in flight): the epilogue's early loads of this warp's first tile (tile = warp:
// M-tile warp / 2, n-tile warp % 2; o_proj / down residuals, qkv's cos|sin) as matvec_task's, and, on a later pass,
// group 0's copies (the previous pass's epilogue has left the scratch).
struct WgaStart {
  unsigned r[4];
};
__device__ __noinline__ WgaStart wga_pass_start(const Smem S, const Params& P, const Task t, int p0, int mt,
                                                unsigned char* xs, const elem_t* x, int K, int ldx, bool issue,
                                                int warp, int lane WGA_NW_PARAM) {
  WgaStart st{{0u, 0u, 0u, 0u}};
  if ((t.opcode == OP_O_PROJ || t.opcode == OP_DOWN) && t.arg2 == 0 && warp / 2 < mt)
    residual_prefetch(P, t, p0, warp / 2, warp % 2, lane, st.r);
  else if (t.opcode == OP_QKV_ROPE && warp / 2 < mt)
    rope_prefetch(S, P, p0, warp / 2, warp % 2, lane, st.r);
#if MK_WGA_X
  if (issue)
    for (int g = 0; g < WGA_AHEAD; ++g) wga_issue(xs, g, x, K, ldx, P.batch WGA_NW_ARG(nw));
#else
  if (issue) wga_group_issue(xs, x, K, ldx, 0, P.batch);
#endif
  return st;
}

// MK_TRACE_PHASES (bench only; thread 0): as matvec_task's phases -- stage (group 0's copies at a later pass, each
// group's wait, normalise and barrier), chunks (the wgmma loops to each group's drain and the sums' barrier), reduce
// (the sums, the epilogue, its barrier) -- lapped only where no wgmma group is in flight.
struct WgaPhases {
  unsigned long long mark = 0, stage = 0, chunks = 0, reduce = 0;
};

// One pass of NRB row blocks: its x groups and chunks, then its sums to the scratch (red: [warpgroup][M-tile][n-tile]
// [lane] float4, the mma accumulator layout of tile (m, n): warp w % 4 of a warpgroup holds M-tile 4 rb + w % 4 of
// row block rb). Inlined (the wgmma must not cross a call); a template so that every accumulator index is a constant.
template <int NRB>
__device__ __forceinline__ unsigned wga_pass(const Smem& S, const Params& P, unsigned char* xs, const elem_t* x,
                                             const elem_t* nw, int K, int ldx, unsigned it, int warp, int lane,
                                             WgTimeout& to, unsigned& wc, bool ph_on, WgaPhases& ph, bool acc_ss) {
  const int wg = warp >> 2, B = P.batch;
  float d[NRB][8];
#pragma unroll
  for (int rb = 0; rb < NRB; ++rb)
#pragma unroll
    for (int e = 0; e < 8; ++e) d[rb][e] = 0.f;
  int gi = 0;
#if MK_WGA_X
  WgaCarry cw;
#if !MK_WGA_NWS   // MK_WGA_NWS: group 0's weights came with its copies (wga_issue)
  cw.w = wga_norm_w(nw, K, 0);
#endif
#pragma unroll
  for (int i = 0; i < 4; ++i) cw.ss[i] = 0.f;
#endif
  for (int kg = 0; kg < K; kg += WGA_XG, ++gi) {
    unsigned char* gb = xs + (gi & (WGA_NBUF - 1)) * GROUP_BYTES;
    if (ph_on) phase_lap(ph.mark, ph.chunks);
#if MK_WGA_X
    cw = wga_group_ready_x(S, xs, gi, x, nw, K, ldx, B, cw, acc_ss);
#else
    wga_group_ready(S, gb, kg + WGA_XG < K ? xs + ((gi + 1) & 1) * GROUP_BYTES : nullptr, x, nw, K, ldx, kg, B);
#endif
    if (ph_on) phase_lap(ph.mark, ph.stage);
    const int nc = min(WGA_XG, K - kg) / WGA_KC;
    int prev = -1;     // the previous chunk's slot (none yet: -1) and whether this thread's wait for it succeeded
    bool pok = false;
    for (int c = 0; c < nc; ++c) {
      // this warpgroup's k-steps 8 wg + j: the chunk's column group 2 wg + j / 4, x's 64-column group
      // 4 c + 2 wg + j / 4
      const unsigned xb = smem_addr(gb) + (4 * c + 2 * wg) * WGA_XLINE;
#pragma unroll
      for (int rb = 0; rb < NRB; ++rb) {
        const int slot = it % NUM_STAGES;
        const unsigned c0 = (unsigned)clock64();
        const int ws = wg_slot_wait(S, P, slot, it, to);
        wc += (unsigned)clock64() - c0;
        const unsigned wa = S.ring(slot) + 2 * wg * WGA_GROUP_BYTES;
        wg_fence();
#pragma unroll
        for (int j = 0; j < 8; ++j)
          wg_mma_m64n16(d[rb], wg_desc_sw128(wa + (j >> 2) * WGA_GROUP_BYTES + (j & 3) * 32),
                        wg_desc_sw128(xb + (j >> 2) * WGA_XLINE + (j & 3) * 32));
        wg_chunk_issued(S, slot, ws, prev, pok);
        ++it;
      }
    }
    wg_chunks_drained(S, prev, pok);   // this group's x and slots are read: the buffer may be refilled
  }
  wg_record(S, P, to);
  consumer_sync();   // both warpgroups' wgmmas are done with x before the sums overwrite it
  if (ph_on) phase_lap(ph.mark, ph.chunks);
#if MK_WGA_X
  if (acc_ss) wga_rstd(S, xs, cw, B, warp, lane);   // task-uniform
#endif
  float4* red = reinterpret_cast<float4*>(xs);
#pragma unroll
  for (int rb = 0; rb < NRB; ++rb)
#pragma unroll
    for (int n = 0; n < 2; ++n)
      red[((wg * WGA_MT + WGA_BT * rb + (warp & 3)) * 2 + n) * 32 + lane] =
          make_float4(d[rb][4 * n], d[rb][4 * n + 1], d[rb][4 * n + 2], d[rb][4 * n + 3]);
  consumer_sync();
  return it;
}

// The pass's sums to the epilogue (out of line): warp w takes tiles w, w + 8, .. (tile = M-tile * 2 + n-tile), the
// two warpgroups' halves added in a fixed order. Its first tile's early loads came with the pass's start; a later
// tile's (M-tile >= 4: only gate_up has so many, and it loads none) are loaded here.
__device__ __noinline__ void wga_epilogue(const Smem S, const Params& P, const Task t, int p0, int mt, int mtpu,
                                          const float4* red, int warp, int lane, unsigned r0, unsigned r1, unsigned r2,
                                          unsigned r3 WGA_EPI_PARAM) {
  for (int tile = warp; tile < 2 * mt; tile += CONSUMER_WARPS) {
    const int m = tile / 2, n = tile % 2;
    if (mtpu == 2 && (m & 1)) continue;   // gate_up's up tile: read with its gate tile
    unsigned rres[4] = {r0, r1, r2, r3};
    if (tile >= CONSUMER_WARPS) {
      if ((t.opcode == OP_O_PROJ || t.opcode == OP_DOWN) && t.arg2 == 0)
        residual_prefetch(P, t, p0, m, n, lane, rres);
      else if (t.opcode == OP_QKV_ROPE)
        rope_prefetch(S, P, p0, m, n, lane, rres);
    }
    float v[4], vu[4] = {0.f, 0.f, 0.f, 0.f};
    const float4 a = red[((0 * WGA_MT + m) * 2 + n) * 32 + lane], b = red[((1 * WGA_MT + m) * 2 + n) * 32 + lane];
    v[0] = a.x + b.x; v[1] = a.y + b.y; v[2] = a.z + b.z; v[3] = a.w + b.w;
    if (mtpu == 2) {
      const float4 c = red[((0 * WGA_MT + m + 1) * 2 + n) * 32 + lane];
      const float4 e = red[((1 * WGA_MT + m + 1) * 2 + n) * 32 + lane];
      vu[0] = c.x + e.x; vu[1] = c.y + e.y; vu[2] = c.z + e.z; vu[3] = c.w + e.w;
    }
#if MK_WGA_X
    if (scale) {   // a norm-fused op: y[b, row] = rstd[b] * sum_k W[row, k] round(x[b, k] w[k])
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int b = n * 8 + 2 * (lane & 3) + (e & 1);
        const float r = b < P.batch ? S.rstd()[b] : 0.f;
        v[e] *= r;
        vu[e] *= r;
      }
    }
#endif
    matvec_epilogue(S, P, t, p0, m, n, lane, v, vu, rres);
  }
}

// A whole task (matvec_dispatch, megakernel.cu: inlined into mk_decode, since ptxas serialises the wgmma of a called
// function, C7510).
__device__ __forceinline__ unsigned wga_task(const Smem& S, const Params& P, const Task& t, const WeightPlan& wp,
                                             const elem_t* x, const elem_t* nw, unsigned it, int warp, int lane,
                                             unsigned long long& wait_cycles) {
  const int B = P.batch, K = wp.K, upp = WGA_MT / wp.mtpu, uend = t.arg0 + t.arg1;
  unsigned char* xs = reinterpret_cast<unsigned char*>(S.scratch());
  // group 0 before the norm statistics' round trip, so the two overlap (as matvec_task); MK_WGA_X: groups 0 ..
  // WGA_AHEAD - 1 and no round trip (the first pass sums x^2)
#if MK_WGA_X
  for (int g = 0; g < WGA_AHEAD; ++g) wga_issue(xs, g, x, K, wp.ldx, B WGA_NW_ARG(nw));
#else
  wga_group_issue(xs, x, K, wp.ldx, 0, B);
  if (nw != nullptr)
    rows_rstd(x, B, S.rstd(), reinterpret_cast<float*>(xs + UNION_BYTES - STAGE_PART_BYTES), warp, lane);
#endif
  // wait cycles (the trace's), in a 32-bit register (the caller's counter is in memory): it wraps only after 2^32
  // cycles (~2.2 s) of one task's waits, i.e. past a watchdog timeout
  unsigned wc = 0;
  WgTimeout to;
  const bool ph_on = MK_TRACE_PHASES && P.trace != nullptr && threadIdx.x == 0;
  WgaPhases ph;
  const unsigned long long ph_entry = ph_on ? global_ns() : 0ull;
  for (int p0 = t.arg0; p0 < uend; p0 += upp) {
    const int mt = min(upp, uend - p0) * wp.mtpu;
    if (ph_on) ph.mark = global_ns();
    const WgaStart st = wga_pass_start(S, P, t, p0, mt, xs, x, K, wp.ldx, p0 != t.arg0, warp, lane WGA_NW_ARG(nw));
    if (ph_on) phase_lap(ph.mark, ph.stage);
    const bool acc_ss = MK_WGA_X && nw != nullptr && p0 == t.arg0;   // the first pass sums x^2 (MK_WGA_X)
    const int nrb = (mt + WGA_BT - 1) / WGA_BT;   // the whole wgmma sequence inside one branch: no predicate in a group
    constexpr int R2 = WGA_RB >= 2 ? 2 : 1, R3 = WGA_RB >= 3 ? 3 : 1;   // the row-block counts this build has
    if (WGA_RB == 1 || nrb == 1)
      it = wga_pass<1>(S, P, xs, x, nw, K, wp.ldx, it, warp, lane, to, wc, ph_on, ph, acc_ss);
    else if (WGA_RB == 2 || nrb == 2)
      it = wga_pass<R2>(S, P, xs, x, nw, K, wp.ldx, it, warp, lane, to, wc, ph_on, ph, acc_ss);
    else if (nrb == 3)
      it = wga_pass<R3>(S, P, xs, x, nw, K, wp.ldx, it, warp, lane, to, wc, ph_on, ph, acc_ss);
    else
      it = wga_pass<WGA_RB>(S, P, xs, x, nw, K, wp.ldx, it, warp, lane, to, wc, ph_on, ph, acc_ss);
    wga_epilogue(S, P, t, p0, mt, wp.mtpu, reinterpret_cast<const float4*>(xs), warp, lane, st.r[0], st.r[1], st.r[2],
                 st.r[3] WGA_EPI_ARG(nw != nullptr));
    consumer_sync();   // the epilogue's reads of the sums before the next pass's group 0 lands there
    if (ph_on) phase_lap(ph.mark, ph.reduce);
  }
  if (ph_on) trace_phase_times(S, P, ph.stage, ph.chunks, ph.reduce, ph_entry);
  wait_cycles += wc;
  if (is_ksplit(t)) ksplit_merge(S, P, t);   // o_proj.cuh: the last part of the range adds the parts
  return it;
}
#endif
#if MK_WGA_X && !MK_WGMMA_A
static_assert(false, "MK_WGA_X is MK_WGMMA_A's x staging: build it with MK_WGMMA_A");
#endif
#if MK_WGA_ONLY && !(MK_WGMMA_A && MK_NTILES == 2)
static_assert(false, "MK_WGA_ONLY: every task of a batch-9..16 build on wgmma; build it with MK_WGMMA_A, MK_NTILES=2");
#endif
#if MK_WGA_NWS && !(MK_WGMMA_A && MK_WGA_X == 2)
static_assert(false, "MK_WGA_NWS is MK_WGA_X = 2's norm-weight staging: build it with MK_WGMMA_A and MK_WGA_X=2");
#endif

}  // namespace mk
