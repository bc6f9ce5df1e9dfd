// Weight-streaming skinny GEMM shared by qkv_rope, o_proj, gate_up, down and lm_head tasks:
//   y[b, row] = sum_k W[row, k] * x'[b, k]     for the task's units (16 output rows each),
// with x' = round(x * rstd[b] * norm_w[k]) for norm-fused ops (norm_elem: round(round(x * rstd) * w)
// under MK_ROUNDING=1), else x' = x.
//
// Tensor cores, "swap AB": the weight rows are the m16 side of mma.m16n8k16, the batch (<= 16
// tokens, padded to 8 or 16) the n8 side. A task's units are processed in passes of up to
// ACC_TILES / NT M-tiles (NT = 1 n-tile for B <= 8, else 2); a pass streams its rows through the
// ring in chunks of KC = CHUNK_COLS columns (at NT = 2 consumed in two halves: nt2_full_chunks).
// Inside a chunk (half), k-step j (16 columns) belongs to consumer warp j % 8, so every warp works
// whatever the pass size; the warps' partial sums are reduced through shared memory, then each
// consumer warp owns one accumulator tile for the op-specific epilogue (matvec_epilogue, defined in
// megakernel.cu).
//
// Activations reach shared memory before their fragments are read: whole per pass when x[B, K] fits
// the scratch (stage_x, rows padded), else one column group at a time, double-buffered through
// cp.async (group_issue / group_frags, rows swizzled).
//
// The producer warp walks the same queue with the same pass/chunk plan (weight_plan, weight_row)
// and issues one cp.async.bulk per weight row and chunk; chunk number `it` (counted over the whole
// queue by both sides) uses slot it % NUM_STAGES with mbarrier parity (it / NUM_STAGES) & 1.
#pragma once
#include "common.cuh"
#include "weight_tma.cuh"
#include "matvec_plan.cuh"
#include "producer.cuh"
#include "x_frags.cuh"

