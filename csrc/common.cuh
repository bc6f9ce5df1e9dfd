// Model constants (from the -D options of encoding.kernel_defines), element type, kernel context.
#pragma once
#include "tasks.h"
#include "sync.cuh"
#include "copy.cuh"

#ifndef MK_HIDDEN
#error "compile with the -D options of mk_plugin.persistent.encoding.kernel_defines(spec)"
#endif

// Rounding points (encoding.Rounding, mirrored by vm.py): 0 = FUSED (the GPU-measured kernel,
// one rounding per fused op), 1 = STOCK (also round where vLLM's unfused ops store).

namespace mk {

constexpr int H = MK_HIDDEN;
constexpr int I = MK_INTER;
constexpr int NQ = MK_NQ;
constexpr int NKV = MK_NKV;
constexpr int D = MK_HEAD_DIM;
constexpr int V = MK_VOCAB;
constexpr int LAYERS = MK_LAYERS;
constexpr int G = NQ / NKV;
constexpr int QS = NQ * D;
constexpr int KVS = NKV * D;
constexpr float EPS = MK_EPS;
constexpr int QKV_UNITS_PER_GROUP = (G + 2) * (D / UNIT);

static_assert(NQ % NKV == 0, "q heads must be a multiple of kv heads");
static_assert(D == 64 || D == 128, "head_dim 64 or 128");
static_assert(H % UNIT == 0 && I % UNIT == 0, "hidden and intermediate sizes must be multiples of 16");
static_assert(ACC_TILES == CONSUMER_WARPS, "epilogue maps one accumulator tile per consumer warp");
static_assert(CONSUMER_WARPS == 8, "the kernel is written for 8 consumer warps");

// The model dtype as raw 16-bit storage, converted with PTX cvt (no cuda_bf16.h / cuda_fp16.h:
// NVRTC then needs no include path). MK_DTYPE_BF16=1: bfloat16, else float16.
struct elem_t {
  unsigned short bits;
};
static_assert(sizeof(elem_t) == 2, "16-bit elements");

__device__ __forceinline__ float bits_to_f(unsigned short b) {
#if MK_DTYPE_BF16
  return __uint_as_float(((unsigned)b) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
  return f;
#endif
}

__device__ __forceinline__ unsigned short f_to_bits(float x) {  // round to nearest even
  unsigned short b;
#if MK_DTYPE_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(x));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(x));
#endif
  return b;
}

__device__ __forceinline__ float to_f(elem_t x) { return bits_to_f(x.bits); }
__device__ __forceinline__ elem_t from_f(float x) { return elem_t{f_to_bits(x)}; }

// Two packed 16-bit elements (low half = lower address) <-> floats.
__device__ __forceinline__ float lo_f(unsigned u) { return bits_to_f((unsigned short)(u & 0xFFFFu)); }
__device__ __forceinline__ float hi_f(unsigned u) { return bits_to_f((unsigned short)(u >> 16)); }
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  return (unsigned)f_to_bits(lo) | ((unsigned)f_to_bits(hi) << 16);
}

constexpr bool STOCK_ROUNDING = MK_ROUNDING == ROUNDING_STOCK;
static_assert(MK_ROUNDING == ROUNDING_FUSED || MK_ROUNDING == ROUNDING_STOCK, "MK_ROUNDING: 0 fused, 1 stock");

// A value vLLM would have stored in the activation dtype (a GEMM output, x * rstd): rounded under
// STOCK rounding, kept in fp32 under FUSED.
__device__ __forceinline__ float stock_rnd(float x) { return STOCK_ROUNDING ? bits_to_f(f_to_bits(x)) : x; }

// One element of rms_norm before its store: x * rstd * w, with vLLM's intermediate rounding of
// x * rstd under STOCK (its rms_norm kernels compute (scalar_t)(x * rstd) * w).
__device__ __forceinline__ float norm_elem(float x, float rstd, float w) { return stock_rnd(x * rstd) * w; }

// norm_elem on both 16-bit halves of a packed pair x, with their norm weights w: x' of two columns.
__device__ __forceinline__ unsigned norm_pair(unsigned x, float rstd, unsigned w) {
  return pack2(norm_elem(lo_f(x), rstd, lo_f(w)), norm_elem(hi_f(x), rstd, hi_f(w)));
}

// exp2 on the SFU (ex2.approx(-inf) = +0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Everything a task needs: kernel arguments and shared-memory addresses. Lives in shared memory
// (written by thread 0 at start-up) so that run-time indexed fields (buffers) never go to local
// memory.
struct Params {
  const int* prog;
  const unsigned long long* wptr;   // [(LAYERS + 1) * LP_COUNT] weight pointers
  const unsigned long long* kvptr;  // [LAYERS] kv cache base pointers
  unsigned* counters;
  const long long* positions;
  const long long* slots;
  const int* seq_lens;
  const int* block_table;
  const void* cos_sin;
  unsigned long long* trace;        // null unless tracing
  int* err;                         // [ERROR_WORDS] error record (encoding.ERROR_FIELDS)
  int* err_host;                    // null, or a pinned host mirror of the record
  unsigned long long budget_ns;     // watchdog budget of every wait
  void* buf[NUM_BUFS];
  int bt_stride;
  int block_size;
  int cs_rows;
  int cs_stride;
  int cs_f32;
  int batch;
  int chunks;
  int tasks_at;
};

// Shared memory map (dynamic): ring slots | union scratch | misc (mbarriers, rstd, params).
constexpr int RING_OFF = 0;
// Ring slot stride: SLOT_BYTES (16 padded rows), or under MK_W_TMA 32 KB slots (1024-byte aligned for the tensor
// map's 128-byte swizzle: csrc/weight_tma.cuh) inside the same region.
constexpr int RING_STRIDE = MK_W_TMA ? 32768 : SLOT_BYTES;
static_assert(RING_STRIDE <= SLOT_BYTES && RING_STRIDE % 128 == 0, "ring slot stride");
// MK_WGMMA_A: the scratch right after the 32 KB slots, 1024-byte aligned for its x groups' 128-byte swizzle (the
// slots' padding, NUM_STAGES x 256 bytes, is then left unused after the misc block); every other build as measured.
constexpr int UNION_OFF = MK_WGMMA_A ? NUM_STAGES * RING_STRIDE : NUM_STAGES * SLOT_BYTES;
static_assert(!MK_WGMMA_A || (MK_W_TMA && UNION_OFF % 1024 == 0), "MK_WGMMA_A: 1024-byte aligned scratch");
constexpr int MISC_OFF = UNION_OFF + UNION_BYTES;
constexpr int FULL_BAR_OFF = MISC_OFF;                        // NUM_STAGES x 8 bytes
constexpr int EMPTY_BAR_OFF = FULL_BAR_OFF + 8 * NUM_STAGES;  // NUM_STAGES x 8 bytes
constexpr int RSTD_OFF = EMPTY_BAR_OFF + 8 * NUM_STAGES;      // MAX_BATCH floats
constexpr int FLAGS_OFF = RSTD_OFF + 4 * MAX_BATCH;            // abort flag, current task, tasks released
constexpr int STEP_OFF = (FLAGS_OFF + 12 + 15) / 16 * 16;      // positions, slots, seq_lens (step_inputs)
constexpr int PARAMS_OFF = STEP_OFF + (8 + 8 + 4) * MAX_BATCH;
static_assert(PARAMS_OFF + (int)sizeof(Params) <= MISC_OFF + MISC_BYTES, "misc shared memory overflow");

struct Smem {
  unsigned char* base;
  __device__ __forceinline__ unsigned ring(int slot) const { return smem_addr(base + RING_OFF + slot * RING_STRIDE); }
  __device__ __forceinline__ unsigned full_bar(int slot) const { return smem_addr(base + FULL_BAR_OFF + 8 * slot); }
  __device__ __forceinline__ unsigned empty_bar(int slot) const { return smem_addr(base + EMPTY_BAR_OFF + 8 * slot); }
  __device__ __forceinline__ float* scratch() const { return reinterpret_cast<float*>(base + UNION_OFF); }
  __device__ __forceinline__ float* rstd() const { return reinterpret_cast<float*>(base + RSTD_OFF); }
  __device__ __forceinline__ Params& params() const { return *reinterpret_cast<Params*>(base + PARAMS_OFF); }
  // Non-zero once this CTA stops: its consumers leave their queue at the next task boundary and
  // the producer stops issuing (set by thread 0 on a failed counter wait, or by a consumer warp
  // whose weight-ring wait timed out).
  __device__ __forceinline__ volatile int* abort_flag() const { return reinterpret_cast<volatile int*>(base + FLAGS_OFF); }
  // Index (in this launch's task array) of the task the consumers are running, for the record.
  __device__ __forceinline__ volatile int* cur_task() const { return reinterpret_cast<volatile int*>(base + FLAGS_OFF + 4); }
  // MK_RELEASE_GATE: index + 1 of the last task whose signal thread 0 has released (the queue's start
  // before the first): the producer reads it to hold weight copies back until a release is done.
  // Written and polled with shared-memory atomics after the start barrier (a volatile word is the same
  // hint, but racecheck reports every write/poll pair of it as a hazard: 8449 at batch 8, session 8).
  __device__ __forceinline__ int* released() const { return reinterpret_cast<int*>(base + FLAGS_OFF + 8); }
  // This step's per-request inputs, copied once per launch (step_inputs): the qkv epilogue and the
  // attention read them from shared memory instead of paying a global round trip per task.
  __device__ __forceinline__ long long* pos() const { return reinterpret_cast<long long*>(base + STEP_OFF); }
  __device__ __forceinline__ long long* slot() const { return pos() + MAX_BATCH; }
  __device__ __forceinline__ int* seq_len() const { return reinterpret_cast<int*>(slot() + MAX_BATCH); }
};

// MK_TRACE_PHASES (bench only): the time since `mark` added to `acc`, and `mark` moved to now.
__device__ __forceinline__ void phase_lap(unsigned long long& mark, unsigned long long& acc) {
  const unsigned long long now = global_ns();
  acc += now - mark;
  mark = now;
}

// MK_TRACE_PHASES (bench only): thread 0 stores its task's phase times (ns) and its entry timestamp into the
// current task's trace record (encoding.TRACE_FIELDS; mk_plugin.persistent.trace_phases reads them).
__device__ __forceinline__ void trace_phase_times(const Smem& S, const Params& P, unsigned long long stage,
                                                  unsigned long long chunks, unsigned long long reduce,
                                                  unsigned long long entry) {
  unsigned long long* tr = P.trace + (size_t)(*S.cur_task()) * TRACE_WORDS;
  tr[TR_PH_STAGE] = stage;
  tr[TR_PH_CHUNKS] = chunks;
  tr[TR_PH_REDUCE] = reduce;
  tr[TR_PH_ENTRY] = entry;
}

// Consumer threads b < batch copy request b's position, KV slot and length into shared memory; the
// consumer loop's first barrier orders the copies before any use.
__device__ __forceinline__ void step_inputs(const Smem& S, const Params& P) {
  const int b = threadIdx.x;
  if (b < P.batch) {
    S.pos()[b] = ld_nc_s64(P.positions + b);
    S.slot()[b] = ld_nc_s64(P.slots + b);
    S.seq_len()[b] = ld_nc_s32(P.seq_lens + b);
  }
}

// The first failed wait of a launch fills the error record (encoding.ERROR_FIELDS): atomicCAS on
// the code word picks one writer; later failures (usually consequences of the first) are dropped.
// Out of line: it runs at most once per launch and keeps the waits' fast paths small.
__device__ __noinline__ void watchdog_record(const Params& P, int code, int task_index, int counter, int expected,
                                             int seen, unsigned long long waited_ns) {
  if (atomicCAS(P.err + E_CODE, 0, code) != 0) return;
  int rec[ERROR_WORDS];
#pragma unroll
  for (int i = 0; i < ERROR_WORDS; ++i) rec[i] = 0;
  rec[E_CODE] = code;
  rec[E_SM] = (int)blockIdx.x;
  rec[E_THREAD] = (int)threadIdx.x;
  rec[E_BATCH] = P.batch;
  rec[E_TASK_INDEX] = task_index;
  rec[E_TID] = rec[E_OPCODE] = rec[E_LAYER] = -1;
  if (task_index >= 0) {
    const int* r = P.prog + P.tasks_at + task_index * TASK_WORDS;
    rec[E_TID] = r[F_TID];
    rec[E_OPCODE] = r[F_OPCODE];
    rec[E_LAYER] = r[F_LAYER];
  }
  rec[E_COUNTER] = counter;
  rec[E_EXPECTED] = expected;
  rec[E_SEEN] = seen;
  rec[E_ELAPSED_US] = (int)min(waited_ns / 1000ull, 0x7fffffffull);
  rec[E_BUDGET_MS] = (int)(P.budget_ns / 1000000ull);
  for (int i = 1; i < ERROR_WORDS; ++i) P.err[i] = rec[i];
  __threadfence();
  if (P.err_host != nullptr) {  // fields first, code last: a host that sees the code sees the rest
    volatile int* h = P.err_host;
    for (int i = 1; i < ERROR_WORDS; ++i) h[i] = rec[i];
    __threadfence_system();
    h[E_CODE] = code;
    __threadfence_system();
  }
}

// Counter wait of a task (thread 0): WAIT_OK with v = the counter's value, or the failure status
// (a timeout is recorded here).
__device__ __forceinline__ int task_counter_wait(const Params& P, int task_index, int ctr, unsigned target,
                                                 unsigned& v) {
  const unsigned* p = P.counters + (size_t)ctr * COUNTER_STRIDE;
  v = ld_acquire_gpu(p);
  if (v >= target) return WAIT_OK;
  unsigned long long waited = 0;
  const int ws = counter_wait_slow(p, target, P.err, P.budget_ns, v, waited);
  if (ws == WAIT_TIMEOUT) watchdog_record(P, ERR_COUNTER_TIMEOUT, task_index, ctr, (int)target, (int)v, waited);
  return ws;
}

// Weight-ring mbarrier wait. For the record: task_index (-1: the consumers' current task), tag
// (MBAR_TAG_* + slot), chunk (the chunk number). poll_abort: also give up when this CTA's abort
// flag is set. budget_mult scales the budget. A timeout is recorded and stops this CTA.
__device__ __forceinline__ int ring_wait(const Smem& S, const Params& P, unsigned bar, unsigned parity, int task_index,
                                         int tag, unsigned chunk, bool poll_abort, unsigned budget_mult) {
  if (mbar_try_wait(bar, parity)) return WAIT_OK;
  unsigned long long waited = 0;
  const int ws = mbar_wait_slow(bar, parity, poll_abort ? S.abort_flag() : nullptr, P.budget_ns * budget_mult, waited);
  if (ws == WAIT_TIMEOUT) {
    watchdog_record(P, ERR_MBAR_TIMEOUT, task_index >= 0 ? task_index : *S.cur_task(), tag, (int)parity, (int)chunk,
                    waited);
    *S.abort_flag() = 1;
  }
  return ws;
}

// The matvec chunk loops' ring wait with its slow path out of line (session 32), so that a
// wait whose chunk is in (the common case) runs on instead of jumping over ~50 inlined slow-path instructions (a taken
// branch to a target the instruction fetch has not reached: session 13's "no instruction" samples sit on such
// targets). Only there: the producer and the attention loops keep ring_wait (as a call the producer's waits cost
// mk_decode 28 more bytes of spills at 8B). The out-of-line body is ring_wait itself (its one more try_wait is free).
__device__ __noinline__ int chunk_wait_slow(const Smem S, const Params& P, int slot, unsigned chunk) {
  return ring_wait(S, P, S.full_bar(slot), (chunk / NUM_STAGES) & 1, -1, MBAR_TAG_FULL + slot, chunk, true, 1);
}

// A matvec chunk loop's wait for ring slot `slot`'s chunk number `chunk` (ring_wait with the consumers' current task,
// the abort flag polled, one budget).
__device__ __forceinline__ int chunk_wait(const Smem& S, const Params& P, int slot, unsigned chunk) {
  if (mbar_try_wait(S.full_bar(slot), (chunk / NUM_STAGES) & 1)) return WAIT_OK;
  return chunk_wait_slow(S, P, slot, chunk);
}

__device__ __forceinline__ const elem_t* weight_ptr(const Params& P, int layer, int slot) {
  return reinterpret_cast<const elem_t*>(P.wptr[layer * LP_COUNT + slot]);
}

__device__ __forceinline__ elem_t* buf_ptr(const Params& P, int id) {
  return reinterpret_cast<elem_t*>(P.buf[id]);
}

// Task record fields, loaded once per task.
struct Task {
  int opcode, layer, arg0, arg1, arg2, in_buf, res_buf, out_buf;
  int wait_ctr[NUM_WAITS], wait_target[NUM_WAITS];
  int signal_ctr, signal_add;
  int ticket_ctr;  // ATTN_PARTIAL merging in the partial: its (b, g) ticket counter; -1 otherwise
};

__device__ __forceinline__ Task load_task(const Params& P, int index) {
  const int4* r = reinterpret_cast<const int4*>(P.prog + P.tasks_at + index * TASK_WORDS);
  static_assert(TASK_WORDS == 16, "record loaded as four int4");
  int4 a = __ldg(r), b = __ldg(r + 1), c = __ldg(r + 2), d = __ldg(r + 3);
  int w[16] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w, c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
  Task t;
  t.opcode = w[F_OPCODE];
  t.layer = w[F_LAYER];
  t.arg0 = w[F_ARG0];
  t.arg1 = w[F_ARG1];
  t.arg2 = w[F_ARG2];
  t.in_buf = w[F_IN_BUF];
  t.res_buf = w[F_RES_BUF];
  t.out_buf = w[F_OUT_BUF];
  t.wait_ctr[0] = w[F_WAIT0_CTR];
  t.wait_target[0] = w[F_WAIT0_TARGET];
  t.wait_ctr[1] = w[F_WAIT1_CTR];
  t.wait_target[1] = w[F_WAIT1_TARGET];
  t.signal_ctr = w[F_SIGNAL_CTR];
  t.signal_add = w[F_SIGNAL_ADD];
  t.ticket_ctr = w[F_TICKET_CTR];
  return t;
}

#define NEG_INF (__int_as_float(0xff800000u))  // -inf (no constexpr infinity in NVRTC)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// ss + the sum of squares of the 8 16-bit elements in q (fixed order: results are bit-reproducible).
__device__ __forceinline__ float sumsq8(const uint4& q, float ss) {
  const unsigned w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float a = lo_f(w[j]), c = hi_f(w[j]);
    ss = fmaf(a, a, ss);
    ss = fmaf(c, c, ss);
  }
  return ss;
}

