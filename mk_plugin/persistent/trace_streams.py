"""The weight streams of a traced step (persistent/trace.py records; no phase stamps needed): per task type,
how fast each SM's producer streamed a task's weights, how much of that stream came before the task's counter
wait ended, and how long the consumers ran after the last chunk was issued; and the per-SM byte groups of a
layer's op (the partition's tile counts).

Why (session 46, from the committed 8B traces): at batch 16 on the H200 qkv_rope and o_proj streamed at ~15 GB/s
an SM against ~30 for gate_up / down, and gate_up's 896 units over 132 SMs gave 104 SMs 7 units and 28 SMs 6: the
28 end ~10 us early, and the others' per-SM rate does not rise when they stop. The per-op table (trace.op_table)
shows neither: it averages over all tasks.

Definitions, per task with weights (prod_first > 0), medians over a type's tasks:
    lead_us     ready - prod_first: the stream's head start over the counter wait (negative: it began after)
    stream_us   prod_last - prod_first: issuing the task's chunks (bounded below by the ring's turnover)
    rate_gbps   weight_bytes / stream_us, one SM's rate (x the SMs streaming = the aggregate)
    tail_us     end - prod_last: the consumers' work after the last chunk was issued
    busy_us     end - ready
Byte groups, per type: each SM's weight bytes in one op instance (a layer's op), grouped by value over all
instances; imbalance = the largest group's bytes / the mean bytes per SM that had any (1.0 = even).
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from .trace import _type, check_records, type_order


@dataclass(frozen=True)
class StreamRow:
    op: str
    tasks: int
    kb_per_task: float
    lead_us: float
    stream_us: float
    rate_gbps: float
    tail_us: float
    busy_us: float


@dataclass(frozen=True)
class ByteGroup:
    op: str
    kb_per_sm: float      # one SM's weight bytes in one op instance
    sms: int              # distinct SMs that ever had this many bytes in an instance
    instances: int        # (SM, instance) pairs in the group
    busy_us: float        # median over the pairs of the SM's (last end - first ready) in the instance


def _streamed(records: Sequence[dict]) -> list[dict]:
    if records and "weight_bytes" not in records[0]:
        raise ValueError("these records carry no byte fields (saved before trace.annotate added them): "
                         "re-record the step with bench/mk_step.py --trace")
    return [r for r in records if r["prod_first"] and r["weight_bytes"] and r["prod_last"] >= r["prod_first"]]


def stream_table(records: Sequence[dict]) -> list[StreamRow]:
    """One StreamRow per task type that streams weights (TYPES order); see the module doc."""
    check_records(records)
    by_type: dict[str, list[dict]] = defaultdict(list)
    for r in _streamed(records):
        by_type[_type(r)].append(r)
    med = statistics.median
    rows = []
    for t in type_order(by_type):
        rs = by_type[t]
        rows.append(StreamRow(
            t, len(rs), med(r["weight_bytes"] for r in rs) / 1e3, med(r["ready"] - r["prod_first"] for r in rs) / 1e3,
            med(r["prod_last"] - r["prod_first"] for r in rs) / 1e3,
            med(r["weight_bytes"] / max(1, r["prod_last"] - r["prod_first"]) for r in rs),   # B/ns = GB/s
            med(r["end"] - r["prod_last"] for r in rs) / 1e3, med(r["end"] - r["ready"] for r in rs) / 1e3))
    return rows


def byte_groups(records: Sequence[dict]) -> dict[str, tuple[list[ByteGroup], float]]:
    """Per task type: its per-SM byte groups (largest first) and the imbalance (module doc)."""
    check_records(records)
    per: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
    for r in _streamed(records):
        per[(_type(r), r["op"], r["sm"])].append(r)
    groups: dict[str, dict[int, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
    for (t, _, sm), rs in per.items():
        groups[t][sum(r["weight_bytes"] for r in rs)].append((sm, max(r["end"] for r in rs) - min(r["ready"] for r in rs)))
    out = {}
    for t in type_order(groups):
        g = groups[t]
        pairs = [b for b, v in g.items() for _ in v]
        rows = [ByteGroup(t, b / 1e3, len({sm for sm, _ in g[b]}), len(g[b]), statistics.median(d for _, d in g[b]) / 1e3)
                for b in sorted(g, reverse=True)]
        out[t] = (rows, max(pairs) / statistics.mean(pairs))
    return out


def streams_markdown(records: Sequence[dict]) -> str:
    """Both views as markdown (times in us, rates in GB/s per SM, sizes in KB = 1e3 B)."""
    head = "| op | tasks | KB/task | lead us | stream us | GB/s per SM | tail us | busy us |"
    out = ["median per task:", "", head, "|" + "---|" * head.count(" | ") + "---|"]
    for s in stream_table(records):
        out.append(f"| {s.op} | {s.tasks} | {s.kb_per_task:.1f} | {s.lead_us:.2f} | {s.stream_us:.2f} "
                   f"| {s.rate_gbps:.1f} | {s.tail_us:.2f} | {s.busy_us:.2f} |")
    out += ["", "per-SM weight bytes in one layer's op (groups, largest first; imbalance = largest / mean):", ""]
    for t, (rows, imb) in byte_groups(records).items():
        parts = ", ".join(f"{g.kb_per_sm:.1f} KB x {g.sms} SMs (busy {g.busy_us:.2f} us)" for g in rows)
        out.append(f"- {t}: {parts}; imbalance {imb:.3f}")
    return "\n".join(out)
