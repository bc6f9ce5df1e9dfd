// Cluster probe (bench/cluster_probe.py): what does a hand-off between the two CTAs of a thread-block cluster cost
// while the SMs stream weights, through distributed shared memory instead of L2 and a gpu-scope release?
//
// The megakernel's hand-off (payload stores, red.release.gpu = MEMBAR.ALL.GPU, the reader's ld.acquire.gpu poll and
// its loads) costs ~1.2-1.9 us idle and 15-25 us while the SMs stream 32 KB chunks (bench/release_probe.py): the
// fence drains this SM's copies and queues behind everyone's (session 40: a co-resident CTA's copies cost half of
// what its own do). A cluster's CTAs reach each other's shared memory over the SM-to-SM network, not through L2, and
// Hopper's st.async signals the reader's mbarrier with the bytes it delivered: no fence at all. If that hand-off stays
// near its idle cost under streaming, a chain op whose consumers sit in the producer's cluster (attention of a KV
// group after the group's qkv rows, its chunks' merge) can drop its gpu-scope release. Independent of csrc/.
//
// Grid: one CTA per SM, clusters of 2 (compile-time __cluster_dims__), CTAs 0 and 1 are cluster 0's ranks 0 and 1.
// Warp 0 = producer: with `stream` 1 (every CTA) or 2 (all but CTAs 0 and 1) it streams `chunks` chunks of 32 KB (16
// cp.async.bulk of 2 KB, the megakernel's per-row pattern) from its region of `src` into a 6-slot ring; warp 1 frees
// each slot once full (HBM-bound, like gate_up's phase). Warp 2 of CTAs 0 and 1 plays ping-pong, `iters` rounds of
// a `words`-word payload carrying the round number (mismatches counted, never hidden):
//
// mode 0: payload st.global, __syncwarp, lane 0 red.release.gpu.global.add; the reader polls ld.acquire.gpu and
//         loads the payload ld.relaxed.gpu (the megakernel's form; release_probe's mode 0 / 7)
// mode 1: mode 0 at cluster scope: red.release.cluster / ld.acquire.cluster (valid: both threads are in the cluster)
// mode 2: payload st.shared::cluster into the reader's shared memory, __syncwarp, lane 0
//         mbarrier.arrive.release.cluster on the reader's mbarrier; the reader waits on it (try_wait.acquire.cluster)
//         and reads its own shared memory
// mode 3: payload st.async (16 bytes a store) into the reader's shared memory, each store completing its bytes on
//         the reader's mbarrier (complete_tx); the reader arms its mbarrier with arrive.expect_tx(bytes) and waits:
//         no fence and no flag
// mode 4: payload written to this CTA's stage (generic stores, fence.proxy.async.shared::cta), then one
//         cp.async.bulk shared::cta -> shared::cluster into the reader's shared memory, completing on the reader's
//         mbarrier (the TMA unit's path, which the SM's weight copies also take); the reader as in mode 3
//
// SASS (nvcc 13.0, sm_90a, checked with Triton's cuobjdump): red.release.cluster and
// mbarrier.arrive.release.cluster both compile to MEMBAR.ALL.CTA + MEMBAR.ALL.GPU + ERRBAR + CGAERRBAR before the
// RED / SYNCS.ARRIVE, as red.release.gpu does: modes 1 and 2 keep the fence. st.async is STAS.128 with no fence.
//
// out[0] = CTA 0's ns for all rounds, out[1] = payload mismatches, out[2] = CTA 0's end time, out[3] = the earliest
// producer end (atomicMin; the host sets ~0: the streaming must outlast the ping-pong), out[4] = 1 when a wait timed
// out, out[5] / out[6] = the earliest producer start / the latest producer end (the streaming rate).

#define CP_THREADS 96
#define CP_NS 6
#define CP_SLOT 32768u
#define CP_COPY 2048u
#define CP_WORDS_MAX 1024   // the payload buffer and mode 4's stage in shared memory (4 KB each: a batch-1
                            // activation of Llama-3.2-1B)
