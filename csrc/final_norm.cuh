// final_norm task: OUT[:, cols] = RESID[:, cols] * rstd[b] * final_norm_w[cols] for the task's
// units (16 columns each); rstd from the whole row (rows_rstd).
#pragma once
#include "common.cuh"

namespace mk {

__device__ __forceinline__ void final_norm_task(const Smem& S, const Params& P, const Task& t, int warp, int lane) {
  const elem_t* x = buf_ptr(P, t.in_buf);
  elem_t* out = buf_ptr(P, t.out_buf);
  const elem_t* w = weight_ptr(P, LAYERS, MP_FINAL_NORM);
  rows_rstd(x, P.batch, S.rstd(), S.scratch(), warp, lane);
  const float* rstd = S.rstd();
  const int c0 = t.arg0 * UNIT, cols = t.arg1 * UNIT;
  for (int idx = threadIdx.x; idx < P.batch * cols; idx += CONSUMER_THREADS) {
    const int b = idx / cols, c = c0 + idx % cols;
    const size_t i = (size_t)b * H + c;
    out[i] = from_f(norm_elem(bits_to_f(ld_cg_u16(x + i)), rstd[b], bits_to_f(ld_nc_u16(w + c))));
  }
}

}  // namespace mk
