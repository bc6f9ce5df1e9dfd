"""MK_CHAIN_PREFETCH (an A/B experiment, variant.KernelVariant.chain_prefetch): L2 prefetch of gate_up's
weights by the SMs that sit idle during a layer's latency chain.

Why. At 1B batch 1 qkv_rope -> attention -> o_proj is a ~14-20 us chain of small tasks with HBM mostly idle,
while each SM's weight ring is already full of its gate_up task's first chunks; the rest (~316 KB per SM)
streams only once gate_up is ready. Session 3's MK_L2_PREFETCH (every producer prefetching its own chunks
past the ring) cost +22 us per layer, most likely because a task's release fence waits for the SM's
in-flight bulk operations, and every SM then had prefetches in flight at its chain releases. Here only the
SMs with no task of qkv_rope(l), attention(l), o_proj(l) or down(l-1) prefetch (with 132 SMs at 1B those ops
have 128 tasks each, so 4 SMs are idle), so no SM on the chain has a prefetch in flight at its release.

The program (build_program(..., chain_prefetch=True)): for each layer whose qkv_rope, attention, o_proj and
gate_up share a segment and that has idle SMs, one L2_PREFETCH task per idle SM, pinned to it (Task.pin),
with tids just before gate_up(l)'s (its FusedOp is gate_up(l)'s). It waits on down(l-1) (the chain's start;
nothing at layer 0) and signals nothing (no release fence). The layer's gate_up tasks j = 0..parts-1 are
split over the idle SMs (arg0 = first j, arg1 = count, arg2 = parts). Its time-model cost is 0, so every
other task keeps its SM (list_schedule; tests check it); an op whose shape leaves no idle SM (8B: o_proj
has 132 tasks) simply gets no prefetch task.

What the kernel prefetches (csrc/l2_prefetch.cuh mirrors prefetch_ranges): for gate_up task j, units
[s, s+n) (tasks.split_units), the units past those whose chunks the ring holds when the task starts
(ring_units: the producer's first NUM_STAGES chunks), then the held ones (their later chunks are past the
ring too), as byte ranges of the gate rows and of the up rows, MK_CHAIN_PREFETCH KB per task split evenly
between the two. Whole rows are contiguous in W[2I, H], so each range is one cp.async.bulk.prefetch.L2.
"""
from __future__ import annotations

from dataclasses import replace

from .encoding import LAYOUT, UNIT, Opcode
from .tasks import Task, TaskSet, split_units

CHAIN_OPS = ("qkv_rope", "attention", "o_proj")   # layer l's chain; down(l-1) starts it
TILES_PER_UNIT = 2                                # gate_up: a gate tile and an up tile (csrc WeightPlan.mtpu)


def ring_units(n: int, batch: int, hidden: int, num_stages: int) -> int:
    """Units of a gate_up task of n units touched by its first num_stages chunks, in the producer's order
    (csrc/matvec.cuh producer_loop: passes of upp units; per pass, for each column chunk k0, each M-tile)."""
    nt = 1 if batch <= 8 else 2
    upp = (LAYOUT.acc_tiles // nt) // TILES_PER_UNIT
    kch = -(-hidden // LAYOUT.chunk_cols)          # chunk_cols_for(nt) == CHUNK_COLS at NT 1 and 2
    c, touched, p = num_stages, 0, 0
    while p < n and c > 0:
        mt = min(upp, n - p) * TILES_PER_UNIT
        touched = p + (min(c, mt) + 1) // TILES_PER_UNIT
        c -= mt * kch
        p += upp
    return min(touched, n)


def prefetch_ranges(args: tuple[int, int, int], *, units: int, hidden: int, inter: int, elem_bytes: int,
                    batch: int, num_stages: int, cap_kb: int) -> list[tuple[int, int]]:
    """(byte offset in the layer's gate_up weight [2I, H], bytes) of every prefetch one L2_PREFETCH task with
    these args issues: the Python mirror of csrc/l2_prefetch.cuh (same order: first ranges, then wrapped)."""
    j0, jn, parts = args
    row_bytes = hidden * elem_bytes
    half = cap_kb * 1024 // 2                      # per matrix (gate rows, up rows)
    out: list[tuple[int, int]] = []
    split = split_units(0, units, parts)
    for wrapped in (False, True):
        for base_row in (0, inter):
            for s, n in split[j0:j0 + jn]:
                skip = ring_units(n, batch, hidden, num_stages)
                first = (n - skip) * UNIT * row_bytes     # units [s + skip, s + n): wholly past the ring
                if wrapped:                               # then [s, s + skip), with what the cap leaves
                    lo, size = s, min(max(0, half - first), skip * UNIT * row_bytes)
                else:
                    lo, size = s + skip, min(half, first)
                if size > 0:
                    out.append(((base_row + lo * UNIT) * row_bytes, size))
    return out


def idle_sms(tasks: list[Task], queues: list[list[int]], layer: int) -> list[int]:
    """SMs with no task of layer's chain (CHAIN_OPS, and down(layer - 1)) in this segment's queues."""
    busy_ops = {f"L{layer}.{o}" for o in CHAIN_OPS} | {f"L{layer - 1}.down"}
    busy = {sm for sm, q in enumerate(queues) for i in q if tasks[i].op.key in busy_ops}
    return [sm for sm in range(len(queues)) if sm not in busy]


def add_chain_prefetch(ts: TaskSet, plans: list[tuple[list[Task], list[list[int]]]]) -> TaskSet:
    """ts with the L2_PREFETCH tasks of every layer that has idle SMs, given each segment's (tasks, queues)
    as scheduled without them; tids renumbered (every prefetch task sits just before its gate_up's)."""
    by_name = {c.name: i for i, c in enumerate(ts.counters)}
    inserts: dict[str, list[Task]] = {}            # gate_up op key -> its prefetch tasks
    for tasks, queues in plans:
        keys = {t.op.key for t in tasks}
        for op in {t.op for t in tasks if t.op.name == "gate_up"}:
            L = op.layer
            if not all(f"L{L}.{o}" in keys for o in CHAIN_OPS):
                continue                           # the chain runs in another launch (fallback ops)
            sms = idle_sms(tasks, queues, L)
            parts = sum(1 for t in tasks if t.op.key == op.key)
            if not sms or parts == 0:
                continue
            down = f"L{L - 1}.down"
            waits = [(by_name[down], ts.counters[by_name[down]].total)] if L > 0 else []
            inserts[op.key] = [Task(0, Opcode.L2_PREFETCH, op, (j0, jn, parts), waits=list(waits), pin=sm)
                               for sm, (j0, jn) in zip(sms, split_units(0, parts, len(sms)))]
    if not inserts:
        return ts
    out: list[Task] = []
    for t in ts.tasks:
        if t.op.key in inserts and t.tid == ts.op_ranges[t.op.key][0]:
            out += inserts.pop(t.op.key)
        out.append(t)
    ranges: dict[str, tuple[int, int]] = {}
    for tid, t in enumerate(out):
        t.tid = tid
        lo, _ = ranges.get(t.op.key, (tid, tid))
        ranges[t.op.key] = (lo, tid + 1)
    assert ranges.keys() == ts.op_ranges.keys()
    return replace(ts, tasks=out, op_ranges=ranges)
