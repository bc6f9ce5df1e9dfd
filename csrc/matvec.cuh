// Weight-streaming skinny GEMM shared by qkv_rope, o_proj, gate_up, down and lm_head tasks:
//   y[b, row] = sum_k W[row, k] * x'[b, k]     for the task's units (16 output rows each),
// with x' = round(x * rstd[b] * norm_w[k]) for norm-fused ops (norm_elem: round(round(x * rstd) * w)
// under MK_ROUNDING=1), else x' = x.
//
// Tensor cores, "swap AB": the weight rows are the m16 side of mma.m16n8k16, the batch (<= 16
// tokens, padded to 8 or 16) the n8 side. A task's units are processed in passes of up to
// ACC_TILES / NT M-tiles (NT = 1 n-tile for B <= 8, else 2); a pass streams its rows through the
// ring in chunks of KC = CHUNK_COLS columns (at NT = 2 consumed in two halves: nt2_full_chunks).
// Inside a chunk (half), k-step j (16 columns) belongs to consumer warp j % 8, so every warp works
// whatever the pass size; the warps' partial sums are reduced through shared memory, then each
// consumer warp owns one accumulator tile for the op-specific epilogue (matvec_epilogue, defined in
// megakernel.cu).
//
// Activations reach shared memory before their fragments are read: whole per pass when x[B, K] fits
// the scratch (stage_x, rows padded), else one column group at a time, double-buffered through
// cp.async (group_issue / group_frags, rows swizzled).
//
// The producer warp walks the same queue with the same pass/chunk plan (weight_plan, weight_row)
// and issues one cp.async.bulk per weight row and chunk; chunk number `it` (counted over the whole
// queue by both sides) uses slot it % NUM_STAGES with mbarrier parity (it / NUM_STAGES) & 1.
#pragma once
#include "common.cuh"
#include "weight_tma.cuh"

