// The wgmma path's x staging (MK_WGMMA_A's consumers, csrc/matvec_wgmma_a.cuh): its geometry, x's column groups
// in shared memory, their copies, waits and normalisation, MK_WGA_X's rstd epilogue and MK_WGA_NWS's norm-weight
// staging. Split from matvec_wgmma_a.cuh in session 47 (the file had passed ~500 lines); the code is as it was.
//
// x: one column group of 512 columns at a time (two chunks), double-buffered through cp.async as the default path's
// group staging, but laid out for wgmma: [64-column group c 0..7][token 0..15][128 B], 16-byte unit u of a token's
// line at u ^ (token & 7) (the 128-byte swizzle; tokens past the batch are never written, their sums are dropped).
// Norm-fused ops normalise their own copied units in place (norm_pair with rows_rstd's rstd: the default's x' bits).
//
// MK_WGA_X (session 30, default 0; variant.KernelVariant.wga_x, a per-batch knob of the tables: ScheduleTuning.wga_x):
// the norm's 1/rms moves to the epilogue (MK_RSTD_EPI's form: x' = round(x * w) normalised in place, the accumulators
// scaled by rstd[b]), the first pass summing x^2 per thread from its groups as it normalises them: qkv / gate_up start
// without rows_rstd's L2 rounds (~2.5 us a task at 8B batch 16). Measured (H200, bench/NOTES.md session 30): 8B batch
// 16 -2.1%, 1B batch 16 -3.3% against the tables' builds. As measured it also loads each thread's norm weights of the
// next group one group ahead (a thread's units share one 16-byte column unit) and, where the scratch holds four groups
// (num_stages <= 5), keeps three groups of copies in flight (cp.async.wait_group 2; a group past K commits an empty
// group, so every wait counts alike). Those two alone (session 30's MK_WGA_X=1, normalising with rows_rstd's rstd)
// measured +0.7% at 8B batch 9..16, and the 4-buffer pipeline at 5 slots lost to 6 slots: the groups' stage time is
#pragma once
#include "common.cuh"
#include "weight_tma.cuh"
#include "matvec_plan.cuh"
#include "x_frags.cuh"
#include "wgmma.cuh"