namespace mk {

// ---- consumer --------------------------------------------------------------------------------
// Epilogue of one accumulator tile: rows (p0's pass) M-tile m, batch n-tile nt. v[e] holds the
// sum for (row r_lo + 8*(e>>1), batch nt*8 + 2*(lane&3) + (e&1)) with r_lo = lane>>2; for gate_up,
// vu[] holds the matching up tile (m + 1). Defined in megakernel.cu (one case per opcode).
__device__ __forceinline__ void matvec_epilogue(const Smem& S, const Params& P, const Task& t, int p0, int m,
                                                int nt, int lane, const float (&v)[4], const float (&vu)[4],
                                                const unsigned (&rres)[4]);
__device__ __forceinline__ void residual_prefetch(const Params& P, const Task& t, int p0, int m, int nt, int lane,
                                                  unsigned (&r)[4]);
__device__ __forceinline__ void rope_prefetch(const Smem& S, const Params& P, int p0, int m, int nt, int lane,
                                              unsigned (&cs)[4]);
__device__ __noinline__ void ksplit_merge(const Smem S, const Params& P, const Task t);

#if MK_RSTD_EPI   // nt2_full_chunks' pass-through of group_frags' ss arguments (NT = 2)
#define MK_SS_PARAMS2 , bool acc_ss, float (&ss)[2]
#else
#define MK_SS_PARAMS2
#endif

// The chunk loop of one pass at NT = 2 (matvec_task's at NT = 1 is the one-part case; the fragment loads
// are written out in both: a shared helper changed the SASS, +32 instructions, session 10): each chunk of
// CHUNK_COLS columns is used in two parts of KG = CHUNK_COLS / 2 columns (one column group each), the
// part's fragments loaded once and used for every M-tile. Part 0 waits for every M-tile's slot of the
// column range (mt <= NUM_STAGES slots resident at once), the last part frees them. Measured faster in
// session 11 than half-width chunks (1 KB copies, each consumed whole): half the ring waits and slot
// arrivals per weight byte, and the producer's copies are 2 KB (bench/NOTES.md). Returns the chunk count.
template <int JMAX>
__device__ __forceinline__ unsigned nt2_full_chunks(const Smem& S, const Params& P, const elem_t* x, const elem_t* nw,
                                                    bool staged, const float* rstd, int K, int ldx, int B, int mt,
                                                    unsigned it, unsigned char* xs, int& gi, int warp, int lane,
                                                    unsigned lane_off, float (&acc)[ACC_TILES / 2][2][4],
                                                    unsigned long long& wait_cycles, bool ph_on,
                                                    unsigned long long& ph_gwait MK_SS_PARAMS2) {
  constexpr int NT = 2, MT = ACC_TILES / 2, KC = CHUNK_COLS, KG = CHUNK_COLS / 2;
  static_assert(MT <= NUM_STAGES, "NT = 2 holds a pass's M-tiles of one column range in the ring");
  for (int k0 = 0; k0 < K; k0 += KC) {
    const int nh = k0 + KG < K ? 2 : 1;   // a last chunk of <= KG columns has one part
    unsigned okm = 0;                     // M-tiles whose slot wait succeeded: freed after the last part
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h < nh) {
        const int kg = k0 + h * KG;
        const int nsteps = min(KG, K - kg) >> 4;
        unsigned xb[JMAX][NT][2];
        if (staged) {
          smem_x_frags<NT, JMAX>(xb, xs, nw != nullptr, rstd, K, kg, nsteps, B, warp, lane);
        } else {
          unsigned wv[JMAX][2];  // norm weights: immutable, loaded before the barrier so the two overlap
#pragma unroll
          for (int jj = 0; jj < JMAX; ++jj) {
            const int k = kg + (warp + jj * CONSUMER_WARPS) * 16 + (lane & 3) * 2;
            const bool ld = nw != nullptr && warp + jj * CONSUMER_WARPS < nsteps;
            wv[jj][0] = ld ? ld_nc_u32(nw + k) : 0u;
            wv[jj][1] = ld ? ld_nc_u32(nw + k + 8) : 0u;
          }
          const unsigned long long gw0 = ph_on ? global_ns() : 0ull;
          cp_async_wait_all();  // this thread's copies of the group have landed ...
          consumer_sync();      // ... and everyone's; the other buffer's last readers are done too
          if (ph_on) ph_gwait += global_ns() - gw0;
          group_frags<NT, JMAX>(xb, xs + (gi & 1) * GROUP_BYTES, wv, nw != nullptr, rstd, KG, nsteps, B, warp,
                                lane MK_SS_ARGS);
          // (MK_DIAG & 8: x == nullptr on a later pass, nothing restaged; folds away in every other build)
          if (kg + KG < K && (!(MK_DIAG & 8) || x != nullptr))
            group_issue(xs + ((gi + 1) & 1) * GROUP_BYTES, x, K, ldx, kg + KG, B, KG);
          ++gi;
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          if (m >= mt) break;   // as in matvec_task's loop
          const unsigned c = it + m;
          const int slot = c % NUM_STAGES;
          if (h == 0) {  // not OK (this CTA is stopping): compute on whatever the slot holds, never free it
            const long long c0 = clock64();
            const int ws = ring_wait(S, P, S.full_bar(slot), (c / NUM_STAGES) & 1, -1, MBAR_TAG_FULL + slot, c,
                                     true, 1);
            wait_cycles += clock64() - c0;
            if (ws == WAIT_OK) okm |= 1u << m;
          }
#if MK_W_TMA
          const unsigned sb = S.ring(slot) + lane_off + h * W_HALF_BYTES;
#else
          const unsigned sb = S.ring(slot) + lane_off + h * (KG * 2);
#endif
#pragma unroll
          for (int jj = 0; jj < JMAX; ++jj) {
            const int j = warp + jj * CONSUMER_WARPS;
            if (j < nsteps && !(MK_DIAG & 4)) {
              unsigned a[4];
#if MK_W_TMA
              ldmatrix_x4(a, sb + jj * W_JJ_BYTES);
#else
              ldmatrix_x4(a, sb + j * 32);
#endif
#pragma unroll
              for (int n = 0; n < NT; ++n) mma_16816(acc[m][n], a, xb[jj][n]);
            }
          }
          if (h == nh - 1 && ((okm >> m) & 1u)) mbar_arrive(S.empty_bar(slot));  // each thread its own reads
        }
      }
    }
    it += mt;
  }
  return it;
}

