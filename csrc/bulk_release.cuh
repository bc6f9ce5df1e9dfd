// MK_BULK_RELEASE (A/B switch, default 0, session 16; variant.KernelVariant.bulk_release): a task's release
// without MEMBAR. The kernel's release (red.release.gpu: MEMBAR.ALL.GPU) waits for the SM's own in-flight
// weight copies (bench/NOTES.md session 8), which is why the producer holds the next task's copies behind
// the release gate after gate_up. Here a gate_up, o_proj or down task (not cut over K) whose output fits
// the stage (BULK_STAGE_BYTES, past the layout's shared memory) writes it there instead of global memory;
// thread 0 stores it with one bulk copy per request (cp.async.bulk.global.shared::cta, its own bulk group),
// waits for the group to complete (the data are written) and adds the signal with a relaxed red (mode 2:
// after fence.proxy.async.global). Its rows are [b][c0, c0 + cols) of a [batch, ld] buffer; c0 and cols are
// whole units (32 bytes), so every copy is 16-byte aligned. The reads the task made are complete before its
// output exists (the output depends on them), so the relaxed add still follows them.
#pragma once
#include "matvec.cuh"

namespace mk {

constexpr int BULK_STAGE_BYTES = 768;          // variant.BULK_STAGE_BYTES
constexpr int BULK_STAGE_OFF = SMEM_BYTES;     // the variant's launch adds BULK_STAGE_BYTES
static_assert(!MK_BULK_RELEASE || SMEM_BYTES + BULK_STAGE_BYTES <= 232448, "bulk stage over the sm_90 limit");
static_assert(MK_BULK_RELEASE >= 0 && MK_BULK_RELEASE <= 2, "MK_BULK_RELEASE: 0, 1, 2");

__device__ __forceinline__ bool bulk_task(const Task& t, int batch) {
  if (!MK_BULK_RELEASE) return false;
  if (t.opcode != OP_GATE_UP && !((t.opcode == OP_O_PROJ || t.opcode == OP_DOWN) && !is_ksplit(t))) return false;
  return t.arg1 * UNIT * batch * (int)sizeof(elem_t) <= BULK_STAGE_BYTES;
}

__device__ __forceinline__ elem_t* bulk_stage(const Smem& S) {
  return reinterpret_cast<elem_t*>(S.base + BULK_STAGE_OFF);
}

// An epilogue's element (request b, output column col) of a bulk task, into the stage.
__device__ __forceinline__ void bulk_put(const Smem& S, const Task& t, int b, int col, elem_t v) {
  const int cols = t.arg1 * UNIT;
  bulk_stage(S)[b * cols + (col - t.arg0 * UNIT)] = v;
}

// Each writing thread, after its stage writes and before the barrier that precedes thread 0's copies:
// generic-proxy writes to shared memory become visible to the bulk copy (async proxy).
__device__ __forceinline__ void bulk_put_done() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Thread 0, after the task's last consumer_sync: store the stage, wait for it, signal (ctr null: no signal).
__device__ __forceinline__ void bulk_release(const Smem& S, const Params& P, const Task& t, unsigned* ctr, unsigned add) {
  const int ld = t.opcode == OP_GATE_UP ? I : H;
  const int cols = t.arg1 * UNIT;
  elem_t* out = buf_ptr(P, t.out_buf) + t.arg0 * UNIT;
  const unsigned src = smem_addr(bulk_stage(S));
  for (int b = 0; b < P.batch; ++b)
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(out + (size_t)b * ld), "r"(src + (unsigned)(b * cols * (int)sizeof(elem_t))),
                 "r"((unsigned)(cols * (int)sizeof(elem_t))) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  if (MK_BULK_RELEASE == 2) asm volatile("fence.proxy.async.global;" ::: "memory");
  if (ctr != nullptr) asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(ctr), "r"(add) : "memory");
}

}  // namespace mk