namespace mk {

#if MK_WGMMA_A
static_assert(MK_W_TMA, "MK_WGMMA_A copies its chunks with MK_W_TMA's one-column-group tensor maps");
static_assert(!MK_RSTD_EPI, "MK_WGMMA_A: x' normalised with rows_rstd's rstd (MK_RSTD_EPI's scaling not built)");

constexpr int WGA_RB = MK_WGMMA_A;                // row blocks (of 64 rows) per pass
static_assert(WGA_RB == 1 || WGA_RB == 2 || WGA_RB == 4, "MK_WGMMA_A: 1, 2 or 4 row blocks per pass");
constexpr int WGA_KC = 256;                       // columns per chunk
constexpr int WGA_GROUPS = WGA_KC / W_KG_COLS;    // 64-column groups per chunk
constexpr int WGA_BT = 4;                         // M-tiles per row block
constexpr int WGA_MT = WGA_BT * WGA_RB;           // M-tiles per pass
constexpr int WGA_GROUP_BYTES = WGA_BT * W_KG_BYTES;   // one column group of a row block: 8 KB
constexpr int WGA_XG = 512;                       // x columns staged at once (two column steps)
constexpr int WGA_XLINE = 16 * 128;               // one 64-column group of x: 16 token lines of 128 B
constexpr int WGA_SUM_BYTES = 2 * WGA_MT * 2 * 32 * 16;   // a pass's sums: [warpgroup][M-tile][n-tile][lane] float4
static_assert(WGA_GROUPS * WGA_GROUP_BYTES == 32768, "a chunk is 64 rows x 256 columns");
static_assert((WGA_XG / W_KG_COLS) * WGA_XLINE <= GROUP_BYTES, "an x group fits a staging buffer");
static_assert(WGA_SUM_BYTES <= UNION_BYTES, "a pass's sums fit the scratch");
static_assert(MAX_BATCH == 16, "x' is one n16 operand");
// MK_WGA_X: x group buffers in the scratch (4 where it holds them: num_stages <= 5) and the groups in flight ahead of
// the one in use
constexpr int WGA_NBUF = (MK_WGA_X && UNION_BYTES >= 4 * GROUP_BYTES) ? 4 : 2;
constexpr int WGA_AHEAD = WGA_NBUF - 1;
static_assert(WGA_NBUF * GROUP_BYTES <= UNION_BYTES, "MK_WGA_X: the x group buffers fit the scratch");
#if MK_WGA_NWS
static_assert(MK_WGA_X == 2 && WGA_AHEAD == 1, "MK_WGA_NWS: MK_WGA_X = 2 at 6 ring slots (one x group ahead)");
constexpr int WGA_NWS_OFF = MISC_OFF + MISC_BYTES;   // after the misc block: the 32 KB slots' unused padding
static_assert(WGA_NWS_OFF % 16 == 0 && WGA_NWS_OFF + WGA_XG * 2 <= SMEM_BYTES, "MK_WGA_NWS: a group's norm weights "
              "fit the free shared memory after the misc block");
// the norm-weight buffer from the scratch pointer (xs = S.scratch())
__device__ __forceinline__ unsigned char* wga_nws(unsigned char* xs) { return xs + (WGA_NWS_OFF - UNION_OFF); }
#endif
#if MK_WGA_X
static_assert(MK_WGA_X == 1 || MK_WGA_X == 2, "MK_WGA_X: 0, 1 or 2");
static_assert(MK_ROUNDING == 0, "MK_WGA_X: the fused rounding only (STOCK rounds x * rstd before the weight)");
static_assert(MK_DTYPE_BF16, "MK_WGA_X: bf16 models only (x * w is not range-normalised)");
#define WGA_EPI_PARAM , bool scale
#define WGA_EPI_ARG(v) , v
#else
#define WGA_EPI_PARAM
#define WGA_EPI_ARG(v)
#endif
// MK_WGA_NWS (session 46, default 0; variant.KernelVariant.wga_nws, a per-batch knob of the tables since session 47:
// ScheduleTuning.wga_nws): a norm-fused op's norm weights travel with its x groups -- each group's 1 KB (512 columns)
// by cp.async into shared memory (the wgmma build's free tail after the misc block), issued with the group's x copies
// by the first warp of each warpgroup (its lanes are the warpgroup's 32 column units: wga_unit's u at b0 = 0) -- so
// the ready step's copies' wait covers them and its RET waits for no load. Without it the next group's weights are a register load that the out-of-line ready step's
// RET waits for: an L2 round trip on every group (sass_waits.py; session 45's bound, MK_DIAG & 64, kept it, session
// 33's L1 prefetch removed it but left the copies' wait). One buffer: the next group's weights go out after the
// barrier that ends this group's normalisation, so only one group ahead (6 ring slots: WGA_AHEAD == 1); the other
// three warps of a warpgroup read the units their warp 0 copied, behind one more warpgroup barrier a group.
#if MK_WGA_NWS
#define WGA_NW_PARAM , const elem_t* nw
#define WGA_NW_ARG(v) , v
#else
#define WGA_NW_PARAM
#define WGA_NW_ARG(v)
#endif

// Whether a pass of this task takes this path (the producer and the consumers decide alike): two n-tiles, whole
// 256-column chunks (K, or a K-split part's width).
// MK_WGA_ONLY (session 49; the decoder's default where it holds since session 50): every task of this batch-9..16
// build has whole chunks (the host checks the program's widths: tasks.class_build), so the default path at two
// n-tiles leaves the build
__device__ __forceinline__ bool wga_takes(int K, int B) {
  return MK_WGA_ONLY || (batch_ntiles(B) == 2 && K % WGA_KC == 0);
}

// ---- consumers ----
// x's 16-byte unit u (0..WGA_XG / 8) of token b in a staging buffer.
__device__ __forceinline__ int wga_xunit(int b, int u) {
  return (u >> 3) * WGA_XLINE + b * 128 + (((u & 7) ^ (b & 7)) << 4);
}

// The copies of x[:, k0 : k0 + WGA_XG) (fewer at K's end) into buffer gb; thread idx takes units idx, idx + 256, ..
// (wga_group_ready normalises the same units).
__device__ __forceinline__ void wga_group_issue(unsigned char* gb, const elem_t* x, int K, int ldx, int k0, int B) {
  constexpr int UPR = WGA_XG / 8;
  const int valid = min(WGA_XG, K - k0) / 8;
  for (int idx = threadIdx.x; idx < B * UPR; idx += CONSUMER_THREADS) {
    const int b = idx / UPR, u = idx - b * UPR;
    if (u < valid) cp_async16(smem_addr(gb + wga_xunit(b, u)), x + (size_t)b * ldx + k0 + u * 8);
  }
  cp_async_commit();
}

// Buffer gb's group (columns k0 ..) landed and, for a norm-fused op, normalised in place (x' = norm_pair(x, rstd[b],
// nw), the default path's bits), visible to the wgmmas; then the next group's copies go into the other buffer (its
// last wgmmas completed before this call: the caller's wait_group 0). Out of line: no wgmma is in flight here.
__device__ __noinline__ void wga_group_ready(const Smem S, unsigned char* gb, unsigned char* next, const elem_t* x,
                                             const elem_t* nw, int K, int ldx, int k0, int B) {
  constexpr int UPR = WGA_XG / 8;
  cp_async_wait_all();   // this thread's copies: the units it normalises below are its own
  if (nw != nullptr) {
    const float* rstd = S.rstd();
    const int valid = min(WGA_XG, K - k0) / 8;
    for (int idx = threadIdx.x; idx < B * UPR; idx += CONSUMER_THREADS) {
      const int b = idx / UPR, u = idx - b * UPR;
      if (u < valid) {
        uint4* p = reinterpret_cast<uint4*>(gb + wga_xunit(b, u));
        uint4 v = *p;
        const uint4 w = __ldg(reinterpret_cast<const uint4*>(nw + k0 + u * 8));
        const float r = rstd[b];
        v.x = norm_pair(v.x, r, w.x);
        v.y = norm_pair(v.y, r, w.y);
        v.z = norm_pair(v.z, r, w.z);
        v.w = norm_pair(v.w, r, w.w);
        *p = v;
      }
    }
  }
  wg_fence_proxy();
  consumer_sync();   // everyone's units are in; the other buffer's readers are done
  if (next != nullptr) wga_group_issue(next, x, K, ldx, k0 + WGA_XG, B);
}

#if MK_WGA_X
// A thread's units in every group: one 16-byte column unit u (0 .. WGA_UPR - 1) of tokens b0 + 4 i (i < 4), so the
// same norm weights for all four. MK_WGA_X = 1: u = threadIdx.x % UPR, b0 = threadIdx.x / UPR (a token's units: two
// warps). MK_WGA_X = 2 (A/B switch, session 30): warpgroup g's threads take only the columns its wgmmas read (64-column
// groups 2 g, 2 g + 1, 4 + 2 g, 5 + 2 g of the 512: k-steps 8 g .. 8 g + 7 of each chunk), lane l of its warp w % 4
// unit l % 8 of x group (l / 8), tokens w % 4 + 4 i: each warpgroup copies, waits for and normalises its own half, so
// a group's ready step needs only the warpgroup's own barrier (named barrier 2 + g) and the two warpgroups no longer
// meet at every group.
constexpr int WGA_UPR = WGA_XG / 8;
static_assert(CONSUMER_THREADS % WGA_UPR == 0 && 4 * (CONSUMER_THREADS / WGA_UPR) == MAX_BATCH,
              "MK_WGA_X: a thread's units are one column unit of 4 tokens");
static_assert(CONSUMER_WARPS == 8 && WGA_GROUPS == 4, "MK_WGA_X = 2: two warpgroups, each two of a chunk's column groups");
struct WgaUnit {
  int u, b0;
};
__device__ __forceinline__ WgaUnit wga_unit() {
#if MK_WGA_X == 2
  const int l = threadIdx.x & 127, q = (l & 31) >> 3;
  return {(2 * (threadIdx.x >> 7) + (q & 1) + 4 * (q >> 1)) * 8 + (l & 7), l >> 5};
#else
  WgaUnit r;   // unsigned arithmetic, as measured
  r.u = threadIdx.x % WGA_UPR;
  r.b0 = threadIdx.x / WGA_UPR;
  return r;
#endif
}
// The barrier of a group's ready step: every consumer (MK_WGA_X = 1), or this thread's warpgroup (2).
__device__ __forceinline__ void wga_group_sync() {
#if MK_WGA_X == 2
  asm volatile("bar.sync %0, 128;" ::"r"(2 + (int)(threadIdx.x >> 7)) : "memory");
#else
  consumer_sync();
#endif
}

// Group gi of a pass (columns gi * WGA_XG ..) into its buffer, or an empty commit past K (every ready step waits for
// the same count of groups in flight). MK_WGA_X = 2: this thread's units only.
__device__ __forceinline__ void wga_issue(unsigned char* xs, int gi, const elem_t* x, int K, int ldx,
                                          int B WGA_NW_PARAM) {
  const int k0 = gi * WGA_XG;
#if MK_WGA_X == 2
  const WgaUnit un = wga_unit();
  if (k0 < K && un.u < min(WGA_XG, K - k0) / 8) {
    unsigned char* gb = xs + (gi & (WGA_NBUF - 1)) * GROUP_BYTES;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int b = un.b0 + 4 * i;
      if (b < B) cp_async16(smem_addr(gb + wga_xunit(b, un.u)), x + (size_t)b * ldx + k0 + un.u * 8);
    }
#if MK_WGA_NWS
    if (nw != nullptr && un.b0 == 0) cp_async16(smem_addr(wga_nws(xs) + un.u * 16), nw + k0 + un.u * 8);
#endif
  }
  cp_async_commit();
#else
  if (k0 < K)
    wga_group_issue(xs + (gi & (WGA_NBUF - 1)) * GROUP_BYTES, x, K, ldx, k0, B);
  else
    cp_async_commit();
#endif
}

