"""bench/tbt.py parent side on CPU (--dry-run fakes the engines): table, spread, CSV."""
from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import tbt


def _row(runs: dict[str, list[float]]) -> dict:
    return {"shape": "m", "batch": 1, "prompt": 512, "floor_ms": 0.5, "bytes": 1,
            "tbt": {k: sorted(v)[len(v) // 2] for k, v in runs.items()}, "runs": runs}


def test_spread_table_lists_every_run_only_when_there_are_several():
    assert tbt.spread_table([_row({"stock": [2.0], "megakernel": [1.5]})], ["megakernel"]) == ""
    text = tbt.spread_table([_row({"stock": [2.0, 2.4, 1.7], "megakernel": [1.5, 1.6, 1.4]})], ["megakernel"])
    assert "| m | 1 | 512 | 2.000 / 2.400 / 1.700 | 1.500 / 1.600 / 1.400 |" in text
    missing = tbt.spread_table([_row({"stock": [2.0, 2.1]})], ["megakernel"])
    assert missing.rstrip().endswith("| 2.000 / 2.100 | n/a |")


def test_dry_run_writes_table_spread_and_csv(tmp_path):
    rc = tbt.main(["--dry-run", "--models", "llama-3.2-1b-1layer", "--prompts", "512", "--batches", "1,8",
                   "--runs", "3", "--outdir", str(tmp_path)])
    assert rc == 0
    md = next(tmp_path.glob("tbt_*_dryrun.md")).read_text()
    assert "| llama-3.2-1b-1layer | 8 | 512 |" in md and "Run-to-run spread" in md
    rows = list(csv.DictReader(next(tmp_path.glob("tbt*.csv")).read_text().splitlines()))
    assert {r["mode"] for r in rows} == {"stock", "triton", "megakernel"} and len(rows) == 6
    assert all(float(r["tbt_ms"]) > 0 for r in rows)
