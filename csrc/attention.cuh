// attention tasks over the paged KV cache (vLLM FLASH_ATTN layout, per layer
// [num_blocks, 2, block_size, NKV, D]; slot = block_table[b][t / bs] * bs + t % bs).
//
// ATTN_PARTIAL (b, g, c): the q heads of kv group g of request b against tokens [lo, hi) of chunk
// c (tasks.py: cs = ceil(L / C), lo = min(L, c*cs), hi = min(L, lo + cs), L = seq_lens[b]):
//   s_t = q . k_t / sqrt(D);  m = max_t s_t;  l = sum_t exp(s_t - m);  o = sum_t exp(s_t - m) v_t.
// Writes (m, l) and o to PART_ML / PART_O, or o / l straight into ATTN_O when C == 1 (empty
// ranges: m = -inf, l = 0, o = 0; output 0).
// Layout of the work: a token's K row (D elements) is read by D/8 lanes, 16 bytes each, so a warp
// covers 32/(D/8) tokens per load and AU such steps are in flight; each lane group keeps an online
// softmax state (in exp2 units) for HG heads at a time; states merge across lane groups with
// shuffles and across warps through shared memory.
//
// ATTN_COMBINE (b, g): ATTN_O = sum_c o_c exp(m_c - M) / sum_c l_c exp(m_c - M), M = max_c m_c.
// Merge in the partial (ticket_ctr >= 0, tuning.merge_in_partial): no combine task; each partial stores
// its chunk, then takes a ticket of (b, g), and the one that takes the last ticket runs the same merge.
#pragma once
#include "common.cuh"

namespace mk {

constexpr int ATT_MCB = 16;  // chunks per batch of loads in attn_merge (no spills at 16)
constexpr int ATT_LPT = D / 8;                   // lanes per token
constexpr int ATT_TPW = 32 / ATT_LPT;            // tokens per warp per load step
constexpr int ATT_HG = (G % 4 == 0) ? 4 : (G % 3 == 0) ? 3 : (G % 2 == 0) ? 2 : 1;  // heads per pass
// Load steps in flight per warp (session 10's A/B, bench/NOTES.md: 5 vs 4 -52 us at 8B batch 8 ctx 4096, -15 at
// 1B; +8 at 1B batch 16 ctx 512; 6 +26..+333 us and spills at 8B)
constexpr int ATT_AU = 5;
static_assert(G % ATT_HG == 0, "head passes must tile the group");
constexpr int ATT_SCRATCH_FLOATS = 2 * CONSUMER_WARPS * ATT_HG + CONSUMER_WARPS * ATT_HG * D + ATT_HG * D;
// Block-table entries of the task's token range, staged in shared memory after the merge scratch: the
// KV loads then depend on one round trip instead of two (a range with more blocks reads them from L2).
constexpr int ATT_BT_CAP = (UNION_BYTES / 4 - ATT_SCRATCH_FLOATS);
static_assert(ATT_BT_CAP >= 256, "attention scratch");

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  f[0] = lo_f(v.x); f[1] = hi_f(v.x); f[2] = lo_f(v.y); f[3] = hi_f(v.y);
  f[4] = lo_f(v.z); f[5] = hi_f(v.z); f[6] = lo_f(v.w); f[7] = hi_f(v.w);
}

// Merge online-softmax state (m, l, o) with (mo, lo, oo); -inf maxima mean "empty".
__device__ __forceinline__ void merge_weights(float m, float mo, float& a, float& b, float& M) {
  M = fmaxf(m, mo);
  a = (m == NEG_INF) ? 0.f : fast_exp2(m - M);
  b = (mo == NEG_INF) ? 0.f : fast_exp2(mo - M);
}