// Out of line: inlined into the consumer loop it spills at the 168-register cap (9 warps) and measured
// 62 us slower at 1B batch 1 (NOTES session 5); as its own function it needs no spills.
template <int NT>
// Arguments by value and the chunk count returned: out of line, references to the caller's locals
// made every use in the chunk loop a local-memory reload after each asm memory clobber (SASS, 51f822c).
__device__ __noinline__ unsigned matvec_task(const Smem S, const Params& P, const Task t, const WeightPlan wp,
                                                  const elem_t* x, const elem_t* nw, bool staged, unsigned it,
                                                  int warp, int lane, unsigned long long* wait_out) {
  unsigned long long wait_cycles = 0;
  constexpr int MT = ACC_TILES / NT;
  constexpr int KC = chunk_cols_for(NT);
  // The fragments of a chunk are loaded and used in NH parts of KG columns (one column group each when x
  // is not staged whole): NH = 2 at NT = 2 (nt2_full_chunks), NH = 1 and KG = KC at NT = 1 (the loop below)
  constexpr int KG = group_cols_for(NT);
  constexpr int NH = KC / KG;
  constexpr int JMAX = KG / 16 / CONSUMER_WARPS;   // k-steps per warp per chunk (part)
  const int B = P.batch;
  const float* rstd = S.rstd();
  float* red = S.scratch();
  static_assert(CONSUMER_WARPS * ACC_TILES * 32 * 16 <= UNION_BYTES, "reduction scratch");
  const int upp = MT / wp.mtpu;
  const int uend = t.arg0 + t.arg1;
#if MK_W_TMA
  const unsigned lane_off = w_lane_off(warp, lane);
#else
  const unsigned lane_off = (lane & 15) * row_bytes_for(NT) + (lane >> 4) * 16;
#endif
  unsigned char* xs = reinterpret_cast<unsigned char*>(red);   // staging shares the scratch
  // Column groups consumed so far (group staging: buffer gi & 1 holds the current one). The first
  // group's copies go out before the norm statistics' round trip, so the two overlap.
  int gi = 0;
  if (!staged) group_issue(xs, x, wp.K, wp.ldx, 0, B, KG);
  if (!staged && nw != nullptr && !MK_RSTD_EPI)   // MK_RSTD_EPI: the pass sums x^2 as its groups go by
    rows_rstd(x, B, S.rstd(), reinterpret_cast<float*>(xs + UNION_BYTES - STAGE_PART_BYTES), warp, lane);
  // MK_TRACE_PHASES: thread 0's clock at phase boundaries (after barriers: every warp is past them)
  unsigned long long ph_mark = 0, ph_stage = 0, ph_chunks = 0, ph_reduce = 0, ph_gwait = 0;
  const bool ph_on = MK_TRACE_PHASES && P.trace != nullptr && threadIdx.x == 0;
  const unsigned long long ph_entry = ph_on ? global_ns() : 0ull;
  for (int p0 = t.arg0; p0 < uend; p0 += upp) {
    if (ph_on) ph_mark = global_ns();
    const int mt = min(upp, uend - p0) * wp.mtpu;
    // MK_DIAG & 8 (timing only, wrong results): x reaches shared memory for the task's first pass only; later
    // passes read whatever the scratch holds (the ceiling of re-reading x from L2 once per pass). Constant
    // true in every other build.
    const bool xload = !(MK_DIAG & 8) || p0 == t.arg0;
    // A later pass restages group 0 once the previous pass's reduction has left the scratch.
    if (!staged && p0 != t.arg0 && xload) group_issue(xs + (gi & 1) * GROUP_BYTES, x, wp.K, wp.ldx, 0, B, KG);
    // o_proj/down: this warp's epilogue residuals, loaded early (o_proj.cuh); qkv_rope: its cos|sin values
    // (qkv_rope.cuh)
    unsigned rres[4] = {0u, 0u, 0u, 0u};
    // (a K part, arg2 != 0, prefetches nothing: ksplit_merge loads the residual; spelled !is_ksplit(t) it
    // compiles to other SASS than the measured build)
    if ((t.opcode == OP_O_PROJ || t.opcode == OP_DOWN) && t.arg2 == 0 && warp / NT < mt)
      residual_prefetch(P, t, p0, warp / NT, warp % NT, lane, rres);
    else if (t.opcode == OP_QKV_ROPE && warp / NT < mt)
      rope_prefetch(S, P, p0, warp / NT, warp % NT, lane, rres);
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
#if MK_RSTD_EPI   // the norm's sums of squares: the first pass of an unstaged norm-fused task
    const bool epi_norm = !staged && nw != nullptr;
    const bool acc_ss = epi_norm && p0 == t.arg0;
    float ss[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) ss[n] = 0.f;
#endif

    // Activations: staged whole once per pass in shared memory when they fit (one L2 round trip per
    // pass, norm statistics included); else one column group at a time (group_issue / group_frags),
    // the next group's copies in flight during this one's MMAs, with rstd from rows_rstd above.
    if (staged && xload) stage_x(xs, x, nw, S.rstd(), wp.K, wp.ldx, B, warp, lane);
    if (ph_on) phase_lap(ph_mark, ph_stage);
    if constexpr (NH == 2) {
      it = nt2_full_chunks<JMAX>(S, P, xload ? x : nullptr, nw, staged, rstd, wp.K, wp.ldx, B, mt, it, xs, gi, warp,
                                 lane, lane_off, acc, wait_cycles, ph_on, ph_gwait MK_SS_ARGS);
    } else {
#if MK_DIAG & 16
    // MK_DIAG & 16 (timing only, wrong results): the activation fragments of a pass's first chunk are used
    // for all its chunks (no smem_x_frags / group_frags after it; the column groups' copies and barriers kept):
    // the price of building the fragments per chunk, which one-M-tile tasks pay once per 32 KB chunk
    unsigned xb_kept[JMAX][NT][2] = {};
#endif
    for (int k0 = 0; k0 < wp.K; k0 += KC) {
      const int nsteps = min(KC, wp.K - k0) >> 4;
#if MK_DIAG & 16
      unsigned (&xb)[JMAX][NT][2] = xb_kept;
      const bool xfrag = k0 == 0;
#else
      unsigned xb[JMAX][NT][2];
      constexpr bool xfrag = true;
#endif
      if (staged) {
        if (xfrag) smem_x_frags<NT, JMAX>(xb, xs, nw != nullptr, rstd, wp.K, k0, nsteps, B, warp, lane);
      } else {
        unsigned wv[JMAX][2];  // norm weights: immutable, loaded before the barrier so the two overlap
#pragma unroll
        for (int jj = 0; jj < JMAX; ++jj) {
          const int k = k0 + (warp + jj * CONSUMER_WARPS) * 16 + (lane & 3) * 2;
          const bool ld = nw != nullptr && warp + jj * CONSUMER_WARPS < nsteps;
          wv[jj][0] = ld ? ld_nc_u32(nw + k) : 0u;
          wv[jj][1] = ld ? ld_nc_u32(nw + k + 8) : 0u;
        }
        const unsigned long long gw0 = ph_on ? global_ns() : 0ull;
        cp_async_wait_all();  // this thread's copies of the group have landed ...
        consumer_sync();      // ... and everyone's; the other buffer's last readers are done too
        if (ph_on) ph_gwait += global_ns() - gw0;   // MK_TRACE_PHASES: counted as staging, not chunks
        if (xfrag) group_frags<NT, JMAX>(xb, xs + (gi & 1) * GROUP_BYTES, wv, nw != nullptr, rstd, KG, nsteps, B, warp,
                                         lane MK_SS_ARGS);
        if (k0 + KG < wp.K && xload) group_issue(xs + ((gi + 1) & 1) * GROUP_BYTES, x, wp.K, wp.ldx, k0 + KG, B, KG);
        ++gi;
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        // A pass of mt < MT M-tiles leaves the unrolled loop with one branch: an `if (m < mt)` per body made each
        // M-tile it lacks one more taken branch to a check ~2 KB further on, which the instruction fetch had not
        // reached (session 13's stall samples, 1B batch 1: ~390 "no instruction" samples on each check; session 33:
        // -1..-3% at batch 4..8, bench/NOTES.md)
        if (m >= mt) break;
        const int slot = it % NUM_STAGES;
        const long long c0 = clock64();
        // Not OK (this CTA is stopping): compute on whatever the slot holds -- the results are
        // discarded with the step -- keep every consumer_sync of the task, and do not free the
        // slot (its copy may still be landing); the loop ends at the next task boundary.
        const int ws = chunk_wait(S, P, slot, it);
        wait_cycles += clock64() - c0;
        const unsigned sb = S.ring(slot) + lane_off;
#pragma unroll
        for (int jj = 0; jj < JMAX; ++jj) {
          const int j = warp + jj * CONSUMER_WARPS;
          if (j < nsteps && !(MK_DIAG & 4)) {
            unsigned a[4];
#if MK_W_TMA
            ldmatrix_x4(a, sb + jj * W_JJ_BYTES);
#else
            ldmatrix_x4(a, sb + j * 32);
#endif
#pragma unroll
            for (int n = 0; n < NT; ++n) mma_16816(acc[m][n], a, xb[jj][n]);
          }
        }
        if (ws == WAIT_OK) mbar_arrive(S.empty_bar(slot));  // each thread releases its own reads
        ++it;
      }
    }
    }
    consumer_sync();  // every warp is done with the staged x before `red` overwrites it
    if (ph_on) {
      const unsigned long long now = global_ns();
      ph_chunks += now - ph_mark - ph_gwait;
      ph_stage += ph_gwait;
      ph_gwait = 0;
      ph_mark = now;
    }

    // Cross-warp reduction: red[warp][m][n][lane] (float4), then warp w owns tile w = m*NT + n.
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
        if (m < mt)
          reinterpret_cast<float4*>(red)[((warp * MT + m) * NT + n) * 32 + lane] =
              make_float4(acc[m][n][0], acc[m][n][1], acc[m][n][2], acc[m][n][3]);
    consumer_sync();
#if MK_RSTD_EPI
    {
      const int m = warp / NT, n = warp % NT;
      const bool mine = m < mt && !(wp.mtpu == 2 && (m & 1));
      float v[4] = {0.f, 0.f, 0.f, 0.f}, vu[4] = {0.f, 0.f, 0.f, 0.f};
      if (mine) {
        for (int w = 0; w < CONSUMER_WARPS; ++w) {
          const float4 a = reinterpret_cast<const float4*>(red)[((w * MT + m) * NT + n) * 32 + lane];
          v[0] += a.x; v[1] += a.y; v[2] += a.z; v[3] += a.w;
          if (wp.mtpu == 2) {
            const float4 c = reinterpret_cast<const float4*>(red)[((w * MT + m + 1) * NT + n) * 32 + lane];
            vu[0] += c.x; vu[1] += c.y; vu[2] += c.z; vu[3] += c.w;
          }
        }
      }
      if (epi_norm) {   // task-uniform: every consumer thread takes the barriers below
        if (acc_ss) {   // the first pass: its x^2 sums become rstd (red is free once every warp has read its sums)
          consumer_sync();
          float* part = red;   // [warp][MAX_BATCH], summed in warp order (rstd_from_parts): deterministic
#pragma unroll
          for (int n2 = 0; n2 < NT; ++n2) {
            ss[n2] += __shfl_xor_sync(0xffffffffu, ss[n2], 1);   // the token's 4 lanes' columns
            ss[n2] += __shfl_xor_sync(0xffffffffu, ss[n2], 2);
            if ((lane & 3) == 0) part[warp * MAX_BATCH + n2 * 8 + (lane >> 2)] = ss[n2];
          }
          consumer_sync();
          rstd_from_parts(part, B, S.rstd());
          consumer_sync();
        }
        // the accumulators' columns are tokens: y[b, row] = rstd[b] * sum_k W[row, k] round(x[b, k] w[k])
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int b = n * 8 + 2 * (lane & 3) + (e & 1);
          const float r = b < B ? S.rstd()[b] : 0.f;
          v[e] *= r;
          vu[e] *= r;
        }
      }
      if (mine) matvec_epilogue(S, P, t, p0, m, n, lane, v, vu, rres);
    }
#else
    {
      const int m = warp / NT, n = warp % NT;
      if (m < mt && !(wp.mtpu == 2 && (m & 1))) {
        float v[4] = {0.f, 0.f, 0.f, 0.f}, vu[4] = {0.f, 0.f, 0.f, 0.f};
        for (int w = 0; w < CONSUMER_WARPS; ++w) {
          const float4 a = reinterpret_cast<const float4*>(red)[((w * MT + m) * NT + n) * 32 + lane];
          v[0] += a.x; v[1] += a.y; v[2] += a.z; v[3] += a.w;
          if (wp.mtpu == 2) {
            const float4 c = reinterpret_cast<const float4*>(red)[((w * MT + m + 1) * NT + n) * 32 + lane];
            vu[0] += c.x; vu[1] += c.y; vu[2] += c.z; vu[3] += c.w;
          }
        }
        matvec_epilogue(S, P, t, p0, m, n, lane, v, vu, rres);
      }
    }
#endif
    consumer_sync();
    if (ph_on) ph_reduce += global_ns() - ph_mark;
  }
  if (ph_on) trace_phase_times(S, P, ph_stage, ph_chunks, ph_reduce, ph_entry);
  *wait_out += wait_cycles;
  if (is_ksplit(t)) ksplit_merge(S, P, t);   // o_proj.cuh: the last part of the range adds the parts
  return it;
}

}  // namespace mk

// MK_WGMMA_A's task (compiled out of other builds; after the epilogue declarations above)
#include "matvec_wgmma_a.cuh"
