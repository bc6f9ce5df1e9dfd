// Ring primitives shared by the probes (bench/bulk_probe.cu, bench/release_probe.cu): globaltimer, mbarriers,
// cp.async.bulk global -> shared. Independent of csrc/ on purpose (a probe must not change when the kernel
// does); the probes' build_source() inlines this file (bench/common.inline_includes).
#pragma once
#define PROBE_WAIT_BUDGET_NS 2000000000ull

__device__ __forceinline__ unsigned long long probe_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void probe_mbar_init(unsigned addr, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(addr), "r"(count) : "memory");
}

__device__ __forceinline__ void probe_arrive_expect_tx(unsigned addr, unsigned bytes) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n\t}"
               ::"r"(addr), "r"(bytes) : "memory");
}

__device__ __forceinline__ void probe_arrive(unsigned addr) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared::cta.b64 st, [%0];\n\t}" ::"r"(addr) : "memory");
}

__device__ __forceinline__ bool probe_try_wait(unsigned addr, unsigned parity) {
  unsigned ok;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(ok) : "r"(addr), "r"(parity) : "memory");
  return ok != 0;
}

// Fast path: one try_wait. Slow path bounded by PROBE_WAIT_BUDGET_NS (then sets *flag = 1 and returns, so a
// broken configuration ends the launch instead of hanging the GPU; the host raises on the flag).
template <class T>
__device__ __forceinline__ void probe_wait(unsigned addr, unsigned parity, T* flag) {
  if (probe_try_wait(addr, parity)) return;
  const unsigned long long t0 = probe_ns();
  while (!probe_try_wait(addr, parity)) {
    if (probe_ns() - t0 > PROBE_WAIT_BUDGET_NS) {
      *flag = T(1);
      return;
    }
  }
}

__device__ __forceinline__ void probe_bulk_g2s(unsigned dst, const void* src, unsigned bytes, unsigned mbar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(mbar) : "memory");
}

