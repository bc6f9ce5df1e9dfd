// Consumer probe (bench/wgmma_probe.py): how long do the consumers of one 32 KB weight chunk take, with the
// megakernel's register-fed tensor-core pattern (ldmatrix.x4 + mma.sync, 8 warps) against Hopper's warpgroup MMA
// reading both operands from shared memory (wgmma.mma_async, 2 warpgroups)? The megakernel's chunk loop costs
// 0.35-1.3 us per 32 KB chunk in the H200 phase traces (bench/NOTES.md sessions 23, 24) where the ldmatrix
// floor is ~0.13 us and the copy ~1.0 us per SM: whatever its consumers save is exposed wherever the data is
// already resident (the batch-1 chain, batch 16's chunk work).
//
// One CTA per SM walks its own rows_per_cta x K region of a row-major bf16 matrix W in row blocks of 64 rows,
// each in K / 256 chunks of 64 rows x 256 columns (32 KB), one tensor-map copy per chunk into a ring of NS slots:
// the box (64 columns, 64 rows, 4 column groups) with the 128-byte swizzle lands as [column group][row][128 B],
// which is the K-major 128B-swizzled layout wgmma reads (8-row atoms of 1024 bytes). The consumers compute
// y[n][row] = sum_k W[row][k] x[n][k] for N = WP_N tokens (x staged once in shared memory in the same layout:
// [K / 64][N rows][128 B]) and write y, which the host checks against torch.
//
// Compile-time switches (one RawModule per set, as the megakernel's variants):
//   WP_MODE 0: consumers wait and free each slot only; 1: 8 warps, per chunk warp w takes k-steps w and w + 8 of
//     all 4 M-tiles (ldmatrix.x4 of A + NT mma.m16n8k16 with x fragments from shared memory: the megakernel's
//     pattern); 2: warpgroup g issues 8 wgmma.mma_async.m64nNk16 on column groups 2g, 2g + 1 (A and B by
//     descriptor), one commit group per chunk, the slot freed once the group before it has completed.
//   3: the weights as wgmma's B instead (N = 16 rows: today's 16-row units and MK_W_TMA's chunk of 16 rows x 1024
//     columns, [column group][16 rows][128 B]), x as A from shared memory (M = 64: D rows 0..N-1 are the tokens,
//     the rest read whatever follows x and are dropped); warpgroup g issues 32 wgmma.m64n16k16 on column groups
//     8g..8g+7. 4x the tensor work of mode 2 at N 16 (8x at N 8), no new chunk geometry.
//   4: mode 1's MMAs on mode 3's chunk: one M-tile, warp w takes k-steps w, w + 8, .., w + 56 (8 a chunk, one
//     accumulator chain per n-tile): the megakernel's one-M-tile tasks (qkv_rope, o_proj, down at 1B batch 1).
//   5: mode 3 with x in a compact K-major layout without swizzle, [K / 8][B][16 B] (B = WP_B real tokens), the A
//     descriptor's leading (K-direction) byte offset B * 16: at B < 8 a core matrix's rows past the batch alias the
//     next core matrices (read and dropped). Whether that overlap is legal and what it costs: a megakernel at batch
//     1-7 and large K would need it (the 128B-swizzle layout pads x to 8 rows a column group).
//   WP_N 8 or 16: tokens (the megakernel's NT = 1 / 2).
//   WP_RESIDENT 1: after the first NS chunks the producer only arrives on the full barrier (no copy): the
//     consumers' own rate on resident data (results meaningless, timing only).
//   WP_WARP_ARRIVE 1 (modes 1, 4): one arrive per consumer warp (lane 0 after __syncwarp) instead of one per thread.
//   WP_CW 8 or 16 (modes 0, 1, 4; session 55): consumer warps. With 16, k-step j of a chunk goes to warp j % 16 (half
//     of each warp's k-steps at 8) and the reduction sums 16 partials: does a chunk's time follow the per-warp
//     instruction stream (Hazy's kernel runs 16 consumer warps; the megakernel's 8 are two a scheduler)?
//   WP_CHAINS 1 or 2 (modes 1, 4): a warp's k-steps alternate between that many accumulator chains, summed before
//     the reduction: the MMA chain's dependent latency in isolation (session 8's MK_MT_SPLIT measured it in the kernel).
// Warps 0..WP_CW-1 consume (two warpgroups at 8), warp WP_CW produces. sink[0] = 1 when some mbarrier wait timed
// out, 2 when the dynamic shared memory is not 1024-byte aligned, 3 for a K or rows_per_cta the geometry does not
// allow.
#include "probe_ring.cuh"

