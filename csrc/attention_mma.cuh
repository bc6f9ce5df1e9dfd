// MK_ATT_MMA=1 (an A/B switch, bench/NOTES.md session 15): ATTN_PARTIAL's KV loop on tensor cores.
//
// Why: at batch 16 an attention task is one (request, kv head) over its whole context (one chunk: 132 SMs /
// 128 tasks), and the CUDA-core loop spends ~180 instructions per token per lane group (q.k by 8 lanes, the
// online softmax repeated on every lane of a token): 13.9 us of the 16.4 us per task for 131 KB of KV at 1B
// (session 15's phase trace), ~9 GB/s per SM against ~32 at the copy rate.
//
// Each warp takes 16-token tiles (tile k of the task's range: tokens lo + 16 k ..; warp w has k = w, w + 8, ..)
// and, per tile, for the head pass's HG <= 4 q heads (n8 side, the rest zero):
//   S^T[16 tokens, 8 heads] = K[tokens, :] . Q^T       (mma.m16n8k16, A = K rows, B = q; D / 16 k-steps)
//   O^T[D, 8 heads]        += V^T[:, tokens] . P^T     (A = V^T, B = P^T from S^T's accumulators by movmatrix)
// with an online softmax per head column once per round of AM_TU tiles. The contraction dims of the score and
// the output dims of O are permuted so that every lane's K and V reads are contiguous 16-byte loads straight
// into registers: lane (r = lane / 4, q = lane % 4) reads of K rows r and r + 8 the dims [q D/4, (q+1) D/4)
// (k-step j's k-columns 2q + {0, 1} are dims q D/4 + 4j + {0, 1}, columns 2q + 8 + {0, 1} are + {2, 3}; q takes
// the same permutation), and of V rows 2q, 2q + 1, 2q + 8, 2q + 9 the dims [r D/8, (r+1) D/8) (m-tile i's rows r
// and r + 8 are dims r D/8 + 2i and + 1). Numerics: q and K in bf16 with fp32 sums (as the CUDA-core loop), the
// 1/sqrt(D) scale applied to the fp32 scores, P rounded to bf16 for the PV product (as FlashAttention does), l
// from the fp32 P. The per-warp states then take attn_warps_store's merge, as the CUDA-core loop's do.
#pragma once
#include "attention.cuh"
#include "matvec.cuh"

namespace mk {

constexpr int AM_DQ = D / 4;               // dims of a K row per lane (quarter q)
constexpr int AM_DR = D / 8;               // dims of a V row per lane (row r)
constexpr int AM_KS = D / 16;              // score k-steps = PV m-tiles
constexpr int AM_KV4 = AM_DQ / 8;          // 16-byte loads per K row per lane
constexpr int AM_VV4 = AM_DR / 8;          // 16-byte loads per V row per lane
constexpr int AM_TU = D == 64 ? 2 : 1;     // 16-token tiles in flight per warp (registers)
static_assert(ATT_HG <= 8, "a head pass fits the n8 side");
static_assert(AM_VV4 >= 1, "head_dim >= 64");

__device__ __forceinline__ unsigned movmatrix_trans(unsigned a) {
  unsigned d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}

__device__ __forceinline__ unsigned u4_word(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// Word w (two elements) of a lane's row slice held as N uint4.
template <int N>
__device__ __forceinline__ unsigned slice_word(const uint4 (&v)[N], int w) {
  return u4_word(v[w >> 2], w & 3);
}

// (Its first lines repeat attn_partial_task's set-up while the two loops are A/B alternatives: after the
// measurement one of them leaves, and with it the repetition.)
__device__ __noinline__ void attn_partial_mma(const Smem S, const Params& P, const Task t, int warp, int lane) {
  const int b = t.arg0, g = t.arg1, c = t.arg2;
  const int C = P.chunks;
  int lo, hi;
  attn_range(S, C, b, c, lo, hi);
  const elem_t* cache = reinterpret_cast<const elem_t*>(P.kvptr[t.layer]);
  const int bs = P.block_size;
  const int* bt = P.block_table + (size_t)b * P.bt_stride;
  const int r = lane >> 2, q = lane & 3;
  const float qscale = rsqrtf((float)D) * LOG2E;
  float* wm = S.scratch();                               // [warp][HG], the layout of attn_partial_task
  float* wl = wm + CONSUMER_WARPS * ATT_HG;              // [warp][HG]
  float* wo = wl + CONSUMER_WARPS * ATT_HG;              // [warp][HG][D]
  int* bts = reinterpret_cast<int*>(wo + CONSUMER_WARPS * ATT_HG * D + ATT_HG * D);
  const bool direct = t.out_buf == BUF_ATTN_O && t.ticket_ctr < 0;   // C == 1
  const elem_t* qbuf = buf_ptr(P, BUF_Q) + (size_t)b * QS;
  const int blk0 = lo / bs;
  const int nblk = hi > lo ? (hi - 1) / bs - blk0 + 1 : 0;
  const bool bt_staged = nblk <= ATT_BT_CAP;
  for (int i = threadIdx.x; bt_staged && i < nblk; i += CONSUMER_THREADS) bts[i] = ld_nc_s32(bt + blk0 + i);
  const bool ph_on = MK_TRACE_PHASES && P.trace != nullptr && threadIdx.x == 0;
  unsigned long long ph_t = ph_on ? global_ns() : 0ull, ph_stage = 0, ph_chunks = 0, ph_reduce = 0;
  const unsigned long long ph_entry = ph_t;
  // the KV row of token tok (K: kv = 0, V: kv = 1), head g
  auto kv_row = [&](int tok, int kv) -> const elem_t* {
    const int bi = tok / bs;
    const long long blk = bt_staged ? bts[bi - blk0] : ld_nc_s32(bt + bi);
    return cache + ((blk * 2 + kv) * bs + (tok - bi * bs)) * KVS + g * D;
  };

  for (int h0 = 0; h0 < G; h0 += ATT_HG) {
    // q of head h0 + r (zero past the pass) as the B fragments of the score MMA, unscaled bf16
    uint4 qv[AM_KV4];
#pragma unroll
    for (int i = 0; i < AM_KV4; ++i)
      qv[i] = r < ATT_HG ? ld_cg_v4(qbuf + (g * G + h0 + r) * D + q * AM_DQ + i * 8) : make_uint4(0u, 0u, 0u, 0u);
    consumer_sync();   // the block-table entries are staged
    if (ph_on) phase_lap(ph_t, ph_stage);
    float o[AM_KS][4];
#pragma unroll
    for (int i = 0; i < AM_KS; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[i][e] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};   // heads 2q, 2q + 1 (this thread's columns)
    for (int t0 = lo + warp * 16; t0 < hi; t0 += CONSUMER_WARPS * 16 * AM_TU) {
      uint4 kr[AM_TU][2][AM_KV4], vr[AM_TU][4][AM_VV4];
#pragma unroll
      for (int u = 0; u < AM_TU; ++u) {
        const int tb = t0 + u * CONSUMER_WARPS * 16;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int tok = tb + r + 8 * h;
          const elem_t* p = tok < hi ? kv_row(tok, 0) + q * AM_DQ : nullptr;
#pragma unroll
          for (int i = 0; i < AM_KV4; ++i) kr[u][h][i] = p ? ld_cg_v4(p + i * 8) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int tok = tb + 2 * q + (k & 1) + 8 * (k >> 1);
          const elem_t* p = tok < hi ? kv_row(tok, 1) + r * AM_DR : nullptr;
#pragma unroll
          for (int i = 0; i < AM_VV4; ++i) vr[u][k][i] = p ? ld_cg_v4(p + i * 8) : make_uint4(0u, 0u, 0u, 0u);
        }
      }
      // scores, masked past hi; the round's maximum per head column
      float s[AM_TU][4];
      float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
      for (int u = 0; u < AM_TU; ++u) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < AM_KS; ++j) {
          const unsigned a[4] = {slice_word(kr[u][0], 2 * j), slice_word(kr[u][1], 2 * j),
                                 slice_word(kr[u][0], 2 * j + 1), slice_word(kr[u][1], 2 * j + 1)};
          const unsigned bq[2] = {slice_word(qv, 2 * j), slice_word(qv, 2 * j + 1)};
          mma_16816(acc, a, bq);
        }
        const int tb = t0 + u * CONSUMER_WARPS * 16;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[u][e] = tb + r + 8 * (e >> 1) < hi ? acc[e] * qscale : NEG_INF;
          mx[e & 1] = fmaxf(mx[e & 1], s[u][e]);
        }
      }
#pragma unroll
      for (int off = 4; off < 32; off <<= 1)
#pragma unroll
        for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], off));
      float corr[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float mn = fmaxf(m[h], mx[h]);
        corr[h] = (mn == NEG_INF) ? 1.f : fast_exp2(m[h] - mn);   // exp2(-inf) = 0: nothing kept yet
        m[h] = mn;
        l[h] *= corr[h];
      }
