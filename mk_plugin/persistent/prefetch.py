"""MK_CHAIN_L2 (an A/B experiment, variant.KernelVariant.chain_l2): gate_up's weights asked into L2 by the SMs
that sit idle during a layer's qkv_rope -> attention -> o_proj chain, for the tiled copy (MK_W_TMA) to read.

Why (bench/NOTES.md sessions 11-12, 36-38, 40). At 1B batch 1 the chain takes ~17 us a layer with HBM mostly
idle: under the tables' release gate pair the SMs' rings hold only gate_up's first 2 chunks when gate_up becomes
ready, and the rest of its ~508 KB an SM streams after. L2 feeds MK_W_TMA's 32 KB tiled copies at 2.4x HBM
(session 36's l2_probe), where the 2 KB per-row copies gain 1.3x (which is why session 12's MK_CHAIN_PREFETCH found
nothing); and a release waits for its own SM's prefetches in flight (session 38's release_prefetch), which is why
MK_GATE_L2's in-SM prefetch lost (session 37). So only SMs with no task of qkv_rope(l), attention(l), o_proj(l) or
down(l-1) prefetch (1B on 132 SMs: those ops have 128 tasks, 4 SMs are idle); no SM on the chain then has a prefetch
in flight at its release. gpu_calls l2_window bounds what this can gain (the same chunks folded onto an
L2-resident region).

The program (build_program(..., chain_l2=True)): for each layer whose qkv_rope, attention, o_proj and gate_up share
a segment and that has idle SMs, one L2_PREFETCH task per idle SM, pinned to it (Task.pin), with tids just before
gate_up(l)'s (its FusedOp is gate_up(l)'s). It waits on down(l-1) (the chain's start; nothing at layer 0) and
signals nothing (no release fence). The layer's gate_up tasks j = 0..parts-1 are split over the idle SMs (arg0 =
first j, arg1 = count, arg2 = parts). Its time-model cost is 0, so every other task keeps its SM (list_schedule);
a shape that leaves no idle SM (8B: o_proj has 132 tasks), or gate_up cut in pieces (tuning.piece_deps), gets none.

What the kernel prefetches (csrc/l2_prefetch.cuh; prefetch_ranges is its mirror): for gate_up task j (units
split_units(0, units, parts)[j]), the whole rows (every column) of the M-tiles CHAIN_L2_FROM .. CHAIN_L2_FROM + T - 1
of its first pass (T = MK_CHAIN_L2), 16 rows of H columns each, contiguous in W[2I, H]: one
cp.async.bulk.prefetch.L2 per M-tile. M-tile m is unit s + m // 2's gate rows (m even) or up rows (m odd).
"""
from __future__ import annotations

from dataclasses import replace

from .encoding import LAYOUT, UNIT, Opcode
from .tasks import Task, TaskSet, split_units

CHAIN_OPS = ("qkv_rope", "attention", "o_proj")   # layer l's chain; down(l-1) starts it
TILES_PER_UNIT = 2       # gate_up: a gate tile and an up tile (csrc WeightPlan.mtpu)
CHAIN_L2_FROM = 2        # the first M-tile prefetched: the tables' gate_ahead 2 issues M-tiles 0 and 1 (k0 = 0) early


def prefetch_ranges(args: tuple[int, int, int], *, units: int, hidden: int, inter: int, elem_bytes: int,
                    batch: int, tiles: int) -> list[tuple[int, int]]:
    """(byte offset in the layer's gate_up weight [2I, H], bytes) of every prefetch one L2_PREFETCH task with these
    args issues, in the kernel's order (task j, then M-tile): the Python mirror of csrc/l2_prefetch.cuh."""
    j0, jn, parts = args
    row_bytes = hidden * elem_bytes
    upp = (LAYOUT.acc_tiles // (1 if batch <= 8 else 2)) // TILES_PER_UNIT   # units of the first pass
    out: list[tuple[int, int]] = []
    for s, n in split_units(0, units, parts)[j0:j0 + jn]:
        mt = min(upp, n) * TILES_PER_UNIT
        for m in range(CHAIN_L2_FROM, min(CHAIN_L2_FROM + tiles, mt)):
            u = s + m // TILES_PER_UNIT
            row = (inter if m % TILES_PER_UNIT else 0) + u * UNIT
            out.append((row * row_bytes, UNIT * row_bytes))
    return out


def idle_sms(tasks: list[Task], queues: list[list[int]], layer: int) -> list[int]:
    """SMs with no task of layer's chain (CHAIN_OPS, and down(layer - 1)) in this segment's queues."""
    busy_ops = {f"L{layer}.{o}" for o in CHAIN_OPS} | {f"L{layer - 1}.down"}
    busy = {sm for sm, q in enumerate(queues) for i in q if tasks[i].op.key in busy_ops}
    return [sm for sm in range(len(queues)) if sm not in busy]


def _plain_split(tasks: list[Task], key: str, units: int) -> int:
    """The layer's gate_up task count if its tasks are split_units(0, units, parts) in tid order (what the kernel
    recomputes from j and parts), else 0 (cut in pieces: no prefetch)."""
    mine = [t.args[:2] for t in tasks if t.op.key == key]
    return len(mine) if mine and mine == [tuple(r) for r in split_units(0, units, len(mine))] else 0


def add_chain_prefetch(ts: TaskSet, plans: list[tuple[list[Task], list[list[int]]]]) -> TaskSet:
    """ts with the L2_PREFETCH tasks of every layer that has idle SMs, given each segment's (tasks, queues) as
    scheduled without them; tids renumbered (every prefetch task sits just before its gate_up's)."""
    by_name = {c.name: i for i, c in enumerate(ts.counters)}
    units = ts.spec.intermediate_size // UNIT
    inserts: dict[str, list[Task]] = {}            # gate_up op key -> its prefetch tasks
    for tasks, queues in plans:
        keys = {t.op.key for t in tasks}
        for op in {t.op for t in tasks if t.op.name == "gate_up"}:
            L = op.layer
            if not all(f"L{L}.{o}" in keys for o in CHAIN_OPS):
                continue                           # the chain runs in another launch (fallback ops)
            sms = idle_sms(tasks, queues, L)
            parts = _plain_split(tasks, op.key, units)
            down = f"L{L - 1}.down"
            if not sms or not parts or (L > 0 and down not in by_name):
                continue
            waits = [(by_name[down], ts.counters[by_name[down]].total)] if L > 0 else []
            inserts[op.key] = [Task(0, Opcode.L2_PREFETCH, op, (j0, jn, parts), waits=list(waits), pin=sm)
                               for sm, (j0, jn) in zip(sms, split_units(0, parts, len(sms)))]
    if not inserts:
        return ts
    out: list[Task] = []
    for t in ts.tasks:
        if t.tid == ts.op_ranges[t.op.key][0] and t.op.key in inserts:
            out += inserts.pop(t.op.key)
        out.append(t)
    ranges: dict[str, tuple[int, int]] = {}
    for tid, t in enumerate(out):
        t.tid = tid
        lo, _ = ranges.get(t.op.key, (tid, tid))
        ranges[t.op.key] = (lo, tid + 1)
    assert ranges.keys() == ts.op_ranges.keys()
    return replace(ts, tasks=out, op_ranges=ranges)
