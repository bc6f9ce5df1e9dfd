// The plan of a matvec task that its producer and its consumers walk alike (matvec.cuh): the weight matrix
// and reduction width of each opcode (weight_plan), the rows of each 16-row unit (weight_row, tile_rows), a
// K-split task's columns (ksplit_range) and the chunk geometry per batch n-tile count (chunk_cols_for).
#pragma once
#include "common.cuh"

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

// A batch size's n-tile count (8 tokens an n-tile); batch_ntiles is the build's: a constant where MK_NTILES compiles
// one batch class only (session 49's A/B: the other class's matvec path and the wgmma path at one n-tile leave the
// build), so the compiler drops what that class never runs. The kernel's header check refuses the other class.
__device__ __forceinline__ int batch_class(int batch) { return batch <= 8 ? 1 : 2; }
__device__ __forceinline__ int batch_ntiles(int batch) { return MK_NTILES ? MK_NTILES : batch_class(batch); }

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

}  // namespace mk
