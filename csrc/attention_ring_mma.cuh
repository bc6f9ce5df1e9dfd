// The consumers of a ring-fed attention task (MK_ATT_TMA, attention_tma.cuh: its K/V tiles streamed through the
// weight ring) on the tensor cores. Built in session 25 as the A/B switch MK_RING_MMA, measured in session 26
// against the CUDA-core loop that consumed the ring before (8B ctx 8192 batch 8 / 16: 7804 -> 6026 / 12756 ->
// 9256 us; ctx 512 -150 / -208 us; bench/results/mk_ab_2026-12-04_880feaf_ring_mma.md): it replaced that loop.
//
// Why: the CUDA-core loop (attention.cuh attn_token) spends per token and lane group 4 x 8 FMAs, 4 x 4 dependent
// shuffles and an online-softmax update per head; at 8B ctx 8192 a step without any copies (MK_DIAG=2) kept 84-92%
// of its time (bench/NOTES.md session 25): with the ring feeding them, the consumers bound long contexts.
// (Session 15's MK_ATT_MMA put the register-fed loop on tensor cores and gained 1%: that loop was bound by its
// loads in flight, which the ring has since removed. Its layout was K . q^T with movmatrix; this one is Q K^T.)
//
// Layout: the tiles land 64-byte swizzled (tensormap.kv_tile_map_args): a block's K (then V) of
// head g as [D / 32 parts][16 token rows][32 columns = 64 bytes], the 16-byte chunk c of a row at chunk
// c ^ (address bits 7..8), so the 8 token rows of one ldmatrix read sit in 8 different bank groups (the plain
// tile's rows are D * 2 bytes apart: all in the same banks). The 64-byte swizzle, not the 128-byte one, because its
// atom (512 bytes) is what a default-layout slot can be aligned to inside itself (attention_tma.cuh att_tiles).
// Work: warp w takes 8-token groups w, w + 8, ... of a slot. Per group:
//   S (16 x 8) = Q (16 x D) K^T: mma.m16n8k16 over D / 16 k-steps, the group's G q heads as A rows 0..G-1 (the
//     other rows zero), K by ldmatrix (token rows, 8 dims each) as the col-major B operand;
//   online softmax of rows gid < G in exp2 units (scores x log2(e) / sqrt(D)), the row maximum over the 4 lanes of
//     a row (two shuffles), each lane's l a partial sum over its own columns (summed over the row's lanes at the end);
//   O (16 x D) += P (16 x 8) V: mma.m16n8k8, P's A fragment the scores' C fragment rounded to 16 bits (row gid,
//     columns 2 (lane % 4), + 1: the same places), V by ldmatrix.trans as the B operand, D / 8 n-tiles.
// Tokens outside the task's range get score -inf (p = 0) and their V rows zeroed in the tile first (0 x garbage
// must not be NaN); the newest token (written by this launch's qkv_rope, its tile may predate the store) has its
// K and V rows rewritten from global memory (loaded at the task's start beside q, from the request's slot_mapping
// entry: attention_tma.cuh att_newest_row; session 51's MK_ATT_NEWEST, the code since session 52's A/B: -0.1..-0.9%
// at 1B b4..16 against the load after a block-table round trip when the slot landed). Both only by the warp that
// reads those rows, before it reads them (__syncwarp), and a generic-to-async proxy fence before the slot is freed
// for the next tensor copy.
// Results: the default loop's (attention.cuh) up to the order of the fp32 sums and P's rounding to 16 bits before P V (as
// FlashAttention's); the warps' states are merged and stored by attn_warps_store like the other loops'.
#pragma once
#include "attention_tma.cuh"
#include "x_frags.cuh"