__device__ __forceinline__ void attn_merge(const Params& P, int b, int g) {
  const int C = P.chunks;
  const float* po = reinterpret_cast<const float*>(P.buf[BUF_PART_O]);
  const float* pml = reinterpret_cast<const float*>(P.buf[BUF_PART_ML]);
  elem_t* out = buf_ptr(P, BUF_ATTN_O) + (size_t)b * QS + g * G * D;
  for (int idx = threadIdx.x; idx < G * D; idx += CONSUMER_THREADS) {
    const int h = idx / D, j = idx - h * D;
    const size_t p0 = (size_t)(b * NKV + g) * C * G + h;   // index of chunk 0; chunk c adds c * G
    // Two passes (the maximum, then the weighted sums in chunk order), with the loads issued ATT_MCB chunks
    // at a time: one loop per chunk waited for each chunk's loads in turn, a dependent L2 round trip per
    // chunk (session 9: -16 / -71 us at 1B / 8B batch 1). Chunks 0..ATT_MCB-1 load (m, l, o) at once and
    // are kept for the second pass: one round trip at C <= ATT_MCB.
    float mv[ATT_MCB], lv[ATT_MCB], ov[ATT_MCB];
    auto load = [&](int c0) {
#pragma unroll
      for (int u = 0; u < ATT_MCB; ++u) {
        const size_t pi = p0 + (size_t)(c0 + u) * G;
        const bool in = c0 + u < C;
        mv[u] = in ? ld_cg_f32(pml + pi * 2) : NEG_INF;
        lv[u] = in ? ld_cg_f32(pml + pi * 2 + 1) : 0.f;
        ov[u] = in ? ld_cg_f32(po + pi * D + j) : 0.f;
      }
    };
    load(0);
    float M = NEG_INF;
#pragma unroll
    for (int u = 0; u < ATT_MCB; ++u) M = fmaxf(M, mv[u]);
    for (int c0 = ATT_MCB; c0 < C; c0 += ATT_MCB) {
      float mb[ATT_MCB];
#pragma unroll
      for (int u = 0; u < ATT_MCB; ++u) mb[u] = c0 + u < C ? ld_cg_f32(pml + (p0 + (size_t)(c0 + u) * G) * 2) : NEG_INF;
#pragma unroll
      for (int u = 0; u < ATT_MCB; ++u) M = fmaxf(M, mb[u]);
    }
    float ls = 0.f, os = 0.f;
    if (M != NEG_INF) {
      for (int c0 = 0; c0 < C; c0 += ATT_MCB) {
        if (c0 > 0) load(c0);
#pragma unroll
        for (int u = 0; u < ATT_MCB; ++u) {
          if (mv[u] == NEG_INF) continue;
          const float w = __expf(mv[u] - M);
          ls = fmaf(lv[u], w, ls);
          os = fmaf(ov[u], w, os);
        }
      }
    }
    out[h * D + j] = from_f(ls > 0.f ? os / ls : 0.f);
  }
}

// Tokens [lo, hi) of chunk c of a request of L tokens, C chunks (cs = ceil(L / C), lo = min(L, c*cs),
// hi = min(L, lo + cs)).
__device__ __forceinline__ void attn_range_of(int L, int C, int c, int& lo, int& hi) {
  lo = 0;
  hi = 0;
  if (L > 0) {
    const int cs = (L + C - 1) / C;
    lo = min(L, c * cs);
    hi = min(L, lo + cs);
  }
}

// The same for request b of this step (C = P.chunks), its length from step_inputs' shared copy.
__device__ __forceinline__ void attn_range(const Smem& S, int C, int b, int c, int& lo, int& hi) {
  attn_range_of(S.seq_len()[b], C, c, lo, hi);
}

