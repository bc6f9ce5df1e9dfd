"""bench/bulk_probe.py on CPU: bench/bulk_probe.cu compiles for sm_90a without spills from exactly
build_source() + compile_options() (nvcc -cubin -Xptxas -v, the compiler found as in
tests/test_csrc_compile.py: a missing nvcc fails, never skips; the NVRTC build that CuPy does on the GPU
host skips visibly without libnvrtc), and the config grid's shared memory
and bytes per launch are as documented."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from cuda_tools import libnvrtc_path, nvcc_path, nvrtc_compile  # tests/cuda_tools.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bulk_probe as bp


def test_probe_kernel_compiles_without_spills(tmp_path):
    nvcc = nvcc_path()
    # CI machines carry nvcc 13.0 (no GPU); a missing compiler is a broken machine, not a skip.
    assert nvcc is not None, "nvcc not found (looked in /usr/local/cuda/bin and on PATH)"
    src = tmp_path / "bulk_probe.cu"
    src.write_text(bp.build_source())
    opts = [o.replace("--gpu-architecture=", "-arch=") for o in bp.compile_options("sm_90a")]
    r = subprocess.run([nvcc, *opts, "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "p.cubin"), str(src)],
                       capture_output=True, text=True, timeout=300, check=False)
    log = r.stdout + r.stderr
    assert r.returncode == 0, f"nvcc failed:\n{log[-4000:]}"
    assert re.search(r"Compiling entry function 'bulk_probe' for 'sm_90a'", log), log[-2000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills == [("0", "0")], f"register spills or no ptxas report:\n{log[-2000:]}"
    assert "warning" not in log.lower(), log[-2000:]


@pytest.mark.skipif(libnvrtc_path() is None, reason="no libnvrtc on this machine")
def test_nvrtc_compiles_the_probe():
    """What cupy.RawModule does on the GPU host: NVRTC with compile_options(), no warnings."""
    rc, log = nvrtc_compile(libnvrtc_path(), bp.build_source(), "bulk_probe.cu", bp.compile_options("sm_90a"))
    assert rc == 0, f"NVRTC failed:\n{log[-4000:]}"
    assert "warning" not in log.lower(), log[-2000:]


def test_compile_options_follow_the_project():
    assert bp.compile_options("sm_90a") == ("-std=c++17", "--gpu-architecture=sm_90a")
    assert 'extern "C" __global__' in bp.build_source() and bp.KERNEL in bp.build_source()


def test_grid_fits_or_is_skipped():
    grid = bp.config_grid()
    assert len(set(grid)) == len(grid)
    skipped = set()
    for cfg in grid:
        reason = bp.skip_reason(cfg, bp.H200_SMEM_OPTIN)
        assert (reason is None) == (cfg.smem_bytes <= bp.H200_SMEM_OPTIN), cfg
        if reason is not None:
            assert "skipped" in reason and str(cfg.smem_bytes) in reason
            skipped.add((cfg.mode_copy, cfg.kc, cfg.ns, cfg.compute))
    # the two configs of the brief that cannot fit an H200 (330240 and 328960 bytes) are listed, skipped
    assert skipped == {(0, 1024, 10, 0), (0, 2048, 5, 0)}
    # the megakernel's shape, 16 padded rows of 2 KB (33 KB slots, 6 deep), and 1 KB rows (10 deep: the
    # half-size slots of session 10)
    one = bp.Config(0, 1024, 6, 0)
    assert one.slot_bytes == 16 * 2064 and one.smem_bytes == 6 * 33024 + 96 and one.inflight_bytes == 6 * 32768
    half = bp.Config(0, 512, 10, 2)
    assert half.slot_bytes == 16 * 1040 and half.copy_bytes == 1024 and half.copies_per_chunk == 16
    tiled = bp.Config(1, 512, 6, 0)
    assert tiled.slot_bytes == 16 * 1024 and tiled.copy_bytes == 16 * 1024 and tiled.copies_per_chunk == 1
    # the grid holds every point the brief asks for
    want = {(0, kc, ns, 0) for kc in (256, 512, 1024) for ns in (6, 10)} | {(0, 2048, 3, 0), (0, 2048, 5, 0)}
    want |= {(0, kc, ns, c) for c in (1, 2) for kc, ns in ((512, 6), (512, 10), (1024, 6))}
    want |= {(1, kc, ns, c) for c in (0, 2) for kc, ns in ((512, 6), (512, 10), (1024, 6))}
    assert want <= {(c.mode_copy, c.kc, c.ns, c.compute) for c in grid}


def test_bytes_per_config_as_documented():
    for cfg in bp.config_grid():
        rows_total, chunks = bp.geometry(1.0, bp.H200_SMS, cfg.kc)
        assert rows_total % 16 == 0 and chunks == rows_total // 16 * (bp.K // cfg.kc)
        nbytes = bp.config_bytes(cfg, chunks, bp.H200_SMS)
        assert nbytes == chunks * 16 * cfg.kc * 2 * bp.H200_SMS
        assert nbytes == rows_total * bp.K * 2 * bp.H200_SMS        # each CTA's region, once
        assert 0.95e9 < nbytes <= 1e9                               # ~1 GB: far more than the 50 MB L2


@pytest.mark.parametrize("gb", [0.0, -1.0, float("nan"), float("inf"), 100.0, 1e-6])
def test_bad_gb_is_a_clear_error(gb):
    with pytest.raises(SystemExit, match="--gb"):
        bp.geometry(gb, bp.H200_SMS, 1024)


def test_table_row_rates():
    cfg = bp.Config(0, 1024, 6, 0)
    row = bp.table_row(cfg, 0.5, 2_000_000_000, 132)
    assert len(row) == len(bp.TABLE_HEADER)
    assert row[-4:] == ["0.500", "4000", "30.30", "94%"]
    skipped = bp.table_row(bp.Config(0, 1024, 10, 0), None, 1, 132, "skipped: too big")
    assert skipped[8] == "skipped: too big" and len(skipped) == len(bp.TABLE_HEADER)


def test_no_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)   # import cupy raises ImportError
    with pytest.raises(SystemExit, match="CuPy and a CUDA GPU"):
        bp.run(1.0, 10)


@pytest.mark.parametrize("passes", [0, -3, 1001])
def test_bad_passes_is_a_clear_error(passes):
    with pytest.raises(SystemExit, match="--passes"):
        bp.main(["--passes", str(passes)])


def test_passes_rows_go_to_their_own_csv():
    """Rows of re-read regions (L2-resident) never mix with the one-pass HBM rows: their own file, two more columns."""
    assert bp.CSV_L2 != bp.CSV and bp.CSV_L2_HEADER[:len(bp.CSV_HEADER)] == bp.CSV_HEADER
    assert bp.CSV_L2_HEADER[len(bp.CSV_HEADER):] == ("region_mb", "passes")