namespace mk {

struct WeightPlan {
  const elem_t* w;  // [rows, K] row-major
  int K;            // the consumers' reduction width (a K-split task's part: matvec_dispatch)
  int mtpu;         // M-tiles per unit (2 for gate_up: gate tile, up tile)
  int ldx;          // row stride of the activations x (the matrix's full K)
};

// Columns [lo, hi) of a K-split o_proj/down task (arg2 = parts << KSPLIT_SHIFT | part): 64-column steps
// shared out evenly (16 where K is not a multiple of 64; MK_W_TMA copies 64-column groups). Mirrors
// encoding.ksplit_range.
__device__ __forceinline__ int ksplit_part(int arg2) { return arg2 & ((1 << KSPLIT_SHIFT) - 1); }
__device__ __forceinline__ int ksplit_parts(int arg2) { return arg2 >> KSPLIT_SHIFT; }

__device__ __forceinline__ void ksplit_range(int K, int arg2, int& lo, int& hi) {
  const int part = ksplit_part(arg2), parts = ksplit_parts(arg2);
  const int g = (K & 63) ? 16 : 64, steps = K / g;
  lo = g * (steps * part / parts);
  hi = g * (steps * (part + 1) / parts);
}

__device__ __forceinline__ bool is_ksplit(const Task& t) {
  return (t.opcode == OP_O_PROJ || t.opcode == OP_DOWN) && t.arg2 != 0;
}

__device__ __forceinline__ bool weight_plan(const Params& P, int op, int layer, WeightPlan& wp) {
  switch (op) {
    case OP_QKV_ROPE: wp = {weight_ptr(P, layer, LP_QKV), H, 1, H}; return true;
    case OP_O_PROJ: wp = {weight_ptr(P, layer, LP_O), QS, 1, QS}; return true;
    case OP_GATE_UP: wp = {weight_ptr(P, layer, LP_GATE_UP), H, 2, H}; return true;
    case OP_DOWN: wp = {weight_ptr(P, layer, LP_DOWN), I, 1, I}; return true;
    case OP_LM_HEAD: wp = {weight_ptr(P, LAYERS, MP_LM_HEAD), H, 1, H}; return true;
    default: return false;
  }
}

// Decode qkv unit u into (local head index hl: < G q head of the group, G = k, G+1 = v; group g;
// sub-tile s). Mirrors tasks.qkv_unit.
__device__ __forceinline__ void qkv_unit(int u, int& g, int& hl, int& s) {
  g = u / QKV_UNITS_PER_GROUP;
  const int r = u - g * QKV_UNITS_PER_GROUP;
  hl = r / (D / UNIT);
  s = r - hl * (D / UNIT);
}

// Weight row of row r (0..rows-1) of the pass starting at unit p0; -1 if past the matrix (lm_head).
// Mirrors tasks.qkv_unit_rows and the unit definitions in tasks.py.
__device__ __forceinline__ int weight_row(int op, int p0, int r) {
  const int m = r >> 4, i = r & 15;
  switch (op) {
    case OP_QKV_ROPE: {
      int g, hl, s;
      qkv_unit(p0 + m, g, hl, s);
      const int row0 = hl < G ? (g * G + hl) * D : (hl == G ? QS + g * D : QS + KVS + g * D);
      return row0 + (i < 8 ? s * 8 + i : D / 2 + s * 8 + (i - 8));
    }
    case OP_GATE_UP: {
      const int u = p0 + (m >> 1);
      return (m & 1) ? I + u * UNIT + i : u * UNIT + i;
    }
    case OP_LM_HEAD: {
      const int row = (p0 + m) * UNIT + i;
      return row < V ? row : -1;
    }
    default: return (p0 + m) * UNIT + i;
  }
}

// Rows of M-tile m of the pass at p0 that exist (16, fewer for the LM head's last tile), and where
// row `lane` of its chunk at column k0 starts: what the producer copies per chunk.
__device__ __forceinline__ int tile_rows(int op, int p0, int m) {
  return op == OP_LM_HEAD ? min(16, V - (p0 + m) * UNIT) : 16;
}

__device__ __forceinline__ const elem_t* chunk_row(const elem_t* w, int K, int op, int p0, int m, int lane, int k0) {
  return w + (size_t)weight_row(op, p0, m * 16 + lane) * K + k0;
}

__device__ __forceinline__ int batch_ntiles(int batch) { return batch <= 8 ? 1 : 2; }

// Chunk columns and shared-memory row stride for NT batch n-tiles: the ring chunk is CHUNK_COLS wide at
// NT = 1 and 2 alike (16 copies of 2 KB). The column group (the activation fragments a warp holds at
// once) is CHUNK_COLS / NT columns: at NT = 2 the consumers take each chunk in two halves of
// group_cols_for(2) columns, the fragment width that fits the register budget (nt2_full_chunks). Measured
// faster in session 11 than half-width chunks of 1 KB copies (1B batch 16 1421 -> 1371 us, 8B batch 16
// 7038 -> 5998; bench/NOTES.md). Spelled as the measured build (MK_NT2_FULL=1) spelled it, which keeps
// its SASS: a bare CHUNK_COLS drops the producer's run-time division and reschedules the whole kernel.
__host__ __device__ constexpr int chunk_cols_for(int nt) { return nt == 2 ? CHUNK_COLS : CHUNK_COLS / nt; }
__host__ __device__ constexpr int group_cols_for(int nt) { return CHUNK_COLS / nt; }
__host__ __device__ constexpr int row_bytes_for(int nt) { return 2 * chunk_cols_for(nt) + 16; }
static_assert((row_bytes_for(2) / 16) % 2 == 1 && 16 * row_bytes_for(2) <= SLOT_BYTES, "NT=2 chunk layout");

// ---- producer: stream the weights of every task of this SM's queue ----------------------------
// MK_RELEASE_GATE (megakernel.cu): wait until the consumers have released task ti - 1. A hint, not a
// dependency: it gives up when the CTA stops or after one watchdog budget (then the copies just go out).
// The gate's word is written and polled with shared atomics: racecheck follows them (a volatile word had
// 8449 hazards reported), and session 9's A/B measured the volatile and relaxed ld/st forms no faster.
__device__ __forceinline__ int gate_word_read(int* p) { return atomicOr(p, 0); }
__device__ __forceinline__ void gate_word_write(int* p, int v) { atomicExch(p, v); }
__device__ __forceinline__ void release_gate(const Smem& S, const Params& P, int ti, int lane) {
  if (lane == 0) {
    const unsigned long long t0 = global_ns();
    while (gate_word_read(S.released()) < ti && !*S.abort_flag() && global_ns() - t0 < P.budget_ns) __nanosleep(32);
  }
  __syncwarp();
}

// Before the producer issues chunk `it` into its slot: the slot's consumers have freed it (empty barrier), and
// under MK_INFLIGHT = N (A/B switch, default 0 = off, session 20) chunk it - N has landed, so at most N chunks are
// in flight (issued, not landed) per SM; the ring keeps its depth for landed chunks that wait in shared memory.
// Why: with every SM streaming, 6 x 32 KB in flight per SM is 25 MB over 132 SMs, ~6 us of queue at the 4.26 TB/s
// copy rate (Little's law), and every L2 round trip of the dependency chain (counter polls, releases, activation
// loads) waits in that queue: the release probe's fence-free hand-off floor was 5.8 us under streaming against
// 1.0 idle (bench/NOTES.md session 16), and 6 x 32 KB is ~6x what the copy rate needs in flight.
// Lane 0's outcome decides for the warp (lane 0 arms the barrier after it).
__device__ __forceinline__ int producer_slot_wait(const Smem& S, const Params& P, unsigned it, int ti) {
#if MK_INFLIGHT
  static_assert(MK_INFLIGHT > 0 && MK_INFLIGHT < NUM_STAGES, "MK_INFLIGHT: 1 .. NUM_STAGES - 1 chunks");
  if (it >= (unsigned)MK_INFLIGHT) {
    // chunk c's slot is not re-armed before chunk c + NUM_STAGES > it is issued: its phase cannot be lapped
    const unsigned c = it - MK_INFLIGHT;
    const int cs = c % NUM_STAGES;
    const int ws = __shfl_sync(0xffffffffu, ring_wait(S, P, S.full_bar(cs), (c / NUM_STAGES) & 1, ti,
                                                      MBAR_TAG_INFLIGHT + cs, c, true, PRODUCER_BUDGET_MULT), 0);
    if (ws != WAIT_OK) return ws;
  }
#endif
  const int slot = it % NUM_STAGES;
  return __shfl_sync(0xffffffffu, ring_wait(S, P, S.empty_bar(slot), ((it / NUM_STAGES) & 1) ^ 1, ti,
                                            MBAR_TAG_EMPTY + slot, it, true, PRODUCER_BUDGET_MULT), 0);
}

// Chunk order of a pass (mirrored by matvec_task): for k0 in 0, KC, 2 KC, ..: for each M-tile m.
// A chunk = the tile's 16 weight rows x [k0, k0 + kc): 16 bulk copies of kc * 2 bytes
// (KC = chunk_cols_for(NT)).
//
// Watchdog: a slot wait gives up when this CTA's consumers have stopped (abort flag) or after
// PRODUCER_BUDGET_MULT budgets; the warp then stops issuing. Either way it drains before exiting.
#if MK_ATT_TMA   // attention_tma.cuh (included after this file)
__device__ __forceinline__ bool att_tma_task(int L, int C, int c);
__device__ __forceinline__ bool att_tma_produce(const Smem& S, const Params& P, const Task& t, int L, int ti, int lane,
                                                unsigned& it);
#endif

__device__ __forceinline__ void producer_loop(const Smem& S, const Params& P, int qbeg, int qend, int lane) {
  const int nt = batch_ntiles(P.batch);
  const int KC = chunk_cols_for(nt), RB = row_bytes_for(nt);
  unsigned it = 0;
  int ti = qbeg;
  int prev_op = -1;  // opcode of the queue's previous task (MK_RELEASE_GATE)
#if MK_ATT_TMA
  // request lane's length, loaded once: a load per attention task delayed the next weights (session 18: +15 us
  // at 1B batch 1). From global memory: step_inputs' shared copy is written by the consumers after we start.
  static_assert(MAX_BATCH <= 32, "one lane per request");
  const int lane_len = lane < P.batch ? __ldg(P.seq_lens + lane) : 0;
#endif
  for (; ti < qend; ++ti) {
    const Task t = load_task(P, ti);
    const int gate_op = prev_op;
    prev_op = t.opcode;
#if MK_ATT_TMA   // an attention task's KV tiles stream through the ring like a matvec's weights
    if (t.opcode == OP_ATTN_PARTIAL) {
      const int L = __shfl_sync(0xffffffffu, lane_len, t.arg0);
      if (!att_tma_task(L, P.chunks, t.arg2)) continue;   // a short task: the consumers' default loop
      if (MK_RELEASE_GATE && gate_op >= 0 && ((MK_RELEASE_GATE >> gate_op) & 1)) release_gate(S, P, ti, lane);
      if (!att_tma_produce(S, P, t, L, ti, lane, it)) goto drain;
      continue;
    }
#endif
    WeightPlan wp;
    if (!weight_plan(P, t.opcode, t.layer, wp)) continue;
    if (MK_RELEASE_GATE && gate_op >= 0 && ((MK_RELEASE_GATE >> gate_op) & 1)) release_gate(S, P, ti, lane);
    if (P.trace != nullptr && lane == 0) P.trace[(size_t)ti * TRACE_WORDS + TR_PROD_FIRST] = global_ns();
    const int upp = (ACC_TILES / nt) / wp.mtpu;
    const int uend = t.arg0 + t.arg1;
    int klo = 0, khi = wp.K;   // a K-split task streams its part's columns of the rows
    if (is_ksplit(t)) ksplit_range(wp.K, t.arg2, klo, khi);
#if MK_W_TMA
    const void* wmap_full = w_map(P, t.opcode, t.layer, 0);
    const void* wmap_one = w_map(P, t.opcode, t.layer, 1);
    if (lane == 0) tensormap_acquire(wmap_full);
    if (lane < W_CHUNK_KG) tensormap_acquire(wmap_one);
#endif
    for (int p0 = t.arg0; p0 < uend; p0 += upp) {
      const int mt = min(upp, uend - p0) * wp.mtpu;
      for (int k0 = klo; k0 < khi; k0 += KC) {
        const int kc = min(KC, khi - k0);
        for (int m = 0; m < mt; ++m) {
          const int slot = it % NUM_STAGES;
          const int valid = tile_rows(t.opcode, p0, m);
          if (producer_slot_wait(S, P, it, ti) != WAIT_OK) goto drain;
#if MK_W_TMA   // one tensor-map copy per chunk (a tail: one per column group); rows past the matrix land as zeros
          (void)valid;
          if (lane == 0 && !(MK_DIAG & 2)) mbar_arrive_expect_tx(S.full_bar(slot), w_chunk_bytes(kc));
          __syncwarp();
          if (MK_DIAG & 2) {
            if (lane == 0) mbar_arrive(S.full_bar(slot));
          } else {
            w_chunk_copy(S.ring(slot), wmap_full, wmap_one, t.opcode == OP_QKV_ROPE, weight_row(t.opcode, p0, m * 16),
                         k0, kc, S.full_bar(slot), lane);
          }
#else
          if (lane == 0 && !(MK_DIAG & 2)) mbar_arrive_expect_tx(S.full_bar(slot), (unsigned)(valid * kc * 2));
          __syncwarp();
          if (MK_DIAG & 2) {
            if (lane == 0) mbar_arrive(S.full_bar(slot));
          } else if (lane < valid)
            bulk_g2s(S.ring(slot) + lane * RB, chunk_row(wp.w, wp.K, t.opcode, p0, m, lane, k0), (unsigned)(kc * 2),
                     S.full_bar(slot));
#endif
          ++it;
        }
      }
    }
    if (P.trace != nullptr && lane == 0) P.trace[(size_t)ti * TRACE_WORDS + TR_PROD_LAST] = global_ns();
  }
drain:
  // The last min(it, NUM_STAGES) chunks may still be landing in this CTA's shared memory; consumers
  // that stopped early never wait for them, so wait here: the CTA must not exit with bulk copies in
  // flight. (Earlier chunks were consumed: their slots were freed before being reused.) Nothing
  // re-arms these barriers any more, so each phase is complete once its bytes have arrived.
  for (unsigned c = it > NUM_STAGES ? it - NUM_STAGES : 0; c < it; ++c) {
    const int slot = c % NUM_STAGES;
    const int ws = ring_wait(S, P, S.full_bar(slot), (c / NUM_STAGES) & 1, min(ti, qend - 1),
                             MBAR_TAG_DRAIN + slot, c, false, 1);
    if (ws != WAIT_OK) break;
  }
}

// ---- consumer --------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(unsigned (&a)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr) : "memory");
}

