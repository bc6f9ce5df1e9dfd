// The consumers' operands of a matvec task (matvec.cuh): ldmatrix / mma.m16n8k16 wrappers, and the activations
// x[B, K] brought to shared memory (stage_x: whole, rows padded; group_issue: one column group at a time through
// cp.async, double-buffered) and read out as the mma's B fragments (smem_x_frags, group_frags).
#pragma once
#include "common.cuh"
#include "matvec_plan.cuh"

namespace mk {

__device__ __forceinline__ void ldmatrix_x4(unsigned (&a)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr) : "memory");
}

// The B (activation) fragments of one k-step at NT = 2 by ldmatrix: one LDSM.x4 for both n-tiles instead of four
// LDS.32 and their swizzle arithmetic. Lane l addresses row l & 7 of matrix l >> 3 = (n-tile, k half), the layout
// mma's col B operand wants (thread t: batch row t / 4, columns 2 (t % 4) and + 1); rows at or past B are read
// and then zeroed. Session 14's A/B (MK_B_LDSM, bench/NOTES.md): batch 16 -23 us at 1B, -122 at 8B; at NT = 1
// (x2 for the one n-tile) +17 / +45 at batch 8, so batch <= 8 keeps the 32-bit loads.
__device__ __forceinline__ void ldsm_b(unsigned (&xb)[2][2], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(xb[0][0]), "=r"(xb[0][1]), "=r"(xb[1][0]), "=r"(xb[1][1]) : "r"(addr) : "memory");
}

__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#if MK_DTYPE_BF16
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// The one-n-tile fragments from loaded (and normalised) values v: zero where the lane's batch row is past B or its
// k-step past the chunk's nsteps (those lanes loaded a valid staged row instead, to keep the loads unconditional).
template <int JMAX>
__device__ __forceinline__ void zero_padding1(unsigned (&xb)[JMAX][1][2], const unsigned (&v)[JMAX][2], bool rowok,
                                              int nsteps, int warp) {
#pragma unroll
  for (int jj = 0; jj < JMAX; ++jj) {
    const bool ok = rowok && warp + jj * CONSUMER_WARPS < nsteps;
    xb[jj][0][0] = ok ? v[jj][0] : 0u;
    xb[jj][0][1] = ok ? v[jj][1] : 0u;
  }
}

// ---- Column-group staging: activations that do not fit the scratch whole ---------------------
// x[:, k0 : k0 + KC] of one column group lands in one of two GROUP_BYTES buffers at the start of the
// scratch through cp.async (16-byte copies, L2: the data was written during this launch), group
// g + 1 in flight while group g computes, so the L2 round trip overlaps the ring waits and MMAs
// instead of preceding them (the per-warp fragment loads this replaces cost one exposed round trip per
// group: ~0.7 ms of a batch-8 1B step, bench/NOTES.md session 5). Rows are KC * 2 bytes with their
// 16-byte units XOR-swizzled by (row & 7): conflict-free copies and fragment reads without padding.
constexpr int GROUP_BYTES = 16 * CHUNK_COLS;   // 8 rows x 1024 columns (NT=1) or 16 rows x 512 (NT=2)
static_assert(2 * GROUP_BYTES <= UNION_BYTES, "two column-group buffers in the scratch");

__device__ __forceinline__ void group_issue(unsigned char* gb, const elem_t* x, int K, int ldx, int k0, int B,
                                            int KC) {
  const int upr = KC / 8;                      // 16-byte units per row
  const int valid = (min(KC, K - k0)) / 8;     // K is a multiple of 16
  // At one n-tile (KC = CHUNK_COLS; batch <= 8) the group buffer's R units per thread are unrolled and predicated,
  // instead of a loop whose back edges (up to 4 at batch 8) redirect the instruction fetch every column group (session
  // 32). Not at two n-tiles: there it moved ptxas's allocation of mk_decode to spills (8B wgmma build).
  constexpr int R = GROUP_BYTES / 16 / CONSUMER_THREADS;
  static_assert(R * 16 * CONSUMER_THREADS == GROUP_BYTES, "whole units per thread");
  if (KC == CHUNK_COLS) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int idx = threadIdx.x + r * CONSUMER_THREADS;
      const int b = idx / upr, c = idx - b * upr;
      if (idx < B * upr && c < valid)
        cp_async16(smem_addr(gb + b * KC * 2 + ((c ^ (b & 7)) << 4)), x + (size_t)b * ldx + k0 + c * 8);
    }
  } else {
    for (int idx = threadIdx.x; idx < B * upr; idx += CONSUMER_THREADS) {
      const int b = idx / upr, c = idx - b * upr;
      if (c < valid) cp_async16(smem_addr(gb + b * KC * 2 + ((c ^ (b & 7)) << 4)), x + (size_t)b * ldx + k0 + c * 8);
    }
  }
  cp_async_commit();
}

