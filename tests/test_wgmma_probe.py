"""bench/wgmma_probe.py on CPU: bench/wgmma_probe.cu compiles for sm_90a without spills or warnings in every config
of the grid (nvcc -cubin -Xptxas -v, found as in tests/test_csrc_compile.py: a missing nvcc fails, never skips;
NVRTC, what CuPy runs on the GPU host, skips visibly without libnvrtc), the wgmma configs issue HGMMA, and the
Python side's geometry and shared-memory size match the kernel's constants."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from cuda_tools import libnvrtc_path, nvcc_path, nvrtc_compile  # tests/cuda_tools.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import wgmma_probe as wp


def _nvcc(tmp_path: Path, cfg: wp.Config) -> tuple[str, Path]:
    nvcc = nvcc_path()
    assert nvcc is not None, "nvcc not found (looked in /usr/local/cuda/bin and on PATH)"
    src = tmp_path / "wgmma_probe.cu"
    src.write_text(wp.build_source())
    cubin = tmp_path / f"p{'_'.join(d.split('=')[1] for d in cfg.defines())}.cubin"
    opts = [o.replace("--gpu-architecture=", "-arch=") for o in wp.compile_options("sm_90a", cfg)]
    r = subprocess.run([nvcc, *opts, "-cubin", "-Xptxas", "-v", "-o", str(cubin), str(src)],
                       capture_output=True, text=True, timeout=300, check=False)
    log = r.stdout + r.stderr
    assert r.returncode == 0, f"nvcc failed for {cfg}:\n{log[-4000:]}"
    return log, cubin


@pytest.mark.parametrize("cfg", list(dict.fromkeys(wp.config_grid() + wp.warps_grid())),
                         ids=lambda c: "_".join(d[5:] for d in c.defines()))
def test_every_config_compiles_without_spills_or_warnings(tmp_path, cfg):
    log, _ = _nvcc(tmp_path, cfg)
    assert re.search(r"Compiling entry function 'wgmma_probe' for 'sm_90a'", log), log[-2000:]
    assert re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log) == [("0", "0")], log[-2000:]
    assert "warning" not in log.lower(), log[-2000:]
    # ptxas reports serialized wgmma (a register touched between them) only as an info line (C7520)
    assert "Potential Performance Loss" not in log, log[-2000:]


@pytest.mark.parametrize("mode, n, hgmmas", [(2, 16, 8), (2, 8, 8), (3, 8, 32), (3, 16, 32), (5, 16, 32)])
def test_the_wgmma_configs_issue_warpgroup_mmas(tmp_path, mode, n, hgmmas):
    """The SASS of modes 2 and 3 has 8 / 32 HGMMA a chunk (one unrolled loop: mode 3's B is 16 weight rows at any
    token count), waits on its groups and has no register-fed HMMA."""
    import sass as bench_sass  # bench/sass.py: Triton's nvdisasm

    _, cubin = _nvcc(tmp_path, wp.Config(mode, n, False))
    sass = subprocess.run([bench_sass.tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, timeout=300,
                          check=True).stdout
    shape = f"64x{16 if mode == 3 else n}x16"
    assert len(re.findall(rf"HGMMA\.{shape}\.F32\.BF16", sass)) == hgmmas, sass[-3000:]
    assert len(re.findall(r"HGMMA[^;]*gsb0 ;", sass)) == 1, "serialized: more than one group barrier a chunk"
    assert "WARPGROUP.DEPBAR.LE" in sass and "HMMA" not in sass.replace("HGMMA", "")


@pytest.mark.skipif(libnvrtc_path() is None, reason="no libnvrtc on this machine")
def test_nvrtc_compiles_the_probe():
    for cfg in (wp.Config(1, 16, True, True), wp.Config(2, 8, False)):
        rc, log = nvrtc_compile(libnvrtc_path(), wp.build_source(), "wgmma_probe.cu", wp.compile_options("sm_90a", cfg))
        assert rc == 0, f"NVRTC failed for {cfg}:\n{log[-4000:]}"
        assert "warning" not in log.lower(), log[-2000:]


def test_constants_match_the_kernel():
    src = wp.SOURCE.read_text()
    const: dict[str, list[int]] = {}
    for k, v in re.findall(r"constexpr int (WP_\w+) = (\d+);", src):
        const.setdefault(k, []).append(int(v))
    assert (const["WP_NS"], const["WP_MAX_K"]) == ([wp.NS], [wp.K])
    assert const["WP_ROWS"] == [wp.ROWS_B, wp.ROWS] and const["WP_KC"] == [wp.KC_B, wp.KC]   # mode 3's, the others'
    assert wp.ROWS * wp.KC == wp.ROWS_B * wp.KC_B   # the same 32 KB chunk: as many chunks per CTA
    assert wp.SMEM_BYTES == 229456 and wp.SMEM_BYTES <= 232448   # ring, x [16 groups][16 rows][128 B], reduction, barriers
    assert "constexpr int WP_RED_BYTES = 8 * 4 * 2 * 32 * 16;" in src


def test_grid_and_geometry():
    grid = wp.config_grid()
    assert len(set(grid)) == len(grid) and all(c.checked == (c.mode != 0 and not c.resident) for c in grid)
    assert {(c.mode, c.n) for c in grid if c.checked} == {(m, n) for m in (1, 2, 3, 4) for n in (8, 16)} | {(5, 16)}
    assert sorted(c.tokens for c in grid if c.mode == 5) == [1, 1, 2, 3, 5, 16]
    # mode 5's configs pass their real tokens as -DWP_B, the others not at all
    assert all(any(d.startswith("-DWP_B=") for d in c.defines()) == (c.mode == 5) for c in grid)
    rows, chunks = wp.geometry(1.0, 132)
    assert rows % wp.ROWS == 0 and chunks == rows // 64 * 4 and rows * 132 * wp.K * 2 <= 1e9
    for bad in (0.0, -1.0, float("nan"), 1e-6):
        with pytest.raises(SystemExit, match="--gb"):
            wp.geometry(bad, 132)
    with pytest.raises(ValueError, match="warp_arrive only with modes 1 and 4"):
        wp.Config(2, 8, True, True)
    args = wp.weight_map_args(132 * rows, 2)
    # session 55's grid: 8 / 16 consumer warps and two accumulator chains, each resident and streamed (checked)
    wg = wp.warps_grid()
    assert len(set(wg)) == len(wg) and {c.consumers for c in wg if c.checked} == {
        "mma.sync-1M", "mma.sync-1M 16w", "mma.sync-1M 2ch", "mma.sync", "mma.sync 16w", "mma.sync 2ch"}
    assert [c.threads for c in (wp.Config(4, 8, True), wp.Config(4, 8, True, warps=16))] == [288, 544]
    assert wp.Config(4, 16, True, warps=16, chains=1).defines()[-1] == "-DWP_CW=16"
    assert wp.Config(4, 8, True).defines() == ("-DWP_MODE=4", "-DWP_N=8", "-DWP_RESIDENT=1", "-DWP_WARP_ARRIVE=0")
    for mode, n, warps, chains in ((2, 8, 16, 1), (1, 16, 16, 1), (4, 8, 12, 1), (2, 8, 8, 2), (1, 8, 16, 2),
                                   (4, 8, 8, 3)):
        with pytest.raises(ValueError, match="warps|chains"):
            wp.Config(mode, n, True, warps=warps, chains=chains)
    assert args.box == (64, 64, 4) and args.dims == (64, 132 * rows, 16) and args.strides == (2048, 128)
    assert wp.weight_map_args(132 * rows, 3).box == wp.weight_map_args(132 * rows, 4).box == (64, 16, 16)   # MK_W_TMA's


# ---- the probe's shared-memory addressing, emulated byte by byte (numpy) ---------------------------------------
# The model (CUTLASS's Swizzle<3,4,3>, what TMA's 128-byte swizzle writes and wgmma's 128B-swizzle mode reads): the
# 16-byte unit bits [4:6] of an address XOR its bits [7:9], over a 1024-byte aligned base. The same model on both
# sides makes this a check of the probe's index arithmetic (group offsets, descriptor starts, SBO), not of the
# hardware: the streamed rows' check against torch on the GPU is that.
def _phys(addr):
    return addr ^ (((addr >> 7) & 7) << 4)


def _tma_place(mat, rows, groups):
    """A [rows, groups * 64] tile as a TMA box (64, rows, groups) with the 128-byte swizzle lands: uint16 smem."""
    import numpy as np
    smem = np.zeros(rows * groups * 64, dtype=np.int64)
    for r in range(rows):
        for k in range(groups * 64):
            lin = (k // 64) * rows * 128 + r * 128 + (k % 64) * 2
            smem[_phys(lin) // 2] = mat[r, k]
    return smem


def _desc_read(smem, start, rows):
    """What wgmma reads through a K-major 128B-swizzle descriptor (SBO 1024) at `start`: [rows, 16]."""
    import numpy as np
    out = np.zeros((rows, 16), dtype=np.int64)
    for m in range(rows):
        for k in range(16):
            lin = start + (m // 8) * 1024 + (m % 8) * 128 + k * 2
            out[m, k] = smem[_phys(lin) // 2] if _phys(lin) // 2 < smem.size else 0
    return out


@pytest.mark.parametrize("n", [8, 16])
def test_wgmma_modes_read_the_operands_they_mean(n):
    """Mode 2 (A = a 64-row chunk, B = x) and mode 3 (A = x, B = a 16-row chunk): the descriptors' starts and SBO
    select W[rows, k-step columns] and x[tokens, same columns] for every k-step of a chunk."""
    import numpy as np
    rng = np.random.default_rng(n)
    K = wp.K
    x = rng.integers(1, 1 << 15, size=(n, K))
    xs = _tma_place(x, n, K // 64)             # the kernel's x staging writes the same layout (wp_swz)
    # mode 2: chunk kc of a 64-row block: columns kc*256 + [0, 256); warpgroup g's k-step kk: group 2g + kk // 4
    w = rng.integers(1, 1 << 15, size=(64, K))
    for kc in (0, 3):
        slot = _tma_place(w[:, kc * 256:(kc + 1) * 256], 64, 4)
        for wg in (0, 1):
            for kk in range(8):
                g = 2 * wg + (kk >> 2)
                col = kc * 256 + g * 64 + (kk & 3) * 16
                a = _desc_read(slot, g * 64 * 128 + (kk & 3) * 32, 64)
                b = _desc_read(xs, (kc * 4 + g) * n * 128 + (kk & 3) * 32, n)
                assert (a == w[:, col:col + 16]).all() and (b == x[:, col:col + 16]).all(), (kc, wg, kk)
    # mode 3: a chunk is 16 rows x 1024 columns; warpgroup g's k-step kk: group 8g + kk // 4; A's rows past the
    # tokens are dropped, so only rows < n are compared
    w16 = rng.integers(1, 1 << 15, size=(16, K))
    slot = _tma_place(w16, 16, 16)
    for wg in (0, 1):
        for kk in range(32):
            g = 8 * wg + (kk >> 2)
            col = g * 64 + (kk & 3) * 16
            a = _desc_read(xs, g * n * 128 + (kk & 3) * 32, 64)[:n]
            b = _desc_read(slot, g * 16 * 128 + (kk & 3) * 32, 16)
            assert (a == x[:, col:col + 16]).all() and (b == w16[:, col:col + 16]).all(), (wg, kk)


@pytest.mark.parametrize("rows, groups, kc", [(64, 4, 2), (16, 16, 0)])   # modes 1 and 4
def test_mma_sync_mode_fragments_are_the_operands(rows, groups, kc):
    """Modes 1 and 4: warp w's k-step j = w + 8 jj of a chunk, ldmatrix.x4 lane l reads row 16 m + (l & 15), unit
    (j & 3) * 2 + (l >> 4) of group j >> 2; the B fragment of token t = 8 nt + lane / 4 is the 32-bit word at
    unit u (+ 1) and byte (lane & 3) * 4: together they are W[16 m.., 16 columns of step j] and x[t, same]."""
    import numpy as np
    rng = np.random.default_rng(1)
    n, K = 16, wp.K
    w = rng.integers(1, 1 << 15, size=(rows, groups * 64))
    x = rng.integers(1, 1 << 15, size=(n, K))
    slot, xs = _tma_place(w, rows, groups), _tma_place(x, n, K // 64)
    for j in range(groups * 4):
        g, u = j >> 2, (j & 3) * 2
        col = g * 64 + (j & 3) * 16
        for m in range(rows // 16):
            for lane in range(32):   # lane's 8 consecutive elements: row 16 m + (lane & 15), columns +8 (lane >> 4)
                r = m * 16 + (lane & 15)
                base = g * rows * 128 + r * 128 + (((u + (lane >> 4)) ^ (r & 7)) << 4)   # wp_swz, no second swizzle
                got = [slot[(base + 2 * e) // 2] for e in range(8)]
                assert got == list(w[r, col + 8 * (lane >> 4): col + 8 * (lane >> 4) + 8]), (j, m, lane)
        for lane in range(32):
            for nt in range(2):
                tok = nt * 8 + (lane >> 2)
                for h in range(2):   # b0: columns 2 (lane & 3) + {0, 1}; b1: the same + 8
                    off = (kc * groups + g) * n * 128 + tok * 128 + (((u + h) ^ (tok & 7)) << 4) + (lane & 3) * 4
                    got = [xs[off // 2], xs[off // 2 + 1]]
                    c0 = kc * groups * 64 + col + 8 * h + 2 * (lane & 3)
                    assert got == list(x[tok, c0:c0 + 2]), (j, lane, nt, h)


def test_run_keeps_the_rows_before_a_fault_and_reports_timeouts(monkeypatch, tmp_path, capsys):
    """run()'s plumbing on the CPU with a fake CuPy: every config compiles and launches in grid order; a timed-out
    config is reported and the next runs; a CUDA error (here at the first wgmma row) ends the run with the rows
    measured before it; main() writes the table and the CSV and exits 1."""
    import types

    import common
    import torch

    launched: list[tuple] = []

    class FakeFn:
        max_dynamic_shared_size_bytes = 0

        def __init__(self, options):
            self.options = options

        def __call__(self, grid, block, args, shared_mem):
            launched.append(self.options)
            if "-DWP_MODE=2" in self.options:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

    class FakeModule:
        def __init__(self, code, options):
            assert "wgmma_probe" in code and options[1] == "--gpu-architecture=sm_90a"
            self.options = options

        def get_function(self, name):
            return FakeFn(self.options)

    errs = types.SimpleNamespace(compiler=types.SimpleNamespace(CompileException=type("CE", (Exception,), {})),
                                 driver=types.SimpleNamespace(CUDADriverError=type("DE", (RuntimeError,), {})),
                                 runtime=types.SimpleNamespace(CUDARuntimeError=type("RE", (RuntimeError,), {})))
    cp = types.SimpleNamespace(RawModule=FakeModule, uint64=int, int32=int, cuda=errs)
    props = {"name": b"Fake H200", "multiProcessorCount": 2, "major": 9, "minor": 0}
    monkeypatch.setattr(common, "probe_device", lambda tool: (cp, props))
    monkeypatch.setattr("mk_plugin.persistent.tensormap.encode_tile_map", lambda addr, args: bytes(128))
    monkeypatch.setattr(wp, "DEVICE", "cpu")
    monkeypatch.setattr(wp, "rel_error", lambda y, x, w: 1e-6)

    class FakeEvent:
        def __init__(self, enable_timing):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 0.25

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    real_measure = wp.measure

    def measure(fn, args, grid, threads, reps, sink):
        assert threads == 32 * (16 if "-DWP_CW=16" in fn.options else 8) + 32
        if "-DWP_MODE=4" in fn.options and "-DWP_RESIDENT=1" in fn.options and "-DWP_N=8" in fn.options \
                and "-DWP_WARP_ARRIVE=0" in fn.options:
            return [], "an mbarrier wait timed out (a probe bug)"
        return real_measure(fn, args, grid, threads, reps, sink)

    monkeypatch.setattr(wp, "measure", measure)
    rc = wp.main(["--gb", "0.02", "--reps", "3", "--csv", str(tmp_path / "p.csv"), "--out", str(tmp_path / "p.md")])
    assert rc == 1
    md = (tmp_path / "p.md").read_text()
    grid = wp.config_grid()
    first_wgmma = next(i for i, c in enumerate(grid) if c.mode == 2)
    assert md.count("| wgmma | ") == 1 and "ERROR RuntimeError: CUDA error" in md and "wgmma-B" not in md.split("|\n")[-1]
    assert "FAIL: an mbarrier wait timed out" in md and "| mma.sync-1M | 8 | resident | per thread |" in md
    csv_rows = (tmp_path / "p.csv").read_text().splitlines()
    assert len(csv_rows) == 1 + first_wgmma - 1   # the header, every row before the fault but the timed-out one
    assert all(",ok" not in r for r in csv_rows) and "0.2500" in csv_rows[1]
    # each config launched WARMUP + reps times at two sizes but the timed-out one (0 here: measure replaced) and the
    # faulting one (its first launch)
    assert len(launched) == (first_wgmma - 1) * 2 * (wp.WARMUP + 3) + 1
    assert "not run: wgmma N16 streamed" in capsys.readouterr().err


def _ns_desc_read(smem, start, lbo, sbo, rows):
    """What wgmma reads through a K-major no-swizzle descriptor: core matrices of 8 rows x 16 bytes (rows 16 bytes
    apart), lbo bytes apart along K (2 per 16-column k-step), sbo bytes apart along M: [rows, 16]."""
    import numpy as np
    out = np.zeros((rows, 16), dtype=np.int64)
    for m in range(rows):
        for k in range(16):
            addr = start + (m // 8) * sbo + (m % 8) * 16 + (k // 8) * lbo + (k % 8) * 2
            out[m, k] = smem[addr // 2] if addr // 2 < smem.size else 0
    return out


@pytest.mark.parametrize("b", [1, 2, 3, 5, 16])
def test_compact_x_descriptor_reads_the_real_tokens(b):
    """Mode 5: x's B real tokens as [K / 8][B][16 B]; the A descriptor at (16 columns from c0) starts at c0 / 8 * B
    * 16 with LBO B * 16 and SBO 128: rows < B are x[row, c0 .. c0 + 16] (rows >= B alias other tokens' bytes)."""
    import numpy as np
    rng = np.random.default_rng(b)
    K = wp.K
    x = rng.integers(1, 1 << 15, size=(b, K))
    smem = np.zeros(K * b, dtype=np.int64)          # 2 B K bytes of uint16
    for t in range(b):
        for k8 in range(K // 8):
            smem[(k8 * b + t) * 8:(k8 * b + t) * 8 + 8] = x[t, k8 * 8:(k8 + 1) * 8]
    for kg in (0, 7, 15):
        for kk in range(4):
            c0 = kg * 64 + kk * 16
            a = _ns_desc_read(smem, (kg * 8 + kk * 2) * b * 16, b * 16, 128, 64)[:b]
            assert (a == x[:, c0:c0 + 16]).all(), (b, kg, kk)