// The B (activation) fragments of one k-step at NT = 2 by ldmatrix: one LDSM.x4 for both n-tiles instead of four
// LDS.32 and their swizzle arithmetic. Lane l addresses row l & 7 of matrix l >> 3 = (n-tile, k half), the layout
// mma's col B operand wants (thread t: batch row t / 4, columns 2 (t % 4) and + 1); rows at or past B are read
// and then zeroed. Session 14's A/B (MK_B_LDSM, bench/NOTES.md): batch 16 -23 us at 1B, -122 at 8B; at NT = 1
// (x2 for the one n-tile) +17 / +45 at batch 8, so batch <= 8 keeps the 32-bit loads.
__device__ __forceinline__ void ldsm_b(unsigned (&xb)[2][2], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(xb[0][0]), "=r"(xb[0][1]), "=r"(xb[1][0]), "=r"(xb[1][1]) : "r"(addr) : "memory");
}

__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#if MK_DTYPE_BF16
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Epilogue of one accumulator tile: rows (p0's pass) M-tile m, batch n-tile nt. v[e] holds the
// sum for (row r_lo + 8*(e>>1), batch nt*8 + 2*(lane&3) + (e&1)) with r_lo = lane>>2; for gate_up,
// vu[] holds the matching up tile (m + 1). Defined in megakernel.cu (one case per opcode).
__device__ __forceinline__ void matvec_epilogue(const Smem& S, const Params& P, const Task& t, int p0, int m,
                                                int nt, int lane, const float (&v)[4], const float (&vu)[4],
                                                const unsigned (&rres)[4]);
__device__ __forceinline__ void residual_prefetch(const Params& P, const Task& t, int p0, int m, int nt, int lane,
                                                  unsigned (&r)[4]);
__device__ __forceinline__ void rope_prefetch(const Smem& S, const Params& P, int p0, int m, int nt, int lane,
                                              unsigned (&cs)[4]);
__device__ __noinline__ void ksplit_merge(const Smem S, const Params& P, const Task t);

// ---- Column-group staging: activations that do not fit the scratch whole ---------------------
// x[:, k0 : k0 + KC] of one column group lands in one of two GROUP_BYTES buffers at the start of the
// scratch through cp.async (16-byte copies, L2: the data was written during this launch), group
// g + 1 in flight while group g computes, so the L2 round trip overlaps the ring waits and MMAs
// instead of preceding them (the per-warp fragment loads this replaces cost one exposed round trip per
// group: ~0.7 ms of a batch-8 1B step, bench/NOTES.md session 5). Rows are KC * 2 bytes with their
// 16-byte units XOR-swizzled by (row & 7): conflict-free copies and fragment reads without padding.
constexpr int GROUP_BYTES = 16 * CHUNK_COLS;   // 8 rows x 1024 columns (NT=1) or 16 rows x 512 (NT=2)
static_assert(2 * GROUP_BYTES <= UNION_BYTES, "two column-group buffers in the scratch");

__device__ __forceinline__ void group_issue(unsigned char* gb, const elem_t* x, int K, int ldx, int k0, int B,
                                            int KC) {
  const int upr = KC / 8;                      // 16-byte units per row
  const int valid = (min(KC, K - k0)) / 8;     // K is a multiple of 16
  for (int idx = threadIdx.x; idx < B * upr; idx += CONSUMER_THREADS) {
    const int b = idx / upr, c = idx - b * upr;
    if (c < valid) cp_async16(smem_addr(gb + b * KC * 2 + ((c ^ (b & 7)) << 4)), x + (size_t)b * ldx + k0 + c * 8);
  }
  cp_async_commit();
}

// B fragments of this warp's k-steps j = warp + 8*jj (nsteps 16-column steps in the group) from a
// staged group; wv: the norm weights of the same columns (norm-fused ops), loaded by the caller.
template <int NT, int JMAX>
__device__ __forceinline__ void group_frags(unsigned (&xb)[JMAX][NT][2], const unsigned char* gb,
                                            const unsigned (&wv)[JMAX][2], bool norm, const float* rstd, int KC,
                                            int nsteps, int B, int warp, int lane) {
  if constexpr (NT == 2) {   // ldsm_b: measured faster at batch 9..16 only (see there)
    // (the mask-and-normalise lines below repeat smem_x_frags': as one shared helper they changed the PTX of
    // matvec_task<2>, i.e. no longer the measured build; checked in session 14)
    // lane's ldmatrix row: batch row bi = (mat >> 1) * 8 + (lane & 7) of matrix mat = lane >> 3, k half mat & 1
    const int lbi = min(((lane >> 4) << 3) + (lane & 7), B - 1);   // rows past B: any staged row (zeroed below)
    const unsigned lrow = smem_addr(gb + lbi * KC * 2);
    const int lhalf = (lane >> 3) & 1;
#pragma unroll
    for (int jj = 0; jj < JMAX; ++jj) {
      const int j = warp + jj * CONSUMER_WARPS;
      unsigned f[NT][2] = {};
      if (j < nsteps) ldsm_b(f, lrow + (((2 * j + lhalf) ^ (lbi & 7)) << 4));
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int bi = n * 8 + (lane >> 2);
        unsigned v0 = 0, v1 = 0;
        if (j < nsteps && bi < B) {
          v0 = f[n][0];
          v1 = f[n][1];
          if (norm) {
            const float r = rstd[bi];
            v0 = norm_pair(v0, r, wv[jj][0]);
            v1 = norm_pair(v1, r, wv[jj][1]);
          }
        }
        xb[jj][n][0] = v0;
        xb[jj][n][1] = v1;
      }
    }
  } else {
#pragma unroll
    for (int jj = 0; jj < JMAX; ++jj) {
      const int j = warp + jj * CONSUMER_WARPS;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int bi = n * 8 + (lane >> 2);
        unsigned v0 = 0, v1 = 0;
        if (j < nsteps && bi < B) {
          const unsigned char* row = gb + bi * KC * 2 + (lane & 3) * 4;
          v0 = *reinterpret_cast<const unsigned*>(row + (((2 * j) ^ (bi & 7)) << 4));
          v1 = *reinterpret_cast<const unsigned*>(row + (((2 * j + 1) ^ (bi & 7)) << 4));
          if (norm) {
            const float r = rstd[bi];
            v0 = norm_pair(v0, r, wv[jj][0]);
            v1 = norm_pair(v1, r, wv[jj][1]);
          }
        }
        xb[jj][n][0] = v0;
        xb[jj][n][1] = v1;
      }
    }
  }
}

