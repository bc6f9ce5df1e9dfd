"""Per-SM queues, segments cut at fallback ops, and the assembled, encoded Program.

Queues. The grid has one CTA per SM, all co-resident (checked at launch: grid = SM count and one
CTA fits per SM). Every queue lists its tasks in increasing tid, and tid is a topological order of
the dependencies (a task only waits on tasks of earlier ops). Hence no SM ever waits on work queued
behind itself: the unfinished task of smallest tid has all its dependencies done and is at the head
of its queue, so some SM can always progress. vm.check_deadlock_free re-proves this per program by
simulation.

Assignment is earliest-finish-time list scheduling over a time model of every task (tasks.py):
each task goes to the SM predicted to finish it first (list_schedule).
"""
from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np

from ..spec import LlamaSpec
from .encoding import encode, megakernel_supports, spec_hash
from .graph import FusedOp, split_segments
from .tasks import SIGNAL_NS, Counter, Task, TaskSet, build_tasks
from .tuning import DEFAULT_TUNING, ScheduleTuning


def list_schedule(tasks: list[Task], num_sms: int,
                  waits: list[list[tuple[int, int]]] | None = None) -> tuple[list[list[int]], float]:
    """Queues (indices into `tasks`, which must be in tid order) for num_sms SMs, and the time
    model's predicted span of the launch (ns).

    Earliest-finish-time list scheduling over the time model of tasks.py: tasks in tid order each
    go to the SM that would finish them first, given when every SM becomes free and when the task's
    counters are complete (its producers' predicted ends + SIGNAL_NS). Ops are separated by counter
    waits, so balancing each op over the SMs free at that moment is what shortens the step; a
    cumulative-load balance (the first version) put three attention partials in a row on the few
    SMs without a qkv task and delayed every layer by ~7 us (H200 trace, 1B batch 1).
    `waits` (default: each task's own) are the dependencies kept inside the segment."""
    free = np.zeros(num_sms)
    finish = np.empty(num_sms)   # reused: two in-place ufuncs and an argmin a task (2x the allocating form)
    done: dict[int, float] = {}  # counter -> predicted time its last signaller finishes
    queues: list[list[int]] = [[] for _ in range(num_sms)]
    maximum, get = np.maximum, done.get
    for idx, t in enumerate(tasks):
        ready = 0.0
        for c, _ in (t.waits if waits is None else waits[idx]):
            ready = max(ready, get(c, 0.0) + SIGNAL_NS)
        maximum(free, ready, out=finish)
        finish += t.cost
        sm = int(finish.argmin())   # the first SM of the earliest finish: ties (also rounding ties) go low
        end = float(finish[sm])
        free[sm] = end
        queues[sm].append(idx)
        if t.signal is not None and end > get(t.signal[0], 0.0):
            done[t.signal[0]] = end
    return queues, float(free.max(initial=0.0))


@dataclass
class Segment:
    """One megakernel launch: tasks of consecutive non-fallback ops."""
    ops: list[FusedOp]
    tasks: list[Task]                  # tid order
    waits: list[list[tuple[int, int]]]  # per task, the waits kept (dependencies inside the segment)
    queues: list[list[int]]            # per SM, indices into tasks
    encoded: np.ndarray                # int32 program (encoding.encode)
    predicted_ns: float = 0.0          # the time model's span of this launch (list_schedule)


@dataclass
class FallbackStep:
    """One op run by the Triton kernels between segments; tid_range is what its tasks would be."""
    op: FusedOp
    tid_range: tuple[int, int]


