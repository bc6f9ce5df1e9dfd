"""bench/race_stress.py on CPU: the tally's arithmetic, the argument checks (before CUDA), and the no-GPU error."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import race_stress as rs


def test_tally_counts_mismatches_and_nans():
    t = rs.Tally()
    t.add(0, True, False, 0.0)
    t.add(1, True, False, 0.0)
    t.add(2, False, True, float("inf"))
    t.add(3, False, False, 0.5)
    assert (t.replays, t.mismatching, t.nan, t.first) == (4, 2, 1, 2)
    row = t.row("llama-3.2-1b", "bulk=1", 3, 300)
    assert len(row) == len(rs.TABLE_HEADER) and row[4:] == ["4", "2", "1", "2", "inf"]
    clean = rs.Tally()
    clean.add(0, True, False, 0.0)
    assert clean.row("m", "default", 1, 300)[-2:] == ["-", "-"]


@pytest.mark.parametrize("batches,replays,ctx,match", [([1], 1, 300, "--replays 1"), ([0], 10, 300, "--batch 0"),
                                                       ([17], 10, 300, "--batch 17"), ([1], 10, 0, "--ctx 0")])
def test_bad_arguments_are_clear_errors(batches, replays, ctx, match):
    with pytest.raises(SystemExit, match=match):
        rs.check_args(batches, replays, ctx)


def test_no_gpu_is_a_clear_error(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        rs.run("bench/models/llama-3.2-1b", [1], 2, 300, [])
