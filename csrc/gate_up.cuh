// gate_up task: ACT[:, cols] = silu(g) * u with g = rms_norm(RESID) @ Wgate[cols]^T and
// u = rms_norm(RESID) @ Wup[cols]^T. A unit is two M-tiles (gate rows, up rows); the warp owning
// the gate tile also receives the up tile's sums (vu).
#pragma once
#include "matvec.cuh"

namespace mk {

__device__ __forceinline__ void gate_up_epilogue(const Smem& S, const Params& P, const Task& t, int p0, int m, int nt,
                                                 int lane, const float (&v)[4], const float (&vu)[4]) {
  elem_t* act = buf_ptr(P, t.out_buf);
  const int u = p0 + (m >> 1);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int b = nt * 8 + (lane & 3) * 2 + (e & 1);
    const int col = u * UNIT + (lane >> 2) + (e >> 1) * 8;
    if (b < P.batch) {
      const float gt = stock_rnd(v[e]);   // STOCK: vLLM's gate_up GEMM stores g and u first
      const elem_t a = from_f(gt / (1.f + __expf(-gt)) * stock_rnd(vu[e]));
      act[(size_t)b * I + col] = a;
    }
  }
}

}  // namespace mk
