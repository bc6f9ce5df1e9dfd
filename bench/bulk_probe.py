"""Weight-streaming probe: what limits the per-SM rate at which the megakernel streams weights?

The megakernel fills a shared-memory ring of NS slots, one chunk of 16 weight rows x KC bf16 columns
per slot, with 16 one-row cp.async.bulk copies (KC*2 bytes each); 8 consumer warps read each chunk
with ldmatrix.x4 + mma.m16n8k16. At KC = 1024 (2 KB copies) a step streams near the HBM copy rate;
at KC = 512 (1 KB copies, batch 9..16 until session 11) the per-SM rate roughly halved, and more
half-size slots did not help. This probe (bench/bulk_probe.cu, independent of csrc/) streams ~1 GB from HBM, one CTA per
SM, in that pattern and varies one thing at a time:

    python bench/bulk_probe.py [--gb 1.0] [--reps 10] [--passes 1] [--out FILE.md]

--passes P re-reads each CTA's region P times in one launch (the chunk index wraps over the region): with a
region that fits L2 (--gb 0.035: 34.6 MB), the rate at which an SM's copies take weights parked in L2, without
the launch and the 1 us event resolution that made session 24's 17 / 35 / 52 MB launches inconclusive for the
tiled copy. Those rows go to bench/results/bulk_probe_l2.csv (with the region's MB and P).

Reading the table (rate = GB/s; `% of 4.26` against the device-to-device copy rate):
- copy-count limit (TMA per-copy cost): at compute 0 the rate follows the copy size (B/copy), not
  the bytes in flight: KC 512 NS 12 (~192 KB in flight, like KC 1024 NS 6) stays slow, and mode
  "tiled" (one contiguous copy per chunk, weights pre-tiled) at the same KC and NS is fast.
- ring-depth limit (latency x bytes in flight): at compute 0 the rate follows "in flight/SM" whatever
  the copy size (KC 512 NS 12 ~ KC 1024 NS 6 ~ KC 2048 NS 3), and "tiled" gains nothing.
- consumer limit: compute 0 is fast but compute 1 / 2 at the same copy mode, KC and NS are slow.
Rows 'skipped' need more shared memory than the device's opt-in limit (227 KB on an H200).
Every measured row is also appended to bench/results/bulk_probe.csv.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # mk_plugin from the checkout, as mk_step.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # bench/common.py: git_commit, today, append_csv, RESULTS

from mk_plugin.persistent.trace import COPY_GBPS  # the H200's measured device-to-device copy rate

SOURCE = Path(__file__).resolve().with_suffix(".cu")
KERNEL = "bulk_probe"
K = 4096                 # row length (elements) of the streamed matrix: a multiple of every KC
ROWS = 16                # weight rows per chunk (one M-tile)
CONSUMER_WARPS = 8
THREADS = 32 * (1 + CONSUMER_WARPS)
H200_SMEM_OPTIN = 227 * 1024   # cudaDevAttrMaxSharedMemoryPerBlockOptin on an H200 (232448 B)
H200_SMS = 132
WARMUP = 2
CSV = common.RESULTS / "bulk_probe.csv"
CSV_HEADER = ("date", "gpu", "commit", "mode_copy", "kc", "ns", "compute", "ms", "gbps")
CSV_L2 = common.RESULTS / "bulk_probe_l2.csv"   # --passes > 1: the same columns and the region re-read
CSV_L2_HEADER = CSV_HEADER + ("region_mb", "passes")
MODE_NAMES = ("per-row", "tiled")


@dataclass(frozen=True)
class Config:
    mode_copy: int   # 0: one copy per row (megakernel); 1: one contiguous copy per chunk
    kc: int          # columns per chunk
    ns: int          # ring slots
    compute: int     # 0: wait/arrive only; 1: ldmatrix.x4 + 1 mma per k-step; 2: + 2 mmas
    rows: int = ROWS

    @property
    def copy_bytes(self) -> int:
        return self.kc * 2 * (self.rows if self.mode_copy else 1)

    @property
    def copies_per_chunk(self) -> int:
        return 1 if self.mode_copy else self.rows

    @property
    def slot_bytes(self) -> int:  # rows padded by 16 bytes in mode 0 (conflict-free ldmatrix)
        return self.rows * (self.kc * 2 + (0 if self.mode_copy else 16))

    @property
    def smem_bytes(self) -> int:  # the ring, then NS full and NS empty mbarriers (8 bytes each)
        return self.ns * self.slot_bytes + 2 * self.ns * 8

    @property
    def inflight_bytes(self) -> int:
        return self.ns * self.rows * self.kc * 2


def config_grid() -> list[Config]:
    """The fixed grid: copy size x ring depth at compute 0 (with KC 512 NS 12 and KC 256 NS 24: the
    bytes in flight of KC 1024 NS 6 in smaller copies), the consumers' work at three points, and
    pre-tiled single copies. KC 1024 NS 10 and KC 2048 NS 5 exceed 227 KB: listed as skipped."""
    g = [Config(0, kc, ns, 0) for kc, nss in ((256, (6, 10, 24)), (512, (6, 10, 12)), (1024, (6, 10)),
                                              (2048, (3, 5))) for ns in nss]
    g += [Config(0, kc, ns, c) for c in (1, 2) for kc, ns in ((512, 6), (512, 10), (1024, 6))]
    g += [Config(1, kc, ns, c) for c in (0, 2) for kc, ns in ((512, 6), (512, 10), (1024, 6))]
    return g


def skip_reason(cfg: Config, smem_limit: int) -> str | None:
    if cfg.smem_bytes > smem_limit:
        return f"skipped: {cfg.smem_bytes} B of shared memory > the device's {smem_limit} B"
    return None


def geometry(gb: float, num_sms: int, kc: int, rows: int = ROWS) -> tuple[int, int]:
    """(rows_total per CTA, chunks_per_cta) for ~gb GB streamed by num_sms CTAs, each over its own
    region of rows_total x K elements once; raises SystemExit for a bad --gb."""
    if not (math.isfinite(gb) and 0 < gb <= 64):
        raise SystemExit(f"--gb {gb}: want a size in GB in (0, 64] (default 1.0: > 50 MB of L2)")
    rows_total = int(gb * 1e9 // (num_sms * K * 2)) // rows * rows
    if rows_total < rows:
        raise SystemExit(f"--gb {gb}: too small for {num_sms} SMs (at least {num_sms * rows * K * 2 / 1e9:.3f})")
    return rows_total, rows_total // rows * (K // kc)


def check_passes(passes: int) -> int:
    if not 1 <= passes <= 1000:
        raise SystemExit(f"--passes {passes}: want 1..1000 re-reads of each CTA's region per launch")
    return passes


def config_bytes(cfg: Config, chunks_per_cta: int, grid: int) -> int:
    """Bytes one launch streams: chunks_per_cta * 16 * KC * 2 * grid."""
    return chunks_per_cta * cfg.rows * cfg.kc * 2 * grid


def build_source() -> str:
    """The probe's source with bench/probe_ring.cuh inlined (one text for NVRTC and nvcc)."""
    return common.inline_includes(SOURCE)


