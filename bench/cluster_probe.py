"""Cluster probe: a hand-off between the two CTAs of a thread-block cluster, through L2 or distributed shared memory,
while the SMs stream weights.

The megakernel's release (red.release.gpu: MEMBAR.ALL.GPU) waits for the SM's in-flight weight copies and queues
behind everyone's (bench/release_probe.py: ~1.2-1.9 us idle, 15-25 us under streaming; a co-resident CTA's copies
cost half of the SM's own, session 40). This probe (bench/cluster_probe.cu, independent of csrc/) launches one CTA per
SM in clusters of 2 and ping-pongs a payload between cluster 0's two CTAs in four forms, with every SM streaming 32 KB
chunks from HBM (stream 1), all but the two (stream 2) or none (stream 0):

    python bench/cluster_probe.py [--iters 1000] [--reps 5] [--words 64,1024] [--out FILE.md]

mode 0 st.global + red.release.gpu / ld.acquire.gpu (the megakernel's form); 1 the same at cluster scope; 2 payload
st.shared::cluster into the reader's shared memory + mbarrier.arrive.release.cluster on the reader's mbarrier; 3
payload by st.async, each store completing its bytes on the reader's mbarrier (no fence, no flag); 4 one bulk copy
(the TMA unit, which the weight copies also use) from the writer's shared memory into the reader's, completing on the
reader's mbarrier. SASS: modes 1 and 2 keep MEMBAR.ALL.GPU (cluster-scope releases compile to it), 3 and 4 have no
fence. Reading it: if mode 3 (or 4) under streaming stays near its idle figure while mode 0 climbs to its
release_probe figure, a hand-off inside a cluster does not pay the fence's drain: the chain ops whose consumers can sit
in the producer's cluster (attention after its KV group's qkv rows, the merge of its chunks) can be rebuilt on it
(bench/NOTES.md, session 41).
Every row is also appended to bench/results/cluster_probe.csv.

    python bench/cluster_probe.py --residency 8,16

instead asks whether a persistent grid of clusters of N CTAs (one per SM, ~200 KB of shared memory each: the
megakernel's) is wholly co-resident, and which SMs each cluster got (a chain built on clusters needs all of them), and

    python bench/cluster_probe.py --allgather --words 16,64,128

times an all-gather among a cluster of 8 CTAs by st.async (each CTA's slice to all 8): the pattern of a KV group's
chain inside one cluster (rows 5 of the CSV: ns per round).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # bench/common.py: git_commit, today, append_csv, RESULTS

SOURCE = Path(__file__).resolve().with_suffix(".cu")
KERNEL = "cluster_probe"
THREADS = 96
CP_SLOT = 32768    # bytes per chunk (cluster_probe.cu's CP_SLOT)
CP_NS = 6          # ring slots
WORDS_MAX = 1024   # CP_WORDS_MAX: the payload buffer (4 KB)
# the ring, 12 mbarriers, the receive mbarrier (padded to 16 bytes), the payload buffer and mode 4's stage
SMEM_BYTES = CP_NS * CP_SLOT + 16 * CP_NS + 16 + 2 * 4 * WORDS_MAX
REGION_BYTES = 8 << 20                      # streamed per CTA, cycled (132 x 8 MB >> the 50 MB L2)
MODES = {0: "st + red.release.gpu (kernel)", 1: "st + red.release.cluster", 2: "DSMEM st + mbarrier arrive.release",
         3: "DSMEM st.async + complete_tx", 4: "DSMEM bulk copy (TMA) + complete_tx"}
STREAMS = {0: "off", 1: "all SMs", 2: "all but the two"}   # --allgather: "the two" = cluster 0's 8 CTAs
CSV = common.RESULTS / "cluster_probe.csv"
CSV_HEADER = ("date", "gpu", "commit", "mode", "stream", "words", "iters", "ns_per_handoff", "stream_gbps",
              "mismatches")
TABLE_HEADER = ("mode", "form", "payload", "stream", "ns per hand-off (median)", "min", "max", "stream GB/s",
                "mismatches")


def build_source() -> str:
    """The probe's source with bench/probe_ring.cuh inlined (one text for NVRTC and nvcc)."""
    return common.inline_includes(SOURCE)


# shared with the other probes (bench/common.py)
compile_options = common.probe_compile_options
handoff_ns = common.handoff_ns


def grid_for(sms: int) -> int:
    """One CTA per SM in clusters of 2: the SM count rounded down to even."""
    if sms < 2:
        raise SystemExit(f"{sms} SMs: the probe needs a cluster of 2")
    return sms - sms % 2


