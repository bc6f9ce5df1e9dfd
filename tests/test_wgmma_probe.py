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


@pytest.mark.parametrize("cfg", wp.config_grid(), ids=lambda c: "_".join(d[5:] for d in c.defines()))
def test_every_config_compiles_without_spills_or_warnings(tmp_path, cfg):
    log, _ = _nvcc(tmp_path, cfg)
    assert re.search(r"Compiling entry function 'wgmma_probe' for 'sm_90a'", log), log[-2000:]
    assert re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log) == [("0", "0")], log[-2000:]
    assert "warning" not in log.lower(), log[-2000:]


@pytest.mark.parametrize("mode, n, hgmmas", [(2, 16, 8), (2, 8, 8), (3, 8, 32)])
def test_the_wgmma_configs_issue_warpgroup_mmas(tmp_path, mode, n, hgmmas):
    """The SASS of modes 2 and 3 has 8 / 32 HGMMA a chunk (one unrolled loop: mode 3's B is 16 weight rows at any
    token count), waits on its groups and has no register-fed HMMA."""
    import sass as bench_sass  # bench/sass.py: Triton's nvdisasm

    _, cubin = _nvcc(tmp_path, wp.Config(mode, n, False))
    sass = subprocess.run([bench_sass.tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, timeout=300,
                          check=True).stdout
    shape = f"64x{16 if mode == 3 else n}x16"
    assert len(re.findall(rf"HGMMA\.{shape}\.F32\.BF16", sass)) == hgmmas, sass[-3000:]
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
    assert {(c.mode, c.n) for c in grid if c.checked} == {(m, n) for m in (1, 2, 3) for n in (8, 16)}
    rows, chunks = wp.geometry(1.0, 132)
    assert rows % wp.ROWS == 0 and chunks == rows // 64 * 4 and rows * 132 * wp.K * 2 <= 1e9
    for bad in (0.0, -1.0, float("nan"), 1e-6):
        with pytest.raises(SystemExit, match="--gb"):
            wp.geometry(bad, 132)
    with pytest.raises(ValueError, match="warp_arrive only with mode 1"):
        wp.Config(2, 8, True, True)
    args = wp.weight_map_args(132 * rows, 2)
    assert args.box == (64, 64, 4) and args.dims == (64, 132 * rows, 16) and args.strides == (2048, 128)
    assert wp.weight_map_args(132 * rows, 3).box == (64, 16, 16)   # MK_W_TMA's chunk: [16 groups][16 rows][128 B]
