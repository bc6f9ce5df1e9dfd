// MK_W_TMA (A/B switch, session 19; variant.KernelVariant.w_tma): a weight ring chunk (16 rows x CHUNK_COLS
// columns, 32 KB) is one tensor-map copy instead of 16 bulk copies of one 2 KB row each. The bulk probe
// (bench/NOTES.md session 11) streams 2 KB copies at 94-95% of the copy rate with the consumers' MMA pattern and one
// contiguous copy per chunk at 101-102%: each copy costs an SM ~36 ns of issue whatever is in flight.
//
// Layout of a chunk in its ring slot (RING_STRIDE = 32 KB, 1024-byte aligned): [column group 0..15][row 0..15]
// [64 columns], each 128-byte line's 16-byte units XOR-swizzled by (row & 7) -- the tensor map's 128-byte swizzle,
// so the 8 rows of one ldmatrix read are in 8 different bank groups with no padding (the default layout pads each
// row by 16 bytes instead). Maps (tensormap.weight_maps): per layer qkv, o, gate_up, down, then the LM head, each a
// pair: box of 16 column groups (a whole chunk) and box of 1 (a chunk's tail, K-split parts and K % 1024). Rows
// past the matrix (the LM head's last tile) and columns past K land as zeros and count in the transaction bytes.
#pragma once
#include "common.cuh"

namespace mk {

constexpr int W_KG_COLS = 64;                   // columns per 128-byte line (tensormap.W_KGROUP)
constexpr int W_KG_BYTES = 16 * W_KG_COLS * 2;  // one column group of a 16-row tile: 2 KB
constexpr int W_CHUNK_KG = CHUNK_COLS / W_KG_COLS;
constexpr int W_MAP_OPS = 4;                    // qkv, o, gate_up, down per layer (tensormap.W_MAP_OPS)
static_assert(W_CHUNK_KG == 16 && W_CHUNK_KG * W_KG_BYTES == 32768, "MK_W_TMA: a chunk is 16 column groups");

#if MK_W_TMA
static_assert(H % W_KG_COLS == 0 && QS % W_KG_COLS == 0 && I % W_KG_COLS == 0,
              "MK_W_TMA: every matrix's K a multiple of 64 (tensormap.check_weights_model)");
static_assert(D / 2 % 8 == 0, "MK_W_TMA: qkv tiles are 8 rows of each half of a head");

// The map pair of (op, layer): kind 0 the whole-chunk box, 1 the one-column-group box.
__device__ __forceinline__ const void* w_map(const Params& P, int op, int layer, int kind) {
  const unsigned char* maps = reinterpret_cast<const unsigned char*>(P.wptr[LAYERS * LP_COUNT + MP_WEIGHT_MAPS]);
  const int k = op == OP_QKV_ROPE ? 0 : op == OP_O_PROJ ? 1 : op == OP_GATE_UP ? 2 : 3;
  const int idx = op == OP_LM_HEAD ? LAYERS * W_MAP_OPS : layer * W_MAP_OPS + k;
  return maps + (size_t)(2 * idx + kind) * 128;
}

// One box at (row, column group kg): the qkv maps are 4-D (row, half 0..1, group), the others 3-D (row, group).
__device__ __forceinline__ void tma_w(unsigned dst, const void* map, bool qkv, int row, int kg, unsigned mbar) {
#if MK_DIAG & 32   // (timing only: the folded chunks are meant to stay in L2, so no evict-first hint)
  if (qkv) tma_4d_g2s(dst, map, row, 0, kg, mbar);
  else tma_3d_g2s(dst, map, row, kg, mbar);
#else
  if (qkv) tma_4d_g2s_w(dst, map, row, 0, kg, mbar);
  else tma_3d_g2s_w(dst, map, row, kg, mbar);
#endif
}

// Producer warp, one chunk: M-tile rows from row0 (weight_row of its first row), columns [k0, k0 + kc). Returns
// the transaction bytes the chunk's barrier must expect (lane 0 arms it before any lane copies).
__device__ __forceinline__ unsigned w_chunk_bytes(int kc) {
  return kc == CHUNK_COLS ? (unsigned)(W_CHUNK_KG * W_KG_BYTES) : (unsigned)(((kc + W_KG_COLS - 1) / W_KG_COLS) * W_KG_BYTES);
}

__device__ __forceinline__ void w_chunk_copy(unsigned dst, const void* map_full, const void* map_one, bool qkv, int row0,
                                             int k0, int kc, unsigned mbar, int lane) {
  const int kg0 = k0 / W_KG_COLS;
  if (kc == CHUNK_COLS) {
    if (lane == 0) tma_w(dst, map_full, qkv, row0, kg0, mbar);
  } else if (lane < (kc + W_KG_COLS - 1) / W_KG_COLS) {
    tma_w(dst + lane * W_KG_BYTES, map_one, qkv, row0, kg0 + lane, mbar);
  }
}

// Consumer: this thread's ldmatrix address in a chunk for its first k-step (warp's j = warp, 16 columns), row
// lane & 15, column half lane >> 4. k-step j = warp + 8 jj sits at column group j / 4 = warp / 4 + 2 jj, unit
// (j % 4) * 2 + (lane >> 4) = (warp % 4) * 2 + (lane >> 4) of the line: the same unit for every jj.
__device__ __forceinline__ unsigned w_lane_off(int warp, int lane) {
  const int r = lane & 15, u = ((warp & 3) << 1) | (lane >> 4);
  return (unsigned)((warp >> 2) * W_KG_BYTES + r * 128 + ((u ^ (r & 7)) << 4));
}
constexpr unsigned W_JJ_BYTES = 2 * W_KG_BYTES;            // k-step j -> j + 8: two column groups on
constexpr unsigned W_HALF_BYTES = (W_CHUNK_KG / 2) * W_KG_BYTES;   // NT = 2: the chunk's second 512 columns
#endif

}  // namespace mk
