// Weight-streaming probe (bench/bulk_probe.py): one CTA per SM streams its own region of a large
// bf16 matrix from HBM into a shared-memory ring of NS slots, the way the megakernel's matvec does
// (csrc/matvec.cuh), with the knobs that separate the possible limits of the per-SM rate:
//   KC, mode_copy: the size and number of cp.async.bulk copies per chunk (TMA per-copy cost);
//   NS:            the ring depth (bytes in flight per SM);
//   compute:       the consumers' ldmatrix/mma work per chunk.
// Independent of the megakernel's headers and layout on purpose.
//
// Block: warp 0 = producer, warps 1..8 = consumers. Dynamic shared memory: NS slots of
// rows_per_chunk rows (pitch KC*2+16 bytes in mode 0, KC*2 in mode 1), then NS full and NS empty
// mbarriers. Chunk `it` uses slot it % NS with parity (it / NS) & 1 on both sides (counted
// incrementally: no division per chunk).
//
// mode_copy 0: one copy of KC*2 bytes per weight row (lane i copies row i), rows padded to KC*2+16
//              bytes in shared memory (conflict-free ldmatrix).
// mode_copy 1: one copy of rows_per_chunk*KC*2 contiguous bytes per chunk (weights as if pre-tiled);
//              rows unpadded, so the consumers XOR-swizzle their 16-byte column within each
//              128-byte segment ((row & 7) << 4) to stay conflict-free: they read the same number
//              of bytes per chunk, only not the "right" ones (the probe's values mean nothing).
// compute 0: consumers only wait/arrive; 1: per chunk and warp KC/128 k-steps of ldmatrix.x4 +
//            one mma.m16n8k16 (batch <= 8, NT = 1); 2: the same with two mmas (NT = 2).
// sink[blockIdx.x * 256 + consumer thread] = the thread's accumulator sum (keeps the MMAs live);
// sink[gridDim.x * 256] = 1 when some mbarrier wait timed out (a probe bug: the host raises).

#define PROBE_CONSUMER_WARPS 8
#define PROBE_CONSUMERS (32 * PROBE_CONSUMER_WARPS)
#define PROBE_THREADS (32 * (1 + PROBE_CONSUMER_WARPS))
#include "probe_ring.cuh"

__device__ __forceinline__ void probe_ldmatrix_x4(unsigned (&a)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr) : "memory");
}

__device__ __forceinline__ void probe_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

extern "C" __global__ void __launch_bounds__(PROBE_THREADS, 1)
    bulk_probe(const unsigned short* __restrict__ src, int K, int rows_total, int KC, int rows_per_chunk, int NS,
               int mode_copy, int compute, int chunks_per_cta, float* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int pitch = KC * 2 + (mode_copy == 0 ? 16 : 0);       // bytes per slot row
  const int slot_bytes = rows_per_chunk * pitch;
  const unsigned ring = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned full0 = ring + NS * slot_bytes;              // NS full, then NS empty mbarriers
  const unsigned empty0 = full0 + 8 * NS;
  float* flag = sink + gridDim.x * PROBE_CONSUMERS;
  if (threadIdx.x == 0) {
    for (int s = 0; s < NS; ++s) {
      probe_mbar_init(full0 + 8 * s, 1);
      probe_mbar_init(empty0 + 8 * s, PROBE_CONSUMERS);       // every consumer thread frees its reads
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int col_chunks = K / KC, row_chunks = rows_total / rows_per_chunk;
  const unsigned short* region = src + (size_t)blockIdx.x * rows_total * K;
  const unsigned chunk_bytes = (unsigned)(rows_per_chunk * KC * 2);

  if (warp == 0) {  // ---- producer ----
    // slot / phase / source position advanced incrementally (no divisions on the issue path)
    int slot = 0, col = 0, rowblk = 0;
    unsigned phase = 0, tile = 0;
    const unsigned tiles = (unsigned)(col_chunks * row_chunks);
    for (int it = 0; it < chunks_per_cta; ++it) {
      const unsigned full = full0 + 8 * slot;
      probe_wait(empty0 + 8 * slot, phase ^ 1, flag);
      if (lane == 0) probe_arrive_expect_tx(full, chunk_bytes);
      __syncwarp();
      const unsigned dst = ring + slot * slot_bytes;
      if (mode_copy == 0) {
        if (lane < rows_per_chunk)
          probe_bulk_g2s(dst + lane * pitch, region + (size_t)(rowblk * rows_per_chunk + lane) * K + col * KC,
                         (unsigned)(KC * 2), full);
      } else if (lane == 0) {
        probe_bulk_g2s(dst, region + (size_t)tile * chunk_bytes / 2, chunk_bytes, full);
      }
      if (++col == col_chunks) {
        col = 0;
        if (++rowblk == row_chunks) rowblk = 0;
      }
      if (++tile == tiles) tile = 0;
      if (++slot == NS) {
        slot = 0;
        phase ^= 1;
      }
    }
    // drain: no copy may be in flight when the CTA exits
    for (int it = chunks_per_cta > NS ? chunks_per_cta - NS : 0; it < chunks_per_cta; ++it)
      probe_wait(full0 + 8 * (it % NS), (it / NS) & 1, flag);
    return;
  }

  // ---- consumers (warps 1..8 as consumer warps 0..7) ----
  const int cw = warp - 1, ct = threadIdx.x - 32;
  const int ksteps = KC >> 7;                                  // KC / 16 / 8 k-steps per warp and chunk
  const int m_tiles = rows_per_chunk >> 4;
  const unsigned swz = mode_copy == 1 ? (unsigned)(lane & 7) << 4 : 0u;
  const unsigned row_off = (unsigned)((lane & 15) * pitch), col_off = (unsigned)((lane >> 4) * 16);
  const unsigned b0 = 0x3f803f80u ^ (unsigned)lane, b1 = 0x3f803f80u ^ (unsigned)ct;  // not constant-folded
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  int slot = 0;
  unsigned phase = 0;
  for (int it = 0; it < chunks_per_cta; ++it) {
    probe_wait(full0 + 8 * slot, phase, flag);
    if (compute != 0) {
      const unsigned sb = ring + slot * slot_bytes + row_off;
      for (int m = 0; m < m_tiles; ++m) {
#pragma unroll 4
        for (int jj = 0; jj < ksteps; ++jj) {
          const unsigned j = (unsigned)(cw + jj * PROBE_CONSUMER_WARPS);
          unsigned a[4];
          probe_ldmatrix_x4(a, sb + m * 16 * pitch + ((j * 32 + col_off) ^ swz));
          probe_mma(acc[0], a, b0, b1);
          if (compute == 2) probe_mma(acc[1], a, b1, b0);
        }
      }
    }
    probe_arrive(empty0 + 8 * slot);
    if (++slot == NS) {
      slot = 0;
      phase ^= 1;
    }
  }
  float s = 0.f;
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s += acc[n][e];
  sink[blockIdx.x * PROBE_CONSUMERS + ct] = s;
}
