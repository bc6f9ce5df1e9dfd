"""Refresh the kernel-only rows of a packaged paths table (mk_plugin/persistent/tuned/paths_<gpu>.json) from
bench/mk_step.py rows: both decode paths measured in one job on one GPU at one commit, ctx 512, no LM head. That
table is what MK_MODE=auto reads first (mk_plugin/adapter/auto.py); an entry with an in-vLLM TBT (`vllm_tbt`) keeps it,
and that block still decides its batch size (the refreshed kernel-only times are shown beside it).

    python bench/paths_table.py ROWS.csv --gpu "NVIDIA H200" --commit abc1234            # what would change
    python bench/paths_table.py ROWS.csv --gpu "NVIDIA H200" --commit abc1234 --write    # and write it

Each (model, batch) needs both paths' rows; several rows of a path (rounds) give their median. Prints one line per
entry: the old and new times and auto's choice before and after."""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # bench/common.py

from mk_plugin.adapter.auto import KERNEL_ONLY, entry_times, paths_file, pick
from mk_plugin.persistent.encoding import spec_hash
from mk_plugin.spec import LlamaSpec
from mk_plugin.triton_ops._device import gpu_slug

CTX = 512   # the table's context (auto's kernel-only rows are all at 512)
Measured = dict[tuple[str, int], dict[str, list[float]]]


def read_rows(path: Path, gpu: str, commit: str, ctx: int = CTX) -> tuple[Measured, str]:
    """((model, batch) -> {"triton": [us...], "megakernel": [us...]}, the latest date) of the rows of this GPU and
    commit at ctx, without the LM head."""
    out: Measured = defaultdict(lambda: {"triton": [], "megakernel": []})
    date = ""
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            if (r["gpu"], r["commit"], int(r["ctx"]), r["lm_head"]) != (gpu, commit, ctx, "0"):
                continue
            if r["path"] in ("triton", "megakernel"):
                out[(r["shape"], int(r["batch"]))][r["path"]].append(float(r["step_us"]))
                date = max(date, r["date"])
    return dict(out), date


def _choice(e: dict[str, Any] | None) -> str:
    """auto's choice from one entry, as load_paths reads it (vllm_tbt first)."""
    if e is None:
        return "-"
    t = entry_times(e)
    return pick(t) + ("" if t.what == KERNEL_ONLY else " (vllm_tbt)")


def refresh(table: dict[str, Any], measured: Measured, hashes: dict[str, int], num_sms: int, commit: str,
            date: str, note: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """(the table with its kernel-only times replaced or added from `measured`, one report line per change).
    A (model, batch) lacking either path is left as it is and reported. `note` replaces a refreshed entry's note (how
    its rows were measured: an old entry's note describes the old rows); None keeps it."""
    entries = {(e["spec"], int(e["batch"])): dict(e) for e in table["entries"]}
    lines = []
    for (shape, batch), paths in sorted(measured.items()):
        if not paths["triton"] or not paths["megakernel"]:
            lines.append(f"{shape} b{batch}: skipped, one path unmeasured ({', '.join(k for k, v in paths.items() if v)})")
            continue
        if shape not in hashes:
            raise SystemExit(f"{shape}: no model folder bench/models/{shape} to hash its spec")
        tri, mk = (round(statistics.median(paths[p]), 1) for p in ("triton", "megakernel"))
        old = entries.get((shape, batch))
        new = dict(old or {"spec": shape, "spec_hash": hashes[shape], "num_sms": num_sms, "batch": batch})
        new.update(triton_us=tri, megakernel_us=mk, commit=commit, date=date, ctx=CTX)
        if note is not None:
            new["note"] = note
        entries[(shape, batch)] = new
        was = "new" if old is None else f"mk {old['megakernel_us']} / triton {old['triton_us']} ({old['commit']})"
        lines.append(f"{shape} b{batch}: {was} -> mk {mk} / triton {tri} ({mk / tri:.3f}x); "
                     f"auto {_choice(old)} -> {_choice(new)}")
    out = dict(table, entries=[entries[k] for k in sorted(entries)])
    return out, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", type=Path, help="mk_step.csv rows (bench/mk_step.py --csv)")
    ap.add_argument("--gpu", required=True, help='the rows\' gpu column, e.g. "NVIDIA H200"')
    ap.add_argument("--commit", required=True, help="the rows' commit column")
    ap.add_argument("--num-sms", type=int, default=132, help="SM count of a new entry's key (default 132)")
    ap.add_argument("--table", type=Path, help="the paths table (default: the packaged one of --gpu)")
    ap.add_argument("--write", action="store_true", help="write the table (default: only report)")
    ap.add_argument("--note", help="a refreshed entry's note: how its rows were measured (default: keep the old note)")
    a = ap.parse_args(argv)
    path = a.table or paths_file(gpu_slug(a.gpu))
    table = json.loads(path.read_text()) if path.is_file() else {"format": 1, "gpu": a.gpu, "entries": []}
    measured, date = read_rows(a.rows, a.gpu, a.commit)
    if not measured:
        raise SystemExit(f"{a.rows}: no rows of gpu {a.gpu!r} at commit {a.commit!r}, ctx {CTX}, no LM head")
    hashes = {d.name: spec_hash(LlamaSpec.from_json_file(d)) for d in common.MODELS.iterdir()
              if (d / "config.json").is_file()}
    out, lines = refresh(table, measured, hashes, a.num_sms, a.commit, date, a.note)
    print("\n".join(lines))
    if a.write:
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