// B fragments of this warp's k-steps j = warp + 8*jj (nsteps 16-column steps in the group) from a
// staged group; wv: the norm weights of the same columns (norm-fused ops), loaded by the caller.
// MK_RSTD_EPI (A/B switch, default 0; variant.KernelVariant.rstd_epi): the norm's 1/rms leaves the fragments (x' =
// round(x * w)) and scales the accumulators in the epilogue instead (rstd is one factor per token, a column of the
// product); the pass's first column groups also sum x^2 per token into ss (this lane's token of each n-tile), so no
// rows_rstd round trips precede the chunk loop. MK_SS_PARAMS / MK_SS_ARGS are empty in every other build.
#if MK_RSTD_EPI
#define MK_SS_PARAMS , bool acc_ss, float (&ss)[NT]
#define MK_SS_ARGS , acc_ss, ss
static_assert(MK_ROUNDING == 0, "MK_RSTD_EPI: the fused rounding only (STOCK rounds x * rstd before the weight)");
// x * w is not range-normalised: fp16's 65504 (and its subnormals where rstd > 1) would bite, bf16's range does not
static_assert(MK_DTYPE_BF16, "MK_RSTD_EPI: bf16 models only");
__device__ __forceinline__ float sumsq_pair(unsigned u, float ss) {
  const float a = lo_f(u), c = hi_f(u);
  return fmaf(c, c, fmaf(a, a, ss));
}
#else
#define MK_SS_PARAMS
#define MK_SS_ARGS
#endif

template <int NT, int JMAX>
__device__ __forceinline__ void group_frags(unsigned (&xb)[JMAX][NT][2], const unsigned char* gb,
                                            const unsigned (&wv)[JMAX][2], bool norm, const float* rstd, int KC,
                                            int nsteps, int B, int warp, int lane MK_SS_PARAMS) {
  if constexpr (NT == 2) {   // ldsm_b: measured faster at batch 9..16 only (see there)
    // (the mask-and-normalise lines below repeat smem_x_frags': as one shared helper they changed the PTX of
    // matvec_task<2>, i.e. no longer the measured build; checked in session 14)
    // lane's ldmatrix row: batch row bi = (mat >> 1) * 8 + (lane & 7) of matrix mat = lane >> 3, k half mat & 1
    const int lbi = min(((lane >> 4) << 3) + (lane & 7), B - 1);   // rows past B: any staged row (zeroed below)
    const unsigned lrow = smem_addr(gb + lbi * KC * 2);
    const int lhalf = (lane >> 3) & 1;
#pragma unroll
    for (int jj = 0; jj < JMAX; ++jj) {
      const int j = warp + jj * CONSUMER_WARPS;
      unsigned f[NT][2] = {};
      if (j < nsteps) ldsm_b(f, lrow + (((2 * j + lhalf) ^ (lbi & 7)) << 4));
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int bi = n * 8 + (lane >> 2);
        unsigned v0 = 0, v1 = 0;
        if (j < nsteps && bi < B) {
          v0 = f[n][0];
          v1 = f[n][1];
#if MK_RSTD_EPI
          if (acc_ss) ss[n] = sumsq_pair(v1, sumsq_pair(v0, ss[n]));
#endif
          if (norm) {
            const float r = MK_RSTD_EPI ? 1.f : rstd[bi];
            v0 = norm_pair(v0, r, wv[jj][0]);
            v1 = norm_pair(v1, r, wv[jj][1]);
          }
        }
        xb[jj][n][0] = v0;
        xb[jj][n][1] = v1;
      }
    }
  } else {
    static_assert(NT == 1, "the one-n-tile fragments");
    // As smem_x_frags' one-n-tile case, from the swizzled group buffer (row 0 is always copied; a short
    // group's k-steps past its end read the last copied one).
    const int bi = lane >> 2;
    const bool rowok = bi < B;
    const int bc = rowok ? bi : 0;
    const unsigned char* row = gb + bc * KC * 2 + (lane & 3) * 4;
    const float r = norm ? (MK_RSTD_EPI ? 1.f : rstd[bc]) : 0.f;
    unsigned xv[JMAX][2];
#pragma unroll
    for (int jj = 0; jj < JMAX; ++jj) {
      const int j = min(warp + jj * CONSUMER_WARPS, nsteps - 1);
      xv[jj][0] = *reinterpret_cast<const unsigned*>(row + (((2 * j) ^ (bc & 7)) << 4));
      xv[jj][1] = *reinterpret_cast<const unsigned*>(row + (((2 * j + 1) ^ (bc & 7)) << 4));
    }
#if MK_RSTD_EPI   // the lane's row and k-steps that count (the clamped ones re-read a valid step)
    if (acc_ss && rowok) {
#pragma unroll
      for (int jj = 0; jj < JMAX; ++jj)
        if (warp + jj * CONSUMER_WARPS < nsteps) ss[0] = sumsq_pair(xv[jj][1], sumsq_pair(xv[jj][0], ss[0]));
    }
#endif
    if (norm) {
#pragma unroll
      for (int jj = 0; jj < JMAX; ++jj) {
        xv[jj][0] = norm_pair(xv[jj][0], r, wv[jj][0]);
        xv[jj][1] = norm_pair(xv[jj][1], r, wv[jj][1]);
      }
    }
    zero_padding1<JMAX>(xb, xv, rowok, nsteps, warp);
  }
}