// rstd[b] = rsqrt(sum of the consumer warps' partial sums part[w * MAX_BATCH + b] / H + eps), b < batch,
// summed in warp order.
__device__ __forceinline__ void rstd_from_parts(const float* part, int batch, float* rstd) {
  if (threadIdx.x < batch) {
    float ss = 0.f;
    for (int w = 0; w < CONSUMER_WARPS; ++w) ss += part[w * MAX_BATCH + threadIdx.x];
    rstd[threadIdx.x] = rsqrtf(ss / (float)H + EPS);
  }
}

// Per-row 1/rms of a [batch, H] activation, fp32 statistics of its stored values:
// rstd[b] = rsqrt(sum_k x[b,k]^2 / H + eps), into shared memory. All consumer threads share each
// row (16-byte L2 loads, four rows in flight per round), partial sums meet in `part` (scratch,
// CONSUMER_WARPS x MAX_BATCH floats). x was (possibly) written by other SMs during this launch:
// read through L2 (ld.global.cg). Ends with consumer_sync().
__device__ __forceinline__ void rows_rstd(const elem_t* x, int batch, float* rstd, float* part, int warp, int lane) {
  constexpr int STEP = CONSUMER_THREADS * 8;
  constexpr int ITERS = (H + STEP - 1) / STEP;
  const int k0 = threadIdx.x * 8;
  for (int b0 = 0; b0 < batch; b0 += 4) {
    uint4 v[4][ITERS];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
        const int k = k0 + i * STEP;
        v[r][i] = (b0 + r < batch && k < H) ? ld_cg_v4(x + (size_t)(b0 + r) * H + k) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < ITERS; ++i) ss = sumsq8(v[r][i], ss);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      if (lane == 0 && b0 + r < batch) part[warp * MAX_BATCH + b0 + r] = ss;
    }
  }
  consumer_sync();
  rstd_from_parts(part, batch, rstd);
  consumer_sync();
}

}  // namespace mk