// Whole-task activation staging: x[B, K] as stored into shared memory, rows padded to K*2 + 16
// bytes (an odd number of 16-byte units: the fragment reads below are conflict-free), and for a
// norm-fused op the norm weight nw[K] as one more row after them, loaded in the same round of L2
// requests. The rows' 1/rms (rstd[b] = rsqrt(sum_k x[b,k]^2 / H + eps)) then comes from the staged
// copy: one L2 round trip per pass instead of two (rows_rstd, then staging). Used when it fits the
// scratch (staged_fits). Ends with consumer_sync().
constexpr int STAGE_PART_BYTES = 4 * CONSUMER_WARPS * MAX_BATCH;  // per-warp row sums, end of scratch

__device__ __forceinline__ bool staged_fits(int K, int B, bool norm) {
  return (B + (norm ? 1 : 0)) * (K * 2 + 16) <= UNION_BYTES - STAGE_PART_BYTES;
}

__device__ __forceinline__ void stage_x(unsigned char* xs, const elem_t* x, const elem_t* nw, float* rstd, int K,
                                        int ldx, int B, int warp, int lane) {
  const int vpr = K / 8;
  const int total = (B + (nw != nullptr ? 1 : 0)) * vpr;
  const int rowb = K * 2 + 16;
  constexpr int U = 4;
  for (int base = threadIdx.x; base < total; base += U * CONSUMER_THREADS) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int idx = base + u * CONSUMER_THREADS;
      const int b = idx / vpr, kv = idx - b * vpr;
      v[u] = make_uint4(0u, 0u, 0u, 0u);
      if (idx < total)
        v[u] = b < B ? ld_cg_v4(x + (size_t)b * ldx + kv * 8) : __ldg(reinterpret_cast<const uint4*>(nw + kv * 8));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int idx = base + u * CONSUMER_THREADS;
      if (idx < total) {
        const int b = idx / vpr, kv = idx - b * vpr;
        *reinterpret_cast<uint4*>(xs + (size_t)b * rowb + kv * 16) = v[u];
      }
    }
  }
  consumer_sync();
  if (nw == nullptr) return;
  float* part = reinterpret_cast<float*>(xs + UNION_BYTES - STAGE_PART_BYTES);
  for (int b = 0; b < B; ++b) {  // fixed summation order: bit-identical across runs
    float ss = 0.f;
    for (int kv = threadIdx.x; kv < vpr; kv += CONSUMER_THREADS)
      ss = sumsq8(*reinterpret_cast<const uint4*>(xs + (size_t)b * rowb + kv * 16), ss);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) part[warp * MAX_BATCH + b] = ss;
  }
  consumer_sync();
  rstd_from_parts(part, B, rstd);
  consumer_sync();
}

