// MK_ATT_TMA = N (variant.KernelVariant.att_tma, per batch size from the tuning table; default 0 = off, session 16):
// ATTN_PARTIAL's K/V through the weight ring for every task of at least N tokens (1: all of them; session 18's
// threshold 128, since the ring path gained only on long tasks: the shorter ones keep the default loop, chosen per
// task at run time from the request's length, so one build serves every context). The CUDA-core loop
// (attention.cuh) keeps ~40 KB of K/V loads in flight per SM, and under the step's traffic a load round trip takes
// ~3-4 us, so attention streams at ~9 GB/s per SM (bench/NOTES.md session 16). Here the producer warp streams an
// attention task's KV like a matvec's weights: one tensor-map copy (cp.async.bulk.tensor, box 16 tokens x 1 head
// x D, 64-byte swizzled) per (block, K|V), ATT_TMA_BPS blocks per ring slot, issued whenever a slot is free --
// before the task's dependency resolves, since the cached tokens are not written during the launch. The consumers
// are the tensor cores (attention_ring_mma.cuh; session 26 measured them against this file's former CUDA-core
// loop: -23% / -27% at 8B ctx 8192 batch 8 / 16, bench/NOTES.md). The newest token of the request (position
// L - 1, written by this launch's qkv_rope) is the one exception: its tile in the ring may predate qkv's store,
// so the consumers load its row from global memory after the task's counter wait, as the default loop does.
// Tensor maps: one per layer (tensormap.py: the layer's cache [blocks, 2, 16, NKV, D] viewed as
// (32 columns, rows = blocks * 2 * 16, D / 32 parts, NKV)), 128 bytes each in global memory, their addresses in
// P.kvptr[LAYERS + l] (the host builds the longer table only for this build). Needs block_size 16 and one head
// pass (G == ATT_HG).
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

// Where a slot's KV tiles start: the slot rounded up to 512 bytes (their 64-byte swizzle's atom,
// attention_ring_mma.cuh). A default-layout slot is 33024 bytes (256 more than its tiles) and 256-byte aligned from
// the 1024-aligned shared base, so the shift is 0 or 256 and the tiles stay inside it.
#if MK_ATT_TMA
static_assert(RING_STRIDE % 512 == 0 || (RING_STRIDE % 256 == 0 && RING_STRIDE - 2 * ATT_TMA_BPS * ATT_TILE_BYTES >= 256),
              "MK_ATT_TMA: a slot's tiles must fit after rounding its start up to 512 bytes");
#endif
__device__ __forceinline__ unsigned att_tiles(const Smem& S, int slot) { return (S.ring(slot) + 511u) & ~511u; }

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
      // the swizzled 4-D view (32 columns, rows, D / 32 parts, heads): attention_ring_mma.cuh
      tma_4d_g2s(dst, map, blk * 2 * ATT_TMA_ROWS, 0, g, S.full_bar(slot));
      tma_4d_g2s(dst + ATT_TILE_BYTES, map, (blk * 2 + 1) * ATT_TMA_ROWS, 0, g, S.full_bar(slot));
    }
    ++it;
  }
  return true;
}

// Consumers of a ring-fed task over tokens [lo, hi) (attention_ring_mma.cuh): ring slot si's wait, its first
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
// wrote them during this launch, after the tile in the ring may have been copied. Read where qkv_rope stored them, the
// request's slot_mapping entry (in shared memory since the launch: the row costs one round trip, not a block-table
// round trip before it; vLLM's slot of the newest token is its block-table slot); a request without a slot (< 0:
// padding, nothing stored) reads its block-table slot, as the other tokens.
__device__ __forceinline__ void att_newest_row(const Smem& S, const Params& P, const Task& t, int tok, int e, uint4& kr,
                                               uint4& vr) {
  const long long slot = S.slot()[t.arg0];
  if (slot >= 0) {   // block_size is ATT_TMA_ROWS (tensormap.py refuses another): no 64-bit division
    attn_kv_row(reinterpret_cast<const elem_t*>(P.kvptr[t.layer]), slot / ATT_TMA_ROWS, (int)(slot % ATT_TMA_ROWS),
                P.block_size, t.arg1, e, kr, vr);
    return;
  }
  const int bi = tok / P.block_size;
  const long long blk = ld_nc_s32(P.block_table + (size_t)t.arg0 * P.bt_stride + bi);
  attn_kv_row(reinterpret_cast<const elem_t*>(P.kvptr[t.layer]), blk, tok - bi * P.block_size, P.block_size, t.arg1,
              e, kr, vr);
}

}  // namespace mk