namespace mk {

#if MK_ATT_TMA
// (the decoder builds MK_ATT_TMA only for models tensormap.check_model accepts: G 1..4, D % 32 == 0)
static_assert(D % 32 == 0, "MK_ATT_TMA: head_dim a multiple of 32 (one 64-byte swizzle line per 32 columns)");
static_assert(G <= 8, "MK_ATT_TMA: the group's q heads are A rows 0..G-1 of one 8-row half");
static_assert(ATT_TMA_ROWS == 16 && ATT_TILE_BYTES == (D / 32) * ATT_TMA_ROWS * 64, "MK_ATT_TMA: tile layout");
constexpr int AM_KSTEPS = D / 16;                              // score k-steps (16 dims each)
constexpr int AM_NT = D / 8;                                   // P V n-tiles (8 dims each)
constexpr int AM_GROUPS = ATT_TMA_BPS * ATT_TMA_ROWS / 8;      // 8-token groups per ring slot (8 at D = 128)
constexpr int AM_CHUNKS = D / 8;                               // 16-byte chunks per token row
// the newest token's staged K / V rows (2 x D elements) fit the scratch's q area (ATT_HG x D floats), 16-byte aligned
static_assert(2 * D * (int)sizeof(elem_t) <= ATT_HG * D * 4 &&
                  (2 * CONSUMER_WARPS * ATT_HG + CONSUMER_WARPS * ATT_HG * D) % 4 == 0,
              "MK_ATT_TMA: newest-row staging");
// 16-token blocks a warp (am_block; session 51's MK_AM_BLOCK, the code since session 52's A/B: -1.0% at 1B b16, no row
// slower) at head_dim <= 64 only: at 128 (8B) its P V step spilled 64 / 80 bytes in mk_decode around this function's
// call, so the 8-token groups (am_group) stay there
#define AM_BLOCK (MK_HEAD_DIM <= 64)
static_assert(AM_KSTEPS % 2 == 0 && AM_NT % 4 == 0, "MK_ATT_TMA: ldmatrix.x4 covers 32 columns (one part)");

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&v)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(addr) : "memory");
}

// (c0, c1) += A (16 x 8) B (8 x 8, b0) on rows gid: the P V step. A's rows gid + 8 are zero (a1 = 0), so the
// accumulator's rows gid + 8 stay zero: they go in as zeros and their outputs are dropped, which keeps O in 2
// registers an n-tile instead of 4 (8B spilled 20 bytes with all 4).
__device__ __forceinline__ void mma_1688_top(float& c0, float& c1, unsigned a0, unsigned b0) {
#if MK_DTYPE_BF16
#define MK_MMA_1688 "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32"
#else
#define MK_MMA_1688 "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32"
#endif
  asm("{\n\t.reg .f32 z, d2, d3;\n\t.reg .b32 za;\n\tmov.f32 z, 0f00000000;\n\tmov.b32 za, 0;\n\t" MK_MMA_1688
      " {%0, %1, d2, d3}, {%2, za}, {%3}, {%0, %1, z, z};\n\t}"
      : "+f"(c0), "+f"(c1) : "r"(a0), "r"(b0));
#undef MK_MMA_1688
}

// (c0, c1) += A (16 x 16) B (16 x 8, b0 / b1: k rows 0..7 / 8..15) on rows gid: am_block's steps over a
// 16-token block, A's rows gid + 8 zero (a1 = a3 = 0) as in mma_1688_top, A's k columns 0..7 in a0, 8..15 in a2.
__device__ __forceinline__ void mma_16816_top(float& c0, float& c1, unsigned a0, unsigned a2, unsigned b0,
                                              unsigned b1) {
#if MK_DTYPE_BF16
#define MK_MMA_16816 "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#else
#define MK_MMA_16816 "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#endif
  asm("{\n\t.reg .f32 z, d2, d3;\n\t.reg .b32 za;\n\tmov.f32 z, 0f00000000;\n\tmov.b32 za, 0;\n\t" MK_MMA_16816
      " {%0, %1, d2, d3}, {%2, za, %3, za}, {%4, %5}, {%0, %1, z, z};\n\t}"
      : "+f"(c0), "+f"(c1) : "r"(a0), "r"(a2), "r"(b0), "r"(b1));
#undef MK_MMA_16816
}