#include "probe_ring.cuh"

__device__ __forceinline__ unsigned cp_ld_acquire(const unsigned* p, bool cluster) {
  unsigned v;
  if (cluster)
    asm volatile("ld.acquire.cluster.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned cp_ld_relaxed(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned cp_ld_shared(unsigned addr) {
  unsigned v;
  asm volatile("ld.volatile.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// The partner CTA's (cluster rank `rank`) address of this CTA's shared-memory address `addr`.
__device__ __forceinline__ unsigned cp_mapa(unsigned addr, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}

__device__ __forceinline__ bool cp_try_wait_cluster(unsigned addr, unsigned parity) {
  unsigned ok;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(ok) : "r"(addr), "r"(parity) : "memory");
  return ok != 0;
}

__device__ __forceinline__ void cp_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// One side's release of round value v into the reader: payload (`words` words = v), then the signal.
__device__ __forceinline__ void cp_release(int mode, int words, unsigned* gpayload, unsigned* gflag,
                                           unsigned rpayload, unsigned rbar, unsigned stage, unsigned v, int lane) {
  if (mode <= 1) {
    for (int i = lane; i < words; i += 32) gpayload[i] = v;
    __syncwarp();
    if (lane == 0) {
      if (mode == 0)
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(gflag) : "memory");
      else
        asm volatile("red.release.cluster.global.add.u32 [%0], 1;" ::"l"(gflag) : "memory");
    }
  } else if (mode == 2) {
    for (int i = lane; i < words; i += 32)
      asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(rpayload + 4u * i), "r"(v) : "memory");
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(rbar) : "memory");
  } else if (mode == 3) {
    for (int i = lane; i < words / 4; i += 32)
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %1, %1, %1}, [%2];"
                   ::"r"(rpayload + 16u * i), "r"(v), "r"(rbar) : "memory");
  } else {
    for (int i = lane; i < words; i += 32) asm volatile("st.shared.u32 [%0], %1;" ::"r"(stage + 4u * i), "r"(v) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // generic writes -> the bulk copy's reads
    __syncwarp();
    if (lane == 0)
      asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(rpayload), "r"(stage), "r"(4u * (unsigned)words), "r"(rbar) : "memory");
  }
  __syncwarp();
}

// Wait for round value v (flag >= target in modes 0 / 1; the receive mbarrier's phase `parity` in modes 2 / 3), then
// count the payload's words != v (whole warp; every lane gets the total).
__device__ __forceinline__ unsigned cp_take(int mode, int words, const unsigned* gpayload, const unsigned* gflag,
                                            unsigned target, unsigned lpayload, unsigned lbar, unsigned parity,
                                            unsigned v, int lane, unsigned long long* out) {
  if (lane == 0) {
    const unsigned long long t0 = probe_ns();
    if (mode >= 3) probe_arrive_expect_tx(lbar, 4u * (unsigned)words);   // this round's bytes, and the arrival
    for (;;) {
      const bool ok = mode <= 1 ? cp_ld_acquire(gflag, mode == 1) >= target : cp_try_wait_cluster(lbar, parity);
      if (ok) break;
      if (probe_ns() - t0 > PROBE_WAIT_BUDGET_NS) {
        out[4] = 1;
        break;
      }
    }
  }
  __syncwarp();
  unsigned bad = 0;
  for (int i = lane; i < words; i += 32)
    bad += (mode <= 1 ? cp_ld_relaxed(gpayload + i) : cp_ld_shared(lpayload + 4u * i)) != v;
  for (int o = 16; o; o >>= 1) bad += __shfl_xor_sync(0xffffffffu, bad, o);
  return bad;
}