#ifndef WP_MODE
#define WP_MODE 2
#endif
#ifndef WP_N
#define WP_N 8
#endif
#ifndef WP_RESIDENT
#define WP_RESIDENT 0
#endif
#ifndef WP_WARP_ARRIVE
#define WP_WARP_ARRIVE 0
#endif
#ifndef WP_B
#define WP_B WP_N   // mode 5: the real tokens (rows of A) of the N-token tile
#endif
#ifndef WP_CW
#define WP_CW 8
#endif
#ifndef WP_CHAINS
#define WP_CHAINS 1
#endif

constexpr int WP_NS = 5;                     // ring slots
#if WP_MODE >= 3
constexpr int WP_ROWS = 16;                  // rows per chunk: today's unit, the wgmma's N
constexpr int WP_KC = 1024;                  // columns per chunk (today's CHUNK_COLS)
#else
constexpr int WP_ROWS = 64;                  // rows per chunk (one wgmma M)
constexpr int WP_KC = 256;                   // columns per chunk
#endif
constexpr int WP_GROUPS = WP_KC / 64;        // 128-byte column groups per chunk
constexpr int WP_GROUP_BYTES = WP_ROWS * 128;
constexpr int WP_CHUNK_BYTES = WP_GROUPS * WP_GROUP_BYTES;
constexpr int WP_NT = WP_N / 8;
constexpr int WP_MTC = WP_ROWS / 16;         // modes 1 / 4: M-tiles a chunk (4 / 1)
constexpr int WP_JJ = WP_KC / 16 / WP_CW;    // modes 1 / 4: k-steps a warp a chunk (2 / 8 at 8 warps)
constexpr int WP_CONSUMERS = 32 * WP_CW;
constexpr int WP_THREADS = WP_CONSUMERS + 32;
constexpr int WP_MAX_K = 1024;               // x staged whole: K / 64 groups of N rows x 128 B
constexpr int WP_X_BYTES = (WP_MAX_K / 64) * 16 * 128;
constexpr int WP_RED_BYTES = 8 * 4 * 2 * 32 * 16;   // mode 1: [warp][M-tile][n-tile][lane] float4
constexpr int WP_SMEM = WP_NS * WP_CHUNK_BYTES + WP_X_BYTES + WP_RED_BYTES + 2 * WP_NS * 8;
static_assert(WP_N == 8 || WP_N == 16, "WP_N: 8 or 16 tokens");
static_assert(WP_CHUNK_BYTES == 32768 && WP_CHUNK_BYTES % 1024 == 0, "1024-byte aligned 32 KB slots");
static_assert(WP_NT * 8 == WP_N && WP_SMEM <= 232448, "an H200's opt-in shared memory per block");
static_assert(WP_MTC * 16 == WP_ROWS && WP_JJ * 16 * WP_CW == WP_KC, "modes 1 / 4: M-tiles and k-steps of a chunk");
static_assert((WP_CW == 8 || WP_CW == 16) && (WP_CW == 8 || WP_MODE == 0 || WP_MODE == 1 || WP_MODE == 4),
              "WP_CW: 8, or 16 with modes 0, 1, 4 (the wgmma modes are two warpgroups)");
static_assert((WP_CHAINS == 1 || WP_CHAINS == 2) && (WP_CHAINS == 1 || WP_MODE == 1 || WP_MODE == 4) &&
              WP_JJ % WP_CHAINS == 0, "WP_CHAINS: 1, or 2 with modes 1 and 4");
