"""The tracked tree stays small enough to travel to the GPU host beside a vLLM bundle part: the device tool carries the
working tree and the carried paths, 64 MiB in all, and a part of the bundle is ~43 MB (bench/results/RECORDS.md: in
session 50 the trace records of 40 sessions, ~43 MB, had grown the tree to ~60 MB and a part no longer fitted)."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 24 << 20   # 64 MiB carry - a ~43 MB bundle part, with room to spare


def test_tracked_tree_leaves_room_for_a_bundle_part():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    sizes = {f.decode(): (ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file()}
    total = sum(sizes.values())
    big = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total < LIMIT, (f"tracked files {total / 2**20:.1f} MiB >= {LIMIT >> 20} MiB: move old trace records to git "
                           f"history (bench/results/RECORDS.md); largest: {big}")
