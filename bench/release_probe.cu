// Release probe (bench/release_probe.py): what does one cross-SM hand-off cost while the releasing SM
// streams weights? The megakernel's release (thread 0: red.release.gpu.add after the task's stores,
// SASS MEMBAR.ALL.GPU) was measured to wait for the SM's own in-flight cp.async.bulk weight copies
// (bench/NOTES.md session 8: gate_up's release 3.3 us with down's copies in flight, 0.4-0.8 us
// without), which is why the producer holds copies behind a release gate. This probe measures the
// hand-off latency of other release forms under the same load, before any of them enters csrc/.
// Independent of the megakernel's headers on purpose.
//
// Grid: one CTA per SM, all co-resident. Warp 0 = producer: when `stream` is set (1: every CTA; 2: all but the
// two ping-pong CTAs), it streams `chunks` chunks of 32 KB (16 copies of 2 KB: the megakernel's per-row pattern
// at KC = 1024) from the CTA's own region of `src` into a 6-slot ring, with at most `inflight` chunks issued and
// not landed (6: no cap; before chunk i it waits for chunk i - inflight to land, the megakernel's MK_INFLIGHT);
// warp 1 frees each slot as soon as it is full (no compute: HBM-bound, like gate_up's phase). Warp 2 of CTAs 0 and 1 plays ping-pong: CTA 0 writes a
// 256-byte payload (64 words, every lane two), releases flag 0 and waits for flag 1; CTA 1 waits for
// flag 0, checks the payload, writes its own and releases flag 1; `iters` rounds. The payload words
// carry the round number, so a release form that does not order the payload before the flag shows up
// as mismatches (counted, never hidden).
//
// mode 0: generic st.global of the payload, __syncwarp, lane 0 red.release.gpu.global.add (the kernel's form)
// mode 1: payload to shared memory, fence.proxy.async, lane 0 cp.async.bulk.global.shared::cta of
//         the 256 bytes, commit, wait_group 0 (the write is complete), red.relaxed.gpu.global.add:
//         no MEMBAR; the bulk group waited for is this thread's store only
// mode 2: mode 1's bulk store, then red.release.gpu (the bulk path's cost with the fence kept)
// mode 3: generic stores, fence.acq_rel.cta only, red.relaxed.gpu: NOT a valid release (no gpu-scope
//         ordering): the floor of a hand-off with no fence at all, mismatches expected to be possible
// mode 4: mode 1 with fence.proxy.async.global between the wait and the relaxed add (MK_BULK_RELEASE=2)
// mode 5: data as flag (session 21): st.relaxed.gpu of the payload words and nothing else -- no fence, no flag; the
//         reader re-reads the whole payload (ld.relaxed.gpu) until every word carries this round's value. Valid
//         for the payload itself: each aligned 32-bit word is single-copy atomic, and the reader accepts only
//         when it has seen every word's new value (what a tagged activation -- bf16 value | 16-bit epoch per
//         word -- would give the megakernel's consumers: the activation load is the poll)
// mode 6: mode 5 with a 4 KB payload (1024 words: a batch-1 activation of Llama-3.2-1B as tagged bf16 words is 8
//         KB, read by each consumer; its untagged form 4 KB)
// mode 7: mode 0 with the same 4 KB payload (the kernel's form at that size: flag, then the payload's loads)
// The reader polls the flag with ld.acquire.gpu and reads the payload with ld.relaxed.gpu (modes 0-4, 7).
//
// stream 3 / 4 (session 37: why did MK_GATE_L2 cost ~16 N us a step?): the producer of a prefetching CTA issues
// cp.async.bulk.prefetch.L2 of its region instead of copies (16 x 2 KB a 32 KB chunk, as MK_GATE_L2 did, no ring,
// no completion), one chunk every `pace_ns` (0: as fast as it issues). 3: every CTA prefetches; 4: the two ping-pong
// CTAs prefetch and every other CTA streams copies (stream 2's load): if the release fence waits for the SM's own
// prefetches, stream 4's hand-off is far above stream 2's and grows as the pace shortens.
//
// stream 5 / 6 / 7 (session 39: does a release wait for the copies of *another CTA* on its SM, or only its own?): two
// CTAs per SM (grid 2 x SMs, a `ring_slots`-slot ring each, 3 by the host), so each ping-pong CTA shares its SM with one
// partner CTA (found by %smid). 5: every CTA streams, the ping-pong CTAs' own producers too (a release beside its own
// CTA's copies, at this ring depth); 6: the partners stream, the ping-pong CTAs' producers do not (copies of another
// CTA on the same SM); 7: the partners idle too (other SMs' copies only, stream 2's case). If 6 is near 5, the fence
// waits for the SM's copies whoever issued them; if near 7, only for its own CTA's: a producer CTA beside a consumer
// CTA would free the chain's releases from the weight stream (the release gate's reason).
//
// out[0] = CTA 0's ns for all rounds, out[1] = payload mismatches (both sides), out[2] = CTA 0's end
// time, out[3] = the earliest producer end time (atomicMin; the host sets it to ~0 first: streaming
// must outlast the ping-pong), out[4] = 1 when a wait timed out (a probe bug or a broken form), out[5] / out[6] =
// the earliest producer start / the latest producer end (the streaming rate: chunks x 32 KB per streaming CTA
// over that span), out[7] = streams 5-7: the partner CTAs found on the ping-pong CTAs' SMs (the host wants 2), or
// 1000 when the two ping-pong CTAs share an SM.