// B fragments from the staged copy (see load_x_frags for the fragment layout and the
// normalisation, here with the norm weight from the staged row B).
template <int NT, int JMAX>
__device__ __forceinline__ void smem_x_frags(unsigned (&xb)[JMAX][NT][2], const unsigned char* xs, bool norm,
                                             const float* rstd, int K, int k0, int nsteps, int B, int warp,
                                             int lane) {
  const int rowb = K * 2 + 16;
  if constexpr (NT == 2) {   // ldsm_b: measured faster at batch 9..16 only (see there)
    // ldmatrix rows as in group_frags; padded rows (an odd number of 16-byte units) keep the 8 rows of a
    // matrix on distinct banks
    const int lbi = min(((lane >> 4) << 3) + (lane & 7), B - 1);   // rows past B: any staged row (zeroed below)
    const unsigned lrow = smem_addr(xs + lbi * rowb + k0 * 2 + ((lane >> 3) & 1) * 16);
#pragma unroll
    for (int jj = 0; jj < JMAX; ++jj) {
      const int j = warp + jj * CONSUMER_WARPS;
      const int off = (k0 + j * 16 + (lane & 3) * 2) * 2;
      unsigned w0 = 0, w1 = 0;
      if (norm && j < nsteps) {
        w0 = *reinterpret_cast<const unsigned*>(xs + B * rowb + off);
        w1 = *reinterpret_cast<const unsigned*>(xs + B * rowb + off + 16);
      }
      unsigned f[NT][2] = {};
      if (j < nsteps) ldsm_b(f, lrow + j * 32);
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int bi = n * 8 + (lane >> 2);
        unsigned v0 = 0, v1 = 0;
        if (j < nsteps && bi < B) {
          v0 = f[n][0];
          v1 = f[n][1];
          if (norm) {
            const float r = rstd[bi];
            v0 = norm_pair(v0, r, w0);
            v1 = norm_pair(v1, r, w1);
          }
        }
        xb[jj][n][0] = v0;
        xb[jj][n][1] = v1;
      }
    }
  } else {
    static_assert(NT == 1, "the one-n-tile fragments");
#if MK_XFRAG
    // MK_XFRAG (A/B switch, session 23): no branch per k-step. Every lane loads from a staged row (a lane of a
    // row past B reads row 0; a tail chunk's k-steps past nsteps read the last valid one), all of the chunk's
    // loads first, then the norm, then a select zeroes what the default leaves zero: the k-steps' loads are in
    // flight together instead of one divergent branch (BSSY/BSYNC) and one rstd load per k-step (SASS of the
    // default, session 23). The fragments are bitwise the default's.
    const int bi = lane >> 2;
    const bool rowok = bi < B;
    const unsigned char* xr = xs + (rowok ? bi : 0) * rowb;
    const unsigned char* wr = xs + B * rowb;   // the staged norm weights (norm-fused ops)
    const float r = norm ? rstd[rowok ? bi : 0] : 0.f;
    unsigned xv[JMAX][2], wv[JMAX][2];
#pragma unroll
    for (int jj = 0; jj < JMAX; ++jj) {
      const int off = (k0 + min(warp + jj * CONSUMER_WARPS, nsteps - 1) * 16 + (lane & 3) * 2) * 2;
      xv[jj][0] = *reinterpret_cast<const unsigned*>(xr + off);
      xv[jj][1] = *reinterpret_cast<const unsigned*>(xr + off + 16);
      wv[jj][0] = norm ? *reinterpret_cast<const unsigned*>(wr + off) : 0u;
      wv[jj][1] = norm ? *reinterpret_cast<const unsigned*>(wr + off + 16) : 0u;
    }
    if (norm) {   // one (warp-uniform) branch for all k-steps
#pragma unroll
      for (int jj = 0; jj < JMAX; ++jj) {
        xv[jj][0] = norm_pair(xv[jj][0], r, wv[jj][0]);
        xv[jj][1] = norm_pair(xv[jj][1], r, wv[jj][1]);
      }
    }
#pragma unroll
    for (int jj = 0; jj < JMAX; ++jj) {
      const bool ok = rowok && warp + jj * CONSUMER_WARPS < nsteps;
      xb[jj][0][0] = ok ? xv[jj][0] : 0u;
      xb[jj][0][1] = ok ? xv[jj][1] : 0u;
    }
#else
#pragma unroll
    for (int jj = 0; jj < JMAX; ++jj) {
      const int j = warp + jj * CONSUMER_WARPS;
      const int off = (k0 + j * 16 + (lane & 3) * 2) * 2;
      unsigned w0 = 0, w1 = 0;
      if (norm && j < nsteps) {
        w0 = *reinterpret_cast<const unsigned*>(xs + B * rowb + off);
        w1 = *reinterpret_cast<const unsigned*>(xs + B * rowb + off + 16);
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int bi = n * 8 + (lane >> 2);
        unsigned v0 = 0, v1 = 0;
        if (j < nsteps && bi < B) {
          const unsigned char* p = xs + bi * rowb + off;
          v0 = *reinterpret_cast<const unsigned*>(p);
          v1 = *reinterpret_cast<const unsigned*>(p + 16);
          if (norm) {
            const float r = rstd[bi];
            v0 = norm_pair(v0, r, w0);
            v1 = norm_pair(v1, r, w1);
          }
        }
        xb[jj][n][0] = v0;
        xb[jj][n][1] = v1;
      }
    }
#endif
  }
}