// Warps 0 and 1 of a streaming CTA (n chunks): the producer streams 32 KB chunks of its region into the ring, warp 1
// frees each slot once full. Returns whether this warp was one of them (the caller's other warps do the hand-offs).
__device__ __forceinline__ bool cp_stream_warps(int warp, int lane, int n, unsigned ring, unsigned full0,
                                                unsigned empty0, const unsigned char* region, long long region_bytes,
                                                unsigned long long* out) {
  if (warp == 0) {  // producer
    long long off = 0;
    if (lane == 0 && n > 0) atomicMin(out + 5, probe_ns());
    for (int it = 0; it < n; ++it) {
      const int slot = it % CP_NS;
      probe_wait(empty0 + 8 * slot, ((unsigned)(it / CP_NS) & 1u) ^ 1u, out);
      if (lane == 0) probe_arrive_expect_tx(full0 + 8 * slot, CP_SLOT);
      __syncwarp();
      if (lane < (int)(CP_SLOT / CP_COPY))
        probe_bulk_g2s(ring + slot * CP_SLOT + lane * CP_COPY, region + off + lane * CP_COPY, CP_COPY, full0 + 8 * slot);
      off += CP_SLOT;
      if (off + CP_SLOT > region_bytes) off = 0;
    }
    for (int it = n > CP_NS ? n - CP_NS : 0; it < n; ++it) probe_wait(full0 + 8 * (it % CP_NS), (unsigned)(it / CP_NS) & 1u, out);
    if (lane == 0 && n > 0) {
      const unsigned long long t_end = probe_ns();
      atomicMin(out + 3, t_end);
      atomicMax(out + 6, t_end);
    }
    return true;
  }
  if (warp == 1) {  // frees each slot once full
    for (int it = 0; it < n; ++it) {
      probe_wait(full0 + 8 * (it % CP_NS), (unsigned)(it / CP_NS) & 1u, out);
      probe_arrive(empty0 + 8 * (it % CP_NS));
    }
    return true;
  }
  return false;
}

