// MK_OPROJ_MERGE (A/B switch, session 52; tuning.ScheduleTuning.merge_in_oproj): with C > 1 attention chunks the
// partial tasks store their chunk's (o, m, l) in PART_O / PART_ML and signal o_proj's counter themselves (no ticket,
// no merging task), and o_proj's whole-x staging merges the chunks of every (request, head) as it stages them: the
// values attention.cuh attn_merge would have stored in ATTN_O, by the same operations in the same order (the same
// bits), written to the staging rows instead. Why: at 1B batch 1 the step waits for the attention task that takes the
// last ticket, and its ticket round trip + merge loads + merged stores are ~2.3 us of each layer's chain (session 51's
// record analysis, bench/NOTES.md); here they leave the chain for one more L2 round trip inside o_proj's staging (its
// x is C fp32 partials per element instead of one 16-bit value: B * QS * C * 4 bytes a task, from L2).
#pragma once
#include "common.cuh"

namespace mk {

constexpr int OM_MAXC = OPROJ_MERGE_MAX_CHUNKS;   // the most chunks merged here (checked by the host: tuning, tasks)
constexpr int OM_CB = 4;      // chunks whose o loads are in flight together (8 floats each a thread)
static_assert(D % 8 == 0, "a staged 16-byte vector stays inside one head");
static_assert(OM_MAXC % OM_CB == 0, "the chunk loop takes whole batches of loads");

// x [B, QS] of an o_proj task, merged from the attention partials, into the staging rows (stage_x's layout: rows of
// QS * 2 + 16 bytes). Out of line: its loads' registers stay out of matvec_task's allocation. Ends with
// consumer_sync().
__device__ __forceinline__ void stage_x_merged(unsigned char* xs, const Params& P, int B) {
  const int C = P.chunks;
  const float* po = reinterpret_cast<const float*>(P.buf[BUF_PART_O]);
  const float* pml = reinterpret_cast<const float*>(P.buf[BUF_PART_ML]);
  constexpr int vpr = QS / 8;
  constexpr int rowb = QS * 2 + 16;
  for (int idx = threadIdx.x; idx < B * vpr; idx += CONSUMER_THREADS) {
    const int b = idx / vpr, kv = idx - b * vpr;
    const int head = kv * 8 / D, j = kv * 8 - head * D;
    const int g = head / G, h = head - g * G;
    const size_t p0 = (size_t)(b * NKV + g) * C * G + h;   // chunk 0's partial; chunk c adds c * G (attn_merge's index)
    // one round trip: every chunk's m and the first OM_CB chunks' (l, o); the later batches' (l, o) after it
    float mv[OM_MAXC];
#pragma unroll
    for (int c = 0; c < OM_MAXC; ++c) mv[c] = c < C ? ld_cg_f32(pml + (p0 + (size_t)c * G) * 2) : NEG_INF;
    float lv[OM_CB];
    float4 o[OM_CB][2];
    auto load_lo = [&](int c0) {
#pragma unroll
      for (int u = 0; u < OM_CB; ++u) {
        const size_t pi = p0 + (size_t)(c0 + u) * G;
        const float4* src = reinterpret_cast<const float4*>(po + pi * D + j);
        const bool in = c0 + u < C;
        lv[u] = in ? ld_cg_f32(pml + pi * 2 + 1) : 0.f;
        o[u][0] = in ? __ldcg(src) : make_float4(0.f, 0.f, 0.f, 0.f);
        o[u][1] = in ? __ldcg(src + 1) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    };
    load_lo(0);
    float M = NEG_INF;
#pragma unroll
    for (int c = 0; c < OM_MAXC; ++c) M = fmaxf(M, mv[c]);
    float ls = 0.f, os[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (M != NEG_INF) {
#pragma unroll
      for (int c0 = 0; c0 < OM_MAXC; c0 += OM_CB) {   // unrolled: mv's indices are static (registers, not a stack)
        if (c0 >= C) break;
        if (c0 > 0) load_lo(c0);
#pragma unroll
        for (int u = 0; u < OM_CB; ++u) {
          if (c0 + u >= C || mv[c0 + u] == NEG_INF) continue;
          const float w = __expf(mv[c0 + u] - M);
          ls = fmaf(lv[u], w, ls);
          const float ov[8] = {o[u][0].x, o[u][0].y, o[u][0].z, o[u][0].w, o[u][1].x, o[u][1].y, o[u][1].z, o[u][1].w};
#pragma unroll
          for (int e = 0; e < 8; ++e) os[e] = fmaf(ov[e], w, os[e]);
        }
      }
    }
    float r[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) r[e] = ls > 0.f ? os[e] / ls : 0.f;
    *reinterpret_cast<uint4*>(xs + (size_t)b * rowb + kv * 16) =
        make_uint4(pack2(r[0], r[1]), pack2(r[2], r[3]), pack2(r[4], r[5]), pack2(r[6], r[7]));
  }
  consumer_sync();
}

}  // namespace mk