// What one group's ready step hands to the next: the next group's norm weights of this thread's column unit, and (a
// task's first pass) this thread's tokens' sums of x^2 so far.
struct WgaCarry {
#if !MK_WGA_NWS   // MK_WGA_NWS: the weights come from shared memory in the ready step, nothing to carry
  uint4 w;
#endif
  float ss[4];
};
__device__ __forceinline__ uint4 wga_norm_w(const elem_t* nw, int K, int k0) {
  const int k = k0 + wga_unit().u * 8;
  return nw != nullptr && k < K ? __ldg(reinterpret_cast<const uint4*>(nw + k)) : make_uint4(0u, 0u, 0u, 0u);
}

// MK_WGA_X's ready step of group gi: its copies landed (WGA_AHEAD - 1 later groups may still be in flight), a
// norm-fused op's units normalised in place with the weights loaded a group ago (x' = round(x * w), x^2 summed on the
// first pass), visible to the wgmmas; then group gi + WGA_AHEAD's
// copies go into the buffer group gi - 1 used (its wgmmas completed before this call) and the next group's weights
// are loaded. Out of line: no wgmma is in flight here. (S is unused since the rstd-normalising form left; the
// signature is the measured build's.)
__device__ __noinline__ WgaCarry wga_group_ready_x(const Smem S, unsigned char* xs, int gi, const elem_t* x,
                                                   const elem_t* nw, int K, int ldx, int B, WgaCarry c, bool acc_ss) {
  constexpr int TSTEP = CONSUMER_THREADS / WGA_UPR;
  const WgaUnit un = wga_unit();
  const int u = un.u, b0 = un.b0, k0 = gi * WGA_XG;
  unsigned char* gb = xs + (gi & (WGA_NBUF - 1)) * GROUP_BYTES;
  // MK_DIAG & 64 (timing only, wrong results; session 44): a pass's groups after its first are used as they stand --
  // no wait for their copies, no normalisation, no barrier (the copies still go out): the ready steps' share of the
  // batch 9..16 step. Folds away in every other build.
  // MK_DIAG & 128 (timing only, wrong results; session 46): the next group's norm-weight load below (and in the
  // early return) is skipped, so the RET waits for nothing: with 64, the ready step gone whole for groups after a
  // pass's first; alone, the norm-weight round trip a group without the copies' waits (session 45's bound kept it).
  if ((MK_DIAG & 64) && gi > 0) {
    wga_issue(xs, gi + WGA_AHEAD, x, K, ldx, B WGA_NW_ARG(nw));
#if !MK_WGA_NWS
    if (!(MK_DIAG & 128)) c.w = wga_norm_w(nw, K, k0 + WGA_XG);
#endif
    return c;
  }
  cp_async_wait_group<WGA_AHEAD - 1>();   // this thread's copies of group gi: the units it normalises below
#if MK_WGA_NWS
  uint4 w = make_uint4(0u, 0u, 0u, 0u);
  if (nw != nullptr) {
    wga_group_sync();   // warp 0's copies of this group's norm weights are in for its whole warpgroup
    if (u < min(WGA_XG, K - k0) / 8) w = *reinterpret_cast<const uint4*>(wga_nws(xs) + u * 16);
  }
#else
  const uint4 w = c.w;
#endif
  if (nw != nullptr && u < min(WGA_XG, K - k0) / 8) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int b = b0 + i * TSTEP;
      if (b < B) {
        uint4* p = reinterpret_cast<uint4*>(gb + wga_xunit(b, u));
        uint4 v = *p;
        if (acc_ss) c.ss[i] = sumsq8(v, c.ss[i]);
        v.x = norm_pair(v.x, 1.f, w.x);   // round(x * w): rstd scales the sums in the epilogue
        v.y = norm_pair(v.y, 1.f, w.y);
        v.z = norm_pair(v.z, 1.f, w.z);
        v.w = norm_pair(v.w, 1.f, w.w);
        *p = v;
      }
    }
  }
  wg_fence_proxy();
  wga_group_sync();   // everyone's units are in; group gi - 1's buffer is no longer read
  wga_issue(xs, gi + WGA_AHEAD, x, K, ldx, B WGA_NW_ARG(nw));
  // Not in flight past the return: ptxas makes this function's RET (and any CALL) wait for the load (SASS control
  // bits; bench/sass_waits.py). Moving it to the caller, inlining this step and prefetching the norm weights into L1
  // (MK_NW_L1, sessions 31 / 33 / 45: 8B / 1B b16 -1.0 / -1.3%, under its bar) were tried: bench/NOTES.md.