@dataclass
class Program:
    spec: LlamaSpec
    batch: int
    num_sms: int
    lm_head: bool
    fallback: frozenset[str]
    attn_chunks: int
    steps: list[Segment | FallbackStep]
    counters: list[Counter]
    op_ranges: dict[str, tuple[int, int]]
    num_tids: int
    prefix_len: int | None = None      # set on truncated programs
    taskset: TaskSet | None = field(default=None, repr=False)
    tuning: ScheduleTuning = DEFAULT_TUNING

    @property
    def predicted_ns(self) -> float:
        """The time model's prediction of the megakernel launches (fallback ops not included)."""
        return sum(s.predicted_ns for s in self.segments)

    @property
    def segments(self) -> list[Segment]:
        return [s for s in self.steps if isinstance(s, Segment)]

    @property
    def num_counters(self) -> int:
        return len(self.counters)

    def op_end(self, key: str) -> int:
        """The tid just past op `key` (e.g. 'L3.gate_up', 'final_norm'): a bisection point."""
        return self.op_ranges[key][1]

    def prefix(self, n: int) -> Program:
        """The program that runs only tasks with tid < n (and fallback ops wholly before n). tid
        order is topological, so the prefix is closed under dependencies and deadlock free."""
        steps: list[Segment | FallbackStep] = []
        for s in self.steps:
            if isinstance(s, FallbackStep):
                if s.tid_range[1] <= n:
                    steps.append(s)
                continue
            keep = [i for i, t in enumerate(s.tasks) if t.tid < n]
            if not keep:
                continue
            remap = {old: new for new, old in enumerate(keep)}
            tasks = [s.tasks[i] for i in keep]
            waits = [s.waits[i] for i in keep]
            queues = [[remap[i] for i in q if i in remap] for q in s.queues]
            steps.append(Segment(s.ops, tasks, waits, queues,
                                 _encode_segment(self.spec, self.batch, self.attn_chunks, tasks, waits, queues)))
        return replace(self, steps=steps, prefix_len=n)


def _encode_segment(spec: LlamaSpec, batch: int, chunks: int, tasks: list[Task],
                    waits: list[list[tuple[int, int]]], queues: list[list[int]]) -> np.ndarray:
    records = [t.record(w) for t, w in zip(tasks, waits)]
    return encode(records, queues, batch=batch, attn_chunks=chunks, spec_hash=spec_hash(spec))


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block. A program is ~10 container objects per task (20k
    tasks at 8B), all acyclic (reference counting frees them), yet their allocations trigger collections
    that traverse every live object, the programs built before included: about half of build_program's time
    on the CPU with the 16 programs of a decoder kept alive."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def build_program(spec: LlamaSpec, batch: int, num_sms: int, *, lm_head: bool = False,
                  fallback: frozenset[str] = frozenset(), tuning: ScheduleTuning = DEFAULT_TUNING) -> Program:
    """Compile one decode step of `batch` tokens for `num_sms` SMs into encoded per-launch programs.
    Built once per (spec, padded batch, SM count, lm_head, fallback, tuning) and reused every step."""
    why = megakernel_supports(spec)
    if why is not None:
        raise ValueError(f"the megakernel cannot run this model: {why}")
    with _gc_paused():
        return _build_program(spec, batch, num_sms, lm_head, frozenset(fallback), tuning)


def _build_program(spec: LlamaSpec, batch: int, num_sms: int, lm_head: bool, fallback: frozenset[str],
                   tuning: ScheduleTuning) -> Program:
    ts = build_tasks(spec, batch, num_sms, lm_head, tuning)
    steps: list[Segment | FallbackStep] = []
    for part in split_segments(ts.ops, fallback):
        if isinstance(part, FusedOp):
            steps.append(FallbackStep(part, ts.op_ranges[part.key]))
            continue
        keys = {op.key for op in part}
        tasks = [t for op in part for t in ts.tasks[slice(*ts.op_ranges[op.key])]]
        # A wait on an op in another segment is dropped: the launch boundary orders it.
        inside = {i for i, c in enumerate(ts.counters) if c.producer in keys}
        waits = [[w for w in t.waits if w[0] in inside] for t in tasks]
        queues, span = list_schedule(tasks, num_sms, waits)
        steps.append(Segment(part, tasks, waits, queues,
                             _encode_segment(spec, batch, ts.attn_chunks, tasks, waits, queues), span))
    return Program(spec, batch, num_sms, lm_head, fallback, ts.attn_chunks, steps, ts.counters,
                   ts.op_ranges, len(ts.tasks), taskset=ts, tuning=tuning)