#define RP_THREADS 96
#define RP_NS 6
#define RP_SLOT 32768u
#define RP_COPY 2048u
#define RP_PAYLOAD_WORDS 64      // modes 0-5 (the bulk forms stage this many words in shared memory)
#define RP_PAYLOAD_WORDS_BIG 1024 // modes 6, 7 (4 KB); each CTA's payload slot in `payloads` holds this many
#include "probe_ring.cuh"

__device__ __forceinline__ void rp_prefetch_l2(const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ int rp_words(int mode) { return mode >= 6 ? RP_PAYLOAD_WORDS_BIG : RP_PAYLOAD_WORDS; }
__device__ __forceinline__ bool rp_data_flag(int mode) { return mode == 5 || mode == 6; }

__device__ __forceinline__ void rp_bulk_s2g(void* dst, unsigned src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__device__ __forceinline__ unsigned rp_ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned rp_ld_relaxed(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void rp_st_relaxed(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void rp_red_release(unsigned* p) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}

__device__ __forceinline__ void rp_red_relaxed(unsigned* p) {
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}

// One side's release of round value v: the payload (64 words = v) and then the flag.
__device__ __forceinline__ void rp_release(int mode, unsigned* payload, unsigned* flag, unsigned* stage, unsigned v,
                                           int lane) {
  const int nw = rp_words(mode);
  if (mode == 0 || mode == 3 || mode == 7) {
    for (int i = lane; i < nw; i += 32) payload[i] = v;
  } else if (rp_data_flag(mode)) {
    for (int i = lane; i < nw; i += 32) rp_st_relaxed(payload + i, v);
  } else {
    stage[lane] = v;
    stage[lane + 32] = v;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic smem writes -> the bulk copy
  }
  __syncwarp();
  if (lane == 0) {
    if (mode == 1 || mode == 2 || mode == 4) rp_bulk_s2g(payload, (unsigned)__cvta_generic_to_shared(stage), 4 * RP_PAYLOAD_WORDS);
    if (mode == 3) asm volatile("fence.acq_rel.cta;" ::: "memory");
    if (mode == 4) asm volatile("fence.proxy.async.global;" ::: "memory");
    if (mode == 0 || mode == 2 || mode == 7)
      rp_red_release(flag);
    else if (!rp_data_flag(mode))
      rp_red_relaxed(flag);
  }
  __syncwarp();
}

// The payload's words != v, counted by the whole warp (every lane gets the total).
__device__ __forceinline__ unsigned rp_count_stale(const unsigned* payload, int nw, unsigned v, int lane) {
  unsigned bad = 0;
  for (int i = lane; i < nw; i += 32) bad += rp_ld_relaxed(payload + i) != v;
  for (int o = 16; o; o >>= 1) bad += __shfl_xor_sync(0xffffffffu, bad, o);
  return bad;
}

// Wait until *flag >= target (lane 0, acquire), then count payload words != v (whole warp); data as flag (modes 5,
// 6): re-read the payload until no word is stale (0 mismatches by construction, unless the wait timed out).
__device__ __forceinline__ unsigned rp_take(int mode, const unsigned* payload, const unsigned* flag, unsigned target,
                                            unsigned v, int lane, unsigned long long* out) {
  const int nw = rp_words(mode);
  if (rp_data_flag(mode)) {
    const unsigned long long t0 = probe_ns();
    unsigned bad;
    do {
      bad = rp_count_stale(payload, nw, v, lane);
      if (bad && probe_ns() - t0 > PROBE_WAIT_BUDGET_NS) {   // every lane sees the same bad and the same verdict
        if (lane == 0) out[4] = 1;
        break;
      }
    } while (bad);
    return bad;
  }
  if (lane == 0) {
    const unsigned long long t0 = probe_ns();
    while (rp_ld_acquire(flag) < target) {
      if (probe_ns() - t0 > PROBE_WAIT_BUDGET_NS) {
        out[4] = 1;
        break;
      }
    }
  }
  __syncwarp();
  return rp_count_stale(payload, nw, v, lane);
}

extern "C" __global__ void __launch_bounds__(RP_THREADS, 1)
    release_probe(const unsigned short* __restrict__ src, long long region_bytes, int stream, int mode, int iters,
                  int chunks, int inflight, int pace_ns, int ring_slots, unsigned* flags, unsigned* payloads,
                  unsigned long long* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  // ring_slots slots (RP_NS for streams 0-4: the layout measured since session 16), then the mbarriers and the stage
  const int ns = ring_slots;
  const unsigned ring = (unsigned)__cvta_generic_to_shared(smem);
  const unsigned full0 = ring + ns * RP_SLOT, empty0 = full0 + 8 * RP_NS;
  unsigned* stage = reinterpret_cast<unsigned*>(smem + ns * RP_SLOT + 16 * RP_NS);
  __shared__ int partner_s;   // streams 5-7: this CTA shares its SM with a ping-pong CTA
  if (threadIdx.x == 0) {
    for (int s = 0; s < RP_NS; ++s) {
      probe_mbar_init(full0 + 8 * s, 1);
      probe_mbar_init(empty0 + 8 * s, 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned char* region = reinterpret_cast<const unsigned char*>(src) + (size_t)blockIdx.x * region_bytes;
  const bool pp = blockIdx.x < 2;   // a ping-pong CTA
  if (threadIdx.x == 0) {
    partner_s = 0;
    if (stream >= 5) {   // every CTA of the 2 x SMs grid is resident (the host sizes it so): the spin ends
      unsigned smid;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      if (pp) {
        atomicExch(flags + 8 + blockIdx.x, smid + 1u);
      } else {
        const unsigned long long t0 = probe_ns();
        unsigned a = 0, b = 0;
        while ((a = rp_ld_relaxed(flags + 8)) == 0u || (b = rp_ld_relaxed(flags + 9)) == 0u) {
          if (probe_ns() - t0 > PROBE_WAIT_BUDGET_NS) {
            out[4] = 1;
            break;
          }
        }
        // a partner only while its ping-pong CTA still runs (flags[10 + i]: CTA i done): co-resident, not a CTA the
        // scheduler placed on that SM after the ping-pong ended
        partner_s = (a == smid + 1u && rp_ld_relaxed(flags + 10) == 0u) || (b == smid + 1u && rp_ld_relaxed(flags + 11) == 0u);
        if (partner_s) atomicAdd(out + 7, 1ull);
        if (blockIdx.x == 2 && a == b) atomicAdd(out + 7, 1000ull);   // the ping-pong CTAs share an SM
      }
    }
  }
  __syncthreads();
  const bool partner = partner_s != 0;
  const bool copies = stream == 1 || stream == 5 || ((stream == 2 || stream == 4 || stream == 6) && !pp) ||
                      (stream == 7 && !pp && !partner);
  const int n = copies ? chunks : 0;     // chunks copied
  const int np = (stream == 3 || (stream == 4 && pp)) ? chunks : 0;                     // chunks prefetched to L2
  if (warp == 0 && np > 0) {  // producer, prefetching: paced, nothing to wait for
    long long off = 0;
    const unsigned long long t0 = probe_ns();
    if (lane == 0) atomicMin(out + 5, t0);
    for (int it = 0; it < np; ++it) {
      if (lane < (int)(RP_SLOT / RP_COPY)) rp_prefetch_l2(region + off + lane * RP_COPY, RP_COPY);
      off += RP_SLOT;
      if (off + RP_SLOT > region_bytes) off = 0;
      if (lane == 0)
        while (probe_ns() - t0 < (unsigned long long)(it + 1) * (unsigned)pace_ns) {
        }
      __syncwarp();
    }
    if (lane == 0) {
      const unsigned long long t_end = probe_ns();
      atomicMin(out + 3, t_end);
      atomicMax(out + 6, t_end);
    }
  } else if (warp == 0) {  // producer
    long long off = 0;
    if (lane == 0 && n > 0) atomicMin(out + 5, probe_ns());
    for (int it = 0; it < n; ++it) {
      const int slot = it % ns;
      const unsigned parity = (unsigned)(it / ns) & 1u;
      if (inflight < ns && it >= inflight)   // chunk it - inflight has landed (its slot is not re-armed yet)
        probe_wait(full0 + 8 * ((it - inflight) % ns), (unsigned)((it - inflight) / ns) & 1u, out);
      probe_wait(empty0 + 8 * slot, parity ^ 1u, out);
      if (lane == 0) probe_arrive_expect_tx(full0 + 8 * slot, RP_SLOT);
      __syncwarp();
      if (lane < (int)(RP_SLOT / RP_COPY))
        probe_bulk_g2s(ring + slot * RP_SLOT + lane * RP_COPY, region + off + lane * RP_COPY, RP_COPY, full0 + 8 * slot);
      off += RP_SLOT;
      if (off + RP_SLOT > region_bytes) off = 0;
    }
    for (int it = n > ns ? n - ns : 0; it < n; ++it) probe_wait(full0 + 8 * (it % ns), (unsigned)(it / ns) & 1u, out);
    if (lane == 0 && n > 0) {
      const unsigned long long t_end = probe_ns();
      atomicMin(out + 3, t_end);
      atomicMax(out + 6, t_end);
    }
  } else if (warp == 1) {  // frees each slot once full
    for (int it = 0; it < n; ++it) {
      probe_wait(full0 + 8 * (it % ns), (unsigned)(it / ns) & 1u, out);
      probe_arrive(empty0 + 8 * (it % ns));
    }
  } else if (blockIdx.x < 2) {  // ping-pong
    const int me = blockIdx.x, other = 1 - me;
    unsigned* mine = payloads + me * RP_PAYLOAD_WORDS_BIG;
    const unsigned* theirs = payloads + other * RP_PAYLOAD_WORDS_BIG;
    unsigned bad = 0;
    // let the streaming reach its steady state first (the ring fills in ~6 us)
    const unsigned long long w0 = probe_ns();
    while (stream && probe_ns() - w0 < 20000ull) {
    }
    const unsigned long long t0 = probe_ns();
    for (int i = 0; i < iters; ++i) {
      const unsigned v0 = 2u * i + 1u, v1 = 2u * i + 2u;
      if (me == 0) {
        rp_release(mode, mine, flags + 0, stage, v0, lane);
        bad += rp_take(mode, theirs, flags + 1, (unsigned)i + 1u, v1, lane, out);
      } else {
        bad += rp_take(mode, theirs, flags + 0, (unsigned)i + 1u, v0, lane, out);
        rp_release(mode, mine, flags + 1, stage, v1, lane);
      }
      // one lane reads the error word and the warp follows it (lanes must leave together: rp_take syncs)
      const int stop = __shfl_sync(0xffffffffu, lane == 0 ? (int)*(volatile unsigned long long*)(out + 4) : 0, 0);
      if (stop) break;
    }
    if (lane == 0) {
      atomicExch(flags + 10 + me, 1u);
      atomicAdd(out + 1, (unsigned long long)bad);
      if (me == 0) {
        const unsigned long long t1 = probe_ns();
        out[0] = t1 - t0;
        out[2] = t1;
      }
    }
  }
}