// The chunk loop of one pass at NT = 2 (matvec_task's at NT = 1 is the one-part case; the fragment loads
// are written out in both: a shared helper changed the SASS, +32 instructions, session 10): each chunk of
// CHUNK_COLS columns is used in two parts of KG = CHUNK_COLS / 2 columns (one column group each), the
// part's fragments loaded once and used for every M-tile. Part 0 waits for every M-tile's slot of the
// column range (mt <= NUM_STAGES slots resident at once), the last part frees them. Measured faster in
// session 11 than half-width chunks (1 KB copies, each consumed whole): half the ring waits and slot
// arrivals per weight byte, and the producer's copies are 2 KB (bench/NOTES.md). Returns the chunk count.
template <int JMAX>
__device__ __forceinline__ unsigned nt2_full_chunks(const Smem& S, const Params& P, const elem_t* x, const elem_t* nw,
                                                    bool staged, const float* rstd, int K, int ldx, int B, int mt,
                                                    unsigned it, unsigned char* xs, int& gi, int warp, int lane,
                                                    unsigned lane_off, float (&acc)[ACC_TILES / 2][2][4],
                                                    unsigned long long& wait_cycles, bool ph_on,
                                                    unsigned long long& ph_gwait) {
  constexpr int NT = 2, MT = ACC_TILES / 2, KC = CHUNK_COLS, KG = CHUNK_COLS / 2;
  static_assert(MT <= NUM_STAGES, "NT = 2 holds a pass's M-tiles of one column range in the ring");
  for (int k0 = 0; k0 < K; k0 += KC) {
    const int nh = k0 + KG < K ? 2 : 1;   // a last chunk of <= KG columns has one part
    unsigned okm = 0;                     // M-tiles whose slot wait succeeded: freed after the last part
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h < nh) {
        const int kg = k0 + h * KG;
        const int nsteps = min(KG, K - kg) >> 4;
        unsigned xb[JMAX][NT][2];
        if (staged) {
          smem_x_frags<NT, JMAX>(xb, xs, nw != nullptr, rstd, K, kg, nsteps, B, warp, lane);
        } else {
          unsigned wv[JMAX][2];  // norm weights: immutable, loaded before the barrier so the two overlap
#pragma unroll
          for (int jj = 0; jj < JMAX; ++jj) {
            const int k = kg + (warp + jj * CONSUMER_WARPS) * 16 + (lane & 3) * 2;
            const bool ld = nw != nullptr && warp + jj * CONSUMER_WARPS < nsteps;
            wv[jj][0] = ld ? ld_nc_u32(nw + k) : 0u;
            wv[jj][1] = ld ? ld_nc_u32(nw + k + 8) : 0u;
          }
          const unsigned long long gw0 = ph_on ? global_ns() : 0ull;
          cp_async_wait_all();  // this thread's copies of the group have landed ...
          consumer_sync();      // ... and everyone's; the other buffer's last readers are done too
          if (ph_on) ph_gwait += global_ns() - gw0;
          group_frags<NT, JMAX>(xb, xs + (gi & 1) * GROUP_BYTES, wv, nw != nullptr, rstd, KG, nsteps, B, warp, lane);
          // (MK_DIAG & 8: x == nullptr on a later pass, nothing restaged; folds away in every other build)
          if (kg + KG < K && (!(MK_DIAG & 8) || x != nullptr))
            group_issue(xs + ((gi + 1) & 1) * GROUP_BYTES, x, K, ldx, kg + KG, B, KG);
          ++gi;
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          if (m < mt) {
            const unsigned c = it + m;
            const int slot = c % NUM_STAGES;
            if (h == 0) {  // not OK (this CTA is stopping): compute on whatever the slot holds, never free it
              const long long c0 = clock64();
              const int ws = ring_wait(S, P, S.full_bar(slot), (c / NUM_STAGES) & 1, -1, MBAR_TAG_FULL + slot, c,
                                       true, 1);
              wait_cycles += clock64() - c0;
              if (ws == WAIT_OK) okm |= 1u << m;
            }
#if MK_W_TMA
            const unsigned sb = S.ring(slot) + lane_off + h * W_HALF_BYTES;
#else
            const unsigned sb = S.ring(slot) + lane_off + h * (KG * 2);
#endif
#pragma unroll
            for (int jj = 0; jj < JMAX; ++jj) {
              const int j = warp + jj * CONSUMER_WARPS;
              if (j < nsteps && !(MK_DIAG & 4)) {
                unsigned a[4];
#if MK_W_TMA
                ldmatrix_x4(a, sb + jj * W_JJ_BYTES);
#else
                ldmatrix_x4(a, sb + j * 32);
#endif
#pragma unroll
                for (int n = 0; n < NT; ++n) mma_16816(acc[m][n], a, xb[jj][n]);
              }
            }
            if (h == nh - 1 && ((okm >> m) & 1u)) mbar_arrive(S.empty_bar(slot));  // each thread its own reads
          }
        }
      }
    }
    it += mt;
  }
  return it;
}