compile_options = common.probe_compile_options   # shared with the other probes (bench/common.py)


TABLE_HEADER = ("copy mode", "KC", "B/copy", "copies/chunk", "NS", "slot B", "in flight/SM", "compute",
                "ms", "GB/s", "GB/s/SM", "% of 4.26")


def table_row(cfg: Config, ms: float | None, nbytes: int, grid: int, skip: str | None = None) -> list[str]:
    head = [MODE_NAMES[cfg.mode_copy], str(cfg.kc), str(cfg.copy_bytes), str(cfg.copies_per_chunk), str(cfg.ns),
            str(cfg.slot_bytes), f"{cfg.inflight_bytes // 1024} KB", str(cfg.compute)]
    if ms is None:
        return head + [skip or "skipped", "", "", ""]
    gbps = nbytes / (ms * 1e-3) / 1e9
    return head + [f"{ms:.3f}", f"{gbps:.0f}", f"{gbps / grid:.2f}", f"{100 * gbps / COPY_GBPS:.0f}%"]


def run(gb: float, reps: int, passes: int = 1) -> tuple[str, list[list]]:
    """Measure every config, each CTA's region read `passes` times a launch; returns (markdown, csv rows)."""
    if reps < 1:
        raise SystemExit(f"--reps {reps}: want >= 1")
    cp, props = common.probe_device("bulk_probe")
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    grid = int(props["multiProcessorCount"])
    limit = int(props.get("sharedMemPerBlockOptin", H200_SMEM_OPTIN))   # not in every CuPy's property dict
    arch = f"sm_{props['major']}{props['minor']}a"
    rows_total, _ = geometry(gb, grid, 1024)
    free = cp.cuda.runtime.memGetInfo()[0]
    n_elem = grid * rows_total * K
    if 2 * n_elem + (1 << 28) > free:
        raise SystemExit(f"--gb {gb}: {2 * n_elem / 1e9:.2f} GB does not fit the GPU's {free / 1e9:.2f} GB free")
    fn = cp.RawModule(code=build_source(), options=compile_options(arch)).get_function(KERNEL)
    src = cp.full(n_elem, 0x3F80, dtype=cp.uint16)           # bf16 1.0 everywhere (values do not matter)
    sink = cp.zeros(grid * CONSUMER_WARPS * 32 + 1, dtype=cp.float32)
    rows_md, rows_csv = [], []
    commit, date = common.git_commit(), common.today()
    for cfg in config_grid():
        _, chunks = geometry(gb, grid, cfg.kc, cfg.rows)
        chunks *= passes   # the kernel's chunk index wraps over the region
        nbytes = config_bytes(cfg, chunks, grid)
        skip = skip_reason(cfg, limit)
        if skip is not None:
            rows_md.append(table_row(cfg, None, nbytes, grid, skip))
            continue
        fn.max_dynamic_shared_size_bytes = cfg.smem_bytes
        args = (src, *(cp.int32(v) for v in (K, rows_total, cfg.kc, cfg.rows, cfg.ns, cfg.mode_copy,
                                              cfg.compute, chunks)), sink)
        times = []
        for r in range(WARMUP + reps):
            t0, t1 = cp.cuda.Event(), cp.cuda.Event()
            t0.record()
            fn((grid,), (THREADS,), args, shared_mem=cfg.smem_bytes)
            t1.record()
            t1.synchronize()
            if r >= WARMUP:
                times.append(cp.cuda.get_elapsed_time(t0, t1))
        if float(sink[-1].get()) != 0.0:
            raise SystemExit(f"{cfg}: an mbarrier wait timed out in the probe kernel (a probe bug)")
        ms = common.median(times)
        rows_md.append(table_row(cfg, ms, nbytes, grid))
        rows_csv.append([date, name, commit, cfg.mode_copy, cfg.kc, cfg.ns, cfg.compute, f"{ms:.4f}",
                         f"{nbytes / (ms * 1e-3) / 1e9:.1f}"] + ([f"{n_elem * 2 / 1e6:.1f}", passes] if passes > 1 else []))
    title = (f"### bulk_probe: {name}, {grid} SMs, {n_elem * 2 / 1e9:.3f} GB region x {passes} pass(es) per launch, "
             f"median of {reps} "
             f"({WARMUP} warm-up), commit {commit}, {date}")
    notes = ("per-row: 16 copies of KC*2 B per chunk, rows padded to KC*2+16 B (the megakernel); tiled: one "
             "contiguous copy of 32*KC B per chunk, unpadded, ldmatrix XOR-swizzled. compute 0: wait/arrive "
             "only; 1: KC/128 x (ldmatrix.x4 + 1 mma) per warp and chunk (NT=1); 2: the same + 2 mmas (NT=2).")
    return "\n".join([title, "", notes, "", common.markdown_table(TABLE_HEADER, rows_md), ""]), rows_csv


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0, help="GB streamed per launch (default 1.0; L2 is 50 MB)")
    p.add_argument("--reps", type=int, default=10, help="timed launches per config (median; default 10)")
    p.add_argument("--passes", type=int, default=1, help="re-reads of each CTA's region per launch (default 1)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table to this file")
    a = p.parse_args(argv)
    geometry(a.gb, H200_SMS, 1024)   # a bad --gb or --passes fails before CUDA is touched
    check_passes(a.passes)
    md, rows = run(a.gb, a.reps, a.passes)
    if a.out is not None:
        common.write_record(a.out.parent, a.out.name, md)
    else:
        print(md)
    csv, header = (CSV, CSV_HEADER) if a.passes == 1 else (CSV_L2, CSV_L2_HEADER)
    common.append_csv(csv, header, rows)
    print(f"appended {len(rows)} rows to {csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
