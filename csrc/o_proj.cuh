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
__device__ __forceinline__ void residual_epilogue(const Smem& S, const Params& P, const Task& t, int p0, int m, int nt,
                                                  int lane, const float (&v)[4], const unsigned (&rres)[4]) {
  elem_t* out = buf_ptr(P, t.out_buf);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    int b, row;
    residual_elem(p0, m, nt, lane, e, b, row);
    // STOCK: vLLM's GEMM stores its output before the residual add
    if (b < P.batch) {
      const elem_t r = from_f(bits_to_f((unsigned short)rres[e]) + stock_rnd(v[e]));
      out[(size_t)b * H + row] = r;
    }
  }
}

// K-split o_proj/down (tuning.ksplit): a part's fp32 sums go to PART_K[part][b][row] (MAX_BATCH rows per
// part) instead of the output; the part that completes the range's ticket adds them (ksplit_merge).
__device__ __forceinline__ void ksplit_store(const Params& P, const Task& t, int p0, int m, int nt, int lane,
                                             const float (&v)[4]) {
  float* pk = reinterpret_cast<float*>(P.buf[BUF_PART_K]) + (size_t)ksplit_part(t.arg2) * MAX_BATCH * H;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    int b, row;
    residual_elem(p0, m, nt, lane, e, b, row);
    if (b < P.batch) st_f32(pk + (size_t)b * H + row, v[e]);
  }
}

// After a K-split task's passes (their last consumer_sync orders every partial store before thread 0's
// ticket): the ticket (acq_rel) releases this part's partials and, for the last taker, acquires the other
// parts'. The last one adds the parts in part order, whichever finished last (bit-identical results), then
// the residual as residual_epilogue does, and stores the output; its signal follows in consumer_loop. Every part
// signals (a non-last part's second release): only the completer signalling for all measured +0.5..+0.9% at 1B b4 / b8
// (session 39, MK_TICKET_SIGNAL, bench/NOTES.md).
__device__ __noinline__ void ksplit_merge(const Smem S, const Params& P, const Task t) {
  const int parts = ksplit_parts(t.arg2);
  int* last = reinterpret_cast<int*>(S.scratch());
  if (threadIdx.x == 0)
    *last = atom_add_acq_rel_gpu(P.counters + (size_t)t.ticket_ctr * COUNTER_STRIDE, 1u) + 1 == (unsigned)parts;
  consumer_sync();
  if (!*last) return;
  const float* pk = reinterpret_cast<const float*>(P.buf[BUF_PART_K]);
  const elem_t* res = buf_ptr(P, t.res_buf);
  elem_t* out = buf_ptr(P, t.out_buf);
  const int rows = t.arg1 * UNIT, r0 = t.arg0 * UNIT;
  for (int i = threadIdx.x; i < P.batch * rows; i += CONSUMER_THREADS) {
    const int b = i / rows, row = r0 + (i - b * rows);
    const size_t o = (size_t)b * H + row;
    float v = ld_cg_f32(pk + o);
    for (int p = 1; p < parts; ++p) v += ld_cg_f32(pk + (size_t)p * MAX_BATCH * H + o);
    out[o] = from_f(bits_to_f(ld_cg_u16(res + o)) + stock_rnd(v));
  }
}

}  // namespace mk
