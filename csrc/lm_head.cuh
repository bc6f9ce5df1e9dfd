// lm_head task: LOGITS[:, rows] = OUT @ Wlm[rows]^T in fp32 (as triton_ops.lm_head: logits feed
// the sampler in fp32); rows past the vocabulary are neither copied nor stored.
#pragma once
#include "matvec.cuh"

namespace mk {

__device__ __forceinline__ void lm_head_epilogue(const Params& P, const Task& t, int p0, int m, int nt, int lane,
                                                 const float (&v)[4]) {
  float* logits = reinterpret_cast<float*>(P.buf[t.out_buf]);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int b = nt * 8 + (lane & 3) * 2 + (e & 1);
    const int row = (p0 + m) * UNIT + (lane >> 2) + (e >> 1) * 8;
    if (b < P.batch && row < V) st_f32(logits + (size_t)b * V + row, v[e]);
  }
}

}  // namespace mk
