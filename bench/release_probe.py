"""Release probe: what does one cross-SM hand-off cost while the releasing SM streams weights?

The megakernel's release (red.release.gpu: MEMBAR.ALL.GPU) waits for the SM's own in-flight
cp.async.bulk weight copies (bench/NOTES.md session 8), so the producer holds the next task's copies
behind a release gate and every release on the chain pays for the copies in flight. This probe
(bench/release_probe.cu, independent of csrc/) measures the hand-off latency (payload + flag, one
ping-pong between two SMs, half a round trip) of four release forms, with every SM streaming 32 KB
chunks from HBM (stream 1) or idle (stream 0):

    python bench/release_probe.py [--iters 1000] [--reps 5] [--out FILE.md]

mode 0 generic stores + red.release.gpu (the megakernel's release); 1 payload by a bulk store from shared
memory + wait_group 0 + red.relaxed.gpu (no MEMBAR); 2 the bulk store + red.release.gpu; 3 generic stores
+ fence.acq_rel.cta + red.relaxed.gpu: not a valid release, the no-fence floor; 4 mode 1 with
fence.proxy.async.global before the add (csrc/bulk_release.cuh's MK_BULK_RELEASE=2); 5 data as flag (session 21:
relaxed stores of the payload, no fence and no flag; the reader re-reads the payload until every word is this
round's: the hand-off a tagged activation would cost); 6 the same with a 4 KB payload; 7 mode 0 with that 4 KB
payload (the kernel's form at the size of a batch-1 activation of the 1B model). --inflight N caps the
streaming SMs' chunks in flight (issued, not landed) at N x 32 KB, the megakernel's MK_INFLIGHT: the table then
says what the cap costs the streaming rate and what it buys every hand-off (session 20's question: is the
hand-off's 5.8-us floor under streaming the queue of 6 x 32 KB per SM?); --stream 2 keeps the two ping-pong SMs
out of the streaming (a per-SM queue or the whole memory system's); --stream 3 / 4 (session 37) put L2 prefetches
(cp.async.bulk.prefetch.L2, MK_GATE_L2's instruction) in flight instead, one 32 KB chunk every --pace-ns: 3 on every
SM, 4 on the two ping-pong SMs only while the others stream copies (does a release wait for its own SM's prefetches,
as it waits for its copies?). --stream 5 / 6 / 7 (session 39) run two CTAs per SM (3-slot rings): 5 every CTA streams,
6 the ping-pong CTAs' SM partners stream but not the ping-pong CTAs, 7 the partners idle too (does a release wait for
the copies of another CTA on its SM?). `mismatches` counts payload
words that the reader saw stale after the flag (a form that does not order them). Reading it: if mode 0
under streaming is far above mode 0 idle and mode 1 under streaming is near its idle figure, the bulk
store's completion does not wait for the SM's weight copies and a release built on it can drop the gate.
Every row is also appended to bench/results/release_probe.csv.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # bench/common.py: git_commit, today, append_csv, RESULTS

SOURCE = Path(__file__).resolve().with_suffix(".cu")
KERNEL = "release_probe"
THREADS = 96
RP_SLOT = 32768   # bytes per chunk (release_probe.cu's RP_SLOT)
RP_NS = 6         # ring slots (RP_NS): an in-flight cap of 6 is no cap
RING_BYTES = RP_NS * RP_SLOT


def smem_bytes(slots: int) -> int:
    """A CTA's dynamic shared memory with a `slots`-slot ring: the ring, then 6 full + 6 empty mbarriers (RP_NS of
    each, whatever the ring's depth) and the 256-byte payload stage (release_probe.cu's layout)."""
    return slots * RP_SLOT + 16 * RP_NS + 256


SMEM_BYTES = smem_bytes(RP_NS)
REGION_BYTES = 8 << 20                      # streamed per CTA, cycled (132 x 8 MB >> the 50 MB L2)
MODES = {0: "st + red.release.gpu (kernel)", 1: "bulk store + wait + red.relaxed", 2: "bulk store + red.release",
         3: "st + fence.cta + red.relaxed (invalid)", 4: "bulk store + wait + proxy fence + red.relaxed",
         5: "data as flag: st.relaxed, reader re-reads (256 B)", 6: "data as flag (4 KB)",
         7: "st + red.release.gpu (kernel), 4 KB"}
PAYLOAD_WORDS_BIG = 1024   # release_probe.cu's RP_PAYLOAD_WORDS_BIG: each CTA's payload slot (modes 6, 7 use it all)
STREAMS = {0: "off", 1: "all SMs", 2: "all but the two", 3: "all SMs prefetch to L2",
           4: "the two prefetch to L2, the rest copy", 5: "2 CTAs/SM: all stream",
           6: "2 CTAs/SM: the two's partners stream, the two do not", 7: "2 CTAs/SM: all but the two and partners"}
CO_STREAMS = (5, 6, 7)      # two CTAs per SM, each with a CO_SLOTS-slot ring (both fit an SM's shared memory)
CO_SLOTS = 3
CO_SMEM_BYTES = smem_bytes(CO_SLOTS)
COPY_STREAMS = (1, 2, 4, 5, 6, 7)   # streams in which some SMs copy (the in-flight cap applies)
PREFETCH_STREAMS = (3, 4)   # streams whose ping-pong SMs' producers prefetch (paced by --pace-ns)
# rows of this version (the in-flight cap, the streaming rate, the prefetch pace); release_probe.csv keeps session
# 16's rows, release_probe_v2.csv sessions 20-21's (no pace column)
CSV = common.RESULTS / "release_probe_v3.csv"
CSV_HEADER = ("date", "gpu", "commit", "mode", "stream", "inflight", "pace_ns", "iters", "ns_per_handoff",
              "stream_gbps", "mismatches")
TABLE_HEADER = ("mode", "form", "stream", "in flight/SM", "prefetch pace ns", "ns per hand-off (median)", "min", "max",
                "stream GB/s", "mismatches")


def build_source() -> str:
    """The probe's source with bench/probe_ring.cuh inlined (one text for NVRTC and nvcc)."""
    return common.inline_includes(SOURCE)


