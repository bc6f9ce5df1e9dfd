// The producer warp of every CTA (megakernel.cu, warp 8): streams the weights of its queue's tasks, in queue
// order and with the consumers' chunk plan (matvec_plan.cuh), into the NUM_STAGES-slot ring; it never waits on
// a counter, so the next tasks' weights load while the consumers wait or compute.
#pragma once
#include "common.cuh"
#include "weight_tma.cuh"
#include "matvec_plan.cuh"

namespace mk {

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
// MK_GATE_AHEAD = G (A/B switch, session 35; 0 = off): a gated task (MK_RELEASE_GATE) issues its first G chunks
// before the previous task's release and waits for it at chunk `gate_at` (its G-th; ~0u: no wait). Why: the full
// gate gives the next task no head start, and session 35's H100 traces put the ungated releases at 1.5-1.9 us
// (o_proj 4.3 at 1B b16): chunks that go out while the ring still holds the current task's last chunks land long
// before its release, so a few of them should cost the fence little and keep the next task's start.
__device__ __forceinline__ int producer_slot_wait(const Smem& S, const Params& P, unsigned it, int ti,
                                                  unsigned gate_at = ~0u) {
#if MK_GATE_AHEAD
  if (it == gate_at) release_gate(S, P, ti, threadIdx.x & 31);
#else
  (void)gate_at;
#endif
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

// MK_DIAG & 32 (timing only, wrong results; MK_W_TMA builds): every weight chunk is read from layer 0's matrices at
// its row modulo DIAG_L2_ROWS, so the weights a step streams (~14 MB at 1B, ~27 MB at 8B) stay in L2: the step
// with L2-resident weights, between the default and MK_DIAG & 2 (no weight copies), says what parking weights in L2
// could gain at most (session 35's question). 512 rows: a multiple of every head_dim (qkv's row pairs stay pairs) and
// of the intermediate sizes (gate_up's up rows fold onto its gate rows). Many SMs then read the same tiles at once:
// an L2 hot spot the parked weights would not have, so read it as a bound with that caveat.
// MK_DIAG_L2_N > 0 (session 40): the fold only for gate_up's chunks MK_DIAG_L2_FROM .. + N - 1 of each task (c: the
// task's chunks issued so far), the rest from the task's own rows: what a prefetch of those chunks into L2 during the
// chain could gain at most.
constexpr int DIAG_L2_ROWS = 512;
__device__ __forceinline__ bool diag_fold(int opcode, int c) {
  if (!(MK_DIAG & 32)) return false;
  if (MK_DIAG_L2_N == 0) return true;
  return opcode == OP_GATE_UP && c >= MK_DIAG_L2_FROM && c < MK_DIAG_L2_FROM + MK_DIAG_L2_N;
}
__device__ __forceinline__ int diag_row(int row, bool fold) { return fold ? row % DIAG_L2_ROWS : row; }
#if (MK_DIAG & 32) && !MK_W_TMA
#error "MK_DIAG & 32 folds the tensor-map copies' rows: build it with MK_W_TMA=1"
#endif

// Chunk order of a pass (mirrored by matvec_task): for k0 in 0, KC, 2 KC, ..: for each M-tile m.
// A chunk = the tile's 16 weight rows x [k0, k0 + kc): 16 bulk copies of kc * 2 bytes
// (KC = chunk_cols_for(NT)).
//
// Watchdog: a slot wait gives up when this CTA's consumers have stopped (abort flag) or after
// PRODUCER_BUDGET_MULT budgets; the warp then stops issuing. Either way it drains before exiting.
#if MK_WGMMA_A   // matvec_wgmma_a.cuh (included after this file): which passes take 64-row chunks, and their copies
__device__ __forceinline__ bool wga_takes(int K, int B);
__device__ __forceinline__ bool wga_produce(const Smem& S, const Params& P, const Task& t, int mtpu, int klo, int khi,
                                            const void* wmap_one, unsigned& it, int ti, int lane, unsigned gate_at);
#endif
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
      // its K/V copies in the trace as a matvec's weights (mk_plugin.persistent.trace: prod_first / prod_last), so
      // that a release before an attention task sees them in flight (session 39: qkv_rope's at 8B b16)
      if (P.trace != nullptr && lane == 0) P.trace[(size_t)ti * TRACE_WORDS + TR_PROD_FIRST] = global_ns();
      if (!att_tma_produce(S, P, t, L, ti, lane, it)) goto drain;
      if (P.trace != nullptr && lane == 0) P.trace[(size_t)ti * TRACE_WORDS + TR_PROD_LAST] = global_ns();
      continue;
    }
#endif
    WeightPlan wp;
    if (!weight_plan(P, t.opcode, t.layer, wp)) continue;
    const bool gated = MK_RELEASE_GATE && gate_op >= 0 && ((MK_RELEASE_GATE >> gate_op) & 1);
#if MK_GATE_AHEAD
    const unsigned gate_at = gated ? it + MK_GATE_AHEAD : ~0u;   // producer_slot_wait waits there
#else
    if (gated) release_gate(S, P, ti, lane);
    const unsigned gate_at = ~0u;
#endif
    if (P.trace != nullptr && lane == 0) P.trace[(size_t)ti * TRACE_WORDS + TR_PROD_FIRST] = global_ns();
    const int upp = (ACC_TILES / nt) / wp.mtpu;
    const int uend = t.arg0 + t.arg1;
    int klo = 0, khi = wp.K;   // a K-split task streams its part's columns of the rows
    if (is_ksplit(t)) ksplit_range(wp.K, t.arg2, klo, khi);
#if MK_W_TMA
    // MK_DIAG & 32 (timing only, wrong results): layer 0's maps for every layer, rows folded (diag_row); with
    // MK_DIAG_L2_N, layer 0's maps for the window's chunks only (diag_fold)
    const int wlayer = (MK_DIAG & 32) && MK_DIAG_L2_N == 0 ? 0 : t.layer;
    const void* wmap_full = w_map(P, t.opcode, wlayer, 0);
    const void* wmap_one = w_map(P, t.opcode, wlayer, 1);
    if (lane == 0) tensormap_acquire(wmap_full);
    if (lane < W_CHUNK_KG) tensormap_acquire(wmap_one);
#if (MK_DIAG & 32) && MK_DIAG_L2_N   // the window's chunks: layer 0's maps
    const void* fmap_full = w_map(P, t.opcode, 0, 0);
    const void* fmap_one = w_map(P, t.opcode, 0, 1);
    if (lane == 0) tensormap_acquire(fmap_full);
    if (lane < W_CHUNK_KG) tensormap_acquire(fmap_one);
#else   // one set of maps (diag_fold is a constant: every chunk folded with bit 32 alone, none without)
    const void* fmap_full = wmap_full;
    const void* fmap_one = wmap_one;
#endif
    const unsigned it0 = it;   // the task's first chunk (diag_fold counts from it)
#endif
#if MK_WGMMA_A   // batch 9..16: the task's passes of up to 4 x MK_WGMMA_A M-tiles, a row block x 256 columns a chunk
    if (wga_takes(khi - klo, P.batch)) {
      if (!wga_produce(S, P, t, wp.mtpu, klo, khi, wmap_one, it, ti, lane, gate_at)) goto drain;
    } else
#endif
    for (int p0 = t.arg0; p0 < uend; p0 += upp) {
      const int mt = min(upp, uend - p0) * wp.mtpu;
      for (int k0 = klo; k0 < khi; k0 += KC) {
        const int kc = min(KC, khi - k0);
        for (int m = 0; m < mt; ++m) {
          const int slot = it % NUM_STAGES;
          const int valid = tile_rows(t.opcode, p0, m);
          if (producer_slot_wait(S, P, it, ti, gate_at) != WAIT_OK) goto drain;
#if MK_W_TMA   // one tensor-map copy per chunk (a tail: one per column group); rows past the matrix land as zeros
          (void)valid;
          if (lane == 0 && !(MK_DIAG & 2)) mbar_arrive_expect_tx(S.full_bar(slot), w_chunk_bytes(kc));
          __syncwarp();
          if (MK_DIAG & 2) {
            if (lane == 0) mbar_arrive(S.full_bar(slot));
          } else {
            const bool fold = diag_fold(t.opcode, (int)(it - it0));
            w_chunk_copy(S.ring(slot), fold ? fmap_full : wmap_full, fold ? fmap_one : wmap_one,
                         t.opcode == OP_QKV_ROPE, diag_row(weight_row(t.opcode, p0, m * 16), fold), k0, kc,
                         S.full_bar(slot), lane);
          }
#else
          if (lane == 0 && !(MK_DIAG & 2)) mbar_arrive_expect_tx(S.full_bar(slot), (unsigned)(valid * kc * 2));
          __syncwarp();
          if (MK_DIAG & 2) {
            if (lane == 0) mbar_arrive(S.full_bar(slot));
          } else if (lane < valid)
            bulk_g2s_w(S.ring(slot) + lane * RB, chunk_row(wp.w, wp.K, t.opcode, p0, m, lane, k0), (unsigned)(kc * 2),
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

}  // namespace mk