__device__ __forceinline__ void st_shared_v4(unsigned addr, const uint4& v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Generic-proxy writes to shared memory ordered before later async-proxy (tensor copy) writes to the same bytes.
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Shared address of token row r (0..15), 16-byte chunk c (0..D/8-1) of the swizzled tile at `tile` (512-aligned:
// the swizzle's address bits 7..8 are then (r / 2) % 4, the same whether the unit counts from the tile or from 0).
__device__ __forceinline__ unsigned am_addr(unsigned tile, int r, int c) {
  const unsigned row = tile + (unsigned)((c >> 2) * (ATT_TMA_ROWS * 64) + r * 64);
  return row + ((((unsigned)c & 3u) ^ ((row >> 7) & 3u)) << 4);
}

// The newest token's staged rows [2][AM_CHUNKS] (K, then V): the scratch's q area after wo [warp][HG][D].
__device__ __forceinline__ uint4* am_newest_rows(const float* wo) {
  return reinterpret_cast<uint4*>(const_cast<float*>(wo) + CONSUMER_WARPS * ATT_HG * D);
}

// The rows of group `t0` (8 tokens at tile rows r0..r0+7 of the tiles kt / vt) that the MMAs must not read as they
// landed: V of tokens outside [s_lo, s_hi) zeroed, K and V of the newest token written over with its rows from global
// memory, staged at the task's start by this warp (am_newest_rows: K's AM_CHUNKS 16-byte chunks, then V's). The warp's
// lanes take its 8 rows x D / 8 chunks in turn.
__device__ __forceinline__ void am_patch(unsigned kt, unsigned vt, int r0, int t0, int s_lo, int s_hi, int newest,
                                         const float* wo, int lane) {
  const uint4* nrow = am_newest_rows(wo);
  for (int i = lane; i < 8 * AM_CHUNKS; i += 32) {
    const int rr = i / AM_CHUNKS, ch = i % AM_CHUNKS;
    const int tok = t0 + rr;
    const bool valid = tok >= s_lo && tok < s_hi;
    if (valid && tok == newest) {
      const uint4 kr = nrow[ch], vr = nrow[AM_CHUNKS + ch];   // both loads before the stores (the measured build's order)
      st_shared_v4(am_addr(kt, r0 + rr, ch), kr);
      st_shared_v4(am_addr(vt, r0 + rr, ch), vr);
    } else if (!valid) {
      st_shared_v4(am_addr(vt, r0 + rr, ch), make_uint4(0u, 0u, 0u, 0u));
    }
  }
  __syncwarp();
}

// The warp whose unit holds token `tok` of a task whose tokens start at `lo`: its 8-token group (group gi of a slot
// is taken by warp gi % CONSUMER_WARPS; a slot holds ATT_TMA_BPS blocks from the task's first block), or with AM_BLOCK
// its 16-token block (the task's block u, counted from its first, by warp u % CONSUMER_WARPS).
__device__ __forceinline__ int am_newest_warp(int lo, int tok) {
  const int rel = tok / ATT_TMA_ROWS - lo / ATT_TMA_ROWS;
  if (AM_BLOCK) return rel % CONSUMER_WARPS;
  return ((rel % ATT_TMA_BPS) * 2 + (tok % ATT_TMA_ROWS) / 8) % CONSUMER_WARPS;
}

// One 8-token group: scores, the online-softmax update of (m, l) for row gid, and O += P V.
__device__ __forceinline__ void am_group(const unsigned (&qa)[AM_KSTEPS][2], unsigned kt, unsigned vt, int r0, int t0,
                                         int s_lo, int s_hi, bool qrow, float qscale, int lane, float& m, float& l,
                                         float (&o)[AM_NT][2]) {
  const int lr = r0 + (lane & 7), mi = lane >> 3, tq = lane & 3;
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int q = 0; q < AM_KSTEPS / 2; ++q) {   // 32 dims a load: k-steps 2q and 2q + 1
    unsigned kb[4];
    ldmatrix_x4(kb, am_addr(kt, lr, 4 * q + mi));
    const unsigned a0[4] = {qa[2 * q][0], 0u, qa[2 * q][1], 0u}, a1[4] = {qa[2 * q + 1][0], 0u, qa[2 * q + 1][1], 0u};
    const unsigned b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
    mma_16816(s, a0, b0);
    mma_16816(s, a1, b1);
  }
  const int ta = t0 + 2 * tq;
  const float x0 = (ta >= s_lo && ta < s_hi) ? s[0] * qscale : NEG_INF;
  const float x1 = (ta + 1 >= s_lo && ta + 1 < s_hi) ? s[1] * qscale : NEG_INF;
  float mx = fmaxf(x0, x1);
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float mn = fmaxf(m, mx);   // finite: the group has a valid token (the caller skips the others)
  const float corr = fast_exp2(m - mn), p0 = fast_exp2(x0 - mn), p1 = fast_exp2(x1 - mn);
  l = fmaf(l, corr, p0 + p1);
  m = mn;
  const unsigned pa = qrow ? pack2(p0, p1) : 0u;   // rows past the group's heads stay zero
#pragma unroll
  for (int q = 0; q < AM_NT / 4; ++q) {   // 32 dims a load: n-tiles 4q .. 4q + 3
    unsigned vb[4];
    ldmatrix_x4_trans(vb, am_addr(vt, lr, 4 * q + mi));
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      o[4 * q + u][0] *= corr;
      o[4 * q + u][1] *= corr;
      mma_1688_top(o[4 * q + u][0], o[4 * q + u][1], pa, vb[u]);
    }
  }
}

