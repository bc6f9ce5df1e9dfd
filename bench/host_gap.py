"""Is a vLLM decode loop bound by the GPU or by the host? Read a torch-profiler trace (what
`python bench/tbt.py --profile` saves through vLLM's profiler_config) and split its GPU timeline
into engine steps at an anchor kernel that runs once per step (default: vLLM 0.24's V2-runner input
preparation `_prepare_pos_seq_lens_kernel`).

    python bench/host_gap.py bench/results/profiles/<...>.pt.trace.json.gz [--anchor NAME]

Per step (median over the steady part, first/last 10% dropped): period (anchor to anchor), GPU busy
(union of kernel, memcpy and memset intervals in the step) and GPU idle (period - busy), plus the
GPU time per step of the heaviest kernels. With async scheduling a GPU-bound loop has idle ~0; a
large idle share means the host's per-step work sets the time between tokens, and a faster decode
step cannot lower it. The profiler slows the host, so the idle it shows is an upper bound: compare
busy with the unprofiled TBT of the same engine (TBT - busy = host time not hidden behind the GPU).

Why not split at idle gaps: the first version did, and on the H200 trace it found one kernel per
"burst" -- the V2 runner's small preparation kernels are launched from Python between idle gaps
longer than any useful threshold, so gaps do not mark steps.
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ANCHOR = "_prepare_pos_seq_lens_kernel"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class GpuEvent:
    name: str
    start_us: float
    end_us: float


def gpu_events(trace: dict[str, Any]) -> list[GpuEvent]:
    """Kernel, memcpy and memset events of a Chrome/Kineto trace, sorted by start (CPU events dropped)."""
    out = [GpuEvent(str(e.get("name", "")), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
           for e in trace.get("traceEvents", [])
           if e.get("ph") == "X" and str(e.get("cat", "")).lower() in GPU_CATS]
    return sorted(out, key=lambda e: e.start_us)


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


@dataclass(frozen=True)
class Step:
    start_us: float
    period_us: float
    busy_us: float
    per_kernel_us: dict[str, float]


def steps(events: list[GpuEvent], anchor: str) -> list[Step]:
    """One Step per pair of consecutive anchor kernels: the GPU events that start in between."""
    starts = [e.start_us for e in events if e.name == anchor]
    if len(starts) < 2:
        common = ", ".join(f"{n} ({c})" for n, c in Counter(e.name[:60] for e in events).most_common(6))
        raise ValueError(f"anchor kernel {anchor!r} found {len(starts)} times; pick one that runs once per "
                         f"step with --anchor (most frequent: {common})")
    out, i = [], 0
    for a, b in itertools.pairwise(starts):
        while i < len(events) and events[i].start_us < a:
            i += 1
        j = i
        while j < len(events) and events[j].start_us < b:
            j += 1
        inside = events[i:j]
        per: dict[str, float] = defaultdict(float)
        for e in inside:
            per[e.name] += e.end_us - e.start_us
        out.append(Step(a, b - a, union_us([(e.start_us, min(e.end_us, b)) for e in inside]), dict(per)))
        i = j
    return out


def summarize(st: list[Step], trim: float = 0.1, top: int = 4) -> dict[str, Any]:
    """Medians over the steady part; the heaviest kernels by median GPU time per step."""
    k = int(len(st) * trim)
    core = st[k: len(st) - k] if len(st) - 2 * k >= 3 else st
    period = statistics.median(s.period_us for s in core)
    busy = statistics.median(s.busy_us for s in core)
    names = {n for s in core for n in s.per_kernel_us}
    per = {n: statistics.median(s.per_kernel_us.get(n, 0.0) for s in core) for n in names}
    heavy = sorted(per.items(), key=lambda kv: (-kv[1], kv[0]))[:top]  # name breaks ties: stable output
    return {"steps": len(st), "used": len(core), "period_us": period, "busy_us": busy, "idle_us": period - busy,
            "idle_share": (period - busy) / period if period else 0.0, "heavy": heavy}


def load_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--anchor", default=DEFAULT_ANCHOR, help="a kernel that runs once per engine step")
    a = ap.parse_args(argv)
    print("| trace | steps | period us | GPU busy us | GPU idle us | idle share | heaviest kernels, us per step |")
    print("|---|---|---|---|---|---|---|")
    for p in a.traces:
        try:
            s = summarize(steps(gpu_events(load_trace(p)), a.anchor))
        except (ValueError, json.JSONDecodeError, OSError) as e:
            print(f"| {p.name} | {type(e).__name__}: {e} | | | | | |")
            continue
        heavy = "; ".join(f"{n[:40]} {us:.0f}" for n, us in s["heavy"])
        print(f"| {p.name} | {s['steps']} | {s['period_us']:.0f} | {s['busy_us']:.0f} | {s['idle_us']:.0f} | "
              f"{s['idle_share']:.0%} | {heavy} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
