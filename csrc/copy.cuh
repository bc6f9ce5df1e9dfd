// Data movement: bulk async copies global -> shared (weights), cache-coherent loads of data
// produced during the launch (ld.global.cg), read-only loads of immutable inputs (ld.global.nc).
#pragma once

namespace mk {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// The weight copies (and only they: not the ring-fed attention's K/V) carry an L2 evict-first policy, so the ~2 GB a
// 1B step streams through L2 once evict each other before the lines the step reads again (the cached tokens' K/V,
// norm weights, RoPE table, block table). Without a hint every weight line entered L2 evict-normal and those were
// re-read from HBM every step, on the chain's critical path (attention's K/V round trip, the norm-fused ops' stage).
// Session 42's A/B (MK_EVICT_FIRST, H100, bitwise the same step): -1.2..-2.3% at 1B batch 1, -3..-4.5% at 1B batch 4 /
// 8 / 16, -1.6% at 1B ctx 4096, -1.8..-2.2% at 8B batch 1 / 8 / 16 (bench/NOTES.md). HazyResearch's kernel marks
// weights EVICT_FIRST the same way.
__device__ __forceinline__ unsigned long long l2_evict_first_policy() {
  unsigned long long p;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

// One bulk copy of weight bytes (`bytes` a multiple of 16; both addresses 16-byte aligned), evict-first in L2,
// completing on the mbarrier at `mbar` (its tx-count must have been raised by the same number of bytes).
__device__ __forceinline__ void bulk_g2s_w(unsigned dst, const void* src, unsigned bytes, unsigned mbar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(mbar), "l"(l2_evict_first_policy()) : "memory");
}

// Tensor-map copies (cp.async.bulk.tensor, 3-D / 4-D box at coordinates {0, c1, c2[, c3]}) completing on the
// mbarrier at `mbar`, and the acquire that orders a thread's use of a map the host wrote before the launch
// (generic proxy). Used by MK_ATT_TMA (attention_tma.cuh) and MK_W_TMA (weight_tma.cuh).
__device__ __forceinline__ void tensormap_acquire(const void* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(map) : "memory");
}

__device__ __forceinline__ void tma_3d_g2s(unsigned dst, const void* map, int c1, int c2, unsigned mbar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"(map), "r"(0), "r"(c1), "r"(c2), "r"(mbar) : "memory");
}

__device__ __forceinline__ void tma_4d_g2s(unsigned dst, const void* map, int c1, int c2, int c3, unsigned mbar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];" ::"r"(dst), "l"(map), "r"(0), "r"(c1), "r"(c2), "r"(c3), "r"(mbar) : "memory");
}

// Weight tensor-map copies: the same, evict-first in L2
__device__ __forceinline__ void tma_3d_g2s_w(unsigned dst, const void* map, int c1, int c2, unsigned mbar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1, {%2, %3, %4}], [%5], %6;"
      ::"r"(dst), "l"(map), "r"(0), "r"(c1), "r"(c2), "r"(mbar), "l"(l2_evict_first_policy()) : "memory");
}

__device__ __forceinline__ void tma_4d_g2s_w(unsigned dst, const void* map, int c1, int c2, int c3, unsigned mbar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1, {%2, %3, %4, %5}], [%6], %7;"
      ::"r"(dst), "l"(map), "r"(0), "r"(c1), "r"(c2), "r"(c3), "r"(mbar), "l"(l2_evict_first_policy()) : "memory");
}

// 16-byte asynchronous copy global -> shared through L2 (cp.async.cg: generic proxy, so ordinary
// acquire/barrier ordering covers data written during the launch), completed by cp_async_wait_all.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Until at most N of this thread's committed groups are still in flight (the older ones have landed).
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// L2-coherent loads (ld.global.cg) as compiler intrinsics, not volatile asm: the compiler may
// batch independent loads (several in flight), yet never moves them across consumer_sync() or the
// counter acquire (asm volatile with a "memory" clobber).
__device__ __forceinline__ unsigned ld_cg_u32(const void* p) { return __ldcg(reinterpret_cast<const unsigned*>(p)); }

__device__ __forceinline__ unsigned short ld_cg_u16(const void* p) {
  return __ldcg(reinterpret_cast<const unsigned short*>(p));
}

__device__ __forceinline__ float ld_cg_f32(const float* p) { return __ldcg(p); }

__device__ __forceinline__ uint4 ld_cg_v4(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ unsigned ld_nc_u32(const void* p) {
  unsigned v;
  asm("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ unsigned short ld_nc_u16(const void* p) {
  unsigned short v;
  asm("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ int ld_nc_s32(const int* p) {
  int v;
  asm("ld.global.nc.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ long long ld_nc_s64(const long long* p) {
  long long v;
  asm("ld.global.nc.s64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ void st_f32(float* p, float v) {
  asm volatile("st.global.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

}  // namespace mk
