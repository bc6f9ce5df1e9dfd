"""Where a matvec task's time goes once it is ready: the MK_TRACE_PHASES=1 build's per-task phase times
(encoding.TRACE_FIELDS ph_stage, ph_chunks, ph_reduce; thread 0's %globaltimer after the barriers that
end each phase, summed over the task's passes), as a per-op table of medians.

    busy     ready -> end (the counter waits are done; the task's body and its final barrier)
    stage    activation staging: pass start to the chunk loop (stage_x and the norm statistics, or for
             column-group staging only the first group's issue; later groups overlap the chunks)
    chunks   the chunk loop to the barrier after it: ring waits, fragment loads and MMAs of all warps
    reduce   the cross-warp reduction and the op's epilogue (its L2 loads, stores) to the pass's barrier
    release  the signal's red.release.gpu (its fence waits until the CTA's stores are visible), every
             task type
    other    busy - stage - chunks - reduce - release: the call into matvec_task, the row statistics of
             column-group staging, the barrier before the release (for attention: the whole task)
"""
from __future__ import annotations

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
    stage_us: float
    chunks_us: float
    reduce_us: float
    release_us: float
    other_us: float


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
        other = [b - sum(r.get(p, 0) for p in PHASES) for b, r in zip(busy, rs)]
        rows.append(PhaseRow(typ, len(rs), med(busy), med(ph["ph_stage"]), med(ph["ph_chunks"]),
                             med(ph["ph_reduce"]), med(ph["ph_release"]), med(other)))
    return rows


def phase_table_markdown(rows: Sequence[PhaseRow]) -> str:
    head = "| op | tasks | busy us | stage us | chunks us | reduce+epilogue us | release us | other us |"
    out = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.op} | {r.tasks} | {r.busy_us:.2f} | {r.stage_us:.2f} | {r.chunks_us:.2f} | "
                   f"{r.reduce_us:.2f} | {r.release_us:.2f} | {r.other_us:.2f} |")
    return "\n".join(out)