def stream_gbps(streaming_ctas: int, chunks: int, span_ns: int) -> float:
    """GB/s of the streaming CTAs: chunks x 32 KB each over the span from the first start to the last end."""
    if span_ns <= 0:
        return float("nan")
    return streaming_ctas * chunks * CP_SLOT / span_ns


def check_args(streams: list[int], modes: list[int], words: list[int], iters: int, reps: int) -> None:
    if iters < 1 or reps < 1:
        raise SystemExit(f"--iters {iters} --reps {reps}: want >= 1 each")
    bad = [x for x in streams if x not in STREAMS]
    if bad:
        raise SystemExit(f"--stream {bad}: choose from {', '.join(f'{k} ({v})' for k, v in STREAMS.items())}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes {bad}: choose from {', '.join(map(str, MODES))}")
    bad = [w for w in words if not (4 <= w <= WORDS_MAX and w % 4 == 0)]   # mode 3 stores 16 bytes at a time
    if bad:
        raise SystemExit(f"--words {bad}: 32-bit words of payload, a multiple of 4 from 4 to {WORDS_MAX}")


def table_row(mode: int, words: int, stream: int, ns: list[float], gbps: float, mismatches: int) -> list[str]:
    ns = sorted(ns)
    return [str(mode), MODES[mode], f"{4 * words} B", STREAMS[stream], f"{common.median(ns):.0f}", f"{ns[0]:.0f}",
            f"{ns[-1]:.0f}", f"{gbps:.0f}" if stream else "-", str(mismatches)]


def _device() -> tuple[Any, str, int, Any]:
    """(cupy, the GPU's name, its SM count, the probe's module) on the current device (common.probe_device's checks)."""
    cp, props = common.probe_device("cluster_probe")
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    mod = cp.RawModule(code=build_source(), options=compile_options(f"sm_{props['major']}{props['minor']}a"))
    return cp, name, int(props["multiProcessorCount"]), mod


def _measure(cp, launch: Callable[[int], None], out, iters: int, reps: int, stream: int, streaming_ctas: int,
             ns_of: Callable[[int], float], what: str) -> tuple[list[float], float, int]:
    """`reps` launches of launch(chunks) (the kernel's out[] words as cluster_probe.cu documents them): the ns figure
    ns_of(out[0]) of each, the streaming rate's median and the mismatches; the chunks double until the streaming
    outlasts the timed rounds."""
    chunks, ns, rates, bad = 4 * iters, [], [], 0
    while len(ns) < reps:
        out.fill(0)
        out[3] = cp.uint64(2**64 - 1)
        out[5] = cp.uint64(2**64 - 1)
        launch(chunks)
        o = [int(v) for v in out.get()]
        if o[4]:
            raise SystemExit(f"{what}: a wait timed out in the probe kernel")
        if stream and o[3] < o[2]:   # the streaming ended before the timed rounds: stream longer
            chunks *= 2
            if chunks > 1 << 22:
                raise SystemExit(f"streaming cannot outlast the timed rounds ({what}; probe bug)")
            continue
        ns.append(ns_of(o[0]))
        rates.append(stream_gbps(streaming_ctas, chunks, o[6] - o[5]) if stream else float("nan"))
        bad += o[1]
    return ns, common.median(rates), bad