// Whole-task activation staging: x[B, K] as stored into shared memory, rows padded to K*2 + 16
// bytes (an odd number of 16-byte units: the fragment reads below are conflict-free), and for a
// norm-fused op the norm weight nw[K] as one more row after them, loaded in the same round of L2
// requests. The rows' 1/rms (rstd[b] = rsqrt(sum_k x[b,k]^2 / H + eps)) then comes from the staged
// copy: one L2 round trip per pass instead of two (rows_rstd, then staging). Used when it fits the
// scratch (staged_fits). Ends with consumer_sync().
constexpr int STAGE_PART_BYTES = 4 * CONSUMER_WARPS * MAX_BATCH;  // per-warp row sums, end of scratch

#if MK_X_WHOLE && (MK_X_GROUPS || !MK_NTILES)
static_assert(false, "MK_X_WHOLE stages every task's x whole: build it with MK_NTILES and without MK_X_GROUPS");
#endif
__device__ __forceinline__ bool staged_fits(int K, int B, bool norm) {
  if (MK_X_GROUPS) return false;   // A/B switch (session 47): x by column groups at every batch size
  if (MK_X_WHOLE) return true;     // session 50's default where it holds: the host found every task's x fits (tasks.class_build)
  return (B + (norm ? 1 : 0)) * (K * 2 + 16) <= UNION_BYTES - STAGE_PART_BYTES;
}

__device__ __forceinline__ void stage_x(unsigned char* xs, const elem_t* x, const elem_t* nw, float* rstd, int K,
                                        int ldx, int B, int warp, int lane) {
  const int vpr = K / 8;
  const int total = (B + (nw != nullptr ? 1 : 0)) * vpr;
  const int rowb = K * 2 + 16;
  constexpr int U = 4;
  for (int base = threadIdx.x; base < total; base += U * CONSUMER_THREADS) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int idx = base + u * CONSUMER_THREADS;
      const int b = idx / vpr, kv = idx - b * vpr;
      v[u] = make_uint4(0u, 0u, 0u, 0u);
      if (idx < total)
        v[u] = b < B ? ld_cg_v4(x + (size_t)b * ldx + kv * 8) : __ldg(reinterpret_cast<const uint4*>(nw + kv * 8));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int idx = base + u * CONSUMER_THREADS;
      if (idx < total) {
        const int b = idx / vpr, kv = idx - b * vpr;
        *reinterpret_cast<uint4*>(xs + (size_t)b * rowb + kv * 16) = v[u];
      }
    }
  }
  consumer_sync();
  // MK_DIAG & 256 (timing only, wrong results; session 52): the norm statistics below skipped (rstd keeps whatever
  // it held): what the sum-of-squares pass, its shuffles and two barriers cost a norm-fused op's staging (qkv_rope's
  // and gate_up's b1 stage took 1.6 / 2.2 us against o_proj's 0.6 in session 50's records)
  if (nw == nullptr || (MK_DIAG & 256)) return;
  float* part = reinterpret_cast<float*>(xs + UNION_BYTES - STAGE_PART_BYTES);
  for (int b = 0; b < B; ++b) {  // fixed summation order: bit-identical across runs
    float ss = 0.f;
    for (int kv = threadIdx.x; kv < vpr; kv += CONSUMER_THREADS)
      ss = sumsq8(*reinterpret_cast<const uint4*>(xs + (size_t)b * rowb + kv * 16), ss);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) part[warp * MAX_BATCH + b] = ss;
  }
  consumer_sync();
  rstd_from_parts(part, B, rstd);
  consumer_sync();
}

