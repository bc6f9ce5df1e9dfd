"""bench/host_gap.py: kernel bursts from a profiler trace (synthetic traces, CPU)."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import host_gap


def _trace(steps: int, busy: float, idle: float, kernels: int = 4) -> dict:
    """`steps` bursts of `kernels` back-to-back kernels (busy us in all) separated by `idle` us,
    plus CPU events that must be ignored."""
    ev, t = [], 1000.0
    for _ in range(steps):
        for _ in range(kernels):
            ev.append({"ph": "X", "cat": "kernel", "name": "k", "ts": t, "dur": busy / kernels})
            ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::x", "ts": t, "dur": 5000.0})
            t += busy / kernels
        t += idle
    return {"traceEvents": ev}


def test_gpu_bound_and_host_bound_loops_are_told_apart():
    # GPU-bound: idle gaps below the threshold merge every step into one burst
    gpu = host_gap.bursts(host_gap.kernel_intervals(_trace(50, 900.0, 5.0)), 30.0)
    assert len(gpu) == 1 and gpu[0].kernels == 200
    with pytest.raises(ValueError, match="GPU-bound"):
        host_gap.summarize(gpu)
    host = host_gap.summarize(host_gap.bursts(host_gap.kernel_intervals(_trace(50, 900.0, 1100.0)), 30.0))
    assert host["bursts"] == 50 and host["kernels_per_burst"] == 4
    assert host["period_us"] == pytest.approx(2000.0) and host["busy_us"] == pytest.approx(900.0)
    assert host["idle_us"] == pytest.approx(1100.0) and host["idle_share"] == pytest.approx(0.55)


def test_busy_is_the_union_of_overlapping_kernels():
    iv = [(0.0, 10.0), (5.0, 12.0), (20.0, 25.0), (100.0, 110.0)]   # two bursts at gap 30
    b = host_gap.bursts(iv, 30.0)
    assert [(x.start_us, x.end_us, x.busy_us, x.kernels) for x in b] == [(0.0, 25.0, 17.0, 3), (100.0, 110.0, 10.0, 1)]


def test_cli_reads_gzip_and_plain_traces(tmp_path, capsys):
    p = tmp_path / "gpu.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump(_trace(50, 900.0, 5.0), f)
    q = tmp_path / "host.json"
    q.write_text(json.dumps(_trace(20, 500.0, 700.0)))
    assert host_gap.main([str(p), str(q)]) == 0
    out = capsys.readouterr().out
    assert "| gpu.json.gz | 1 bursts: the GPU was never idle" in out
    assert "| host.json | 20 | 1200 | 500 | 700 | 58% | 4 |" in out
