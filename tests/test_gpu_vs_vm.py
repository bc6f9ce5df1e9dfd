"""bench/gpu_vs_vm.py plumbing on CPU: with --device cpu the decoder's VM executor stands in for the
GPU, so every compared buffer must be bitwise equal (the GPU run is the real measurement)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_vs_vm


def test_cpu_stand_in_is_bitwise_equal_everywhere(tmp_path):
    assert gpu_vs_vm.main(["--device", "cpu", "--model", "llama-3.2-1b-1layer", "--layers", "1", "--batch", "2",
                           "--ctx", "19", "--define", "MK_ROUNDING=1", "--outdir", str(tmp_path)]) == 0
    text = next(tmp_path.glob("gpu_vs_vm_*_b2.md")).read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith(("| L0.", "| whole step"))]
    assert len(rows) == 7 and all("| 100.0% | 0.000e+00 | 0.000e+00 |" in r for r in rows), rows
    assert "rounding stock" in text and "top-1 identical in every row: True" in text
