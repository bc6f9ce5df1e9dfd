"""bench/host_gap.py: engine steps from a profiler trace (synthetic traces, CPU)."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import host_gap

ANCHOR = host_gap.DEFAULT_ANCHOR


def _trace(n_steps: int, busy: float, idle: float, gap_inside: float = 80.0) -> dict:
    """n_steps steps: the anchor (10 us), an idle gap_inside (host-launched prep), a decode kernel and
    a memcpy (busy us in all, anchor included), then `idle` us; plus CPU events that must be ignored."""
    ev, t = [], 1000.0
    for _ in range(n_steps):
        ev.append({"ph": "X", "cat": "kernel", "name": ANCHOR, "ts": t, "dur": 10.0})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::x", "ts": t, "dur": 5000.0})
        t += 10.0 + gap_inside
        ev.append({"ph": "X", "cat": "kernel", "name": "mk_decode", "ts": t, "dur": busy - 20.0})
        t += busy - 20.0
        ev.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": t, "dur": 10.0})
        t += 10.0 + idle
    return {"traceEvents": ev}


def test_steps_split_at_the_anchor_and_count_busy_and_idle():
    s = host_gap.summarize(host_gap.steps(host_gap.gpu_events(_trace(50, 900.0, 1100.0)), ANCHOR))
    assert s["steps"] == 49
    assert s["period_us"] == pytest.approx(2080.0) and s["busy_us"] == pytest.approx(900.0)
    assert s["idle_us"] == pytest.approx(1180.0) and s["idle_share"] == pytest.approx(1180.0 / 2080.0)
    assert s["heavy"][0] == ("mk_decode", pytest.approx(880.0))


def test_gpu_bound_loop_has_little_idle():
    s = host_gap.summarize(host_gap.steps(host_gap.gpu_events(_trace(20, 900.0, 0.0, gap_inside=0.0)), ANCHOR))
    assert s["idle_us"] == pytest.approx(0.0, abs=1e-6)


def test_union_of_overlapping_intervals():
    assert host_gap.union_us([(0.0, 10.0), (5.0, 12.0), (20.0, 25.0)]) == pytest.approx(17.0)
    assert host_gap.union_us([]) == 0.0


def test_missing_anchor_names_the_frequent_kernels():
    with pytest.raises(ValueError, match="anchor kernel 'nope' found 0 times.*mk_decode"):
        host_gap.steps(host_gap.gpu_events(_trace(5, 900.0, 100.0)), "nope")


def test_cli_reads_gzip_and_plain_traces(tmp_path, capsys):
    p = tmp_path / "host.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump(_trace(20, 500.0, 700.0), f)
    q = tmp_path / "empty.json"
    q.write_text(json.dumps({"traceEvents": []}))
    assert host_gap.main([str(p), str(q)]) == 0
    out = capsys.readouterr().out
    assert "| host.json.gz | 19 | 1280 | 500 | 780 | 61% | mk_decode 480; Memcpy DtoH 10;" in out
    assert "| empty.json | ValueError: anchor kernel" in out