// AM_BLOCK: one 16-token block (tile rows 0..15, tokens t0..t0+15), as two 8-token groups' scores (two independent
// MMA chains), one online-softmax update over the 16 columns, and O += P V by m16n8k16: half the P V MMAs of two
// am_group calls and one dependent chain instead of two in series (session 50's b16 trace: 3.65 us for a 4-slot task's
// loop, 8 groups a warp). P is rounded to 16 bits relative to the running maximum after the block.
__device__ __forceinline__ void am_block(const unsigned (&qa)[AM_KSTEPS][2], unsigned kt, unsigned vt, int t0, int s_lo,
                                         int s_hi, bool qrow, float qscale, int lane, float& m, float& l,
                                         float (&o)[AM_NT][2]) {
  const int lr = lane & 7, mi = lane >> 3, tq = lane & 3;
  float s0[2] = {0.f, 0.f}, s1[2] = {0.f, 0.f};   // rows gid of tokens t0 + 0..7 / t0 + 8..15 (rows gid + 8 are zero)
#pragma unroll
  for (int q = 0; q < AM_KSTEPS / 2; ++q) {   // 32 dims a load: k-steps 2q and 2q + 1, rows 0..7 then 8..15
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      unsigned kb[4];
      ldmatrix_x4(kb, am_addr(kt, 8 * h + lr, 4 * q + mi));
      float (&sh)[2] = h ? s1 : s0;
      mma_16816_top(sh[0], sh[1], qa[2 * q][0], qa[2 * q][1], kb[0], kb[1]);
      mma_16816_top(sh[0], sh[1], qa[2 * q + 1][0], qa[2 * q + 1][1], kb[2], kb[3]);
    }
  }
  const int ta = t0 + 2 * tq, tb = ta + 8;
  const float x0 = (ta >= s_lo && ta < s_hi) ? s0[0] * qscale : NEG_INF;
  const float x1 = (ta + 1 >= s_lo && ta + 1 < s_hi) ? s0[1] * qscale : NEG_INF;
  const float x2 = (tb >= s_lo && tb < s_hi) ? s1[0] * qscale : NEG_INF;
  const float x3 = (tb + 1 >= s_lo && tb + 1 < s_hi) ? s1[1] * qscale : NEG_INF;
  float mx = fmaxf(fmaxf(x0, x1), fmaxf(x2, x3));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float mn = fmaxf(m, mx);   // finite: the block has a valid token (the caller skips the others)
  const float corr = fast_exp2(m - mn);
  const float p0 = fast_exp2(x0 - mn), p1 = fast_exp2(x1 - mn), p2 = fast_exp2(x2 - mn), p3 = fast_exp2(x3 - mn);
  l = fmaf(l, corr, (p0 + p1) + (p2 + p3));
  m = mn;
  const unsigned pa = qrow ? pack2(p0, p1) : 0u, pb = qrow ? pack2(p2, p3) : 0u;   // A's k columns 2 tq (+8), + 1
  // V's B fragments by ldmatrix.trans: lanes 0-7 / 8-15 address rows 0-7 / 8-15 of n-tile 2q, lanes 16-31 n-tile 2q + 1
  const int vr = (lane & 7) + ((lane >> 3) & 1) * 8, vc = lane >> 4;
