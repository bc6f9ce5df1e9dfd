// Synchronisation primitives of the megakernel: inter-SM counters, the consumer barrier, mbarriers.
//
// Memory-ordering contract (PTX memory model):
// - A task's consumer threads store their outputs with ordinary st.global, then all of them pass
//   consumer_sync() (bar.sync: CTA-scope ordering), then ONE thread does red.release.gpu on the
//   task's counter. Release is cumulative, so every store ordered before it by the barrier is
//   visible to any thread that observes the new counter value with an acquire at gpu scope.
// - A waiting task: one thread spins with ld.acquire.gpu until counter >= target, then the
//   consumers pass consumer_sync() and read the producers' data. Data written during this launch
//   is read with ld.global.cg (L2), never the non-coherent/L1 path, so no stale L1 line is used.
// - No fence.proxy.async is needed: the async proxy (cp.async.bulk) only reads the weights, which
//   nothing writes during the launch, and only writes shared-memory slots whose previous readers
//   released them through the slot's `empty` mbarrier (arrive has release semantics, the producer's
//   wait acquire semantics).
#pragma once

namespace mk {

// Watchdog: a wait longer than this means the program deadlocked (or an SM was not co-resident).
// The waiting thread prints what it waited for and traps, turning a hang into a launch error.
#ifndef MK_WATCHDOG_NS
#define MK_WATCHDOG_NS 5000000000ull
#endif

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __noinline__ void watchdog_fire(const char* what, int a, int b, int c) {
  printf("mk_decode watchdog: block %d thread %d stuck in %s (%d, %d, %d)\n", (int)blockIdx.x, (int)threadIdx.x,
         what, a, b, c);
  __trap();
}

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void red_release_gpu_add(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Spin until *p >= target, backing off with __nanosleep (32 ns doubling to 256 ns). `ctr` is the
// counter id, only for the watchdog's message.
__device__ __forceinline__ unsigned wait_counter_geq(const unsigned* p, unsigned target, int ctr) {
  unsigned v = ld_acquire_gpu(p);
  if (v >= target) return v;
  unsigned ns = 32;
  const unsigned long long t0 = global_ns();
  while (v < target) {
    __nanosleep(ns);
    ns = ns < 256 ? ns * 2 : 256;
    v = ld_acquire_gpu(p);
    if (global_ns() - t0 > MK_WATCHDOG_NS) watchdog_fire("counter wait (ctr, target, value)", ctr, (int)target, (int)v);
  }
  return v;
}

// Barrier 1 among the consumer warps only (the producer warp never joins it; barrier 0 is
// __syncthreads, used once at start-up).
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMER_THREADS) : "memory");
}

// ---- mbarriers (shared::cta addresses as 32-bit) -------------------------------------------
__device__ __forceinline__ void mbar_init(unsigned addr, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(addr), "r"(count) : "memory");
}

__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned addr, unsigned bytes) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n\t}"
               ::"r"(addr), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned addr) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared::cta.b64 st, [%0];\n\t}" ::"r"(addr) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(unsigned addr, unsigned parity) {
  unsigned ok;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(ok) : "r"(addr), "r"(parity) : "memory");
  return ok != 0;
}

// Wait until the phase of parity `parity` has completed. `tag` names the barrier for the watchdog.
__device__ __forceinline__ void mbar_wait(unsigned addr, unsigned parity, int tag) {
  if (mbar_try_wait(addr, parity)) return;
  const unsigned long long t0 = global_ns();
  while (!mbar_try_wait(addr, parity)) {
    if (global_ns() - t0 > MK_WATCHDOG_NS) watchdog_fire("mbarrier wait (tag, parity, -)", tag, (int)parity, 0);
  }
}

}  // namespace mk