// Out of line: inlined into the consumer loop it spills at the 168-register cap (9 warps) and measured
// 62 us slower at 1B batch 1 (NOTES session 5); as its own function it needs no spills.
template <int NT>
// Arguments by value and the chunk count returned: out of line, references to the caller's locals
// made every use in the chunk loop a local-memory reload after each asm memory clobber (SASS, 51f822c).
__device__ __noinline__ unsigned matvec_task(const Smem S, const Params& P, const Task t, const WeightPlan wp,
                                                  const elem_t* x, const elem_t* nw, bool staged, unsigned it,
                                                  int warp, int lane, unsigned long long* wait_out) {
  unsigned long long wait_cycles = 0;
  constexpr int MT = ACC_TILES / NT;
  constexpr int KC = chunk_cols_for(NT);
  // The fragments of a chunk are loaded and used in NH parts of KG columns (one column group each when x
  // is not staged whole): NH = 2 at NT = 2 (nt2_full_chunks), NH = 1 and KG = KC at NT = 1 (the loop below)
  constexpr int KG = group_cols_for(NT);
  constexpr int NH = KC / KG;
  constexpr int JMAX = KG / 16 / CONSUMER_WARPS;   // k-steps per warp per chunk (part)
  const int B = P.batch;
  const float* rstd = S.rstd();
  float* red = S.scratch();
  static_assert(CONSUMER_WARPS * ACC_TILES * 32 * 16 <= UNION_BYTES, "reduction scratch");
  const int upp = MT / wp.mtpu;
  const int uend = t.arg0 + t.arg1;
#if MK_W_TMA
  const unsigned lane_off = w_lane_off(warp, lane);
#else
  const unsigned lane_off = (lane & 15) * row_bytes_for(NT) + (lane >> 4) * 16;
#endif
  unsigned char* xs = reinterpret_cast<unsigned char*>(red);   // staging shares the scratch
  // Column groups consumed so far (group staging: buffer gi & 1 holds the current one). The first
  // group's copies go out before the norm statistics' round trip, so the two overlap.
  int gi = 0;
  if (!staged) group_issue(xs, x, wp.K, wp.ldx, 0, B, KG);
  if (!staged && nw != nullptr)
    rows_rstd(x, B, S.rstd(), reinterpret_cast<float*>(xs + UNION_BYTES - STAGE_PART_BYTES), warp, lane);
  // MK_TRACE_PHASES: thread 0's clock at phase boundaries (after barriers: every warp is past them)
  unsigned long long ph_mark = 0, ph_stage = 0, ph_chunks = 0, ph_reduce = 0, ph_gwait = 0;
  const bool ph_on = MK_TRACE_PHASES && P.trace != nullptr && threadIdx.x == 0;
  const unsigned long long ph_entry = ph_on ? global_ns() : 0ull;
  for (int p0 = t.arg0; p0 < uend; p0 += upp) {
    if (ph_on) ph_mark = global_ns();
    const int mt = min(upp, uend - p0) * wp.mtpu;
    // MK_DIAG & 8 (timing only, wrong results): x reaches shared memory for the task's first pass only; later
    // passes read whatever the scratch holds (the ceiling of re-reading x from L2 once per pass). Constant
    // true in every other build.
    const bool xload = !(MK_DIAG & 8) || p0 == t.arg0;
    // A later pass restages group 0 once the previous pass's reduction has left the scratch.
    if (!staged && p0 != t.arg0 && xload) group_issue(xs + (gi & 1) * GROUP_BYTES, x, wp.K, wp.ldx, 0, B, KG);
    // o_proj/down: this warp's epilogue residuals, loaded early (o_proj.cuh); qkv_rope: its cos|sin values
    // (qkv_rope.cuh)
    unsigned rres[4] = {0u, 0u, 0u, 0u};
    // (a K part, arg2 != 0, prefetches nothing: ksplit_merge loads the residual; spelled !is_ksplit(t) it
    // compiles to other SASS than the measured build)
    if ((t.opcode == OP_O_PROJ || t.opcode == OP_DOWN) && t.arg2 == 0 && warp / NT < mt)
      residual_prefetch(P, t, p0, warp / NT, warp % NT, lane, rres);
    else if (t.opcode == OP_QKV_ROPE && warp / NT < mt)
      rope_prefetch(S, P, p0, warp / NT, warp % NT, lane, rres);
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;

    // Activations: staged whole once per pass in shared memory when they fit (one L2 round trip per
    // pass, norm statistics included); else one column group at a time (group_issue / group_frags),
    // the next group's copies in flight during this one's MMAs, with rstd from rows_rstd above.
    if (staged && xload) stage_x(xs, x, nw, S.rstd(), wp.K, wp.ldx, B, warp, lane);
    if (ph_on) phase_lap(ph_mark, ph_stage);
    if constexpr (NH == 2) {
      it = nt2_full_chunks<JMAX>(S, P, xload ? x : nullptr, nw, staged, rstd, wp.K, wp.ldx, B, mt, it, xs, gi, warp,
                                 lane, lane_off, acc, wait_cycles, ph_on, ph_gwait);
    } else {
#if MK_DIAG & 16
    // MK_DIAG & 16 (timing only, wrong results): the activation fragments of a pass's first chunk are used
    // for all its chunks (no smem_x_frags / group_frags after it; the column groups' copies and barriers kept):
    // the price of building the fragments per chunk, which one-M-tile tasks pay once per 32 KB chunk
    unsigned xb_kept[JMAX][NT][2] = {};
#endif
    for (int k0 = 0; k0 < wp.K; k0 += KC) {
      const int nsteps = min(KC, wp.K - k0) >> 4;
#if MK_DIAG & 16
      unsigned (&xb)[JMAX][NT][2] = xb_kept;
      const bool xfrag = k0 == 0;
#else
      unsigned xb[JMAX][NT][2];
      constexpr bool xfrag = true;
#endif
      if (staged) {
        if (xfrag) smem_x_frags<NT, JMAX>(xb, xs, nw != nullptr, rstd, wp.K, k0, nsteps, B, warp, lane);
      } else {
        unsigned wv[JMAX][2];  // norm weights: immutable, loaded before the barrier so the two overlap
#pragma unroll
        for (int jj = 0; jj < JMAX; ++jj) {
          const int k = k0 + (warp + jj * CONSUMER_WARPS) * 16 + (lane & 3) * 2;
          const bool ld = nw != nullptr && warp + jj * CONSUMER_WARPS < nsteps;
          wv[jj][0] = ld ? ld_nc_u32(nw + k) : 0u;
          wv[jj][1] = ld ? ld_nc_u32(nw + k + 8) : 0u;
        }
        const unsigned long long gw0 = ph_on ? global_ns() : 0ull;
        cp_async_wait_all();  // this thread's copies of the group have landed ...
        consumer_sync();      // ... and everyone's; the other buffer's last readers are done too
        if (ph_on) ph_gwait += global_ns() - gw0;   // MK_TRACE_PHASES: counted as staging, not chunks
        if (xfrag) group_frags<NT, JMAX>(xb, xs + (gi & 1) * GROUP_BYTES, wv, nw != nullptr, rstd, KG, nsteps, B, warp, lane);
        if (k0 + KG < wp.K && xload) group_issue(xs + ((gi + 1) & 1) * GROUP_BYTES, x, wp.K, wp.ldx, k0 + KG, B, KG);
        ++gi;
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m < mt) {
          const int slot = it % NUM_STAGES;
          const long long c0 = clock64();
          // Not OK (this CTA is stopping): compute on whatever the slot holds -- the results are
          // discarded with the step -- keep every consumer_sync of the task, and do not free the
          // slot (its copy may still be landing); the loop ends at the next task boundary.
          const int ws =
              ring_wait(S, P, S.full_bar(slot), (it / NUM_STAGES) & 1, -1, MBAR_TAG_FULL + slot, it, true, 1);
          wait_cycles += clock64() - c0;
          const unsigned sb = S.ring(slot) + lane_off;
#pragma unroll
          for (int jj = 0; jj < JMAX; ++jj) {
            const int j = warp + jj * CONSUMER_WARPS;
            if (j < nsteps && !(MK_DIAG & 4)) {
              unsigned a[4];
#if MK_W_TMA
              ldmatrix_x4(a, sb + jj * W_JJ_BYTES);
#else
              ldmatrix_x4(a, sb + j * 32);
#endif
#pragma unroll
              for (int n = 0; n < NT; ++n) mma_16816(acc[m][n], a, xb[jj][n]);
            }
          }
          if (ws == WAIT_OK) mbar_arrive(S.empty_bar(slot));  // each thread releases its own reads
          ++it;
        }
      }
    }
    }
    consumer_sync();  // every warp is done with the staged x before `red` overwrites it
    if (ph_on) {
      const unsigned long long now = global_ns();
      ph_chunks += now - ph_mark - ph_gwait;
      ph_stage += ph_gwait;
      ph_gwait = 0;
      ph_mark = now;
    }

    // Cross-warp reduction: red[warp][m][n][lane] (float4), then warp w owns tile w = m*NT + n.
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
        if (m < mt)
          reinterpret_cast<float4*>(red)[((warp * MT + m) * NT + n) * 32 + lane] =
              make_float4(acc[m][n][0], acc[m][n][1], acc[m][n][2], acc[m][n][3]);
    consumer_sync();
    {
      const int m = warp / NT, n = warp % NT;
      if (m < mt && !(wp.mtpu == 2 && (m & 1))) {
        float v[4] = {0.f, 0.f, 0.f, 0.f}, vu[4] = {0.f, 0.f, 0.f, 0.f};
        for (int w = 0; w < CONSUMER_WARPS; ++w) {
          const float4 a = reinterpret_cast<const float4*>(red)[((w * MT + m) * NT + n) * 32 + lane];
          v[0] += a.x; v[1] += a.y; v[2] += a.z; v[3] += a.w;
          if (wp.mtpu == 2) {
            const float4 c = reinterpret_cast<const float4*>(red)[((w * MT + m + 1) * NT + n) * 32 + lane];
            vu[0] += c.x; vu[1] += c.y; vu[2] += c.z; vu[3] += c.w;
          }
        }
        matvec_epilogue(S, P, t, p0, m, n, lane, v, vu, rres);
      }
    }
    consumer_sync();
    if (ph_on) ph_reduce += global_ns() - ph_mark;
  }
  if (ph_on) trace_phase_times(S, P, ph_stage, ph_chunks, ph_reduce, ph_entry);
  *wait_out += wait_cycles;
  if (is_ksplit(t)) ksplit_merge(S, P, t);   // o_proj.cuh: the last part of the range adds the parts
  return it;
}

}  // namespace mk