# shared with the other probes (bench/common.py)
compile_options = common.probe_compile_options
handoff_ns = common.handoff_ns


def regions(sms: int, streams: list[int]) -> int:
    """Streamed regions to allocate: one per CTA of the largest grid the streams launch (streams 5-7: two CTAs an SM;
    the kernel's CTA i streams region i)."""
    return (2 if any(x in CO_STREAMS for x in streams) else 1) * sms


def stream_gbps(streaming_ctas: int, chunks: int, span_ns: int) -> float:
    """GB/s of the streaming CTAs: chunks x 32 KB each over the span from the first start to the last end."""
    if span_ns <= 0:
        return float("nan")
    return streaming_ctas * chunks * RP_SLOT / span_ns


def check_args(inflight: list[int], streams: list[int], modes: list[int], iters: int, reps: int,
               paces: tuple[int, ...] = (1000,)) -> None:
    if iters < 1 or reps < 1:
        raise SystemExit(f"--iters {iters} --reps {reps}: want >= 1 each")
    bad = [p for p in paces if not 0 <= p <= 100_000]
    if bad or not paces:
        raise SystemExit(f"--pace-ns {bad or paces}: ns between 32 KB prefetch chunks, 0 (unpaced) .. 100000")
    bad = [n for n in inflight if not 1 <= n <= RP_NS]
    if bad:
        raise SystemExit(f"--inflight {bad}: chunks in flight per SM, 1..{RP_NS} ({RP_NS}: no cap)")
    bad = [x for x in streams if x not in STREAMS]
    if bad:
        raise SystemExit(f"--stream {bad}: choose from {', '.join(f'{k} ({v})' for k, v in STREAMS.items())}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes {bad}: choose from {', '.join(map(str, MODES))}")


def table_row(mode: int, stream: int, inflight: int, ns: list[float], gbps: float, mismatches: int,
              pace: int | None = None) -> list[str]:
    ns = sorted(ns)
    cap = f"{inflight * RP_SLOT // 1024} KB" if stream in COPY_STREAMS else "-"
    return [str(mode), MODES[mode], STREAMS[stream], cap,
            str(pace) if stream in PREFETCH_STREAMS and pace is not None else "-",
            f"{common.median(ns):.0f}", f"{ns[0]:.0f}", f"{ns[-1]:.0f}", f"{gbps:.0f}" if stream else "-",
            str(mismatches)]


