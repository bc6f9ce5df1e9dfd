"""Where a matvec task's time goes once it is ready: the MK_TRACE_PHASES=1 build's per-task phase times
(encoding.TRACE_FIELDS ph_stage, ph_chunks, ph_reduce; thread 0's %globaltimer after the barriers that
end each phase, summed over the task's passes), as a per-op table of medians.

    busy     ready -> end (the counter waits are done; the task's body and its final barrier)
    entry    ready -> entering matvec_task (the dispatch and the out-of-line call; the norm-statistics
             and first-group issue of column-group staging come after it, in "other")
    stage    activation staging: pass start to the chunk loop (stage_x and the norm statistics, or for
             column-group staging the first groups' issue), plus for column-group staging thread 0's
             wait for each group in the chunk loop (its cp.async wait and the barrier after it; since
             session 9, taken out of chunks)
    chunks   the chunk loop to the barrier after it, less those group waits: ring waits, fragment
             loads and MMAs of all warps
    reduce   the cross-warp reduction and the op's epilogue (its L2 loads, stores) to the pass's barrier
    release  the signal's red.release.gpu (its fence waits until the CTA's stores are visible), every
             task type
    other    busy - entry - stage - chunks - reduce - release: the row statistics of column-group
             staging, the return and the barrier before the release

For attn_partial (since session 14) the same fields hold: entry ~0 (the task starts at ready), stage = q and
block-table loads to the head pass's first barrier, chunks = the KV loop (thread 0's warp), reduce = the lane-group
and warp merges and the partial stores; "other" is then the ticket and, for the last chunk, the merge.
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from .trace import task_type

PHASES = ("ph_stage", "ph_chunks", "ph_reduce", "ph_release")
ROW_TYPES = ("qkv_rope", "attn_partial", "attn_combine", "o_proj", "gate_up", "down", "final_norm", "lm_head")


@dataclass(frozen=True)
class PhaseRow:
    op: str
    tasks: int
    busy_us: float     # medians over the op's tasks, all layers
    entry_us: float
    stage_us: float
    chunks_us: float
    reduce_us: float
    release_us: float
    other_us: float


PHASE_FIELDS = tuple(f.name for f in dataclasses.fields(PhaseRow))[2:]   # the times, after op and tasks


def has_phases(records: Sequence[dict]) -> bool:
    """True when the records come from an MK_TRACE_PHASES=1 build (some matvec task has a chunk time)."""
    return any(r.get("ph_chunks", 0) > 0 for r in records)


def phase_table(records: Sequence[dict]) -> list[PhaseRow]:
    """One row per task type present, in ROW_TYPES order (ValueError without phase data)."""
    if not has_phases(records):
        raise ValueError("no phase times in these records: trace an MK_TRACE_PHASES=1 build "
                         "(bench/mk_step.py --trace --define MK_TRACE_PHASES=1)")
    by: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        typ = r.get("type") or task_type(r["opcode"])
        if typ in ROW_TYPES:
            by[typ].append(r)
    rows = []
    for typ in ROW_TYPES:
        rs = by.get(typ)
        if not rs:
            continue

        def med(xs) -> float:
            return statistics.median(xs) / 1e3

        busy = [r["end"] - r["ready"] for r in rs]
        ph = {p: [r.get(p, 0) for r in rs] for p in PHASES}
        entry = [r["ph_entry"] - r["ready"] if r.get("ph_entry", 0) else 0 for r in rs]
        other = [b - e - sum(r.get(p, 0) for p in PHASES) for b, e, r in zip(busy, entry, rs)]
        rows.append(PhaseRow(typ, len(rs), med(busy), med(entry), med(ph["ph_stage"]), med(ph["ph_chunks"]),
                             med(ph["ph_reduce"]), med(ph["ph_release"]), med(other)))
    return rows


def phase_table_markdown(rows: Sequence[PhaseRow], *, signed: bool = False) -> str:
    """The per-op table; signed=True writes every time with its sign (phase_delta's rows)."""
    f = "+.2f" if signed else ".2f"
    head = "| op | tasks | busy us | entry us | stage us | chunks us | reduce+epilogue us | release us | other us |"
    out = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.op} | {r.tasks} | " + " | ".join(f"{getattr(r, n):{f}}" for n in PHASE_FIELDS) + " |")
    return "\n".join(out)


def phase_delta(a: Sequence[PhaseRow], b: Sequence[PhaseRow]) -> list[PhaseRow]:
    """b - a per op present in both (tasks: b's count), in b's order: which phases a build change moved (session
    21: why MK_W_TMA with MK_INFLIGHT=2 paid -194 us at 8B batch 1 where each alone paid ~-55)."""
    by_a = {r.op: r for r in a}
    out = []
    for r in b:
        q = by_a.get(r.op)
        if q is None:
            continue
        out.append(PhaseRow(r.op, r.tasks, *(getattr(r, f) - getattr(q, f) for f in PHASE_FIELDS)))
    return out