#pragma unroll
      for (int i = 0; i < AM_KS; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[i][e] *= corr[e & 1];
#pragma unroll
      for (int u = 0; u < AM_TU; ++u) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          p[e] = s[u][e] == NEG_INF ? 0.f : fast_exp2(s[u][e] - m[e & 1]);
          l[e & 1] += p[e];
        }
        // P^T [tokens r, r + 8][heads 2q, 2q + 1] -> B fragments [tokens 2q.., 2q + 8..][head r]
        const unsigned bp[2] = {movmatrix_trans(pack2(p[0], p[1])), movmatrix_trans(pack2(p[2], p[3]))};
#pragma unroll
        for (int i = 0; i < AM_KS; ++i) {
          const unsigned w0 = slice_word(vr[u][0], i), w1 = slice_word(vr[u][1], i);
          const unsigned w2 = slice_word(vr[u][2], i), w3 = slice_word(vr[u][3], i);
          const unsigned a[4] = {__byte_perm(w0, w1, 0x5410), __byte_perm(w0, w1, 0x7632),
                                 __byte_perm(w2, w3, 0x5410), __byte_perm(w2, w3, 0x7632)};
          mma_16816(o[i], a, bp);
        }
      }
    }
    if (ph_on) phase_lap(ph_t, ph_chunks);
    // l over the warp's tokens (the 8 rows r); m is the same on them
#pragma unroll
    for (int off = 4; off < 32; off <<= 1)
#pragma unroll
      for (int h = 0; h < 2; ++h) l[h] += __shfl_xor_sync(0xffffffffu, l[h], off);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int hh = 2 * q + h;
      if (hh < ATT_HG) {
        if (r == 0) {
          wm[warp * ATT_HG + hh] = m[h];
          wl[warp * ATT_HG + hh] = l[h];
        }
#pragma unroll
        for (int i = 0; i < AM_KS; ++i) {
          wo[(warp * ATT_HG + hh) * D + r * AM_DR + 2 * i] = o[i][h];
          wo[(warp * ATT_HG + hh) * D + r * AM_DR + 2 * i + 1] = o[i][2 + h];
        }
      }
    }
    attn_warps_store(P, wm, wl, wo, C, b, g, c, h0, direct);
    if (ph_on) phase_lap(ph_t, ph_reduce);
  }
  if (ph_on) trace_phase_times(S, P, ph_stage, ph_chunks, ph_reduce, ph_entry);
  attn_ticket_merge(S, P, t, C, b, g);
}

}  // namespace mk