def run(iters: int, reps: int, inflight: list[int], streams: list[int], modes: list[int],
        paces: tuple[int, ...] = (1000,)) -> tuple[str, list[list]]:
    check_args(inflight, streams, modes, iters, reps, paces)
    cp, props = common.probe_device("release_probe")
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    grid = int(props["multiProcessorCount"])
    arch = f"sm_{props['major']}{props['minor']}a"
    fn = cp.RawModule(code=build_source(), options=compile_options(arch)).get_function(KERNEL)
    fn.max_dynamic_shared_size_bytes = SMEM_BYTES
    try:   # the whole carveout: streams 5-7 need two CTAs' rings on an SM (the kernel checks they are co-resident)
        fn.preferred_shared_memory_carveout = 100
    except AttributeError:   # a CuPy without the setter: the driver's default, checked by the partner count
        pass
    src = cp.zeros(regions(grid, streams) * REGION_BYTES // 2, dtype=cp.uint16)
    flags = cp.zeros(64, dtype=cp.uint32)
    payloads = cp.zeros(2 * PAYLOAD_WORDS_BIG, dtype=cp.uint32)
    out = cp.zeros(8, dtype=cp.uint64)
    rows_md, rows_csv = [], []
    commit, date = common.git_commit(), common.today()
    cases = [(stream, cap, pace) for stream in streams
             for cap in ([CO_SLOTS] if stream in CO_STREAMS else inflight if stream in COPY_STREAMS else [RP_NS])
             for pace in (paces if stream in PREFETCH_STREAMS else [0])]
    for stream, cap, pace in cases:
        for mode in modes:
            chunks, ns, rates, bad = 4 * iters, [], [], 0
            while len(ns) < reps:
                flags.fill(0)
                payloads.fill(0)
                out.fill(0)
                out[3] = cp.uint64(2**64 - 1)
                out[5] = cp.uint64(2**64 - 1)
                co = stream in CO_STREAMS
                fn((2 * grid if co else grid,), (THREADS,),
                   (src, cp.int64(REGION_BYTES), cp.int32(stream), cp.int32(mode), cp.int32(iters), cp.int32(chunks),
                    cp.int32(cap), cp.int32(pace), cp.int32(CO_SLOTS if co else RP_NS), flags, payloads, out),
                   shared_mem=CO_SMEM_BYTES if co else SMEM_BYTES)
                o = [int(v) for v in out.get()]
                if o[4]:
                    raise SystemExit(f"mode {mode} stream {stream}: a wait timed out in the probe kernel")
                if co and o[7] != 2:
                    raise SystemExit(f"stream {stream}: {o[7]} co-resident partner CTAs found on the ping-pong CTAs' "
                                     "SMs (want 2; >= 1000: the two ping-pong CTAs share an SM)")
                if stream and o[3] < o[2]:   # the streaming ended before the ping-pong: stream longer
                    chunks *= 2
                    if chunks > 1 << 22:
                        raise SystemExit("streaming cannot outlast the ping-pong (probe bug)")
                    continue
                ns.append(handoff_ns(o[0], iters))
                ctas = {1: grid, 3: grid, 4: 2, 5: 2 * grid, 6: 2 * grid - 2, 7: 2 * grid - 4}.get(stream, grid - 2)
                # stream 3: the prefetch issue rate; 4: the two prefetching SMs' (the copies end first)
                rates.append(stream_gbps(ctas, chunks, o[6] - o[5]) if stream else float("nan"))
                bad += o[1]
            gbps = common.median(rates)
            rows_md.append(table_row(mode, stream, cap, ns, gbps, bad, pace))
            rows_csv.append([date, name, commit, mode, stream, cap if stream else 0, pace, iters,
                             f"{common.median(ns):.1f}", f"{gbps:.0f}" if stream else "", bad])
    title = (f"### release_probe: {name}, {grid} SMs, {iters} ping-pong rounds, median of {reps} launches, "
             f"commit {commit}, {date}")
    notes = ("stream: every SM's producer (or every SM but the two ping-pong ones) streams 32 KB chunks (16 x 2 KB "
             "cp.async.bulk) into a 6-slot ring freed at once (HBM-bound), with at most `in flight/SM` issued and "
             "not landed; stream GB/s = the streaming CTAs' bytes over the first start to the last end; "
             "ns per hand-off = CTA 0's time for the rounds / (2 x rounds). Streams 3 / 4: L2 prefetches of 32 KB "
             "chunks (16 x 2 KB) every `prefetch pace ns` on the prefetching SMs, their GB/s the prefetches issued "
             "over the span (the ping-pong outlasted by doubling the chunks).")
    return "\n".join([title, "", notes, "", common.markdown_table(TABLE_HEADER, rows_md), ""]), rows_csv


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=1000, help="ping-pong rounds per launch (default 1000)")
    p.add_argument("--reps", type=int, default=5, help="launches per (mode, stream) (median; default 5)")
    p.add_argument("--inflight", default="6", help="chunks of 32 KB in flight per streaming SM, comma-separated "
                   "(1..6; 6 = no cap, the default)")
    p.add_argument("--stream", default="0,1", help="0 idle, 1 every SM streams, 2 all but the ping-pong SMs, "
                   "3 every SM prefetches to L2, 4 the ping-pong SMs prefetch and the others stream, 5 / 6 / 7 two CTAs "
                   "per SM: all stream / the ping-pong CTAs' partners stream, they do not / the partners idle too "
                   "(comma-separated; default 0,1)")
    p.add_argument("--pace-ns", default="1000", help="streams 3 / 4: ns between a prefetching SM's 32 KB chunks, "
                   "comma-separated (0: unpaced; default 1000, about an SM's share of the copy rate)")
    p.add_argument("--modes", default=",".join(map(str, MODES)), help="release forms (default all)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table to this file")
    p.add_argument("--csv", type=Path, default=CSV, help=f"rows appended here (default {CSV})")
    a = p.parse_args(argv)
    ints = common.int_list
    md, rows = run(a.iters, a.reps, ints(a.inflight), ints(a.stream), ints(a.modes), tuple(ints(a.pace_ns)))
    if a.out is not None:
        common.write_record(a.out.parent, a.out.name, md)
    print(md)
    common.append_csv(a.csv, CSV_HEADER, rows)
    print(f"appended {len(rows)} rows to {a.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