def run(iters: int, reps: int, streams: list[int], modes: list[int], words: list[int]) -> tuple[str, list[list]]:
    check_args(streams, modes, words, iters, reps)
    cp, name, sms, mod = _device()
    grid = grid_for(sms)
    fn = mod.get_function(KERNEL)
    fn.max_dynamic_shared_size_bytes = SMEM_BYTES
    src = cp.zeros(grid * REGION_BYTES // 2, dtype=cp.uint16)
    flags = cp.zeros(64, dtype=cp.uint32)
    payloads = cp.zeros(2 * WORDS_MAX, dtype=cp.uint32)
    out = cp.zeros(8, dtype=cp.uint64)
    rows_md, rows_csv = [], []
    commit, date = common.git_commit(), common.today()
    for stream in streams:
        for w in words:
            for mode in modes:
                def launch(chunks: int, stream=stream, w=w, mode=mode) -> None:
                    flags.fill(0)
                    payloads.fill(0)
                    fn((grid,), (THREADS,), (src, cp.int64(REGION_BYTES), cp.int32(stream), cp.int32(mode), cp.int32(w),
                                              cp.int32(iters), cp.int32(chunks), flags, payloads, out),
                       shared_mem=SMEM_BYTES)
                ns, gbps, bad = _measure(cp, launch, out, iters, reps, stream, grid if stream == 1 else grid - 2,
                                         lambda t: handoff_ns(t, iters), f"mode {mode} stream {stream} words {w}")
                rows_md.append(table_row(mode, w, stream, ns, gbps, bad))
                rows_csv.append([date, name, commit, mode, stream, w, iters, f"{common.median(ns):.1f}",
                                 f"{gbps:.0f}" if stream else "", bad])
    title = (f"### cluster_probe: {name}, grid {grid} in clusters of 2, {iters} ping-pong rounds, median of {reps} "
             f"launches, commit {commit}, {date}")
    notes = ("stream: the streaming CTAs' producers stream 32 KB chunks (16 x 2 KB cp.async.bulk) into a 6-slot ring "
             "freed at once (HBM-bound); stream GB/s = their bytes over the first start to the last end; ns per "
             "hand-off = CTA 0's time for the rounds / (2 x rounds), between cluster 0's two CTAs.")
    return "\n".join([title, "", notes, "", common.markdown_table(TABLE_HEADER, rows_md), ""]), rows_csv


RESIDENCY_KERNELS = {n: f"cluster_residency_{n}" for n in (2, 4, 8, 16)}
ALLGATHER_KERNEL = "cluster_allgather_8"
AG_SIZE = 8                          # CTAs of the all-gather's cluster
AG_MAX_CLUSTERS = 15                 # clusters of 8 an H100 SXM holds at one CTA per SM (cluster_residency, session 41)
AG_MAX_WORDS = WORDS_MAX // AG_SIZE  # a slice: one of 8 in a 4 KB buffer
NON_PORTABLE_ATTR = 14               # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED (cuda.h)
RESIDENCY_HEADER = ("cluster size", "clusters", "CTAs", "co-resident", "min CTAs seen", "SMs of each cluster")


def sm_ranges(smids: list[int]) -> str:
    """SM ids, sorted, as compact ranges: [0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    out, ids = [], sorted(smids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(f"{ids[i]}" if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def allow_non_portable(cp, fn) -> None:
    """Let `fn` launch with a cluster size above the portable 8 (CuPy's driver wrapper, else libcuda directly)."""
    try:
        cp.cuda.driver.funcSetAttribute(fn.kernel.ptr, NON_PORTABLE_ATTR, 1)   # RawKernel -> Function
    except AttributeError:   # a CuPy without the wrapper
        import ctypes
        rc = ctypes.CDLL("libcuda.so.1").cuFuncSetAttribute(ctypes.c_void_p(fn.kernel.ptr), NON_PORTABLE_ATTR, 1)
        if rc:
            raise SystemExit(f"cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED) failed: CUresult {rc}") from None


def residency(sizes: list[int]) -> str:
    bad = [n for n in sizes if n not in RESIDENCY_KERNELS]
    if bad:
        raise SystemExit(f"--residency {bad}: cluster sizes {', '.join(map(str, RESIDENCY_KERNELS))}")
    cp, name, sms, mod = _device()
    rows = []
    for n in sizes:
        fn = mod.get_function(RESIDENCY_KERNELS[n])
        fn.max_dynamic_shared_size_bytes = SMEM_BYTES
        if n > 8:
            allow_non_portable(cp, fn)
        grid = sms // n * n
        arrived = cp.zeros(1, dtype=cp.uint32)
        smids, seen = cp.zeros(grid, dtype=cp.uint32), cp.zeros(grid, dtype=cp.uint32)
        try:
            fn((grid,), (THREADS,), (arrived, smids, seen), shared_mem=SMEM_BYTES)
            cp.cuda.Device().synchronize()
        except (cp.cuda.driver.CUDADriverError, cp.cuda.runtime.CUDARuntimeError) as e:   # a size it cannot launch
            rows.append([str(n), str(sms // n), str(grid), f"launch failed: {type(e).__name__}: {e}", "-", "-"])
            continue
        ids, s = [int(x) for x in smids.get()], [int(x) for x in seen.get()]
        per = " / ".join(sm_ranges(ids[c * n:(c + 1) * n]) for c in range(grid // n))
        rows.append([str(n), str(grid // n), str(grid), "yes" if min(s) == grid else "no", str(min(s)), per])
    title = f"### cluster residency: {name}, {sms} SMs, {SMEM_BYTES} B of shared memory a CTA, {common.today()}"
    return "\n".join([title, "", common.markdown_table(RESIDENCY_HEADER, rows), ""])


def check_allgather(words: list[int]) -> None:
    bad = [w for w in words if not (4 <= w <= AG_MAX_WORDS and w % 4 == 0)]
    if bad:
        raise SystemExit(f"--words {bad} with --allgather: a slice of 32-bit words, a multiple of 4 from 4 to "
                         f"{AG_MAX_WORDS}")


def allgather(iters: int, reps: int, streams: list[int], words: list[int]) -> tuple[str, list[list]]:
    """The all-gather of cluster 0's 8 CTAs (cluster_allgather_8), rows as mode 5 of the CSV (ns per round)."""
    check_args(streams, [0], [4], iters, reps)
    check_allgather(words)
    cp, name, sms, mod = _device()
    grid = min(AG_MAX_CLUSTERS, sms // AG_SIZE) * AG_SIZE
    fn = mod.get_function(ALLGATHER_KERNEL)
    fn.max_dynamic_shared_size_bytes = SMEM_BYTES
    src = cp.zeros(grid * REGION_BYTES // 2, dtype=cp.uint16)
    out = cp.zeros(8, dtype=cp.uint64)
    rows_md, rows_csv = [], []
    commit, date = common.git_commit(), common.today()
    for stream in streams:
        for w in words:
            def launch(chunks: int, stream=stream, w=w) -> None:
                fn((grid,), (THREADS,), (src, cp.int64(REGION_BYTES), cp.int32(stream), cp.int32(w), cp.int32(iters),
                                          cp.int32(chunks), out), shared_mem=SMEM_BYTES)
            ns, gbps, bad = _measure(cp, launch, out, iters, reps, stream, grid if stream == 1 else grid - AG_SIZE,
                                     lambda t: t / iters, f"all-gather stream {stream} words {w}")
            srt = sorted(ns)
            rows_md.append([f"all-gather of {AG_SIZE} (st.async)", f"{4 * w} B a CTA", STREAMS[stream],
                            f"{common.median(ns):.0f}", f"{srt[0]:.0f}", f"{srt[-1]:.0f}",
                            f"{gbps:.0f}" if stream else "-", str(bad)])
            rows_csv.append([date, name, commit, 5, stream, w, iters, f"{common.median(ns):.1f}",
                             f"{gbps:.0f}" if stream else "", bad])
    title = (f"### cluster all-gather: {name}, grid {grid} in clusters of {AG_SIZE}, {iters} rounds, median of {reps} "
             f"launches, commit {commit}, {date}")
    note = ("ns per round: cluster 0's rank 0, all rounds / rounds; a round = every CTA's slice delivered to all 8 and "
            "waited for (\"all but the two\" = every cluster but cluster 0 streams).")
    header = ("form", "slice", "stream", "ns per round (median)", "min", "max", "stream GB/s", "mismatches")
    return "\n".join([title, "", note, "", common.markdown_table(header, rows_md), ""]), rows_csv


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=1000, help="ping-pong rounds per launch (default 1000)")
    p.add_argument("--reps", type=int, default=5, help="launches per row (median; default 5)")
    p.add_argument("--stream", default="0,1,2", help="0 idle, 1 every SM streams, 2 all but the ping-pong SMs "
                   "(comma-separated; default 0,1,2)")
    p.add_argument("--modes", default=",".join(map(str, MODES)), help="hand-off forms (default all)")
    p.add_argument("--words", default="64,1024", help="payload words (multiples of 4 up to 1024; "
                   "default 64,1024: 256 B and a 1B batch-1 activation's 4 KB)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table to this file")
    p.add_argument("--csv", type=Path, default=CSV, help=f"rows appended here (default {CSV})")
    p.add_argument("--residency", default="", help="instead: are grids of clusters of these sizes (2, 4, 8, 16; "
                   "comma-separated) wholly co-resident at one CTA per SM, and on which SMs (a table, nothing "
                   "appended)")
    p.add_argument("--allgather", action="store_true", help="instead: the all-gather of a cluster of 8 by st.async "
                   "(--words: each CTA's slice, up to 128 words; --stream as above; rows as mode 5)")
    a = p.parse_args(argv)
    rows = None   # --residency: a table only
    if a.residency:
        md = residency(common.int_list(a.residency))
    elif a.allgather:
        md, rows = allgather(a.iters, a.reps, common.int_list(a.stream), common.int_list(a.words))
    else:
        md, rows = run(a.iters, a.reps, common.int_list(a.stream), common.int_list(a.modes),
                       common.int_list(a.words))
    if a.out is not None:
        common.write_record(a.out.parent, a.out.name, md)
    print(md)
    if rows is not None:
        common.append_csv(a.csv, CSV_HEADER, rows)
        print(f"appended {len(rows)} rows to {a.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
