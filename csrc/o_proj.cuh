// o_proj task: RESID[:, rows] = h[:, rows] + ATTN_O @ Wo[rows]^T (h = the layer's residual source:
// the caller's input for layer 0, RESID after). down.cuh reuses this epilogue (ACT @ Wd^T + RESID).
#pragma once
#include "matvec.cuh"

namespace mk {

__device__ __forceinline__ void residual_epilogue(const Params& P, const Task& t, int p0, int m, int nt, int lane,
                                                  const float (&v)[4]) {
  const elem_t* res = buf_ptr(P, t.res_buf);
  elem_t* out = buf_ptr(P, t.out_buf);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int b = nt * 8 + (lane & 3) * 2 + (e & 1);
    const int row = (p0 + m) * UNIT + (lane >> 2) + (e >> 1) * 8;
    if (b < P.batch) {
      const size_t i = (size_t)b * H + row;
      // STOCK: vLLM's GEMM stores its output before the residual add
      out[i] = from_f(bits_to_f(ld_cg_u16(res + i)) + stock_rnd(v[e]));  // same thread reads then writes (down)
    }
  }
}

}  // namespace mk
