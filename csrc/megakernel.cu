// The persistent decode megakernel: one launch runs a whole encoded task program (one decode step,
// or one segment of it between fallback ops). Grid = one CTA per SM, all co-resident
// (__launch_bounds__(NUM_THREADS, 1), SMEM_BYTES of dynamic shared memory: one CTA per SM).
//
// CTA i runs queue i of the program (encoding.py: header | queue offsets | 64-byte task records):
//   warps 0..7  consumers: for each task, wait for its counters (thread 0, acquire), run it,
//               each thread freeing a ring slot once it has read it,
//               consumer_sync, then thread 0 release-adds its signal counter;
//   warp 8      producer: streams the weights of the same tasks, in the same order, into the
//               NUM_STAGES-slot shared-memory ring with cp.async.bulk; it never waits on counters,
//               so the next tasks' weights load while the consumers wait or compute.
// Counters must be zero at launch (backend.py zeroes them with a captured memset each step).
//
// Watchdog (no trap: the CUDA context survives): every wait is bounded by watchdog_ms. A failed
// wait fills the error record `err` (common.cuh: watchdog_record); thread 0's counter waits also
// give up as soon as any SM has recorded a failure. A CTA stops at its next task boundary (the
// consumers leave the queue together through consumer_sync_or; the producer stops issuing once it
// sees the CTA's abort flag and drains its in-flight copies). Tasks that are not blocked may still
// run: an aborted launch writes only the locations a complete one writes (its buffers and this
// step's KV slots), with unspecified values. A launch that finds a record already set exits at once.
#pragma nv_diag_suppress 177  // generated constants that this translation unit does not use
#include "common.cuh"
// MK_DIAG (timing diagnostics only, wrong results): 1 no counter waits, 2 no weight copies, 4 no MMAs, 8 a matvec
// task's activations reach shared memory for its first pass only (matvec.cuh: the cost of the later passes' x)
// 16 at NT = 1 a pass's first chunk's activation fragments serve all its chunks (matvec.cuh: their per-chunk cost)
// 32 with MK_W_TMA every weight chunk from layer 0's first 512 rows, so the weights stay in L2 (producer.cuh: diag_row)
// MK_RELEASE_GATE=<mask of opcodes> (default in tasks.h, generated: after gate_up; 0 = off): the producer does
// not issue the weights of the task that follows one of these opcodes in its queue until that task's signal
// is released. The release's fence (MEMBAR.ALL.GPU, ERRBAR) waits for the SM's in-flight weight copies
// (session 7: gate_up's release 3.3 us with the next task's copies in flight, 0.4-0.8 us without), and the
// release is on the dependency chain; held copies delay the next task's weights instead (session 8: -29..-41
// us at 1B batch 1/4/8 with the gate after gate_up; after down too, it delays qkv's weights: slower).
// Hand-off costs removed in session 9 (A/B in bench/NOTES.md; each was a switch, the measured winners are the
// code): consumers take a matvec task's shape without its weight pointer and load the norm weight's pointer
// before the dependency wait (matvec_dispatch); qkv_rope's cos|sin values are loaded at the start of the pass
// (rope_prefetch). o_proj/down stream x by column groups only when it does not fit the scratch whole (the
// column groups at batch 1 too measured +36 us at 1B batch 1).
// MK_TRACE_PHASES=1 (bench only): matvec tasks record the ns of their phases in the trace (encoding.py
// TRACE_FIELDS); the defaults of all these switches are generated into tasks.h from variant.KernelVariant
#include "matvec.cuh"
#include "qkv_rope.cuh"
#include "attention.cuh"
#include "attention_tma.cuh"
#include "attention_ring_mma.cuh"
#include "o_proj.cuh"
#include "gate_up.cuh"
#include "down.cuh"
#include "final_norm.cuh"
#include "lm_head.cuh"