// modes 1 / 4: the reduction's [warp][M-tile][n-tile][lane] float4 inside WP_RED_BYTES (mode 1 at 16 tokens and 16
// warps would need 64 KB)
static_assert(WP_CW * WP_MTC * WP_NT * 32 * 16 <= WP_RED_BYTES || (WP_MODE != 1 && WP_MODE != 4),
              "the reduction's partials do not fit WP_RED_BYTES");
static_assert(!WP_WARP_ARRIVE || WP_MODE == 1 || WP_MODE == 4, "WP_WARP_ARRIVE: modes 1 and 4 only");
static_assert(WP_B >= 1 && WP_B <= WP_N && (WP_MODE == 5 || WP_B == WP_N), "WP_B: 1..WP_N, mode 5 only");

// probe_wait, except that once some wait has timed out (sink[0] set) a slow wait returns at once: a broken
// configuration then costs one wait budget (~2 s), not one per chunk and thread.
__device__ __forceinline__ void wp_wait(unsigned addr, unsigned parity, float* sink) {
  if (probe_try_wait(addr, parity)) return;
  if (*reinterpret_cast<volatile float*>(sink) != 0.f) return;
  probe_wait(addr, parity, sink);
}

__device__ __forceinline__ void wp_consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(WP_CONSUMERS) : "memory"); }

__device__ __forceinline__ void wp_tma_3d(unsigned dst, const void* map, int c0, int c1, int c2, unsigned mbar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(mbar) : "memory");
}

__device__ __forceinline__ void wp_ldmatrix_x4(unsigned (&a)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr) : "memory");
}

__device__ __forceinline__ void wp_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of 16-byte unit `u` (0..7) of row `r` in a 128B-swizzled [row][128 B] atom stack (TMA's 128-byte
// swizzle: the unit's index XOR the row's index within its 8-row atom).
__device__ __forceinline__ unsigned wp_swz(int r, int u) { return (unsigned)(r * 128 + ((u ^ (r & 7)) << 4)); }

// wgmma shared-memory matrix descriptor without swizzle (mode 5): K-major core matrices of 8 rows x 16 bytes, lbo
// bytes apart along K, sbo bytes apart along M.
__device__ __forceinline__ unsigned long long wp_desc_ns(unsigned addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32);
}

// wgmma shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row atoms 1024 bytes apart (SBO), the
// leading offset unused for a K extent inside one 128-byte line (1), base offset 0 (atoms 1024-byte aligned).
__device__ __forceinline__ unsigned long long wp_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}

#if WP_MODE >= 2
template <int N>
__device__ __forceinline__ void wp_wgmma(float (&d)[N / 2], unsigned long long da, unsigned long long db) {
  if constexpr (N == 8)
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n\t}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db));
  else
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, "
               "p, 1, 1, 0, 0;\n\t}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "l"(da), "l"(db));
}
__device__ __forceinline__ void wp_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wp_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wp_wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
#endif

__device__ __forceinline__ void wp_free(unsigned empty) {
#if WP_WARP_ARRIVE
  __syncwarp();
  if ((threadIdx.x & 31) == 0) probe_arrive(empty);
#else
  probe_arrive(empty);
#endif
}

