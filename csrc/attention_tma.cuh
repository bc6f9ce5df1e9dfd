// MK_ATT_TMA = N (A/B switch, default 0 = off, session 16; variant.KernelVariant.att_tma): ATTN_PARTIAL's K/V
// through the weight ring for every task of at least N tokens (1: all of them; session 18's threshold, since the
// ring path gained only on long tasks: the shorter ones keep the default loop, chosen per task at run time from
// the request's length, so one build serves every context). The CUDA-core loop (attention.cuh) keeps ~40 KB of
// K/V loads in flight per SM, and under the step's traffic a load round trip takes ~3-4 us, so attention
// streams at ~9 GB/s per SM (bench/NOTES.md session 16). Here the producer warp streams an attention task's KV like a matvec's weights: one tensor-map
// copy (cp.async.bulk.tensor, box 16 tokens x 1 head x D) per (block, K|V), ATT_TMA_BPS blocks per ring slot,
// issued whenever a slot is free -- before the task's dependency resolves, since the cached tokens are not
// written during the launch. The newest token of the request (position L - 1, written by this launch's
// qkv_rope) is the one exception: its tile in the ring may predate qkv's store, so the consumers load its row
// from global memory after the task's counter wait, as the default loop does.
// Tensor maps: one per layer (tensormap.py: the layer's cache [blocks, 2, 16, NKV, D] viewed as
// [rows = blocks * 2 * 16][NKV][D]), 128 bytes each in global memory, their addresses in P.kvptr[LAYERS + l]
// (the host builds the longer table only for this build). Needs block_size 16 and one head pass (G == ATT_HG).
// The task's tokens, states, merges and stores are the default loop's (attention.cuh helpers): same results
// up to the order of the fp32 sums within a lane group.
#pragma once
#include "attention.cuh"