namespace mk {

__device__ __forceinline__ void matvec_epilogue(const Smem& S, const Params& P, const Task& t, int p0, int m,
                                                int nt, int lane, const float (&v)[4], const float (&vu)[4],
                                                const unsigned (&rres)[4]) {
  switch (t.opcode) {
    case OP_QKV_ROPE: qkv_rope_epilogue(S, P, t, p0, m, nt, lane, v, rres); break;
    case OP_O_PROJ:
    case OP_DOWN:
      if (is_ksplit(t))
        ksplit_store(P, t, p0, m, nt, lane, v);
      else
        residual_epilogue(S, P, t, p0, m, nt, lane, v, rres);
      break;
    case OP_GATE_UP: gate_up_epilogue(S, P, t, p0, m, nt, lane, v, vu); break;
    case OP_LM_HEAD: lm_head_epilogue(P, t, p0, m, nt, lane, v); break;
    default: break;
  }
}

// The norm weight of a norm-fused op (qkv_rope, gate_up: their K is H), else null.
__device__ __forceinline__ const elem_t* norm_weight(const Params& P, const Task& t) {
  if (t.opcode != OP_QKV_ROPE && t.opcode != OP_GATE_UP) return nullptr;
  return weight_ptr(P, t.layer, t.opcode == OP_QKV_ROPE ? LP_IN_NORM : LP_POST_NORM);
}

// nw: norm_weight(P, t), read before the task's dependency wait.
__device__ __forceinline__ void matvec_dispatch(const Smem& S, const Params& P, const Task& t, unsigned& it, int warp,
                                             int lane, unsigned long long& wait_cycles, const elem_t* nw) {
  WeightPlan wp;
  weight_plan(P, t.opcode, t.layer, wp);
  // the consumers use only the plan's shape, so the weight pointer's load (an L1 miss after the wait's
  // acquire invalidated L1, ~0.5 us: the "entry" phase of session 7's traces) becomes dead code
  wp.w = nullptr;
  const elem_t* x = buf_ptr(P, t.in_buf);
  if (is_ksplit(t)) {   // a K part: x's columns [lo, hi) with the full row stride (WeightPlan.ldx)
    int lo, hi;
    ksplit_range(wp.K, t.arg2, lo, hi);
    x += lo;
    wp.K = hi - lo;
  }
  const bool staged = staged_fits(wp.K, P.batch, nw != nullptr);
#if MK_WGMMA_A   // A/B switch: batch 9..16, whole 256-column chunks: the task on the warpgroup MMA, inline
  if (wga_takes(wp.K, P.batch)) {
    it = wga_task(S, P, t, wp, x, nw, it, warp, lane, wait_cycles);
    return;
  }
#endif
  if (batch_ntiles(P.batch) == 1)
    it = matvec_task<1>(S, P, t, wp, x, nw, staged, it, warp, lane, &wait_cycles);
  else
    it = matvec_task<2>(S, P, t, wp, x, nw, staged, it, warp, lane, &wait_cycles);
}

__device__ __forceinline__ void consumer_loop(const Smem& S, const Params& P, int qbeg, int qend, int warp, int lane) {
  unsigned it = 0;          // weight chunks consumed so far (matches the producer's count)
  int known_ctr = -1;       // thread 0: a counter already seen at >= known_val (counters only grow)
  unsigned known_val = 0;
  for (int ti = qbeg; ti < qend; ++ti) {
    const Task t = load_task(P, ti);
    unsigned long long t_start = 0, t_ready = 0, wait_cycles = 0;
    if (P.trace != nullptr && threadIdx.x == 0) t_start = global_ns();
    // the norm weight's pointer (an immutable table in global memory) is loaded before the wait, so its
    // round trip overlaps the wait instead of following it
    const elem_t* early_nw = norm_weight(P, t);
    int stop = 0;
    if (threadIdx.x == 0) {
      *S.cur_task() = ti;
      stop = *S.abort_flag();  // a weight-ring wait of the previous task timed out
#pragma unroll
      for (int w = 0; w < NUM_WAITS; ++w) {
        const int c = t.wait_ctr[w];
        const unsigned target = (unsigned)t.wait_target[w];
        if (stop || c < 0 || (c == known_ctr && target <= known_val) || (MK_DIAG & 1)) continue;
        unsigned v;
        if (task_counter_wait(P, ti, c, target, v) != WAIT_OK) {
          stop = 1;
        } else {
          known_val = v;
          known_ctr = c;
        }
      }
      if (stop) *S.abort_flag() = 1;  // tells the producer warp to stop issuing
    }
    if (consumer_sync_or(stop)) break;
    if (P.trace != nullptr && threadIdx.x == 0) t_ready = global_ns();
    switch (t.opcode) {
      case OP_QKV_ROPE:
      case OP_O_PROJ:
      case OP_GATE_UP:
      case OP_DOWN:
      case OP_LM_HEAD: matvec_dispatch(S, P, t, it, warp, lane, wait_cycles, early_nw); break;
#if MK_ATT_TMA
      case OP_ATTN_PARTIAL:   // a task under MK_ATT_TMA tokens takes the default loop (its producer skips it)
        if (att_tma_task(S.seq_len()[t.arg0], P.chunks, t.arg2))
          it = attn_partial_mma(S, P, t, it, warp, lane);   // attention_ring_mma.cuh: on the tensor cores
        else
          attn_partial_task(S, P, t, warp, lane);
        break;
#else
      case OP_ATTN_PARTIAL: attn_partial_task(S, P, t, warp, lane); break;
#endif
      case OP_ATTN_COMBINE: attn_combine_task(S, P, t); break;
      case OP_FINAL_NORM: final_norm_task(S, P, t, warp, lane); break;
      default: break;
    }
    consumer_sync();  // all of this task's stores precede the release below
    unsigned long long t_rel = 0;
    if (MK_TRACE_PHASES && P.trace != nullptr && threadIdx.x == 0) t_rel = global_ns();
    if (threadIdx.x == 0 && t.signal_ctr >= 0)
      red_release_gpu_add(P.counters + (size_t)t.signal_ctr * COUNTER_STRIDE, (unsigned)t.signal_add);
    if (MK_RELEASE_GATE && threadIdx.x == 0) gate_word_write(S.released(), ti + 1);  // after the release's fence
    if (P.trace != nullptr && threadIdx.x == 0) {
      unsigned long long* tr = P.trace + (size_t)ti * TRACE_WORDS;
      tr[TR_START] = t_start;
      tr[TR_READY] = t_ready;
      tr[TR_END] = global_ns();
      if (MK_TRACE_PHASES) tr[TR_PH_RELEASE] = tr[TR_END] - t_rel;
      tr[TR_WAIT_CYCLES] = wait_cycles;
      tr[TR_SM] = blockIdx.x;
      tr[TR_OPCODE] = (unsigned long long)t.opcode;
    }
  }
}

}  // namespace mk