// After a head pass's KV loop: the consumer warps' states (wm, wl [warp][HG], wo [warp][HG][D], exp2 units)
// merged and stored: o / l into ATTN_O when direct (C == 1), else this chunk's partial (o, m in natural-log
// units, l). Shared by the loop below and the ring-fed one (attention_tma.cuh). Begins and ends
// with consumer_sync().
__device__ __forceinline__ void attn_warps_store(const Params& P, const float* wm, const float* wl, const float* wo,
                                                 int C, int b, int g, int c, int h0, bool direct) {
  consumer_sync();
  for (int idx = threadIdx.x; idx < ATT_HG * D; idx += CONSUMER_THREADS) {
    const int hh = idx / D, j = idx - hh * D;
    float M = NEG_INF;
    for (int w = 0; w < CONSUMER_WARPS; ++w) M = fmaxf(M, wm[w * ATT_HG + hh]);
    float ls = 0.f, os = 0.f;
    for (int w = 0; w < CONSUMER_WARPS; ++w) {
      const float mw = wm[w * ATT_HG + hh];
      const float a = (mw == NEG_INF) ? 0.f : fast_exp2(mw - M);
      ls = fmaf(wl[w * ATT_HG + hh], a, ls);
      os = fmaf(wo[(w * ATT_HG + hh) * D + j], a, os);
    }
    const int head = g * G + h0 + hh;
    if (direct) {
      buf_ptr(P, BUF_ATTN_O)[(size_t)b * QS + head * D + j] = from_f(ls > 0.f ? os / ls : 0.f);
    } else {
      const size_t pi = ((size_t)(b * NKV + g) * C + c) * G + h0 + hh;
      st_f32(reinterpret_cast<float*>(P.buf[BUF_PART_O]) + pi * D + j, os);
      if (j == 0) {
        float* ml = reinterpret_cast<float*>(P.buf[BUF_PART_ML]) + pi * 2;
        st_f32(ml, M * LN2);  // back to natural-log units of the scaled score (-inf stays -inf)
        st_f32(ml + 1, ls);
      }
    }
  }
  consumer_sync();
}

// A merge-in-partial task (ticket_ctr >= 0) after its partial's stores: the ticket, and the merge of the
// chunks by the task that takes the last one.
__device__ __forceinline__ void attn_ticket_merge(const Smem& S, const Params& P, const Task& t, int C, int b, int g) {
  if (t.ticket_ctr < 0) return;
  // Every thread's partial stores precede thread 0's ticket (the consumer_sync before this); the ticket
  // (acq_rel) releases them and, for the last taker, acquires the other chunks' partials.
  int* last = reinterpret_cast<int*>(S.scratch());
  if (threadIdx.x == 0)
    *last = atom_add_acq_rel_gpu(P.counters + (size_t)t.ticket_ctr * COUNTER_STRIDE, 1u) + 1 == (unsigned)C;
  consumer_sync();
  if (*last) attn_merge(P, b, g);
}

// The pass's q heads h0.. of kv group g, scaled by log2(e) / sqrt(D), into qs [HG][D] (the caller syncs).
__device__ __forceinline__ void attn_stage_q(float* qs, const elem_t* qbuf, int g, int h0, float qscale) {
  for (int idx = threadIdx.x; idx < ATT_HG * D / 8; idx += CONSUMER_THREADS) {
    float qf[8];
    unpack8(ld_cg_v4(qbuf + (g * G + h0) * D + idx * 8), qf);
#pragma unroll
    for (int i = 0; i < 8; ++i) qs[idx * 8 + i] = qf[i] * qscale;
  }
}

// An empty online-softmax state (exp2 units).
__device__ __forceinline__ void attn_state_init(float (&m)[ATT_HG], float (&l)[ATT_HG], float (&o)[ATT_HG][8]) {
#pragma unroll
  for (int hh = 0; hh < ATT_HG; ++hh) {
#pragma unroll
    for (int i = 0; i < 8; ++i) o[hh][i] = 0.f;
    m[hh] = NEG_INF;
    l[hh] = 0.f;
  }
}

// This lane's 16 bytes of the K and V rows of token `off` of cache block `blk`, kv head g (L2 loads: the newest
// token is written during the launch).
__device__ __forceinline__ void attn_kv_row(const elem_t* cache, long long blk, int off, int bs, int g, int e, uint4& kr,
                                            uint4& vr) {
  const elem_t* kp = cache + ((blk * 2) * bs + off) * KVS + g * D + e * 8;
  kr = ld_cg_v4(kp);
  vr = ld_cg_v4(kp + (size_t)bs * KVS);
}