extern "C" __global__ void __launch_bounds__(WP_THREADS, 1)
    wgmma_probe(const void* wmap, const unsigned short* __restrict__ x, float* __restrict__ y, int rows_per_cta,
                int K, int rows_total, float* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const unsigned ring = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned xs = ring + WP_NS * WP_CHUNK_BYTES;
  [[maybe_unused]] float* red = reinterpret_cast<float*>(smem + WP_NS * WP_CHUNK_BYTES + WP_X_BYTES);
  const unsigned full0 = xs + WP_X_BYTES + WP_RED_BYTES, empty0 = full0 + 8 * WP_NS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kchunks = K / WP_KC, blocks = rows_per_cta / WP_ROWS, chunks = blocks * kchunks;
  const int row0 = blockIdx.x * rows_per_cta;
  if (ring & 1023u) {   // the 128-byte swizzle's atoms must start 1024-byte aligned: refuse to run
    if (threadIdx.x == 0) sink[0] = 2.f;
    return;
  }
  if (K < WP_KC || K % WP_KC != 0 || K > WP_MAX_K || rows_per_cta % WP_ROWS != 0) {   // the geometry it is written for
    if (threadIdx.x == 0) sink[0] = 3.f;
    return;
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < WP_NS; ++s) {
      probe_mbar_init(full0 + 8 * s, 1);
      probe_mbar_init(empty0 + 8 * s, WP_WARP_ARRIVE ? WP_CW : WP_CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // x into its swizzled layout, by the consumers: 16-byte unit u of (token n, column group g); mode 5: the compact
  // [K / 8][B][16 B] layout of its B real tokens
  for (int i = threadIdx.x; i < WP_N * (K / 8); i += WP_THREADS) {
    const int n = i / (K / 8), k8 = i % (K / 8), g = k8 >> 3, u = k8 & 7;
    const uint4 v = *reinterpret_cast<const uint4*>(x + (size_t)n * K + k8 * 8);
    if (WP_MODE == 5) {
      if (n < WP_B) *reinterpret_cast<uint4*>(smem + WP_NS * WP_CHUNK_BYTES + (k8 * WP_B + n) * 16) = v;
    } else {
      *reinterpret_cast<uint4*>(smem + WP_NS * WP_CHUNK_BYTES + g * WP_N * 128 + wp_swz(n, u)) = v;
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // generic stores -> wgmma's async-proxy reads
  __syncthreads();

  if (warp == WP_CW) {   // ---- producer: one tensor-map copy per chunk ----
    if (lane == 0) {
      asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(wmap) : "memory");
      int slot = 0;
      unsigned phase = 0;
      for (int c = 0; c < chunks; ++c) {
        const unsigned full = full0 + 8 * slot;
        wp_wait(empty0 + 8 * slot, phase ^ 1, sink);
        if (WP_RESIDENT && c >= WP_NS) {
          probe_arrive(full);   // the slot keeps its old chunk
        } else {
          probe_arrive_expect_tx(full, WP_CHUNK_BYTES);
          wp_tma_3d(ring + slot * WP_CHUNK_BYTES, wmap, 0, row0 + (c / kchunks) * WP_ROWS, (c % kchunks) * WP_GROUPS,
                    full);
        }
        if (++slot == WP_NS) {
          slot = 0;
          phase ^= 1;
        }
      }
      // drain: no copy may be in flight when the CTA exits
      for (int c = chunks > WP_NS ? chunks - WP_NS : 0; c < chunks; ++c)
        wp_wait(full0 + 8 * (c % WP_NS), (c / WP_NS) & 1, sink);
    }
    return;
  }

  // ---- consumers ----
  int slot = 0;
  unsigned phase = 0;
#if WP_MODE == 1 || WP_MODE == 4
  float acc[WP_CHAINS][WP_MTC][WP_NT][4];
#elif WP_MODE == 2
  float d[WP_N / 2];
  const int wg = warp >> 2;
  int prev_slot = -1;
#elif WP_MODE == 3 || WP_MODE == 5
  float d[8];
  const int wg = warp >> 2;
  int prev_slot = -1;
#endif
  for (int b = 0; b < blocks; ++b) {
#if WP_MODE == 1 || WP_MODE == 4
#pragma unroll
    for (int m = 0; m < WP_MTC; ++m)
#pragma unroll
      for (int n = 0; n < WP_NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
          for (int ch = 0; ch < WP_CHAINS; ++ch) acc[ch][m][n][e] = 0.f;
#elif WP_MODE == 2
#pragma unroll
    for (int e = 0; e < WP_N / 2; ++e) d[e] = 0.f;
#elif WP_MODE == 3 || WP_MODE == 5
#pragma unroll
    for (int e = 0; e < 8; ++e) d[e] = 0.f;
#endif
    for (int kc = 0; kc < kchunks; ++kc) {
      [[maybe_unused]] const unsigned sb = ring + slot * WP_CHUNK_BYTES;
      wp_wait(full0 + 8 * slot, phase, sink);
#if WP_MODE == 1 || WP_MODE == 4
#pragma unroll
      for (int jj = 0; jj < WP_JJ; ++jj) {
        const int j = warp + WP_CW * jj, g = j >> 2, u = (j & 3) * 2;   // k-step j: column group g, units u, u + 1
        unsigned bx[WP_NT][2];
        const int kg = kc * WP_GROUPS + g;                          // x's column group
#pragma unroll
        for (int n = 0; n < WP_NT; ++n) {
          const int tok = n * 8 + (lane >> 2);
          const unsigned base = xs + kg * WP_N * 128 + (lane & 3) * 4;
          asm volatile("ld.shared.b32 %0, [%1];" : "=r"(bx[n][0]) : "r"(base + wp_swz(tok, u)));
          asm volatile("ld.shared.b32 %0, [%1];" : "=r"(bx[n][1]) : "r"(base + wp_swz(tok, u + 1)));
        }
#pragma unroll
        for (int m = 0; m < WP_MTC; ++m) {
          const int r = m * 16 + (lane & 15);
          unsigned a[4];
          wp_ldmatrix_x4(a, sb + g * WP_GROUP_BYTES + wp_swz(r, u + (lane >> 4)));
#pragma unroll
          for (int n = 0; n < WP_NT; ++n) wp_mma(acc[jj % WP_CHAINS][m][n], a, bx[n][0], bx[n][1]);
        }
      }
      wp_free(empty0 + 8 * slot);
#elif WP_MODE == 2
      wp_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        const int g = 2 * wg + (kk >> 2), kg = kc * WP_GROUPS + g;
        wp_wgmma<WP_N>(d, wp_desc(sb + g * WP_GROUP_BYTES + (kk & 3) * 32),
                       wp_desc(xs + kg * WP_N * 128 + (kk & 3) * 32));
      }
      wp_wgmma_commit();
      wp_wgmma_wait<1>();   // the group before this one has read its slot
      if (prev_slot >= 0) probe_arrive(empty0 + 8 * prev_slot);
      prev_slot = slot;
#elif WP_MODE == 3 || WP_MODE == 5
      wp_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 32; ++kk) {
        const int g = 8 * wg + (kk >> 2), kg = kc * WP_GROUPS + g;
        const unsigned long long da = WP_MODE == 5
            ? wp_desc_ns(xs + (kg * 8 + (kk & 3) * 2) * WP_B * 16, WP_B * 16, 128)   // 16 columns = 2 core matrices
            : wp_desc(xs + kg * WP_N * 128 + (kk & 3) * 32);
        wp_wgmma<16>(d, da, wp_desc(sb + g * WP_GROUP_BYTES + (kk & 3) * 32));
      }
      wp_wgmma_commit();
      wp_wgmma_wait<1>();
      if (prev_slot >= 0) probe_arrive(empty0 + 8 * prev_slot);
      prev_slot = slot;
#else
      probe_arrive(empty0 + 8 * slot);
#endif
      if (++slot == WP_NS) {
        slot = 0;
        phase ^= 1;
      }
    }
    [[maybe_unused]] const int rb = row0 + b * WP_ROWS;
#if WP_MODE == 1 || WP_MODE == 4
    // the warps' partial sums through shared memory (a warp's chains summed first); warp w < MTC * NT then owns
    // tile (m, n) = (w / NT, w % NT)
#pragma unroll
    for (int m = 0; m < WP_MTC; ++m)
#pragma unroll
      for (int n = 0; n < WP_NT; ++n) {
#pragma unroll
        for (int ch = 1; ch < WP_CHAINS; ++ch)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[0][m][n][e] += acc[ch][m][n][e];
        reinterpret_cast<float4*>(red)[((warp * WP_MTC + m) * WP_NT + n) * 32 + lane] =
            make_float4(acc[0][m][n][0], acc[0][m][n][1], acc[0][m][n][2], acc[0][m][n][3]);
      }
    wp_consumer_sync();
    if (warp < WP_MTC * WP_NT) {
      const int m = warp / WP_NT, n = warp % WP_NT;
      float v[4] = {0.f, 0.f, 0.f, 0.f};
      for (int w = 0; w < WP_CW; ++w) {
        const float4 t = reinterpret_cast<const float4*>(red)[((w * WP_MTC + m) * WP_NT + n) * 32 + lane];
        v[0] += t.x; v[1] += t.y; v[2] += t.z; v[3] += t.w;
      }
      const int r = rb + m * 16 + (lane >> 2), tok = n * 8 + (lane & 3) * 2;
      y[(size_t)tok * rows_total + r] = v[0];
      y[(size_t)(tok + 1) * rows_total + r] = v[1];
      y[(size_t)tok * rows_total + r + 8] = v[2];
      y[(size_t)(tok + 1) * rows_total + r + 8] = v[3];
    }
    wp_consumer_sync();
#elif WP_MODE == 2
    wp_wgmma_wait<0>();
    probe_arrive(empty0 + 8 * prev_slot);
    prev_slot = -1;
    // D of m64nN: warp w % 4 of the group holds rows 16 (w % 4) + lane / 4 (+ 8), n-tile j's columns
    // 8 j + 2 (lane % 4) (+ 1) in d[4 j .. 4 j + 3]; warpgroup 1 hands its sums to warpgroup 0
    const int r = (warp & 3) * 16 + (lane >> 2);
    if (wg == 1) {
#pragma unroll
      for (int e = 0; e < WP_N / 2; ++e) red[e * 128 + (threadIdx.x & 127)] = d[e];
    }
    wp_consumer_sync();
    if (wg == 0) {
#pragma unroll
      for (int j = 0; j < WP_NT; ++j) {
        const int tok = 8 * j + (lane & 3) * 2;
        const float* o = red + 4 * j * 128 + threadIdx.x;
        y[(size_t)tok * rows_total + rb + r] = d[4 * j] + o[0];
        y[(size_t)(tok + 1) * rows_total + rb + r] = d[4 * j + 1] + o[128];
        y[(size_t)tok * rows_total + rb + r + 8] = d[4 * j + 2] + o[256];
        y[(size_t)(tok + 1) * rows_total + rb + r + 8] = d[4 * j + 3] + o[384];
      }
    }
    wp_consumer_sync();
#elif WP_MODE == 3 || WP_MODE == 5
    wp_wgmma_wait<0>();
    probe_arrive(empty0 + 8 * prev_slot);
    prev_slot = -1;
    // D of m64n16: the first warp of each group holds rows 0..15 (tokens lane / 4, + 8), columns (weight rows)
    // 8 j + 2 (lane % 4) (+ 1) in d[4 j .. 4 j + 3]; warp 4 hands its sums to warp 0
    if (warp == 4) {
#pragma unroll
      for (int e = 0; e < 8; ++e) red[e * 32 + lane] = d[e];
    }
    wp_consumer_sync();
    if (warp == 0) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int tok = lane >> 2, wr = rb + 8 * j + (lane & 3) * 2;
#pragma unroll
        for (int h = 0; h < 2; ++h) {   // tokens tok, tok + 8
          if (tok + 8 * h < WP_B) {
            y[(size_t)(tok + 8 * h) * rows_total + wr] = d[4 * j + 2 * h] + red[(4 * j + 2 * h) * 32 + lane];
            y[(size_t)(tok + 8 * h) * rows_total + wr + 1] = d[4 * j + 2 * h + 1] + red[(4 * j + 2 * h + 1) * 32 + lane];
          }
        }
      }
    }
    wp_consumer_sync();
#endif
  }
}
