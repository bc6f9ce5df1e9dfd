"""bench/cluster_probe.py on CPU: bench/cluster_probe.cu compiles for sm_90a without spills from exactly
build_source() + compile_options() (nvcc as in tests/test_release_probe.py: a missing nvcc fails, never skips; the
NVRTC build skips visibly without libnvrtc), and the table arithmetic is as documented."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cuda_tools import libnvrtc_path, nvcc_path, nvrtc_compile  # tests/cuda_tools.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import cluster_probe as cp


def test_probe_kernel_compiles_without_spills(tmp_path):
    nvcc = nvcc_path()
    assert nvcc is not None, "nvcc not found (looked in /usr/local/cuda/bin and on PATH)"
    src = tmp_path / "cluster_probe.cu"
    src.write_text(cp.build_source())
    opts = [o.replace("--gpu-architecture=", "-arch=") for o in cp.compile_options("sm_90a")]
    r = subprocess.run([nvcc, *opts, "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "p.cubin"), str(src)],
                       capture_output=True, text=True, timeout=300, check=False)
    log = r.stdout + r.stderr
    assert r.returncode == 0, f"nvcc failed:\n{log[-4000:]}"
    assert re.search(r"Compiling entry function 'cluster_probe' for 'sm_90a'", log), log[-2000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    # the ping-pong kernel, the four residency kernels and the all-gather, none spilling
    assert spills == [("0", "0")] * 6, f"register spills or no ptxas report:\n{log[-2000:]}"
    assert "warning" not in log.lower(), log[-2000:]


@pytest.mark.skipif(libnvrtc_path() is None, reason="no libnvrtc on this machine")
def test_nvrtc_compiles_the_probe():
    rc, log = nvrtc_compile(libnvrtc_path(), cp.build_source(), "cluster_probe.cu", cp.compile_options("sm_90a"))
    assert rc == 0, f"NVRTC failed:\n{log[-4000:]}"
    assert "warning" not in log.lower(), log[-2000:]


def test_layout_matches_the_kernel_and_fits_an_sm():
    src = cp.build_source()
    assert f"#define CP_SLOT {cp.CP_SLOT}u" in src and f"#define CP_NS {cp.CP_NS}" in src
    assert f"#define CP_WORDS_MAX {cp.WORDS_MAX}" in src and f"#define CP_THREADS {cp.THREADS}" in src
    assert "__cluster_dims__(2, 1, 1)" in src
    # the ring, 12 mbarriers, the receive mbarrier padded to 16 bytes, the 4 KB payload and stage, under 227 KB
    assert cp.SMEM_BYTES == 6 * 32768 + 96 + 16 + 2 * 4096 < 227 * 1024


def test_grid_is_even():
    assert cp.grid_for(132) == 132 and cp.grid_for(133) == 132 and cp.grid_for(2) == 2
    with pytest.raises(SystemExit, match="1 SMs"):
        cp.grid_for(1)


def test_handoff_and_rate():
    assert cp.handoff_ns(4_000_000, 1000) == 2000.0
    with pytest.raises(ValueError, match="iters 0"):
        cp.handoff_ns(1, 0)
    assert cp.stream_gbps(2, 1000, 32768) == 2000.0
    assert cp.stream_gbps(2, 1, 0) != cp.stream_gbps(2, 1, 0)   # nan: no span


def test_check_args_names_the_value():
    cp.check_args([0, 1, 2], [0, 1, 2, 3, 4], [64, 1024], 10, 1)
    with pytest.raises(SystemExit, match=r"--stream \[3\]"):
        cp.check_args([3], [0], [64], 10, 1)
    with pytest.raises(SystemExit, match=r"--modes \[5\]"):
        cp.check_args([0], [5], [64], 10, 1)
    with pytest.raises(SystemExit, match=r"--words \[2048, 6\]"):
        cp.check_args([0], [0], [2048, 6], 10, 1)
    with pytest.raises(SystemExit, match="--iters 0"):
        cp.check_args([0], [0], [64], 0, 1)


def test_table_row():
    row = cp.table_row(3, 1024, 1, [900.0, 1100.0, 1000.0], 3901.4, 0)
    assert len(row) == len(cp.TABLE_HEADER)
    assert row == ["3", cp.MODES[3], "4096 B", "all SMs", "1000", "900", "1100", "3901", "0"]
    assert cp.table_row(0, 64, 0, [1200.0], float("nan"), 0)[2:4] == ["256 B", "off"]
    assert cp.table_row(0, 64, 0, [1200.0], float("nan"), 0)[7] == "-"


def test_residency_kernels_exist_with_their_cluster_sizes():
    src = cp.build_source()
    for n, kernel in cp.RESIDENCY_KERNELS.items():
        assert f"__cluster_dims__({n}, 1, 1) __launch_bounds__(CP_THREADS, 1)\n    {kernel}(" in src


def test_sm_ranges():
    assert cp.sm_ranges([5, 0, 1, 2, 8, 7]) == "0-2,5,7-8"
    assert cp.sm_ranges([3]) == "3" and cp.sm_ranges([]) == ""
    with pytest.raises(SystemExit, match=r"--residency \[3\]"):
        cp.residency([3])


def test_allgather_kernel_and_its_slices():
    src = cp.build_source()
    assert f"__cluster_dims__({cp.AG_SIZE}, 1, 1) __launch_bounds__(CP_THREADS, 1)\n    {cp.ALLGATHER_KERNEL}(" in src
    # two buffers of 8 slices fit the ping-pong's payload + stage bytes: the same dynamic shared memory
    assert 2 * cp.AG_SIZE * 4 * cp.AG_MAX_WORDS == 2 * 4 * cp.WORDS_MAX
    cp.check_allgather([4, 64, 128])
    with pytest.raises(SystemExit, match=r"--words \[256, 6\] with --allgather"):
        cp.check_allgather([256, 6])


class _Out:
    """The kernel's out[] words on the host: what _measure reads and resets (CuPy's fill / get / item set)."""

    def __init__(self):
        self.w = [0] * 8

    def fill(self, v):
        self.w = [v] * 8

    def __setitem__(self, i, v):
        self.w[i] = int(v)

    def get(self):
        return list(self.w)


def test_measure_doubles_the_streaming_until_it_outlasts_the_rounds():
    import types
    fake_cp = types.SimpleNamespace(uint64=int)
    out, chunks_seen = _Out(), []

    def launch(chunks):   # streaming ends at 10 x chunks ns; the rounds end at 100 ns after 2000 ns of rounds
        chunks_seen.append(chunks)
        out.w = [2000, 1, 100, 10 * chunks, 0, 0, 10 * chunks, 0]

    ns, gbps, bad = cp._measure(fake_cp, launch, out, 1, 2, 1, 4, lambda t: t / 2, "x")
    assert chunks_seen == [4, 8, 16, 16]   # 40 and 80 ns end before the rounds' 100: doubled until 160
    assert ns == [1000.0, 1000.0] and bad == 2
    assert gbps == cp.stream_gbps(4, 16, 160)
    ns, gbps, bad = cp._measure(fake_cp, launch, out, 1, 1, 0, 4, lambda t: t, "x")   # idle: no rate, no doubling
    assert ns == [2000] and math.isnan(gbps) and chunks_seen[-1] == 4


def test_measure_names_a_timed_out_wait():
    import types
    out = _Out()

    def launch(chunks):
        out.w = [0, 0, 0, 0, 1, 0, 0, 0]

    with pytest.raises(SystemExit, match="mode 3 stream 1: a wait timed out"):
        cp._measure(types.SimpleNamespace(uint64=int), launch, out, 1, 1, 1, 4, float, "mode 3 stream 1")