// The shared-memory layout of both hand-off kernels (SMEM_BYTES in cluster_probe.py): the ring, its full / empty
// mbarriers, two receive mbarriers (16 bytes; the ping-pong uses the first), then 8 KB of hand-off buffers (the
// ping-pong's payload and mode 4's stage; the all-gather's two 8-slice buffers). Thread 0 initialises the mbarriers
// (a receive mbarrier takes one arrival a phase), then the cluster syncs: every peer's mbarriers exist before any
// remote arrival.
struct CpLayout {
  unsigned ring, full0, empty0, rbar0, buf0;
};
__device__ __forceinline__ CpLayout cp_setup(const unsigned char* smem) {
  CpLayout L;
  L.ring = (unsigned)__cvta_generic_to_shared(smem);
  L.full0 = L.ring + CP_NS * CP_SLOT;
  L.empty0 = L.full0 + 8 * CP_NS;
  L.rbar0 = L.empty0 + 8 * CP_NS;
  L.buf0 = L.rbar0 + 16;
  if (threadIdx.x == 0) {
    for (int s = 0; s < CP_NS; ++s) {
      probe_mbar_init(L.full0 + 8 * s, 1);
      probe_mbar_init(L.empty0 + 8 * s, 32);
    }
    probe_mbar_init(L.rbar0, 1);
    probe_mbar_init(L.rbar0 + 8, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cp_cluster_sync();
  return L;
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(CP_THREADS, 1)
    cluster_probe(const unsigned short* __restrict__ src, long long region_bytes, int stream, int mode, int words,
                  int iters, int chunks, unsigned* flags, unsigned* payloads, unsigned long long* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  const CpLayout L = cp_setup(smem);
  const unsigned ring = L.ring, full0 = L.full0, empty0 = L.empty0, rbar_l = L.rbar0;
  const unsigned payload_l = L.buf0, stage_l = payload_l + 4 * CP_WORDS_MAX;   // the payload buffer, mode 4's stage
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned char* region = reinterpret_cast<const unsigned char*>(src) + (size_t)blockIdx.x * region_bytes;
  const bool pp = blockIdx.x < 2;
  const int n = (stream == 1 || (stream == 2 && !pp)) ? chunks : 0;
  if (cp_stream_warps(warp, lane, n, ring, full0, empty0, region, region_bytes, out)) {
  } else if (pp) {  // ping-pong between cluster ranks 0 and 1
    const int me = blockIdx.x, other = 1 - me;
    unsigned* mine = payloads + me * CP_WORDS_MAX;
    const unsigned* theirs = payloads + other * CP_WORDS_MAX;
    const unsigned rpayload = cp_mapa(payload_l, (unsigned)other), rbar = cp_mapa(rbar_l, (unsigned)other);
    unsigned bad = 0;
    const unsigned long long w0 = probe_ns();
    while (stream && probe_ns() - w0 < 20000ull) {   // the streaming's steady state first (the ring fills in ~6 us)
    }
    const unsigned long long t0 = probe_ns();
    for (int i = 0; i < iters; ++i) {
      const unsigned v0 = 2u * i + 1u, v1 = 2u * i + 2u, parity = (unsigned)i & 1u;
      if (me == 0) {
        cp_release(mode, words, mine, flags + 0, rpayload, rbar, stage_l, v0, lane);
        bad += cp_take(mode, words, theirs, flags + 1, (unsigned)i + 1u, payload_l, rbar_l, parity, v1, lane, out);
      } else {
        bad += cp_take(mode, words, theirs, flags + 0, (unsigned)i + 1u, payload_l, rbar_l, parity, v0, lane, out);
        cp_release(mode, words, mine, flags + 1, rpayload, rbar, stage_l, v1, lane);
      }
      const int stop = __shfl_sync(0xffffffffu, lane == 0 ? (int)*(volatile unsigned long long*)(out + 4) : 0, 0);
      if (stop) break;
    }
    if (lane == 0) {
      atomicAdd(out + 1, (unsigned long long)bad);
      if (me == 0) {
        const unsigned long long t1 = probe_ns();
        out[0] = t1 - t0;
        out[2] = t1;
      }
    }
  }
  // no CTA leaves while its partner may still write into its shared memory or arrive on its mbarrier
  __syncwarp();
  cp_cluster_sync();
}

// Residency (--residency N): can a persistent grid of clusters of N CTAs (one CTA per SM: the megakernel's ~200 KB
// of shared memory each) be wholly co-resident? Every CTA records its SM, arrives on a counter and spins (5 ms at
// most) until the whole grid has arrived; seen[i] = the count CTA i saw when it left (the grid size only if all were
// resident together). N = 16 is a non-portable cluster size (the host sets the function's attribute first).
__device__ __forceinline__ void cp_residency(unsigned* arrived, unsigned* smids, unsigned* seen) {
  if (threadIdx.x == 0) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    smids[blockIdx.x] = smid;
    atomicAdd(arrived, 1u);
    const unsigned long long t0 = probe_ns();
    unsigned s = 0;
    while ((s = cp_ld_relaxed(arrived)) < gridDim.x && probe_ns() - t0 < 5000000ull) {
    }
    seen[blockIdx.x] = s;
  }
}

extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(CP_THREADS, 1)
    cluster_residency_8(unsigned* arrived, unsigned* smids, unsigned* seen) {
  cp_residency(arrived, smids, seen);
}

extern "C" __global__ void __cluster_dims__(16, 1, 1) __launch_bounds__(CP_THREADS, 1)
    cluster_residency_16(unsigned* arrived, unsigned* smids, unsigned* seen) {
  cp_residency(arrived, smids, seen);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(CP_THREADS, 1)
    cluster_residency_2(unsigned* arrived, unsigned* smids, unsigned* seen) {
  cp_residency(arrived, smids, seen);
}

extern "C" __global__ void __cluster_dims__(4, 1, 1) __launch_bounds__(CP_THREADS, 1)
    cluster_residency_4(unsigned* arrived, unsigned* smids, unsigned* seen) {
  cp_residency(arrived, smids, seen);
}

// All-gather (--allgather): the 8 CTAs of cluster 0 each deliver a `words`-word slice to all 8 (itself included) by
// st.async, every store completing its bytes on the receiver's mbarrier, and wait for the 8 slices: the pattern of a
// KV group's chain inside a cluster of 8 (q / k / v rows to every attention chunk, the chunks' (m, l, o) to every CTA
// that merges). Two buffers and two mbarriers alternate by round, so a CTA a round ahead never writes into a buffer
// still being read: a sender starts round i + 2 only after all 8 CTAs have sent round i + 1, i.e. finished checking
// round i. The other clusters stream (stream 2), or every CTA does (1), or none (0). out[0] = rank 0's ns for all
// rounds, out[1] = mismatches; out[2..6] as the ping-pong's.
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(CP_THREADS, 1)
    cluster_allgather_8(const unsigned short* __restrict__ src, long long region_bytes, int stream, int words, int iters,
                        int chunks, unsigned long long* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  const CpLayout L = cp_setup(smem);   // two buffers of 8 slices at buf0 (4 KB each: CP_WORDS_MAX words)
  const unsigned ring = L.ring, full0 = L.full0, empty0 = L.empty0, rbar0 = L.rbar0, buf0 = L.buf0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned char* region = reinterpret_cast<const unsigned char*>(src) + (size_t)blockIdx.x * region_bytes;
  const bool ag = blockIdx.x < 8;   // cluster 0
  const int n = (stream == 1 || (stream == 2 && !ag)) ? chunks : 0;
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (cp_stream_warps(warp, lane, n, ring, full0, empty0, region, region_bytes, out)) {
  } else if (ag) {
    const unsigned slice = 4u * (unsigned)words, vps = (unsigned)words / 4u;   // bytes, 16-byte stores a slice
    unsigned bad = 0;
    const unsigned long long w0 = probe_ns();
    while (stream && probe_ns() - w0 < 20000ull) {
    }
    const unsigned long long t0 = probe_ns();
    for (int i = 0; i < iters; ++i) {
      const unsigned p = (unsigned)i & 1u, v = (unsigned)i + 1u, pb = p * 8u * (unsigned)(4 * CP_WORDS_MAX / 8);
      if (lane == 0) probe_arrive_expect_tx(rbar0 + 8u * p, 8u * slice);
      __syncwarp();
      for (unsigned idx = lane; idx < 8u * vps; idx += 32u) {
        const unsigned r = idx / vps, q = idx - r * vps;
        // mapa per store (one instruction): an array of the 8 ranks' addresses went to the stack (dynamic index)
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %1, %1, %1}, [%2];"
                     ::"r"(cp_mapa(buf0 + pb + rank * slice + 16u * q, r)), "r"(v), "r"(cp_mapa(rbar0 + 8u * p, r))
                     : "memory");
      }
      if (lane == 0) {
        const unsigned long long ts = probe_ns();
        while (!cp_try_wait_cluster(rbar0 + 8u * p, ((unsigned)i >> 1) & 1u)) {
          if (probe_ns() - ts > PROBE_WAIT_BUDGET_NS) {
            out[4] = 1;
            break;
          }
        }
      }
      __syncwarp();
      unsigned b = 0;
      for (unsigned idx = lane; idx < 8u * (unsigned)words; idx += 32u) {
        const unsigned r = idx / (unsigned)words, w = idx - r * (unsigned)words;
        b += cp_ld_shared(buf0 + pb + r * slice + 4u * w) != v;
      }
      for (int o = 16; o; o >>= 1) b += __shfl_xor_sync(0xffffffffu, b, o);
      bad += b;
      const int stop = __shfl_sync(0xffffffffu, lane == 0 ? (int)*(volatile unsigned long long*)(out + 4) : 0, 0);
      if (stop) break;
    }
    if (lane == 0) {
      if (rank == 0) {
        const unsigned long long t1 = probe_ns();
        out[0] = t1 - t0;
        out[2] = t1;
      }
      atomicAdd(out + 1, (unsigned long long)bad);
    }
  }
  __syncwarp();
  cp_cluster_sync();
}