namespace mk {

constexpr int ATT_TMA_ROWS = 16;                                  // tokens per block and tile (box rows)
constexpr int ATT_TILE_BYTES = ATT_TMA_ROWS * D * 2;              // one head's K (or V) of a block
constexpr int ATT_TMA_BPS = 32768 / (2 * ATT_TILE_BYTES);         // blocks per slot: 8 at D = 64, 4 at D = 128
// The ring path reads each slot once, i.e. in one head pass (G == ATT_HG: 1-4 query heads per kv head): another
// model compiles it out, as the host turns it off for that model (tensormap.check_model, the same condition).
constexpr int ATT_TMA_MIN_TOKENS = G == ATT_HG ? MK_ATT_TMA : 0;
static_assert(2 * ATT_TMA_BPS * ATT_TILE_BYTES <= SLOT_BYTES && ATT_TMA_BPS >= 1, "MK_ATT_TMA: slot size");
static_assert(SLOT_BYTES % 128 == 0 && ATT_TILE_BYTES % 128 == 0, "MK_ATT_TMA: 128-byte aligned tiles");

// Where a slot's KV tiles start: the slot itself, or under MK_RING_MMA (64-byte swizzled tiles, whose swizzle atom is
// 512 bytes) the slot rounded up to 512 bytes. A default-layout slot is 33024 bytes (256 more than its tiles) and
// 256-byte aligned from the 1024-aligned shared base, so the shift is 0 or 256 and the tiles stay inside it.
#if MK_RING_MMA
static_assert(RING_STRIDE % 512 == 0 || (RING_STRIDE % 256 == 0 && RING_STRIDE - 2 * ATT_TMA_BPS * ATT_TILE_BYTES >= 256),
              "MK_RING_MMA: a slot's tiles must fit after rounding its start up to 512 bytes");
#endif
__device__ __forceinline__ unsigned att_tiles(const Smem& S, int slot) {
  return MK_RING_MMA ? (S.ring(slot) + 511u) & ~511u : S.ring(slot);
}

// Blocks of a task over tokens [lo, hi), and its ring slots: ATT_TMA_BPS blocks each (producer and consumers
// agree).
__device__ __forceinline__ int att_tma_blocks(int lo, int hi) {
  return hi > lo ? (hi - 1) / ATT_TMA_ROWS - lo / ATT_TMA_ROWS + 1 : 0;
}
__device__ __forceinline__ int att_tma_slots(int lo, int hi) {
  return (att_tma_blocks(lo, hi) + ATT_TMA_BPS - 1) / ATT_TMA_BPS;
}

// Whether attention task (request length L, chunk c of C) goes through the ring: producer and consumers decide
// from the same length (the consumers' shared copy of seq_lens is verbatim), so they agree on its slots.
__device__ __forceinline__ bool att_tma_task(int L, int C, int c) {
  int lo, hi;
  attn_range_of(L, C, c, lo, hi);
  return ATT_TMA_MIN_TOKENS > 0 && hi - lo >= ATT_TMA_MIN_TOKENS;
}

// Producer warp: the KV tiles of attention task t (request length L) into the ring; false when a ring wait failed
// (the CTA stops).
__device__ __forceinline__ bool att_tma_produce(const Smem& S, const Params& P, const Task& t, int L, int ti, int lane,
                                                unsigned& it) {
  const int b = t.arg0, g = t.arg1;
  int lo, hi;
  attn_range_of(L, P.chunks, t.arg2, lo, hi);
  const int nslots = att_tma_slots(lo, hi);
  const int blk0 = lo / ATT_TMA_ROWS, nblk = att_tma_blocks(lo, hi);
  const int* bt = P.block_table + (size_t)b * P.bt_stride;
  const void* map = reinterpret_cast<const void*>(P.kvptr[LAYERS + t.layer]);
  // the map was written by the host (generic proxy) before the launch; each issuing lane orders its reads of it
  if (nslots > 0 && lane < ATT_TMA_BPS)
    tensormap_acquire(map);
  for (int si = 0; si < nslots; ++si) {
    const int n = min(ATT_TMA_BPS, nblk - si * ATT_TMA_BPS);
    const int slot = it % NUM_STAGES;
    if (producer_slot_wait(S, P, it, ti) != WAIT_OK) return false;
    if (lane == 0 && !(MK_DIAG & 2)) mbar_arrive_expect_tx(S.full_bar(slot), (unsigned)(n * 2 * ATT_TILE_BYTES));
    __syncwarp();
    if (MK_DIAG & 2) {
      if (lane == 0) mbar_arrive(S.full_bar(slot));
    } else if (lane < n) {
      const int blk = ld_nc_s32(bt + blk0 + si * ATT_TMA_BPS + lane);
      const unsigned dst = att_tiles(S, slot) + (unsigned)(lane * 2 * ATT_TILE_BYTES);
#if MK_RING_MMA   // the swizzled 4-D view (32 columns, rows, D / 32 parts, heads): attention_ring_mma.cuh
      tma_4d_g2s(dst, map, blk * 2 * ATT_TMA_ROWS, 0, g, S.full_bar(slot));
      tma_4d_g2s(dst + ATT_TILE_BYTES, map, (blk * 2 + 1) * ATT_TMA_ROWS, 0, g, S.full_bar(slot));
#else
      tma_3d_g2s(dst, map, g, blk * 2 * ATT_TMA_ROWS, S.full_bar(slot));
      tma_3d_g2s(dst + ATT_TILE_BYTES, map, g, (blk * 2 + 1) * ATT_TMA_ROWS, S.full_bar(slot));
#endif
    }
    ++it;
  }
  return true;
}

// Consumers of a ring-fed task over tokens [lo, hi) (this loop's and MK_RING_MMA's): ring slot si's wait, its first
// block sb and the task's tokens [s_lo, s_hi) it holds. ws not OK (this CTA is stopping): compute on whatever the
// slot holds (the step is discarded) and do not free it.
struct AttSlot {
  int ws, sb, s_lo, s_hi;
};
__device__ __forceinline__ AttSlot att_slot_wait(const Smem& S, const Params& P, unsigned it, int lo, int hi, int si) {
  const int slot = it % NUM_STAGES;
  const int ws = ring_wait(S, P, S.full_bar(slot), (it / NUM_STAGES) & 1, -1, MBAR_TAG_FULL + slot, it, true, 1);
  const int sb = lo / ATT_TMA_ROWS + si * ATT_TMA_BPS;
  return {ws, sb, max(lo, sb * ATT_TMA_ROWS), min(hi, (sb + ATT_TMA_BPS) * ATT_TMA_ROWS)};
}

// This lane's 16 bytes (chunk e) of the K and V rows of task t's newest token `tok`, from global memory: qkv_rope
// wrote them during this launch, after the tile in the ring may have been copied.
__device__ __forceinline__ void att_newest_row(const Params& P, const Task& t, int tok, int e, uint4& kr, uint4& vr) {
  const int bi = tok / P.block_size;
  const long long blk = ld_nc_s32(P.block_table + (size_t)t.arg0 * P.bt_stride + bi);
  attn_kv_row(reinterpret_cast<const elem_t*>(P.kvptr[t.layer]), blk, tok - bi * P.block_size, P.block_size, t.arg1,
              e, kr, vr);
}

// Consumers: attn_partial_task with the KV loop over the task's ring slots (`it`: the consumers' chunk count;
// returned advanced by the slots read, as the producer's). Inlined: __noinline__ (as matvec_task) measured
// +30..+35 us at 1B ctx 512 batch 4/8 on the ring path (session 18, bench/NOTES.md).
__device__ __forceinline__ unsigned attn_partial_tma(const Smem& S, const Params& P, const Task& t, unsigned it,
                                                     int warp, int lane) {
  const int b = t.arg0, g = t.arg1, c = t.arg2;
  const int C = P.chunks;
  int lo, hi;
  attn_range(S, C, b, c, lo, hi);
  const int newest = S.seq_len()[b] - 1;   // written by this launch's qkv_rope: read from global memory
  const int e = lane % ATT_LPT, sub = lane / ATT_LPT;
  const float qscale = rsqrtf((float)D) * LOG2E;
  float* wm = S.scratch();                               // [warp][HG]
  float* wl = wm + CONSUMER_WARPS * ATT_HG;              // [warp][HG]
  float* wo = wl + CONSUMER_WARPS * ATT_HG;              // [warp][HG][D]
  float* qs = wo + CONSUMER_WARPS * ATT_HG * D;          // [HG][D] scaled q
  const bool direct = t.out_buf == BUF_ATTN_O && t.ticket_ctr < 0;   // C == 1
  const elem_t* qbuf = buf_ptr(P, BUF_Q) + (size_t)b * QS;
  const bool ph_on = MK_TRACE_PHASES && P.trace != nullptr && threadIdx.x == 0;
  unsigned long long ph_t = ph_on ? global_ns() : 0ull, ph_stage = 0, ph_chunks = 0, ph_reduce = 0;
  const unsigned long long ph_entry = ph_t;

  attn_stage_q(qs, qbuf, g, 0, qscale);   // one head pass: h0 = 0
  consumer_sync();
  if (ph_on) phase_lap(ph_t, ph_stage);
  float m[ATT_HG], l[ATT_HG], o[ATT_HG][8];
  attn_state_init(m, l, o);
  const int nslots = att_tma_slots(lo, hi);
  for (int si = 0; si < nslots; ++si) {
    const int slot = it % NUM_STAGES;
    const AttSlot a = att_slot_wait(S, P, it, lo, hi, si);
    const int sb = a.sb, s_lo = a.s_lo, s_hi = a.s_hi;
    const unsigned char* ring = S.base + RING_OFF + slot * RING_STRIDE;
    for (int base = s_lo + warp * ATT_TPW; base < s_hi; base += CONSUMER_WARPS * ATT_TPW * ATT_AU) {
      uint4 kr[ATT_AU], vr[ATT_AU];
      bool valid[ATT_AU];
#pragma unroll
      for (int u = 0; u < ATT_AU; ++u) {
        const int tok = base + u * CONSUMER_WARPS * ATT_TPW + sub;
        valid[u] = tok < s_hi;
        kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
        if (valid[u] && tok == newest) {
          att_newest_row(P, t, tok, e, kr[u], vr[u]);
        } else if (valid[u]) {
          const unsigned char* kp = ring + (tok / ATT_TMA_ROWS - sb) * 2 * ATT_TILE_BYTES +
                                    (tok % ATT_TMA_ROWS) * D * 2 + e * 16;
          kr[u] = *reinterpret_cast<const uint4*>(kp);
          vr[u] = *reinterpret_cast<const uint4*>(kp + ATT_TILE_BYTES);
        }
      }
#pragma unroll
      for (int u = 0; u < ATT_AU; ++u) attn_token(kr[u], vr[u], valid[u], qs, e, m, l, o);
    }
    if (a.ws == WAIT_OK) mbar_arrive(S.empty_bar(slot));  // each thread frees its own reads
    ++it;
  }
  if (ph_on) phase_lap(ph_t, ph_chunks);
  attn_lanes_merge(m, l, o);
  if (sub == 0) {   // as attn_partial_task's (a helper for these lines changed the default build's code)
#pragma unroll
    for (int hh = 0; hh < ATT_HG; ++hh) {
#pragma unroll
      for (int i = 0; i < 8; ++i) wo[(warp * ATT_HG + hh) * D + e * 8 + i] = o[hh][i];
      if (e == 0) {
        wm[warp * ATT_HG + hh] = m[hh];
        wl[warp * ATT_HG + hh] = l[hh];
      }
    }
  }
  attn_warps_store(P, wm, wl, wo, C, b, g, c, 0, direct);
  if (ph_on) phase_lap(ph_t, ph_reduce);
  if (ph_on) trace_phase_times(S, P, ph_stage, ph_chunks, ph_reduce, ph_entry);
  attn_ticket_merge(S, P, t, C, b, g);
  return it;
}

}  // namespace mk