#pragma unroll
  for (int q = 0; q < AM_NT / 2; ++q) {
    unsigned vb[4];
    ldmatrix_x4_trans(vb, am_addr(vt, vr, 2 * q + vc));
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      o[2 * q + u][0] *= corr;
      o[2 * q + u][1] *= corr;
      mma_16816_top(o[2 * q + u][0], o[2 * q + u][1], pa, pb, vb[2 * u], vb[2 * u + 1]);
    }
  }
}

// Consumers of ring-fed attention task t (`it`: the consumers' chunk count, returned advanced by the slots read, as
// the producer's). Out of line: inlined into mk_decode it spilled 20 bytes at 8B (its own function: none); a call
// per task of >= MK_ATT_TMA tokens.
__device__ __noinline__ unsigned attn_partial_mma(const Smem S, const Params& P, const Task t, unsigned it,
                                                     int warp, int lane) {
  const int b = t.arg0, g = t.arg1, c = t.arg2;
  const int C = P.chunks;
  int lo, hi;
  attn_range(S, C, b, c, lo, hi);
  const int newest = S.seq_len()[b] - 1;   // written by this launch's qkv_rope
  const int gid = lane >> 2, tq = lane & 3;
  const bool qrow = gid < G;               // A rows 0..G-1: the group's q heads (G == ATT_HG: one head pass)
  const float qscale = rsqrtf((float)D) * LOG2E;
  float* wm = S.scratch();                               // [warp][HG]
  float* wl = wm + CONSUMER_WARPS * ATT_HG;              // [warp][HG]
  float* wo = wl + CONSUMER_WARPS * ATT_HG;              // [warp][HG][D]
  const bool direct = t.out_buf == BUF_ATTN_O && t.ticket_ctr < 0;   // C == 1
  const bool ph_on = MK_TRACE_PHASES && P.trace != nullptr && threadIdx.x == 0;
  unsigned long long ph_t = ph_on ? global_ns() : 0ull, ph_stage = 0, ph_chunks = 0, ph_reduce = 0;
  const unsigned long long ph_entry = ph_t;

  // Q's A fragments (rows gid < G): q[head][16 j + 2 tq, + 1] and [16 j + 8 + 2 tq, + 1], 16-bit pairs
  unsigned qa[AM_KSTEPS][2];
  {
    const elem_t* qp = buf_ptr(P, BUF_Q) + (size_t)b * QS + (g * G + (qrow ? gid : 0)) * D + 2 * tq;
#pragma unroll
    for (int j = 0; j < AM_KSTEPS; ++j) {
      qa[j][0] = qrow ? ld_cg_u32(qp + 16 * j) : 0u;
      qa[j][1] = qrow ? ld_cg_u32(qp + 16 * j + 8) : 0u;
    }
  }
  // The newest token's K / V rows (this launch's qkv_rope store: the counter wait orders them), in flight beside q's
  // and staged in the scratch's q area (unused here: q is in registers) by the lanes of the warp that takes their
  // group, for am_patch when its slot lands (loaded in am_patch, as before session 52, their round trip followed a
  // block-table one and the slots before it on the step's chain). Registers held across the slot loop spilled at 8B.
  if (newest >= lo && newest < hi && warp == am_newest_warp(lo, newest) && lane < AM_CHUNKS) {
    uint4 kr, vr;
    att_newest_row(S, P, t, newest, lane, kr, vr);
    am_newest_rows(wo)[lane] = kr;
    am_newest_rows(wo)[AM_CHUNKS + lane] = vr;
  }
  __syncwarp();   // am_patch's lanes read chunks that other lanes of this warp staged
  if (ph_on) phase_lap(ph_t, ph_stage);
  float m = NEG_INF, l = 0.f, o[AM_NT][2];   // O's rows gid (its rows gid + 8 are zero: mma_1688_top)
#pragma unroll
  for (int n = 0; n < AM_NT; ++n) o[n][0] = o[n][1] = 0.f;
  const int nslots = att_tma_slots(lo, hi);
  for (int si = 0; si < nslots; ++si) {
    const int slot = it % NUM_STAGES;
    const AttSlot a = att_slot_wait(S, P, it, lo, hi, si);
    const int sb = a.sb, s_lo = a.s_lo, s_hi = a.s_hi;
    bool patched = false;
#if AM_BLOCK
    // the task's block u = si * ATT_TMA_BPS + bi goes to warp u % CONSUMER_WARPS (8 blocks a slot at D = 64: bi = warp)
    for (int bi = ((warp - si * ATT_TMA_BPS) % CONSUMER_WARPS + CONSUMER_WARPS) % CONSUMER_WARPS; bi < ATT_TMA_BPS;
         bi += CONSUMER_WARPS) {
      const int t0 = (sb + bi) * ATT_TMA_ROWS;
      if (t0 + ATT_TMA_ROWS <= s_lo || t0 >= s_hi) continue;   // warp-uniform: no token of the range
      const unsigned kt = att_tiles(S, slot) + (unsigned)(bi * 2 * ATT_TILE_BYTES), vt = kt + ATT_TILE_BYTES;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int th = t0 + 8 * h;
        if (th < s_lo || th + 8 > s_hi || (newest >= th && newest < th + 8)) {
          am_patch(kt, vt, 8 * h, th, s_lo, s_hi, newest, wo, lane);
          patched = true;
        }
      }
      am_block(qa, kt, vt, t0, s_lo, s_hi, qrow, qscale, lane, m, l, o);
    }
#else
    for (int gi = warp; gi < AM_GROUPS; gi += CONSUMER_WARPS) {
      const int t0 = sb * ATT_TMA_ROWS + gi * 8;
      if (t0 + 8 <= s_lo || t0 >= s_hi) continue;   // warp-uniform: no token of the range
      const unsigned kt = att_tiles(S, slot) + (unsigned)((gi >> 1) * 2 * ATT_TILE_BYTES), vt = kt + ATT_TILE_BYTES;
      const int r0 = (gi & 1) * 8;
      if (t0 < s_lo || t0 + 8 > s_hi || (newest >= t0 && newest < t0 + 8)) {
        am_patch(kt, vt, r0, t0, s_lo, s_hi, newest, wo, lane);
        patched = true;
      }
      am_group(qa, kt, vt, r0, t0, s_lo, s_hi, qrow, qscale, lane, m, l, o);
    }
#endif
    if (patched) fence_proxy_async_smem();
    if (a.ws == WAIT_OK) mbar_arrive(S.empty_bar(slot));  // each thread frees its own reads
    ++it;
  }
  if (ph_on) phase_lap(ph_t, ph_chunks);
  l += __shfl_xor_sync(0xffffffffu, l, 1);   // the row's 4 lanes' columns
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (qrow) {
#pragma unroll
    for (int n = 0; n < AM_NT; ++n) {
      wo[(warp * ATT_HG + gid) * D + n * 8 + 2 * tq] = o[n][0];
      wo[(warp * ATT_HG + gid) * D + n * 8 + 2 * tq + 1] = o[n][1];
    }
    if (tq == 0) {
      wm[warp * ATT_HG + gid] = m;
      wl[warp * ATT_HG + gid] = l;
    }
  }
  attn_warps_store(P, wm, wl, wo, C, b, g, c, 0, direct);
  if (ph_on) phase_lap(ph_t, ph_reduce);
  if (ph_on) trace_phase_times(S, P, ph_stage, ph_chunks, ph_reduce, ph_entry);
  attn_ticket_merge(S, P, t, C, b, g);
  return it;
}
#endif

}  // namespace mk