// B fragments from the staged copy (see load_x_frags for the fragment layout and the
// normalisation, here with the norm weight from the staged row B).
template <int NT, int JMAX>
__device__ __forceinline__ void smem_x_frags(unsigned (&xb)[JMAX][NT][2], const unsigned char* xs, bool norm,
                                             const float* rstd, int K, int k0, int nsteps, int B, int warp,
                                             int lane) {
  const int rowb = K * 2 + 16;
  if constexpr (NT == 2) {   // ldsm_b: measured faster at batch 9..16 only (see there)
    // ldmatrix rows as in group_frags; padded rows (an odd number of 16-byte units) keep the 8 rows of a
    // matrix on distinct banks
    const int lbi = min(((lane >> 4) << 3) + (lane & 7), B - 1);   // rows past B: any staged row (zeroed below)
    const unsigned lrow = smem_addr(xs + lbi * rowb + k0 * 2 + ((lane >> 3) & 1) * 16);
#pragma unroll
    for (int jj = 0; jj < JMAX; ++jj) {
      const int j = warp + jj * CONSUMER_WARPS;
      const int off = (k0 + j * 16 + (lane & 3) * 2) * 2;
      unsigned w0 = 0, w1 = 0;
      if (norm && j < nsteps) {
        w0 = *reinterpret_cast<const unsigned*>(xs + B * rowb + off);
        w1 = *reinterpret_cast<const unsigned*>(xs + B * rowb + off + 16);
      }
      unsigned f[NT][2] = {};
      if (j < nsteps) ldsm_b(f, lrow + j * 32);
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int bi = n * 8 + (lane >> 2);
        unsigned v0 = 0, v1 = 0;
        if (j < nsteps && bi < B) {
          v0 = f[n][0];
          v1 = f[n][1];
          if (norm) {
            const float r = rstd[bi];
            v0 = norm_pair(v0, r, w0);
            v1 = norm_pair(v1, r, w1);
          }
        }
        xb[jj][n][0] = v0;
        xb[jj][n][1] = v1;
      }
    }
  } else {
    static_assert(NT == 1, "the one-n-tile fragments");
    // No branch per k-step (MK_XFRAG's A/B, session 24: 1B b1 -23 us, 8B b8 -76; bench/NOTES.md). Every lane
    // loads from a staged row (a lane of a row past B reads row 0; a tail chunk's k-steps past nsteps read the
    // last valid one), all of the chunk's loads first, then the norm, then a select zeroes the padding: the
    // k-steps' loads are in flight together instead of one divergent branch (BSSY/BSYNC) and one rstd load per
    // k-step (the former build's SASS, session 23). Bitwise the former build's fragments.
    const int bi = lane >> 2;
    const bool rowok = bi < B;
    const unsigned char* xr = xs + (rowok ? bi : 0) * rowb;
    const unsigned char* wr = xs + B * rowb;   // the staged norm weights (norm-fused ops)
    const float r = norm ? rstd[rowok ? bi : 0] : 0.f;
    unsigned xv[JMAX][2], wv[JMAX][2];
#pragma unroll
    for (int jj = 0; jj < JMAX; ++jj) {
      const int off = (k0 + min(warp + jj * CONSUMER_WARPS, nsteps - 1) * 16 + (lane & 3) * 2) * 2;
      xv[jj][0] = *reinterpret_cast<const unsigned*>(xr + off);
      xv[jj][1] = *reinterpret_cast<const unsigned*>(xr + off + 16);
      wv[jj][0] = norm ? *reinterpret_cast<const unsigned*>(wr + off) : 0u;
      wv[jj][1] = norm ? *reinterpret_cast<const unsigned*>(wr + off + 16) : 0u;
    }
    if (norm) {   // one (warp-uniform) branch for all k-steps
#pragma unroll
      for (int jj = 0; jj < JMAX; ++jj) {
        xv[jj][0] = norm_pair(xv[jj][0], r, wv[jj][0]);
        xv[jj][1] = norm_pair(xv[jj][1], r, wv[jj][1]);
      }
    }
    zero_padding1<JMAX>(xb, xv, rowok, nsteps, warp);
  }
}

}  // namespace mk
