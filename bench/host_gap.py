"""Is a vLLM decode loop bound by the GPU or by the host? Read a torch-profiler trace (what
`python bench/tbt.py --profile` saves through vLLM's profiler_config) and split its GPU kernel
timeline into bursts: kernels closer than --gap-us belong to one burst (one engine step: a CUDA
graph replay plus compute_logits and sampling); an idle stretch longer than that separates steps.

    python bench/host_gap.py bench/results/profiles/<...>.pt.trace.json.gz [--gap-us 30]

Prints per burst statistics (median over the steady part, first/last 10% dropped): step period
(start to start), GPU busy time (union of kernel intervals), GPU idle between bursts. With async
scheduling a GPU-bound loop has idle ~0 (the next step is queued before this one ends); a large
idle share means the host's per-step work sets the time between tokens, and a faster decode step
cannot lower it.
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Burst:
    start_us: float
    end_us: float
    busy_us: float   # union of the kernel intervals inside the burst
    kernels: int


def kernel_intervals(trace: dict[str, Any]) -> list[tuple[float, float]]:
    """(start, end) in us of every GPU kernel event of a Chrome/Kineto trace, sorted by start."""
    out = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in trace.get("traceEvents", [])
           if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"]
    return sorted(out)


def bursts(intervals: list[tuple[float, float]], gap_us: float) -> list[Burst]:
    """Group sorted kernel intervals into bursts separated by GPU idle stretches > gap_us."""
    res: list[Burst] = []
    cur_s = cur_e = None
    busy, n, seg_s, seg_e = 0.0, 0, None, None
    for s, e in intervals:
        if cur_e is not None and s - cur_e > gap_us:
            busy += seg_e - seg_s
            res.append(Burst(cur_s, cur_e, busy, n))
            cur_s = cur_e = None
        if cur_s is None:
            cur_s, cur_e, busy, n, seg_s, seg_e = s, e, 0.0, 0, s, e
        elif s > seg_e:  # a gap inside the burst: close the merged segment
            busy += seg_e - seg_s
            seg_s, seg_e = s, e
        else:
            seg_e = max(seg_e, e)
        cur_e = max(cur_e, e)
        n += 1
    if cur_s is not None:
        busy += seg_e - seg_s
        res.append(Burst(cur_s, cur_e, busy, n))
    return res


def summarize(bs: list[Burst], trim: float = 0.1) -> dict[str, float]:
    """Medians over the steady part: period (start to start), busy, idle (end to next start)."""
    if len(bs) < 3:
        raise ValueError(f"{len(bs)} bursts: the GPU was never idle longer than the gap threshold between "
                         "steps (GPU-bound at that threshold), or too few steps were profiled; lower --gap-us "
                         "or profile more steps")
    k = int(len(bs) * trim)
    core = bs[k: len(bs) - k] if len(bs) - 2 * k >= 3 else bs
    period = [b.start_us - a.start_us for a, b in itertools.pairwise(core)]
    idle = [b.start_us - a.end_us for a, b in itertools.pairwise(core)]
    busy = [b.busy_us for b in core]
    med_p = statistics.median(period)
    return {"bursts": len(bs), "used": len(core), "period_us": med_p, "busy_us": statistics.median(busy),
            "idle_us": statistics.median(idle), "idle_share": statistics.median(idle) / med_p if med_p else 0.0,
            "kernels_per_burst": statistics.median(b.kernels for b in core)}


def load_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--gap-us", type=float, default=30.0, help="GPU idle longer than this separates bursts")
    a = ap.parse_args(argv)
    print("| trace | bursts | period us | GPU busy us | GPU idle us | idle share | kernels/burst |")
    print("|---|---|---|---|---|---|---|")
    for p in a.traces:
        try:
            s = summarize(bursts(kernel_intervals(load_trace(p)), a.gap_us))
        except ValueError as e:
            print(f"| {p.name} | {e} | | | | | |")
            continue
        print(f"| {p.name} | {s['bursts']} | {s['period_us']:.0f} | {s['busy_us']:.0f} | {s['idle_us']:.0f} | "
              f"{s['idle_share']:.0%} | {s['kernels_per_burst']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
