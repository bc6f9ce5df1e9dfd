// qkv_rope task: rms_norm(h) @ Wqkv^T for the task's qkv units, RoPE (neox) on q and k, q stored
// into the Q buffer, k and v appended to this layer's paged cache at slot_mapping (slot < 0: skip).
// A unit's 16 rows are 8 dims of the head's first half (MMA rows 0-7) and the same 8 dims of its
// second half (rows 8-15), so each thread holds both members of its RoPE pairs (v[e], v[e+2]).
#pragma once
#include "matvec.cuh"

namespace mk {

// cos|sin of position `pos` and rotary index j (0..D/2-1); the table is fp32 or the model dtype.
__device__ __forceinline__ void rope_cos_sin(const Params& P, long long pos, int j, float& c, float& s) {
  pos = pos < 0 ? 0 : (pos >= P.cs_rows ? P.cs_rows - 1 : pos);
  const size_t base = (size_t)pos * P.cs_stride;
  if (P.cs_f32) {
    const float* cs = reinterpret_cast<const float*>(P.cos_sin) + base;
    c = __ldg(cs + j);
    s = __ldg(cs + D / 2 + j);
  } else {
    const elem_t* cs = reinterpret_cast<const elem_t*>(P.cos_sin) + base;
    c = bits_to_f(ld_nc_u16(cs + j));
    s = bits_to_f(ld_nc_u16(cs + D / 2 + j));
  }
}

// cos|sin of this thread's two (request, rotary index) pairs of its warp's epilogue tile
// (m, nt), loaded at the start of the pass like residual_prefetch, so the table's L2 round trip overlaps
// the staging and the chunks instead of following the reduction. cs = {cos, sin} of e = 0, then of e = 1
// (float bits; 0 where unused: v rows, padded requests).
__device__ __forceinline__ void rope_prefetch(const Smem& S, const Params& P, int p0, int m, int nt, int lane,
                                              unsigned (&cs)[4]) {
  int g, hl, s;
  qkv_unit(p0 + m, g, hl, s);
  const int j = s * 8 + (lane >> 2);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int b = nt * 8 + (lane & 3) * 2 + e;
    float c = 0.f, sn = 0.f;
    if (hl <= G && b < P.batch) rope_cos_sin(P, S.pos()[b], j, c, sn);
    cs[2 * e] = __float_as_uint(c);
    cs[2 * e + 1] = __float_as_uint(sn);
  }
}

// cs: rope_prefetch's values.
__device__ __forceinline__ void qkv_rope_epilogue(const Smem& S, const Params& P, const Task& t, int p0, int m, int nt, int lane,
                                                  const float (&v)[4], const unsigned (&cs)[4]) {
  int g, hl, s;
  qkv_unit(p0 + m, g, hl, s);
  const int j = s * 8 + (lane >> 2);   // rotary index of this thread's first-half dim
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int b = nt * 8 + (lane & 3) * 2 + e;
    if (b >= P.batch) continue;
    float y1 = stock_rnd(v[e]), y2 = stock_rnd(v[e + 2]);  // STOCK: vLLM's qkv GEMM stores before RoPE
    if (hl <= G) {  // q or k: rotate the pair (j, j + D/2)
      const float c = __uint_as_float(cs[2 * e]), sn = __uint_as_float(cs[2 * e + 1]);
      const float x1 = y1, x2 = y2;
      y1 = x1 * c - x2 * sn;
      y2 = x2 * c + x1 * sn;
    }
    if (hl < G) {
      elem_t* q = buf_ptr(P, BUF_Q) + (size_t)b * QS + (g * G + hl) * D;
      q[j] = from_f(y1);
      q[D / 2 + j] = from_f(y2);
    } else {
      const long long slot = S.slot()[b];
      if (slot >= 0) {
        const long long bs = P.block_size;
        const long long blk = slot / bs, off = slot - blk * bs;
        elem_t* cache = reinterpret_cast<elem_t*>(P.kvptr[t.layer]);
        elem_t* dst = cache + ((blk * 2 + (hl - G)) * bs + off) * KVS + g * D;
        dst[j] = from_f(y1);
        dst[D / 2 + j] = from_f(y2);
      }
    }
  }
}

}  // namespace mk