// One token of a lane group: its K row's 8 dims in kr and V's in vr (this lane's e-th 16 bytes), the scores of
// the pass's HG heads summed over the group's ATT_LPT lanes, and the online-softmax update of (m, l, o) in exp2
// units (q pre-scaled by log2(e) / sqrt(D) in qs). An invalid token (past the range) joins the shuffles only.
// Shared by the global-load loop below and the ring-fed one (attention_tma.cuh).
__device__ __forceinline__ void attn_token(const uint4& kr, const uint4& vr, bool valid, const float* qs, int e,
                                           float (&m)[ATT_HG], float (&l)[ATT_HG], float (&o)[ATT_HG][8]) {
  float kf[8];
  unpack8(kr, kf);
  float s[ATT_HG];
#pragma unroll
  for (int hh = 0; hh < ATT_HG; ++hh) {
    const float4 qa = *reinterpret_cast<const float4*>(qs + hh * D + e * 8);
    const float4 qb = *reinterpret_cast<const float4*>(qs + hh * D + e * 8 + 4);
    float acc = qa.x * kf[0];
    acc = fmaf(qa.y, kf[1], acc);
    acc = fmaf(qa.z, kf[2], acc);
    acc = fmaf(qa.w, kf[3], acc);
    acc = fmaf(qb.x, kf[4], acc);
    acc = fmaf(qb.y, kf[5], acc);
    acc = fmaf(qb.z, kf[6], acc);
    acc = fmaf(qb.w, kf[7], acc);
    s[hh] = acc;
  }
#pragma unroll
  for (int off = 1; off < ATT_LPT; off <<= 1)
#pragma unroll
    for (int hh = 0; hh < ATT_HG; ++hh) s[hh] += __shfl_xor_sync(0xffffffffu, s[hh], off);
  if (valid) {
    float vf[8];
    unpack8(vr, vf);
#pragma unroll
    for (int hh = 0; hh < ATT_HG; ++hh) {
      const float mn = fmaxf(m[hh], s[hh]);
      const float corr = fast_exp2(m[hh] - mn);
      const float p = fast_exp2(s[hh] - mn);
      l[hh] = l[hh] * corr + p;
#pragma unroll
      for (int i = 0; i < 8; ++i) o[hh][i] = fmaf(o[hh][i], corr, p * vf[i]);
      m[hh] = mn;
    }
  }
}

// After the KV loop: merge the token lane-groups of this warp (lanes that differ in `sub`, same `e`).
__device__ __forceinline__ void attn_lanes_merge(float (&m)[ATT_HG], float (&l)[ATT_HG], float (&o)[ATT_HG][8]) {
#pragma unroll
  for (int off = ATT_LPT; off < 32; off <<= 1) {
#pragma unroll
    for (int hh = 0; hh < ATT_HG; ++hh) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[hh], off);
      const float lo2 = __shfl_xor_sync(0xffffffffu, l[hh], off);
      float a, bb, M;
      merge_weights(m[hh], mo, a, bb, M);
      l[hh] = l[hh] * a + lo2 * bb;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float oo = __shfl_xor_sync(0xffffffffu, o[hh][i], off);
        o[hh][i] = o[hh][i] * a + oo * bb;
      }
      m[hh] = M;
    }
  }
}