LAG_BUCKETS_US = (0.0, 2.0, 5.0)   # edges: <0 (the next weights not started yet), 0-2, 2-5, >= 5 us


def _lag_bucket(lag_us: float | None) -> str:
    if lag_us is None:
        return "no later weights"
    if lag_us < LAG_BUCKETS_US[0]:
        return "not started"
    for lo, hi in itertools.pairwise(LAG_BUCKETS_US):
        if lag_us < hi:
            return f"{lo:g}-{hi:g} us"
    return f">= {LAG_BUCKETS_US[-1]:g} us"


def release_by_lag(records: Sequence[dict]) -> dict[str, dict[str, tuple[int, float]]]:
    """Median release time (us) per task type and per how long before the release this SM's producer
    began issuing the weights of its next weight-streaming task (or, in traces since session 39, an att_tma
    attention task's K/V tiles; "no later weights": none follows):
    {type: {bucket: (tasks, median us)}}. Recently issued copies still in flight make the release's
    fence slow (bench/NOTES.md session 7)."""
    if not any(r.get("ph_release", 0) > 0 for r in records):
        raise ValueError("no release times in these records: trace an MK_TRACE_PHASES=1 build")
    by_sm: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by_sm[r["sm"]].append(r)
    cells: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rs in by_sm.values():
        rs.sort(key=lambda r: r["start"])
        for i, r in enumerate(rs):
            t_rel = r["end"] - r.get("ph_release", 0)
            nxt = next((x for x in rs[i + 1:] if x["prod_first"]), None)
            lag = None if nxt is None else (t_rel - nxt["prod_first"]) / 1e3
            typ = r.get("type") or task_type(r["opcode"])
            cells[typ][_lag_bucket(lag)].append(r.get("ph_release", 0) / 1e3)
    return {t: {b: (len(v), statistics.median(v)) for b, v in sorted(bs.items())} for t, bs in cells.items()}


