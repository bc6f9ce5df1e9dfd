// o_proj task: RESID[:, rows] = h[:, rows] + ATTN_O @ Wo[rows]^T (h = the layer's residual source:
// the caller's input for layer 0, RESID after). down.cuh reuses this epilogue (ACT @ Wd^T + RESID).
#pragma once
#include "matvec.cuh"

namespace mk {

// Element e of this lane's accumulator tile (M-tile m of the pass at p0, batch n-tile nt) in the [batch, H]
// residual: request b (>= batch: a padded row) and hidden row. The prefetch and the epilogue share it.
__device__ __forceinline__ void residual_elem(int p0, int m, int nt, int lane, int e, int& b, int& row) {
  b = nt * 8 + (lane & 3) * 2 + (e & 1);
  row = (p0 + m) * UNIT + (lane >> 2) + (e >> 1) * 8;
}

// The residual values of a warp's epilogue tile are loaded at the start of its pass (residual_prefetch),
// so their L2 round trip overlaps the staging and the chunks instead of following the reduction: -13..-16
// us per 1B step at batch 1/4/8 (bench/results/mk_ab_2026-12-01_b200d73.md; it was the MK_RES_PREFETCH
// variant). The residual is complete before the task starts (o_proj: down of the previous layer, via
// attention and qkv; down: o_proj of its layer, via gate_up).
__device__ __forceinline__ void residual_prefetch(const Params& P, const Task& t, int p0, int m, int nt, int lane,
                                                  unsigned (&r)[4]) {
  const elem_t* res = buf_ptr(P, t.res_buf);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    int b, row;
    residual_elem(p0, m, nt, lane, e, b, row);
    r[e] = b < P.batch ? ld_cg_u16(res + (size_t)b * H + row) : 0u;
  }
}

// The residual values rres come from residual_prefetch (same thread, same elements: down reads then
// writes RESID in place).
__device__ __forceinline__ void residual_epilogue(const Params& P, const Task& t, int p0, int m, int nt, int lane,
                                                  const float (&v)[4], const unsigned (&rres)[4]) {
  elem_t* out = buf_ptr(P, t.out_buf);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    int b, row;
    residual_elem(p0, m, nt, lane, e, b, row);
    // STOCK: vLLM's GEMM stores its output before the residual add
    if (b < P.batch) out[(size_t)b * H + row] = from_f(bits_to_f((unsigned short)rres[e]) + stock_rnd(v[e]));
  }
}

}  // namespace mk