// Parameters: MK_DECODE_PARAMS, generated from encoding.KERNEL_PARAMS (runtime.py packs by name).
extern "C" __global__ void __launch_bounds__(mk::NUM_THREADS, 1) mk_decode(MK_DECODE_PARAMS) {
  using namespace mk;
#if MK_W_TMA || MK_ATT_TMA
  // the weight chunks' 128-byte swizzle unit (MK_W_TMA); MK_ATT_TMA's KV tiles start 512-byte aligned in each slot
  extern __shared__ __align__(1024) unsigned char smem_raw[];
#else
  extern __shared__ __align__(128) unsigned char smem_raw[];
#endif
  const Smem S{smem_raw};
  int start_stop = 0;
  if (threadIdx.x == 0) {
    Params& P = S.params();
    P.prog = prog;
    P.wptr = wptr;
    P.kvptr = kvptr;
    P.counters = counters;
    P.positions = positions;
    P.slots = slots;
    P.seq_lens = seq_lens;
    P.block_table = block_table;
    P.cos_sin = cos_sin;
    P.buf[BUF_HIDDEN_IN] = hidden_in;
    P.buf[BUF_RESID] = resid;
    P.buf[BUF_Q] = q;
    P.buf[BUF_ATTN_O] = attn_o;
    P.buf[BUF_ACT] = act;
    P.buf[BUF_OUT] = out;
    P.buf[BUF_LOGITS] = logits;
    P.buf[BUF_PART_O] = part_o;
    P.buf[BUF_PART_ML] = part_ml;
    P.buf[BUF_PART_K] = part_k;
    P.trace = trace;
    P.err = err;
    P.err_host = err_host;
    P.budget_ns = (unsigned long long)(watchdog_ms > 0 ? watchdog_ms : 1) * 1000000ull;
    P.bt_stride = bt_stride;
    P.block_size = block_size;
    P.cs_rows = cs_rows;
    P.cs_stride = cs_stride;
    P.cs_f32 = cs_f32;
    P.batch = prog[HDR_BATCH];
    P.chunks = prog[HDR_ATTN_CHUNKS];
    P.tasks_at = prog[HDR_TASKS_AT];
    *S.cur_task() = -1;
    if (MK_RELEASE_GATE) *S.released() = __ldg(prog + HEADER_WORDS + blockIdx.x);  // none released yet
    // A program built for another model, batch limit or grid must never run: record which check
    // failed and exit (the host validates ProgramMeta before launching, so this is a last guard).
    int bad = 0;
    if (prog[HDR_MAGIC] != PROGRAM_MAGIC) bad |= HDRCHK_MAGIC;
    if (prog[HDR_VERSION] != PROGRAM_VERSION) bad |= HDRCHK_VERSION;
    if (prog[HDR_SPEC_HASH] != MK_SPEC_HASH) bad |= HDRCHK_SPEC_HASH;
    if (prog[HDR_NUM_QUEUES] != (int)gridDim.x) bad |= HDRCHK_NUM_QUEUES;
    if (P.batch < 1 || P.batch > MAX_BATCH || (MK_NTILES && batch_class(P.batch) != MK_NTILES)) bad |= HDRCHK_BATCH;
    if (blockDim.x != NUM_THREADS) bad |= HDRCHK_BLOCK;
    if (MK_W_TMA && (smem_addr(smem_raw) & 1023u)) bad |= HDRCHK_SMEM_ALIGN;
    int stop = 0;
    if (ld_relaxed_gpu_s32(err) != 0) {
      stop = 1;  // an earlier failure is still recorded: refuse to run until the host clears it
    } else if (bad) {
      watchdog_record(P, ERR_BAD_PROGRAM, -1, -1, 0, bad, 0);
      stop = 1;
    }
    *S.abort_flag() = stop;
    start_stop = stop;
    if (!stop) {
      for (int s = 0; s < NUM_STAGES; ++s) {
        mbar_init(S.full_bar(s), 1);
        mbar_init(S.empty_bar(s), CONSUMER_THREADS);  // every consumer thread frees its own reads
      }
      fence_mbar_init();
    }
  }
  // Barrier + broadcast of thread 0's decision in one step (not a later read of the shared flag,
  // which thread 0 may already have set again in its first counter wait): the whole CTA exits, or
  // none of it does -- a warp missing from a later consumer barrier would hang the others.
  if (__syncthreads_or(start_stop)) return;
  const Params& P = S.params();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int qbeg = __ldg(prog + HEADER_WORDS + blockIdx.x), qend = __ldg(prog + HEADER_WORDS + blockIdx.x + 1);
  if (warp >= CONSUMER_WARPS) {
    if (warp == CONSUMER_WARPS) producer_loop(S, P, qbeg, qend, lane);
    return;
  }
  step_inputs(S, P);
  consumer_loop(S, P, qbeg, qend, warp, lane);
}