#if !MK_WGA_NWS
  if (!(MK_DIAG & 128)) c.w = wga_norm_w(nw, K, k0 + WGA_XG);
#endif
  return c;
}

// The end of a task's first pass (every wgmma done with x; task-uniform): the threads' sums of x^2 to rstd[b]
// (a token's units are two warps' lanes -- MK_WGA_X = 2: one warp of each warpgroup -- summed by shuffles, then the two
// warps in order: deterministic).
__device__ __forceinline__ void wga_rstd(const Smem& S, unsigned char* xs, const WgaCarry& c, int B, int warp,
                                         int lane) {
  constexpr int TSTEP = CONSUMER_THREADS / WGA_UPR;
  float* part = reinterpret_cast<float*>(xs);   // [the token's first or second warp][MAX_BATCH]
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float s = c.ss[i];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) part[(MK_WGA_X == 2 ? warp >> 2 : warp & 1) * MAX_BATCH + wga_unit().b0 + i * TSTEP] = s;
  }
  consumer_sync();
  if (threadIdx.x < B) S.rstd()[threadIdx.x] = rsqrtf((part[threadIdx.x] + part[MAX_BATCH + threadIdx.x]) / (float)H + EPS);
  consumer_sync();   // rstd is in and the sums may overwrite part
}
#endif
#endif  // MK_WGMMA_A

}  // namespace mk
