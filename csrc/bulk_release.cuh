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
// MK_BULK_QKV=1 (with MK_BULK_RELEASE): qkv_rope tasks of batch <= BULK_QKV_MAX_BATCH too. A unit's output is
// two 16-byte pieces per request (8 dims of the head's first half, the same 8 of its second half), into Q or
// the KV cache slot; the stage holds them as [b][half][unit] so that the units of one head (consecutive s)
// are one contiguous run in the stage and at the destination: one bulk copy per (request, half, head run).
#pragma once
#include "matvec.cuh"

namespace mk {

constexpr int BULK_STAGE_OFF = SMEM_BYTES;     // BULK_STAGE_BYTES (tasks.h): the variant's launch adds them
static_assert(!MK_BULK_RELEASE || SMEM_BYTES + BULK_STAGE_BYTES <= 232448, "bulk stage over the sm_90 limit");
static_assert(MK_BULK_RELEASE >= 0 && MK_BULK_RELEASE <= 2, "MK_BULK_RELEASE: 0, 1, 2");
static_assert(!MK_BULK_QKV || MK_BULK_RELEASE, "MK_BULK_QKV needs MK_BULK_RELEASE");
// thread 0 issues one copy per (request, half, head run): batch 4 at 3 units per task (8B) is <= 24 copies
constexpr int BULK_QKV_MAX_BATCH = 4;

__device__ __forceinline__ bool bulk_task(const Task& t, int batch) {
  if (!MK_BULK_RELEASE) return false;
#if MK_BULK_QKV   // preprocessed out otherwise: MK_BULK_RELEASE's measured build stays the same code
  if (t.opcode == OP_QKV_ROPE) return batch <= BULK_QKV_MAX_BATCH && t.arg1 * batch * 2 * 16 <= BULK_STAGE_BYTES;
#endif
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

// qkv_rope (MK_BULK_QKV): this thread's element (request b, unit p0 + m, half h: dim j or D/2 + j) into the stage.
__device__ __forceinline__ void bulk_put_qkv(const Smem& S, const Task& t, int b, int u, int h, int lane, elem_t v) {
  bulk_stage(S)[((b * 2 + h) * t.arg1 + (u - t.arg0)) * 8 + (lane >> 2)] = v;
}

__device__ __forceinline__ void bulk_copy(elem_t* dst, unsigned src, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"((unsigned)bytes)
               : "memory");
}

// qkv_rope's copies: per request and half, runs of units of one head with consecutive sub-tiles.
__device__ __forceinline__ void bulk_issue_qkv(const Smem& S, const Params& P, const Task& t, unsigned src) {
  const int nu = t.arg1;
  for (int b = 0; b < P.batch; ++b) {
    const long long slot = S.slot()[b];
    for (int h = 0; h < 2; ++h) {
      for (int ul = 0; ul < nu;) {
        int g, hl, s;
        qkv_unit(t.arg0 + ul, g, hl, s);
        int run = 1;
        for (int g2, hl2, s2; ul + run < nu; ++run) {
          qkv_unit(t.arg0 + ul + run, g2, hl2, s2);
          if (g2 != g || hl2 != hl || s2 != s + run) break;
        }
        elem_t* dst = nullptr;
        if (hl < G) {
          dst = buf_ptr(P, BUF_Q) + (size_t)b * QS + (g * G + hl) * D;
        } else if (slot >= 0) {
          const long long bs = P.block_size, blk = slot / bs, off = slot - blk * bs;
          dst = reinterpret_cast<elem_t*>(P.kvptr[t.layer]) + ((blk * 2 + (hl - G)) * bs + off) * KVS + g * D;
        }
        if (dst != nullptr)
          bulk_copy(dst + h * (D / 2) + s * 8, src + (unsigned)(((b * 2 + h) * nu + ul) * 16), run * 16);
        ul += run;
      }
    }
  }
}

// Thread 0, after the task's last consumer_sync: store the stage, wait for it, signal (ctr null: no signal).
__device__ __forceinline__ void bulk_release(const Smem& S, const Params& P, const Task& t, unsigned* ctr, unsigned add) {
  const unsigned src = smem_addr(bulk_stage(S));
#if MK_BULK_QKV
  if (t.opcode == OP_QKV_ROPE) {
    bulk_issue_qkv(S, P, t, src);
  } else
#endif
  {
    const int ld = t.opcode == OP_GATE_UP ? I : H;
    const int cols = t.arg1 * UNIT;
    elem_t* out = buf_ptr(P, t.out_buf) + t.arg0 * UNIT;
    for (int b = 0; b < P.batch; ++b)
      bulk_copy(out + (size_t)b * ld, src + (unsigned)(b * cols * (int)sizeof(elem_t)), cols * (int)sizeof(elem_t));
  }
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  if (MK_BULK_RELEASE == 2) asm volatile("fence.proxy.async.global;" ::: "memory");
  if (ctr != nullptr) asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(ctr), "r"(add) : "memory");
}

}  // namespace mk