def _overlaps(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2] and a[3] < b[4] and b[3] < a[4]


def check_ordering(program: Program) -> None:
    """Prove that every pair of tasks touching overlapping data (one of them writing) is ordered by
    happens-before in the same direction as tid order. Happens-before edges: queue order on one SM,
    counter waits (every target is the counter's total, so the waiter follows all its signallers),
    and launch boundaries between segments. Fallback ops are checked by their own kernel order.
    Raises AssertionError naming the first unordered pair. Quadratic: for small programs."""
    signallers: dict[int, list[int]] = {}
    seg_of: dict[int, int] = {}
    tasks: dict[int, Task] = {}
    preds: dict[int, set[int]] = {}
    for si, seg in enumerate(program.segments):
        for t, w in zip(seg.tasks, seg.waits):
            seg_of[t.tid] = si
            tasks[t.tid] = t
            preds[t.tid] = set()
            if t.signal is not None:
                signallers.setdefault(t.signal[0], []).append(t.tid)
            for c, target in w:
                assert target == program.counters[c].total, f"task {t.tid} waits on a partial counter"
        for q in seg.queues:
            for a, b in itertools.pairwise(q):
                preds[seg.tasks[b].tid].add(seg.tasks[a].tid)
    for seg in program.segments:
        for t, w in zip(seg.tasks, seg.waits):
            for c, _ in w:
                preds[t.tid].update(s for s in signallers[c] if seg_of[s] == seg_of[t.tid])
    order = sorted(tasks)
    reach: dict[int, int] = {}
    seg_start_mask: dict[int, int] = {}
    mask_so_far = 0
    prev_seg = None
    for tid in order:
        si = seg_of[tid]
        if si != prev_seg:
            seg_start_mask[si] = mask_so_far  # every task of earlier segments happens before
            prev_seg = si
        r = seg_start_mask[si]
        for p in preds[tid]:
            assert p < tid, f"dependency edge {p} -> {tid} goes backwards in tid order"
            r |= reach[p] | (1 << p)
        reach[tid] = r
        mask_so_far |= 1 << tid
    group: dict[int, list[int]] = {}   # ticket -> its tasks: a merge access runs after all of them
    for tid in order:
        if tasks[tid].ticket is not None:
            group.setdefault(tasks[tid].ticket, []).append(tid)

    def conflict(r1: list, w1: list, r2: list, w2: list) -> bool:
        return any(_overlaps(x, y) for x in w1 for y in r2 + w2) or any(_overlaps(x, y) for x in r1 for y in w2)

    def before(xs: list[int], ys: list[int]) -> bool:
        """Every access done by one of xs happens before some access of ys: each x precedes some y."""
        return all(any((reach[y] >> x) & 1 for y in ys) for x in xs)

    for i, a in enumerate(order):
        ta = tasks[a]
        ga = group.get(ta.ticket, [a]) if ta.ticket is not None else [a]
        for b in order[i + 1:]:
            tb = tasks[b]
            # Tasks of one ticket are ordered by it: each stores its part before its increment, and only the
            # one that completes the ticket reads the parts (merge-in-partial attention, K-split parts).
            if ta.ticket is not None and ta.ticket == tb.ticket:
                continue
            gb = group.get(tb.ticket, [b]) if tb.ticket is not None else [b]
            # (own accesses of a or of its ticket's merge) x (own accesses of b or of its ticket's merge): a merge
            # runs after every task of its ticket, by whichever is last
            for (ra, wa, xs) in ((ta.reads, ta.writes, [a]), (ta.merge_reads, ta.merge_writes, ga)):
                for (rb, wb, ys) in ((tb.reads, tb.writes, [b]), (tb.merge_reads, tb.merge_writes, gb)):
                    if conflict(ra, wa, rb, wb) and not before(xs, ys):
                        raise AssertionError(f"unordered conflict: task {a} ({ta.op.key}) and task {b} ({tb.op.key})")
