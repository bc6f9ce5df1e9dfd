// Synchronisation primitives of the megakernel: inter-SM counters, the consumer barrier, mbarriers.
//
// Memory-ordering contract (PTX memory model):
// - A task's consumer threads store their outputs with ordinary st.global, then all of them pass
//   consumer_sync() (bar.sync: CTA-scope ordering), then ONE thread does red.release.gpu on the
//   task's counter. Release is cumulative, so every store ordered before it by the barrier is
//   visible to any thread that observes the new counter value with an acquire at gpu scope.
// - A waiting task: one thread spins with ld.acquire.gpu until counter >= target, then the
//   consumers pass consumer_sync_or() (bar.red: the same ordering as bar.sync, and it carries the
//   watchdog's stop decision) and read the producers' data. Data written during this launch
//   is read with ld.global.cg (L2), never the non-coherent/L1 path, so no stale L1 line is used.
// - No fence.proxy.async is needed: the async proxy (cp.async.bulk) only reads the weights, which
//   nothing writes during the launch, and only writes shared-memory slots whose previous readers
//   released them through the slot's `empty` mbarrier (arrive has release semantics, the producer's
//   wait acquire semantics).
#pragma once

namespace mk {

// Watchdog: every wait below is bounded by a budget (kernel parameter watchdog_ms). The slow paths
// return a WaitStatus instead of spinning forever; the caller records the failure in the error
// record (common.cuh: watchdog_record) and leaves its loop, so the launch ends and the host reads
// the record (MegakernelHang). Fast paths are unchanged: one load / one try_wait.
enum WaitStatus : int { WAIT_OK = 0, WAIT_ABORTED = 1, WAIT_TIMEOUT = 2 };

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// The error record's code word, read without caching (another SM may have set it).
__device__ __forceinline__ int ld_relaxed_gpu_s32(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void red_release_gpu_add(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Ticket of a merge-in-partial attention task: the CTA's stores (ordered before this by a consumer_sync)
// are released with it, and the partials other CTAs released before it are acquired.
__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ unsigned ld_relaxed_gpu_u32(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Slow path of a counter wait (the caller has read *p once and found it < target): poll until
// *p >= target. The first SPIN_POLLS polls are back to back, relaxed loads (an acquire invalidates
// L1 on every poll); then __nanosleep(256) between polls. The acquire is done once, on success. A
// hand-off on the critical path is usually seen within a few polls; the sleeping tail only spares
// L2 from SMs that wait long (a whole op). WAIT_ABORTED as soon as *err != 0 (a wait somewhere in
// this launch has failed: nothing here can finish), WAIT_TIMEOUT after budget_ns (both checked every
// 16 polls). v: the last value read; waited_ns: time spent here.
constexpr unsigned SPIN_POLLS = 4096;  // sleeping from the first poll measured +16 us (1B batch 1, NOTES session 5)

__device__ __forceinline__ int counter_wait_slow(const unsigned* p, unsigned target, const int* err,
                                                 unsigned long long budget_ns, unsigned& v,
                                                 unsigned long long& waited_ns) {
  const unsigned long long t0 = global_ns();
  for (unsigned polls = 1;; ++polls) {
    if (polls > SPIN_POLLS) __nanosleep(256);
    // The spinning polls are acquires themselves, so the poll that sees the target is the acquire: no
    // second L2 round trip between seeing a hand-off and starting on it (session 9: -18 / -21 us at 1B /
    // 8B batch 1). The sleeping polls stay relaxed, with one acquire when they see the target.
    const bool acq = polls <= SPIN_POLLS;
    v = acq ? ld_acquire_gpu(p) : ld_relaxed_gpu_u32(p);
    if (v >= target) {
      if (!acq) v = ld_acquire_gpu(p);  // orders this CTA's later reads after the signallers' releases
      return WAIT_OK;
    }
    if ((polls & 15) == 0) {
      waited_ns = global_ns() - t0;
      if (ld_relaxed_gpu_s32(err) != 0) return WAIT_ABORTED;
      if (waited_ns > budget_ns) return WAIT_TIMEOUT;
    }
  }
}

// Barrier 1 among the consumer warps only (the producer warp never joins it; barrier 0 is
// __syncthreads, used once at start-up).
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMER_THREADS) : "memory");
}

// consumer_sync() that also ORs `pred` over the consumer threads (bar.red.or: same barrier, same
// memory ordering as bar.sync), so one thread's decision reaches all of them in the same barrier.
__device__ __forceinline__ bool consumer_sync_or(int pred) {
  int r;
  asm volatile("{\n\t.reg .pred p, q;\n\tsetp.ne.s32 p, %1, 0;\n\tbar.red.or.pred q, 1, %2, p;\n\t"
               "selp.s32 %0, 1, 0, q;\n\t}"
               : "=r"(r) : "r"(pred), "n"(CONSUMER_THREADS) : "memory");
  return r != 0;
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

// Slow path of an mbarrier wait (the caller's try_wait failed): until the phase of parity `parity`
// has completed. WAIT_ABORTED as soon as *flag != 0 (flag: this CTA's abort word in shared memory,
// or null), WAIT_TIMEOUT after budget_ns.
__device__ __forceinline__ int mbar_wait_slow(unsigned addr, unsigned parity, const volatile int* flag,
                                              unsigned long long budget_ns, unsigned long long& waited_ns) {
  const unsigned long long t0 = global_ns();
  while (!mbar_try_wait(addr, parity)) {
    waited_ns = global_ns() - t0;
    if (flag != nullptr && *flag != 0) return WAIT_ABORTED;
    if (waited_ns > budget_ns) return WAIT_TIMEOUT;
  }
  return WAIT_OK;
}

}  // namespace mk
