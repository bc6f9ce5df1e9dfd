"""Consumer probe: what one 32 KB weight chunk costs the consumers with the megakernel's ldmatrix + mma.sync pattern
against Hopper's warpgroup MMA (wgmma.mma_async, both operands read from shared memory by descriptor).

    python bench/wgmma_probe.py [--gb 1.0] [--reps 10] [--grid all|warps] [--out FILE.md] [--csv FILE]

Why: the megakernel's chunk loop takes 0.35-1.3 us per 32 KB chunk in the H200 phase traces where ldmatrix alone
needs ~0.13 us and the copy ~1.0 us per SM (bench/NOTES.md sessions 23-24): on the batch-1 chain (qkv, o_proj and
down find their chunks resident) and in batch 16's chunk work the consumers, not HBM, set the time. The probe
(bench/wgmma_probe.cu, independent of csrc/) streams W [rows, 1024] (~gb GB) through a 5-slot ring in chunks of
64 rows x 256 columns (one 128B-swizzled tensor-map copy each, the layout wgmma reads) and computes y = x W^T for
8 or 16 tokens, one CTA per SM, in three consumer modes:
  sync-wait (0): wait and free each slot only; mma.sync (1): 8 warps of ldmatrix.x4 + mma.m16n8k16 with x
  fragments from shared memory (the megakernel's pattern); wgmma (2): 2 warpgroups of 8 wgmma.m64nNk16 a chunk;
  wgmma-B (3): the weights as wgmma's B (N = 16 rows) in today's chunk of 16 rows x 1024 columns (MK_W_TMA's
  layout) and x as A (M = 64, rows past the tokens dropped): 32 wgmma.m64n16k16 per warpgroup a chunk, 4-8x the
  tensor work of (2) but no new chunk geometry for the megakernel's 16-row units; mma.sync-1M (4): (1)'s MMAs on
  (3)'s chunk, one M-tile and 8 k-steps a warp (the megakernel's one-M-tile tasks: qkv, o_proj, down at 1B batch 1);
  wgmma-B compact (5): (3) with x in a compact unswizzled layout of its B real tokens, the A descriptor's K-direction
  offset B * 16 (rows past the batch alias the next core matrices at B < 8: is that legal?).
Streaming rows time the copy with the consumers behind it and check y against torch (fp32); resident rows copy
the first 5 chunks only and time the consumers alone (their y is meaningless). Reading the table:
- us/chunk of the resident rows is the consumers' own cost per 32 KB; the streaming rows' is max(copy, consumers).
- wgmma resident well under mma.sync resident (and a passing check) says the megakernel's matvec should move to
  wgmma (wgmma-B as well: on today's chunks; only wgmma: on 64-row chunks); equal says the per-chunk cost is
  elsewhere (waits, arrivals, the fragment build).
- "warp arrive" against the per-thread row: what 256 mbarrier arrivals per chunk cost.
- `--grid warps` (session 55): mma.sync-1M and mma.sync (N 8) at 8 and 16 consumer warps ("16w") and with two
  accumulator chains a warp ("2ch"). 16w well under the 8-warp row says the chunk's time follows each warp's
  instruction stream (the megakernel's 8 consumer warps are two a scheduler) and a 16-warp consumer side would
  shorten the batch-1 chain's chunk phases; 2ch under it says the MMA chain's latency; neither says the ring's
  wait / arrive and the reduction set it.
Rows go to bench/results/wgmma_probe.csv; the script exits 1 if a streamed row's check fails or a config times out
or faults (a fault ends the run: the rows before it are kept, the wgmma rows come last).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # mk_plugin from the checkout, as mk_step.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # bench/common.py

from mk_plugin.persistent.trace import COPY_GBPS

SOURCE = Path(__file__).resolve().with_suffix(".cu")
KERNEL = "wgmma_probe"
K = 1024                 # columns of W: x [N, K] is staged whole (the kernel's WP_MAX_K)
ROWS, KC, NS = 64, 256, 5          # rows and columns per chunk, ring slots (the kernel's WP_ROWS, WP_KC, WP_NS)
ROWS_B, KC_B = 16, 1024            # mode 3's chunk (today's unit x CHUNK_COLS): the same 32 KB, as many per CTA
CHUNK_BYTES = ROWS * KC * 2
SMEM_BYTES = NS * CHUNK_BYTES + (K // 64) * 16 * 128 + 8 * 4 * 2 * 32 * 16 + 2 * NS * 8   # the kernel's WP_SMEM
H200_SMS = 132
WARMUP = 2
DEVICE = "cuda"          # where run() puts its tensors (a CPU test of its plumbing sets "cpu" with a fake CuPy)
TOL = 1e-3               # max |y - ref| / max |ref|: fp32 sums of bf16 products in another order
CSV = common.RESULTS / "wgmma_probe.csv"
CSV_HEADER = ("date", "gpu", "commit", "mode", "n", "b", "resident", "warp_arrive", "ms", "gbps", "us_per_chunk",
              "fixed_us", "rel_err")
MODES = ("sync-wait", "mma.sync", "wgmma", "wgmma-B", "mma.sync-1M", "wgmma-B compact")


@dataclass(frozen=True)
class Config:
    mode: int            # 0 wait/free only, 1 ldmatrix + mma.sync, 2 wgmma, 3 wgmma with the weights as B, 4 mode 1
                         # on mode 3's one-M-tile chunk
    n: int               # tokens: 8 or 16
    resident: bool       # copy the first NS chunks only (the consumers' own rate)
    warp_arrive: bool = False   # modes 1, 4: one arrive per warp instead of per thread
    b: int = 0           # mode 5: the real tokens (1..n; 0 = n)
    warps: int = 8       # consumer warps: 8, or 16 with modes 0, 1 (n 8: the reduction's partials) and 4
    chains: int = 1      # modes 1, 4: accumulator chains a warp's k-steps alternate between (1 or 2)

    def __post_init__(self) -> None:
        if self.mode not in range(6) or self.n not in (8, 16) or (self.warp_arrive and self.mode not in (1, 4)):
            raise ValueError(f"{self}: mode 0..5, n 8 or 16, warp_arrive only with modes 1 and 4")
        if self.b and (self.mode != 5 or not 1 <= self.b <= self.n):
            raise ValueError(f"{self}: b (real tokens) 1..n, mode 5 only")
        if self.warps not in (8, 16) or (self.warps == 16 and (self.mode not in (0, 1, 4) or
                                                               (self.mode == 1 and self.n == 16))):
            raise ValueError(f"{self}: warps 8, or 16 with modes 0, 4 and mode 1 at n 8")
        if self.chains not in (1, 2) or (self.chains == 2 and (self.mode not in (1, 4) or
                                                               (self.mode == 1 and self.warps == 16))):
            raise ValueError(f"{self}: chains 1, or 2 with modes 1 (8 warps) and 4")

    @property
    def threads(self) -> int:
        return 32 * (self.warps + 1)   # the consumers and one producer warp

    @property
    def tokens(self) -> int:
        return self.b or self.n

    def defines(self) -> tuple[str, ...]:
        return (f"-DWP_MODE={self.mode}", f"-DWP_N={self.n}", f"-DWP_RESIDENT={int(self.resident)}",
                f"-DWP_WARP_ARRIVE={int(self.warp_arrive)}") + ((f"-DWP_B={self.b}",) if self.b else ()) + (
                    (f"-DWP_CW={self.warps}",) if self.warps != 8 else ()) + (
                    (f"-DWP_CHAINS={self.chains}",) if self.chains != 1 else ())

    @property
    def consumers(self) -> str:
        """The mode's name, with the consumer warps and chains where they are not the 8 / 1 of every earlier row
        (the name goes to the CSV's mode column: its header stays)."""
        return MODES[self.mode] + (f" {self.warps}w" if self.warps != 8 else "") + (
            f" {self.chains}ch" if self.chains != 1 else "")

    @property
    def checked(self) -> bool:
        return self.mode != 0 and not self.resident

    def label(self) -> str:
        return (f"{self.consumers} N{self.n}{f' B{self.b}' if self.b else ''} "
                f"{'resident' if self.resident else 'streamed'}{' warp-arrive' if self.warp_arrive else ''}")


def config_grid() -> list[Config]:
    """The copy-only baseline and the mma.sync rows first (streamed and checked, resident, per-warp arrivals), the
    wgmma rows last: a fault in a new code path (a bad descriptor) loses the context, and the rows before it are
    kept."""
    g = [Config(0, 8, False), Config(0, 8, True)]
    g += [Config(m, n, res) for m in (1, 4) for res in (False, True) for n in (8, 16)]
    g += [Config(m, n, True, True) for m in (1, 4) for n in (8, 16)]
    g += [Config(m, n, res) for m in (2, 3) for res in (False, True) for n in (8, 16)]
    # the compact layout at batch 1-5 (K-direction offsets of 16-80 bytes; MK_WGMMA_B ran there until session 29) and 16
    g += [Config(5, 16, False, b=b) for b in (16, 5, 3, 2, 1)] + [Config(5, 16, True, b=1)]
    return g


def warps_grid() -> list[Config]:
    """`--grid warps` (session 55): the one-M-tile pattern of the megakernel's batch-1 chain tasks (mode 4) and the
    four-M-tile one (mode 1, n 8) at 8 and 16 consumer warps and with two accumulator chains, resident (the
    consumers' own rate) and streamed (checked), after the copy-only baseline at 16 warps."""
    g = [Config(0, 8, True, warps=16)]
    for res in (True, False):
        g += [Config(4, n, res, warps=w, chains=c) for n in (8, 16) for w, c in ((8, 1), (16, 1), (8, 2))]
        g += [Config(1, 8, res, warps=w, chains=c) for w, c in ((8, 1), (16, 1), (8, 2))]
    return g


GRIDS = {"all": config_grid, "warps": warps_grid}


def geometry(gb: float, num_sms: int) -> tuple[int, int]:
    """(rows per CTA, chunks per CTA) for ~gb GB of W over num_sms CTAs; SystemExit for a bad --gb."""
    if not (math.isfinite(gb) and 0 < gb <= 16):
        raise SystemExit(f"--gb {gb}: want a size in GB in (0, 16] (default 1.0: > 50 MB of L2)")
    rows = int(gb * 1e9 // (num_sms * K * 2)) // ROWS * ROWS
    if rows < ROWS:
        raise SystemExit(f"--gb {gb}: too small for {num_sms} SMs (at least {num_sms * ROWS * K * 2 / 1e9:.3f})")
    return rows, rows // ROWS * (K // KC)


def build_source() -> str:
    return common.inline_includes(SOURCE)


def compile_options(arch: str, cfg: Config) -> tuple[str, ...]:
    """NVRTC options as the project's runtime.py, plus the config's switches."""
    return ("-std=c++17", f"--gpu-architecture={arch}", *cfg.defines())


def weight_map_args(rows_total: int, mode: int):
    """W [rows_total, K] as (64 columns, rows, K / 64 column groups) with the 128-byte swizzle, box (64, 64, 4): a
    chunk lands as [column group][64 rows][128 B]; mode 3's box (64, 16, 16): [column group][16 rows][128 B]."""
    from mk_plugin.persistent.tensormap import _SWIZZLE_128B, TileMapArgs
    rows, kc = (ROWS_B, KC_B) if mode >= 3 else (ROWS, KC)
    return TileMapArgs(dims=(64, rows_total, K // 64), strides=(K * 2, 128), box=(64, rows, kc // 64),
                       swizzle=_SWIZZLE_128B)


TABLE_HEADER = ("consumers", "N", "data", "arrive", "launch ms", "GB/s", "% of 4.26", "us/chunk/SM", "fixed us",
                "check")


def table_row(cfg: Config, ms: float | None, gbps: float, us_chunk: float, rel: float | None,
              failed: str | None = None, fixed_us: float = 0.0) -> list[str]:
    """us/chunk/SM: the full-size launch's time less the half-size one's over their chunks' difference (the
    consumers' or the copy's per-chunk time, whichever bounds); fixed us: what is left of a launch (start, x staging,
    the first copies, the drain). GB/s and % of 4.26: the full-size launch's, fixed costs included."""
    head = [cfg.consumers, f"{cfg.n} (B {cfg.b})" if cfg.b else str(cfg.n), "resident" if cfg.resident else "streamed",
            "per warp" if cfg.warp_arrive else "per thread"]
    if ms is None:
        return head + ["", "", "", "", "", failed or "not run"]
    check = "-" if rel is None else f"{'ok' if rel <= TOL else 'FAIL'} ({rel:.1e})"
    return head + [f"{ms:.3f}", f"{gbps:.0f}", f"{100 * gbps / COPY_GBPS:.0f}%", f"{us_chunk:.3f}", f"{fixed_us:.1f}",
                   check]


def rel_error(y, x, w) -> float:
    """max |y - x W^T| / max |x W^T| in fp32, W in slices (its fp32 copy would not fit at once)."""
    import torch
    err, scale = 0.0, 0.0
    for r0 in range(0, w.shape[0], 1 << 16):
        ref = x.float() @ w[r0:r0 + (1 << 16)].float().T
        diff = (y[:, r0:r0 + (1 << 16)] - ref).abs()
        if not bool(torch.isfinite(diff).all()):
            return float("inf")   # a row the kernel did not write (still the NaN poison) or a non-finite sum
        err = max(err, float(diff.max()))
        scale = max(scale, float(ref.abs().max()))
        del ref
    return err / scale if scale > 0 else float("inf")


def measure(fn, args: tuple, grid: int, threads: int, reps: int, sink) -> tuple[list[float], str | None]:
    """Launch times (ms) of `reps` launches queued back to back (the GPU never idles when a start event is queued,
    so the host's launch call is not timed) after WARMUP launches, or [] and why the probe refused or timed out
    (checked after the first launch: a broken config costs one ~2 s wait budget)."""
    import torch

    def failed() -> str | None:
        flag = float(sink.item())
        return None if flag == 0.0 else {1.0: "an mbarrier wait timed out (a probe bug)",
                                         2.0: "the dynamic shared memory is not 1024-byte aligned",
                                         3.0: "K or rows per CTA outside the kernel's geometry"}.get(flag, str(flag))

    for r in range(WARMUP):
        fn((grid,), (threads,), args, shared_mem=SMEM_BYTES)
        if r == 0:
            torch.cuda.synchronize()
            if (why := failed()) is not None:
                return [], why
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for t0, t1 in events:
        t0.record()
        fn((grid,), (threads,), args, shared_mem=SMEM_BYTES)
        t1.record()
    torch.cuda.synchronize()
    if (why := failed()) is not None:
        return [], why
    return [t0.elapsed_time(t1) for t0, t1 in events], None


def run(gb: float, reps: int, grid_name: str = "all") -> tuple[str, list[list], bool]:
    """Measure every config; (markdown, csv rows, every check passed). A config that times out is reported and the
    next one runs; a CUDA error (the context is lost) ends the run with the rows measured so far."""
    import torch

    from mk_plugin.persistent.tensormap import encode_tile_map
    if reps < 1:
        raise SystemExit(f"--reps {reps}: want >= 1")
    cp, props = common.probe_device(KERNEL)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    grid = int(props["multiProcessorCount"])
    arch = f"sm_{props['major']}{props['minor']}a"
    rows, chunks = geometry(gb, grid)
    rows_total = rows * grid
    # a second, half-size launch of every config: the per-chunk cost is the difference over the chunks' difference,
    # free of each launch's fixed costs (CTA start, x staging, the first copies, the drain)
    rows_small = rows // 2 // ROWS * ROWS
    chunks_small = chunks * rows_small // rows
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w = (torch.randn(rows_total, K, device=DEVICE, generator=gen) * 0.05).to(torch.bfloat16)
    xs = {n: torch.randn(n, K, device=DEVICE, generator=gen).to(torch.bfloat16) for n in (8, 16)}
    ys = {n: torch.empty(n, rows_total, device=DEVICE, dtype=torch.float32) for n in (8, 16)}
    wmaps = {m: torch.frombuffer(bytearray(encode_tile_map(w.data_ptr(), weight_map_args(rows_total, m))),
                                 dtype=torch.uint8).to(DEVICE) for m in (0, 3)}   # mode 4 takes mode 3's
    sink = torch.zeros(1, device=DEVICE, dtype=torch.float32)
    src = build_source()
    rows_md, rows_csv, ok_all = [], [], True
    commit, date = common.git_commit(), common.today()
    nbytes = grid * chunks * CHUNK_BYTES
    # torch raises RuntimeError for a CUDA error, CuPy its own (runtime / driver errors, NVRTC's CompileException)
    cuda_errors = (RuntimeError, cp.cuda.driver.CUDADriverError, cp.cuda.runtime.CUDARuntimeError)
    configs = GRIDS[grid_name]()
    for i, cfg in enumerate(configs):
        try:
            fn = cp.RawModule(code=src, options=compile_options(arch, cfg)).get_function(KERNEL)
            fn.max_dynamic_shared_size_bytes = SMEM_BYTES
        except cp.cuda.compiler.CompileException as e:   # the context is fine: the next config runs
            rows_md.append(table_row(cfg, None, 0.0, 0.0, None, f"FAIL: NVRTC: {str(e)[:120]}"))
            ok_all = False
            print(f"{cfg.label()}: NVRTC failed: {e}", file=sys.stderr, flush=True)
            continue
        try:
            y = ys[cfg.n]
            wmap = wmaps[3 if cfg.mode >= 3 else 0]

            def args_for(n_rows: int, y=y, wmap=wmap, cfg=cfg) -> tuple:
                return tuple(cp.uint64(t.data_ptr()) for t in (wmap, xs[cfg.n], y)) + (
                    cp.int32(n_rows), cp.int32(K), cp.int32(rows_total), cp.uint64(sink.data_ptr()))
            sink.zero_()
            small, why = measure(fn, args_for(rows_small), grid, cfg.threads, reps, sink)
            y.fill_(float("nan"))   # poisoned: a row the full-size launches never write fails the check
            times, why2 = measure(fn, args_for(rows), grid, cfg.threads, reps, sink) if why is None else ([], why)
            why = why or why2
            t = cfg.tokens   # mode 5 writes y for its real tokens only
            rel = rel_error(y[:t], xs[cfg.n][:t], w) if cfg.checked and why is None else None
        except cuda_errors as e:   # a CUDA error is sticky: keep what was measured, name the rest
            lost = ", ".join(c.label() for c in configs[i + 1:])
            rows_md.append(table_row(cfg, None, 0.0, 0.0, None, f"ERROR {type(e).__name__}: {str(e)[:120]}"))
            print(f"{cfg.label()}: {type(e).__name__}: {e}; not run: {lost}", file=sys.stderr, flush=True)
            ok_all = False
            break
        if why is not None:
            rows_md.append(table_row(cfg, None, 0.0, 0.0, None, f"FAIL: {why}"))
            ok_all = False
            print(f"{cfg.label()}: {why}", file=sys.stderr, flush=True)
            continue
        ms, ms_small = common.median(times), common.median(small)
        ok_all &= rel is None or rel <= TOL
        gbps = nbytes / (ms * 1e-3) / 1e9
        us_chunk = (ms - ms_small) * 1e3 / (chunks - chunks_small)
        fixed_us = ms * 1e3 - us_chunk * chunks
        rows_md.append(table_row(cfg, ms, gbps, us_chunk, rel, fixed_us=fixed_us))
        print(" | ".join(rows_md[-1]), flush=True)
        rows_csv.append([date, name, commit, cfg.consumers, cfg.n, cfg.tokens, int(cfg.resident), int(cfg.warp_arrive),
                         f"{ms:.4f}", f"{gbps:.1f}", f"{us_chunk:.4f}", f"{fixed_us:.2f}",
                         "" if rel is None else f"{rel:.2e}"])
    title = (f"### wgmma_probe: {name}, {grid} SMs, {nbytes / 1e9:.2f} GB per launch ({chunks} chunks of 32 KB "
             f"per SM), median of {reps} ({WARMUP} warm-up), commit {commit}, {date}")
    notes = ("Chunks of 64 rows x 256 columns (one 128B-swizzled tensor-map copy), 5 slots, K 1024. mma.sync: 8 "
             "warps, each 2 k-steps x 4 M-tiles of ldmatrix.x4 + NT mma.m16n8k16 a chunk (x fragments from shared "
             "memory); wgmma: 2 warpgroups, each 8 wgmma.m64nNk16 a chunk, the slot freed when the next chunk's "
             "group is issued and this one's done; wgmma-B: chunks of 16 rows x 1024 columns, the weights as B "
             "(N 16), x as A (M 64), 32 wgmma.m64n16k16 per warpgroup a chunk; mma.sync-1M: mma.sync on those "
             "chunks, 8 k-steps of one M-tile a warp. resident: the first 5 chunks copied, then only arrivals (the "
             "consumers' own rate; y meaningless). us/chunk/SM: (full launch - half launch) / their chunks' "
             f"difference ({chunks} and {chunks_small} a CTA), timed back to back. Compare like with like: wgmma with "
             "mma.sync (4 chunks a 64-row block), wgmma-B with mma.sync-1M (one chunk a block, an epilogue each). "
             f"check: max |y - x W^T| / max |x W^T| <= {TOL}. A consumers name with 16w: 16 consumer warps (k-step j "
             "of a chunk to warp j % 16, 16 partials reduced); 2ch: a warp's k-steps alternate between two "
             "accumulator chains, summed before the reduction.")
    md = "\n".join([title, "", notes, "", common.markdown_table(TABLE_HEADER, rows_md), ""])
    return md, rows_csv, ok_all


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0, help="GB of W per launch (default 1.0; L2 is 50 MB)")
    p.add_argument("--reps", type=int, default=10, help="timed launches per config (median; default 10)")
    p.add_argument("--grid", choices=sorted(GRIDS), default="all",
                   help="configs: all (default), or warps: 8 against 16 consumer warps and 2 accumulator chains on the "
                        "one- and four-M-tile mma.sync patterns (session 55)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table to this file")
    p.add_argument("--csv", type=Path, default=CSV, help=f"rows appended here (default {CSV.name} in bench/results)")
    a = p.parse_args(argv)
    geometry(a.gb, H200_SMS)   # a bad --gb fails before CUDA is touched
    md, rows, ok = run(a.gb, a.reps, a.grid)
    if a.out is not None:
        common.write_record(a.out.parent, a.out.name, md)   # prints it too
    else:
        print(md)
    common.append_csv(a.csv, CSV_HEADER, rows)
    print(f"appended {len(rows)} rows to {a.csv}")
    if not ok:
        print("a streamed row's y differs from torch's: see the check column", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