__device__ __forceinline__ void attn_partial_task(const Smem& S, const Params& P, const Task& t, int warp, int lane) {
  const int b = t.arg0, g = t.arg1, c = t.arg2;
  const int C = P.chunks;
  int lo, hi;
  attn_range(S, C, b, c, lo, hi);
  const elem_t* cache = reinterpret_cast<const elem_t*>(P.kvptr[t.layer]);
  const int bs = P.block_size;
  const int* bt = P.block_table + (size_t)b * P.bt_stride;
  const int e = lane % ATT_LPT, sub = lane / ATT_LPT;
  const float qscale = rsqrtf((float)D) * LOG2E;
  float* wm = S.scratch();                               // [warp][HG]
  float* wl = wm + CONSUMER_WARPS * ATT_HG;              // [warp][HG]
  float* wo = wl + CONSUMER_WARPS * ATT_HG;              // [warp][HG][D]
  float* qs = wo + CONSUMER_WARPS * ATT_HG * D;          // [HG][D] scaled q (registers are short)
  const bool direct = t.out_buf == BUF_ATTN_O && t.ticket_ctr < 0;   // C == 1
  const elem_t* qbuf = buf_ptr(P, BUF_Q) + (size_t)b * QS;
  // Block-table entries of [lo, hi) (immutable inputs): loaded with the first head pass's q, in the
  // same round trip; entry i is block (lo / bs) + i.
  int* bts = reinterpret_cast<int*>(qs + ATT_HG * D);
  const int blk0 = lo / bs;
  const int nblk = hi > lo ? (hi - 1) / bs - blk0 + 1 : 0;
  const bool bt_staged = nblk <= ATT_BT_CAP;
  // This thread's first entry is loaded into a register and stored after q's loads, so the two round
  // trips overlap (storing it at once would wait for it before q's loads issue).
  const bool bt_mine = bt_staged && threadIdx.x < nblk;
  const int bt_first = bt_mine ? ld_nc_s32(bt + blk0 + threadIdx.x) : 0;
  // MK_TRACE_PHASES (bench only): thread 0's ns in the trace's phase fields, summed over head passes: stage = q
  // and block-table loads up to the pass's first barrier, chunks = the KV loop, reduce = the merges across lane
  // groups and warps and the stores; what follows (ticket, merge of the chunks) is the table's "other".
  const bool ph_on = MK_TRACE_PHASES && P.trace != nullptr && threadIdx.x == 0;
  unsigned long long ph_t = ph_on ? global_ns() : 0ull, ph_stage = 0, ph_chunks = 0, ph_reduce = 0;
  const unsigned long long ph_entry = ph_t;

  for (int h0 = 0; h0 < G; h0 += ATT_HG) {
    attn_stage_q(qs, qbuf, g, h0, qscale);
    if (h0 == 0 && bt_staged) {
      if (bt_mine) bts[threadIdx.x] = bt_first;
      for (int i = threadIdx.x + CONSUMER_THREADS; i < nblk; i += CONSUMER_THREADS) bts[i] = ld_nc_s32(bt + blk0 + i);
    }
    consumer_sync();
    if (ph_on) phase_lap(ph_t, ph_stage);
    float m[ATT_HG], l[ATT_HG], o[ATT_HG][8];
    attn_state_init(m, l, o);
    for (int base = lo + warp * ATT_TPW; base < hi; base += CONSUMER_WARPS * ATT_TPW * ATT_AU) {
      uint4 kr[ATT_AU], vr[ATT_AU];
      bool valid[ATT_AU];
#pragma unroll
      for (int u = 0; u < ATT_AU; ++u) {
        const int tok = base + u * CONSUMER_WARPS * ATT_TPW + sub;
        valid[u] = tok < hi;
        kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
        if (valid[u]) {
          const int bi = tok / bs;
          const long long blk = bt_staged ? bts[bi - blk0] : ld_nc_s32(bt + bi);
          attn_kv_row(cache, blk, tok - bi * bs, bs, g, e, kr[u], vr[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < ATT_AU; ++u) attn_token(kr[u], vr[u], valid[u], qs, e, m, l, o);
    }
    if (ph_on) phase_lap(ph_t, ph_chunks);
    attn_lanes_merge(m, l, o);
    if (sub == 0) {
#pragma unroll
      for (int hh = 0; hh < ATT_HG; ++hh) {
#pragma unroll
        for (int i = 0; i < 8; ++i) wo[(warp * ATT_HG + hh) * D + e * 8 + i] = o[hh][i];
        if (e == 0) {
          wm[warp * ATT_HG + hh] = m[hh];
          wl[warp * ATT_HG + hh] = l[hh];
        }
      }
    }
    attn_warps_store(P, wm, wl, wo, C, b, g, c, h0, direct);
    if (ph_on) phase_lap(ph_t, ph_reduce);
  }
  if (ph_on) trace_phase_times(S, P, ph_stage, ph_chunks, ph_reduce, ph_entry);
  attn_ticket_merge(S, P, t, C, b, g);
}

__device__ __forceinline__ void attn_combine_task(const Smem& S, const Params& P, const Task& t) {
  attn_merge(P, t.arg0, t.arg1);
}

}  // namespace mk
