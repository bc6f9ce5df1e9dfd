"""bench/release_probe.py on CPU: bench/release_probe.cu compiles for sm_90a without spills from exactly
build_source() + compile_options() (nvcc as in tests/test_bulk_probe.py: a missing nvcc fails, never skips;
the NVRTC build skips visibly without libnvrtc), and the table arithmetic is as documented."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from cuda_tools import libnvrtc_path, nvcc_path, nvrtc_compile  # tests/cuda_tools.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import release_probe as rp


def test_probe_kernel_compiles_without_spills(tmp_path):
    nvcc = nvcc_path()
    assert nvcc is not None, "nvcc not found (looked in /usr/local/cuda/bin and on PATH)"
    src = tmp_path / "release_probe.cu"
    src.write_text(rp.build_source())
    opts = [o.replace("--gpu-architecture=", "-arch=") for o in rp.compile_options("sm_90a")]
    r = subprocess.run([nvcc, *opts, "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "p.cubin"), str(src)],
                       capture_output=True, text=True, timeout=300, check=False)
    log = r.stdout + r.stderr
    assert r.returncode == 0, f"nvcc failed:\n{log[-4000:]}"
    assert re.search(r"Compiling entry function 'release_probe' for 'sm_90a'", log), log[-2000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills == [("0", "0")], f"register spills or no ptxas report:\n{log[-2000:]}"
    assert "warning" not in log.lower(), log[-2000:]


@pytest.mark.skipif(libnvrtc_path() is None, reason="no libnvrtc on this machine")
def test_nvrtc_compiles_the_probe():
    rc, log = nvrtc_compile(libnvrtc_path(), rp.build_source(), "release_probe.cu", rp.compile_options("sm_90a"))
    assert rc == 0, f"NVRTC failed:\n{log[-4000:]}"
    assert "warning" not in log.lower(), log[-2000:]


def test_shared_memory_fits_one_cta_per_sm():
    # the ring, 12 mbarriers and the 256-byte payload stage under the H200's 227 KB opt-in limit
    assert rp.SMEM_BYTES == 6 * 32768 + 96 + 256 < 227 * 1024
    assert f"#define RP_SLOT {rp.RING_BYTES // 6}u" in rp.build_source()


def test_handoff_is_half_a_round():
    assert rp.handoff_ns(4_000_000, 1000) == 2000.0
    with pytest.raises(ValueError, match="iters 0"):
        rp.handoff_ns(1, 0)


def test_table_row():
    row = rp.table_row(1, 1, 2, [900.0, 1100.0, 1000.0], 3901.4, 0)
    assert len(row) == len(rp.TABLE_HEADER)
    assert row == ["1", rp.MODES[1], "all SMs", "64 KB", "-", "1000", "900", "1100", "3901", "0"]
    idle = rp.table_row(0, 0, 6, [1200.0], float("nan"), 0)
    assert idle[2:5] == ["off", "-", "-"] and idle[8] == "-"
    # session 37's prefetch streams: the pace shows, the cap only where some SMs copy (stream 4)
    assert rp.table_row(0, 3, 6, [1.0], 5.0, 0, 500)[2:5] == [rp.STREAMS[3], "-", "500"]
    assert rp.table_row(0, 4, 6, [1.0], 5.0, 0, 250)[3:5] == ["192 KB", "250"]


def test_stream_rate():
    # 130 streaming CTAs x 1000 chunks of 32 KB over 1 ms = 4.26 GB/ms
    assert rp.stream_gbps(130, 1000, 1_000_000) == pytest.approx(130 * 1000 * 32768 / 1e6)
    assert rp.stream_gbps(130, 1000, 0) != rp.stream_gbps(130, 1000, 0)   # nan: no span measured


def test_arguments_are_checked():
    with pytest.raises(SystemExit, match="--inflight \\[0, 7\\]"):
        rp.check_args([0, 7, 2], [1], [0], 10, 1)
    with pytest.raises(SystemExit, match="--stream \\[8\\]"):
        rp.check_args([2], [8], [0], 10, 1)
    with pytest.raises(SystemExit, match="--pace-ns \\[-1\\]"):
        rp.check_args([2], [3], [0], 10, 1, (1000, -1))
    rp.check_args([2], [0, 3, 4], [0], 10, 1, (0, 250, 1000))
    with pytest.raises(SystemExit, match="--modes \\[9\\]"):
        rp.check_args([2], [1], [9], 10, 1)
    rp.check_args([1, 6], [0, 1, 2], [0, 3], 10, 1)


def test_kernel_caps_what_is_in_flight():
    src = rp.build_source()
    assert "int chunks, int inflight, int pace_ns," in src and "it >= inflight" in src


def test_prefetch_streams_are_the_kernels():
    """Streams 3 / 4 (session 37): the producer of a prefetching CTA issues MK_GATE_L2's instruction, paced; 4 puts
    the prefetches on the ping-pong CTAs only, with the others copying as stream 2."""
    src = rp.build_source()
    assert "cp.async.bulk.prefetch.L2.global" in src
    assert "(stream == 2 || stream == 4 || stream == 6) && !pp" in src and "stream == 3 || (stream == 4 && pp)" in src
    assert set(rp.STREAMS) == {0, 1, 2, 3, 4, 5, 6, 7} and rp.PREFETCH_STREAMS == (3, 4)
    assert "pace_ns" in rp.CSV_HEADER and rp.CSV.name == "release_probe_v3.csv"


def test_no_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(SystemExit, match="CuPy and a CUDA GPU"):
        rp.run(10, 1, [6], [0], [0])


def test_data_as_flag_modes_agree_with_the_kernel():
    """Modes 5-7 (session 21): the data-as-flag hand-off and the kernel's form at a 4 KB payload; the host's
    payload buffer holds the kernel's per-CTA slot for both CTAs."""
    src = rp.build_source()
    assert set(rp.MODES) == set(range(8))
    assert f"#define RP_PAYLOAD_WORDS_BIG {rp.PAYLOAD_WORDS_BIG}" in src
    assert "mode == 5 || mode == 6" in src and "mode >= 6 ? RP_PAYLOAD_WORDS_BIG" in src
    assert "st.relaxed.gpu.global.u32" in src
    rp.check_args([6], [0, 1], [5, 6, 7], 10, 1)


def test_two_ctas_per_sm_streams():
    """Streams 5-7 (session 39): two CTAs per SM, each with a 3-slot ring, both under the 227 KB an SM opts into; the
    kernel finds each ping-pong CTA's partner by %smid, counts it only while the ping-pong runs, and streams by role."""
    assert rp.CO_STREAMS == (5, 6, 7) and set(rp.CO_STREAMS) <= set(rp.COPY_STREAMS)
    assert 2 * (rp.CO_SMEM_BYTES + 1024) <= 227 * 1024 < 2 * rp.SMEM_BYTES
    src = rp.build_source()
    assert "%%smid" in src and "int pace_ns, int ring_slots," in src
    assert "stream == 1 || stream == 5 ||" in src and "(stream == 7 && !pp && !partner)" in src
    assert rp.table_row(0, 6, rp.CO_SLOTS, [1.0], 5.0, 0)[2:4] == [rp.STREAMS[6], "96 KB"]
    # every CTA streams its own region (blockIdx.x * region_bytes): twice the regions for the two-CTA grid
    assert "(size_t)blockIdx.x * region_bytes" in src
    assert rp.regions(132, [0, 1, 2]) == 132 and rp.regions(132, [1, 6]) == 264
