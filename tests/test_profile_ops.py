"""bench/profile_ops.py on a CPU: the table it derives from Nsight Compute's metrics, and a dry run
through the CSV/markdown/plot code (the GPU run itself needs ncu and nsight-python)."""
from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import profile_ops


def test_table_rows_derive_throughput_from_bytes_and_duration():
    meta = {"date": "d", "gpu": "g", "commit": "c", "model": "m", "ctx": 512}
    recs = [{"Annotation": "down", "batch": 8, "Metric": "gpu__time_duration.sum", "AvgValue": 8000.0},
            {"Annotation": "down", "batch": 8, "Metric": "dram__bytes_read.sum", "AvgValue": 33.5e6},
            {"Annotation": "down", "batch": 8, "Metric": "dram__bytes_write.sum", "AvgValue": 0.5e6}]
    (row,) = profile_ops.table_rows(recs, meta)
    got = dict(zip(profile_ops.HEADER, row))
    assert got["op"] == "down" and got["batch"] == 8 and got["duration_us"] == "8.0"
    assert got["dram_gbps"] == "4250" and got["dram_pct_of_4800"] == "88.5"   # 34 MB / 8 us


def test_dry_run_writes_every_op_and_batch(tmp_path, capsys):
    assert profile_ops.main(["--dry-run", "--batch", "1", "16", "--outdir", str(tmp_path)]) == 0
    with open(tmp_path / "profile_ops_dry.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["op"], r["batch"]) for r in rows} == {(op, b) for op in profile_ops.OPS for b in ("1", "16")}
    assert "megakernel_step" in capsys.readouterr().out