def stage_by_lead(records: Sequence[dict], parts: int = 4) -> dict[str, list[tuple[int, float, float]]]:
    """Matvec tasks per type, split into `parts` equal groups by the producer's lead (ready - the task's first weight
    issue, us): [(tasks, median lead, median stage us)] from the shortest lead up. A stage that falls as the lead
    grows waits behind the SM's own recent copies; a flat one does not (session 35: 1B b16's norm-fused stage, flat)."""
    cells: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        if r.get("prod_first") and r.get("ph_stage", 0) > 0:
            cells[r.get("type") or task_type(r["opcode"])].append(((r["ready"] - r["prod_first"]) / 1e3,
                                                                   r["ph_stage"] / 1e3))
    out: dict[str, list[tuple[int, float, float]]] = {}
    for typ, xs in cells.items():
        xs.sort()
        groups = [xs[len(xs) * i // parts:len(xs) * (i + 1) // parts] for i in range(parts)]
        out[typ] = [(len(g), statistics.median(x[0] for x in g), statistics.median(x[1] for x in g))
                    for g in groups if g]
    return out


# ---- the budget of one layer (issue 11): bytes, task time and hand-off gaps along the chain ---------------
CHAIN = ("qkv_rope", "attn", "o_proj", "gate_up", "down")   # one layer's ops in dependency order
READ_GBPS = 4500.0   # the H200's streaming read rate (bench/results/release_probe_2026-12-03_6b93050_inflight.md)


@dataclass(frozen=True)
class BudgetRow:
    op: str             # a CHAIN entry ("attn": the partial and combine tasks)
    weight_mb: float    # the op's weight bytes per layer (trace.annotate's weight_bytes)
    bytes_us: float     # weight_mb at READ_GBPS
    busy_us: float      # median task ready -> end
    chunks_us: float | None   # median chunk phase (MK_TRACE_PHASES builds only)
    window_us: float    # the op's first task ready -> its last task end, median over layers
    gap_us: float       # the op's last end -> the next op's first ready (the next layer's qkv for down)


def _chain_op(r: dict) -> str | None:
    typ = r.get("type") or task_type(r["opcode"])
    return "attn" if typ in ("attn_partial", "attn_combine") else typ if typ in CHAIN else None


def layer_budget(records: Sequence[dict]) -> tuple[list[BudgetRow], float]:
    """Per CHAIN op, medians over the layers that have a next op (all but the last for down): its weight bytes,
    task time, window and the gap to the next op; and the median layer time (qkv ready to the next layer's qkv
    ready). The records must carry 'layer' (trace.load_records annotates them when the meta can rebuild the
    program). A layer's time is about the sum of the windows and gaps: the ops do not overlap (each waits for
    all of the previous one's tasks)."""
    if not records or "layer" not in records[0]:
        raise ValueError("records without 'layer': load them with trace.load_records from a records file with meta")
    by: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for r in records:
        op = _chain_op(r)
        if op is not None:
            by[(int(r["layer"]), op)].append(r)
    layers = sorted({lay for lay, _ in by})
    phases = has_phases(records)

    def nxt(lay: int, i: int) -> tuple[int, str] | None:
        key = (lay, CHAIN[i + 1]) if i + 1 < len(CHAIN) else (lay + 1, CHAIN[0])
        return key if key in by else None

    rows = []
    for i, op in enumerate(CHAIN):
        keys = [(lay, op) for lay in layers if (lay, op) in by]
        if not keys:
            continue
        windows, gaps, mb = [], [], []
        for k in keys:
            rs = by[k]
            windows.append(max(r["end"] for r in rs) - min(r["ready"] for r in rs))
            mb.append(sum(r.get("weight_bytes", 0) for r in rs) / 1e6)
            n = nxt(k[0], i)
            if n is not None:
                gaps.append(min(r["ready"] for r in by[n]) - max(r["end"] for r in rs))
        tasks = [r for k in keys for r in by[k]]
        w = statistics.median(mb)
        rows.append(BudgetRow(op, w, w * 1e3 / READ_GBPS, statistics.median(r["end"] - r["ready"] for r in tasks) / 1e3,
                              statistics.median(r.get("ph_chunks", 0) for r in tasks) / 1e3 if phases else None,
                              statistics.median(windows) / 1e3, statistics.median(gaps) / 1e3 if gaps else float("nan")))
    starts = [min(r["ready"] for r in by[(lay, CHAIN[0])]) for lay in layers if (lay, CHAIN[0]) in by]
    per_layer = statistics.median(b - a for a, b in itertools.pairwise(starts)) / 1e3 if len(starts) > 1 else float("nan")
    return rows, per_layer


def budget_markdown(rows: Sequence[BudgetRow], per_layer_us: float) -> str:
    head = (f"| op | weight MB | bytes us at {READ_GBPS / 1000:g} TB/s | task busy us | chunks us | window us | "
            "gap to next op us |\n|---|---|---|---|---|---|---|")
    out = [head]
    for r in rows:
        ch = "-" if r.chunks_us is None else f"{r.chunks_us:.2f}"
        out.append(f"| {r.op} | {r.weight_mb:.1f} | {r.bytes_us:.2f} | {r.busy_us:.2f} | {ch} | {r.window_us:.2f} | "
                   f"{r.gap_us:.2f} |")
    tot_b = sum(r.bytes_us for r in rows)
    tot_w = sum(r.window_us for r in rows)
    tot_g = sum(r.gap_us for r in rows if r.gap_us == r.gap_us)
    out.append(f"| layer | {sum(r.weight_mb for r in rows):.1f} | {tot_b:.2f} | | | {tot_w:.2f} | {tot_g:.2f} |")
    return "\n".join(out) + (f"\n\nmedian layer (qkv ready to the next qkv ready): {per_layer_us:.2f} us; "
                              f"windows + gaps {tot_w + tot_g:.2f} us; weight bytes {tot_b:.2f} us")


def main(argv: Sequence[str] | None = None) -> int:
    """python -m mk_plugin.persistent.trace_phases [--budget] [--streams] RECORDS.json...: the tables per records
    file; --compare A B: B's per-op medians minus A's (two builds' traces of one shape)."""
    import argparse

    from .trace import load_records
    from .trace_streams import streams_markdown

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("records", nargs="+")
    ap.add_argument("--budget", action="store_true", help="also the budget of one layer (bytes, windows, gaps)")
    ap.add_argument("--streams", action="store_true",
                    help="also the weight streams per op and the per-SM byte groups (trace_streams; no phases needed)")
    ap.add_argument("--compare", action="store_true", help="two records files A B: B's per-op medians minus A's")
    args = ap.parse_args(argv)
    if args.compare:
        if len(args.records) != 2:
            ap.error(f"--compare takes two records files (A B), got {len(args.records)}")
        a, b = (phase_table(load_records(p)[0]) for p in args.records)
        print(f"## {args.records[1]} minus {args.records[0]}\n\nmedian per task (us):\n\n"
              f"{phase_table_markdown(phase_delta(a, b), signed=True)}\n")
        return 0
    for path in args.records:
        recs, _ = load_records(path)
        if args.budget:
            print(f"## {path}: one layer\n\n{budget_markdown(*layer_budget(recs))}\n")
        if args.streams:
            print(f"## {path}: weight streams\n\n{streams_markdown(recs)}\n")
        if (args.budget or args.streams) and not has_phases(recs):
            continue
        print(f"## {path}\n\nmedian per task (us):\n\n{phase_table_markdown(phase_table(recs))}\n")
        print("release us by when the SM's next weights (or ring-fed K/V) began (tasks, median):\n")
        for typ, bs in release_by_lag(recs).items():
            print(f"- {typ}: " + ", ".join(f"{b}: {m:.2f} ({n})" for b, (n, m) in bs.items()))
        print("\nstage us by the producer's lead, quartiles from the shortest (tasks, median lead -> median stage):\n")
        for typ, qs in stage_by_lead(recs).items():
            print(f"- {typ}: " + ", ".join(f"{ld:.2f} -> {sg:.2f} ({n})" for n, ld, sg in qs))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
