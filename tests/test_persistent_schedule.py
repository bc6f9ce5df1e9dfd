"""Programs are deadlock free (every wait satisfiable, queues in topological order) and every pair
of conflicting memory accesses is ordered by the counters, for small random specs and for the
Llama-3.2-1B / Llama-3.1-8B shapes (encoding + deadlock check only for the big ones)."""
from __future__ import annotations

import gc
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import small_specs  # tests/strategies.py

from mk_plugin.ops import STEP_OPS
from mk_plugin.persistent import encoding as enc
from mk_plugin.persistent.schedule import (
    Program,
    Segment,
    _encode_segment,
    build_program,
    check_ordering,
    list_schedule,
)
from mk_plugin.persistent.tasks import SIGNAL_NS, Task, op_units, qkv_unit
from mk_plugin.persistent.tuning import ScheduleTuning
from mk_plugin.persistent.vm import DeadlockError, check_deadlock_free
from mk_plugin.spec import LlamaSpec

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"


@settings(max_examples=25, deadline=None)
@given(small_specs(), st.integers(1, 16), st.integers(1, 20), st.booleans(),
       st.sets(st.sampled_from(STEP_OPS), max_size=3), st.integers(0, 5), st.booleans(),
       st.sampled_from([(), (("down", 2),), (("down", 4), ("o_proj", 3))]))
def test_random_programs_are_deadlock_free_and_ordered(spec, batch, sms, lm_head, fallback, chunks, merge, ksplit):
    tuning = ScheduleTuning(attn_chunks=chunks, merge_in_partial=merge, ksplit=ksplit)
    p = build_program(spec, batch, sms, lm_head=lm_head, fallback=frozenset(fallback), tuning=tuning)
    check_deadlock_free(p)
    check_ordering(p)
    # every task of every op is somewhere: megakernel segments + fallback steps cover all tids
    covered = sum(len(s.tasks) for s in p.segments) + sum(
        st_.tid_range[1] - st_.tid_range[0] for st_ in p.steps if not isinstance(st_, Segment))
    assert covered == p.num_tids


@pytest.mark.parametrize("model,batches", [("llama-3.2-1b", (1, 3, 8, 16)), ("llama-3.1-8b", (1, 16))])
def test_big_models_deadlock_free(model, batches):
    spec = LlamaSpec.from_json_file(MODELS / model)
    for b in batches:
        p = build_program(spec, b, 132, lm_head=True, tuning=ScheduleTuning(merge_in_partial=False))
        (rep,) = check_deadlock_free(p)
        assert rep.tasks == p.num_tids
        pm = build_program(spec, b, 132, lm_head=True)   # the default: merge in the last partial
        (repm,) = check_deadlock_free(pm)   # no combine tasks where there are chunks to merge
        assert repm.tasks == pm.num_tids == p.num_tids - (b * spec.num_kv_heads * spec.num_layers
                                                          if p.attn_chunks > 1 else 0)
        seg = p.segments[0]
        assert len(seg.queues) == 132 and min(len(q) for q in seg.queues) > 0
        # the big linear ops give every SM a task ("fill the 132 SMs")
        for key in ("L0.gate_up", "L0.down", "L0.o_proj", "lm_head"):
            lo, hi = p.op_ranges[key]
            assert hi - lo == min(132, op_units(spec, key.split(".")[-1]))
        dp = enc.decode(seg.encoded)
        assert dp.header["batch"] == b and dp.num_tasks == p.num_tids


def test_prefix_programs_are_closed():
    spec = LlamaSpec.tiny()
    p = build_program(spec, 3, 6, lm_head=True, fallback=frozenset({"o_proj"}))
    for key in ("L0.qkv_rope", "L0.attention", "L0.o_proj", "L1.down", "final_norm"):
        q = p.prefix(p.op_end(key))
        check_deadlock_free(q)
        kept = {t.tid for s in q.segments for t in s.tasks}
        assert kept == set(range(p.op_end(key))) - set(range(*p.op_ranges["L0.o_proj"])) - set(
            range(*p.op_ranges["L1.o_proj"]))


def _with_waits(p: Program, mutate) -> Program:
    seg = p.segments[0]
    waits = [list(w) for w in seg.waits]
    mutate(seg, waits)
    enc_ = _encode_segment(p.spec, p.batch, p.attn_chunks, seg.tasks, waits, seg.queues)
    return replace(p, steps=[Segment(seg.ops, seg.tasks, waits, seg.queues, enc_)])


def test_checkers_catch_broken_programs():
    spec = LlamaSpec.tiny()
    p = build_program(spec, 2, 4)
    lo, _ = p.op_ranges["L0.o_proj"]

    def unsatisfiable(seg, waits):
        c, t = waits[lo][0]
        waits[lo][0] = (c, t + 1)

    with pytest.raises(DeadlockError):
        check_deadlock_free(_with_waits(p, unsatisfiable))

    def wait_on_later_op(seg, waits):  # qkv of layer 0 waits for layer 0's down: a cycle
        down = seg.tasks[p.op_ranges["L0.down"][0]].signal[0]
        waits[0] = [(down, p.counters[down].total)]

    with pytest.raises(DeadlockError):
        check_deadlock_free(_with_waits(p, wait_on_later_op))

    def drop_dependency(seg, waits):  # gate_up no longer waits for o_proj: a read-after-write race
        for i in range(*p.op_ranges["L0.gate_up"]):
            waits[i] = []

    with pytest.raises(AssertionError, match="unordered conflict"):
        check_ordering(_with_waits(p, drop_dependency))


def test_checker_orders_k_split_merges_by_their_ticket():
    """tuning.piece_deps: down's part p waits for gate_up's piece p only, so a part may run while other pieces of
    gate_up still read the residual; the residual is written only by the merge, after every part (each after its
    piece): ordered. A part made to wait for another part's piece reads ACT columns nobody ordered: caught; and a
    merge whose parts do not all wait for their pieces would write the residual under a reader: caught."""
    spec = LlamaSpec.tiny()
    p = build_program(spec, 2, 5, tuning=ScheduleTuning(ksplit=(("down", 3),), piece_deps=True))
    check_ordering(p)
    check_deadlock_free(p)
    lo, hi = p.op_ranges["L0.down"]
    part0 = next(i for i in range(lo, hi) if enc.ksplit_parts(p.taskset.tasks[i].args[2])[0] == 0)
    part1 = next(i for i in range(lo, hi) if enc.ksplit_parts(p.taskset.tasks[i].args[2])[0] == 1
                 and p.taskset.tasks[i].ticket == p.taskset.tasks[part0].ticket)

    def wrong_piece(seg, waits):   # part 0 waits for part 1's piece: its own ACT columns are unordered
        waits[part0] = list(waits[part1])

    with pytest.raises(AssertionError, match="unordered conflict"):
        check_ordering(_with_waits(p, wrong_piece))

    def no_wait(seg, waits):   # part 1 waits for nothing: it and the merge race with gate_up
        waits[part1] = []

    with pytest.raises(AssertionError, match="unordered conflict"):
        check_ordering(_with_waits(p, no_wait))


# ---- the fast build equals plain reference code ---------------------------------------------------------
def _reference_list_schedule(tasks, num_sms, waits=None):
    """list_schedule as first written (one allocating numpy expression per task): the fast loop's reference."""
    free = np.zeros(num_sms)
    done: dict[int, float] = {}
    queues: list[list[int]] = [[] for _ in range(num_sms)]
    for idx, t in enumerate(tasks):
        ws = t.waits if waits is None else waits[idx]
        ready = max((done.get(c, 0.0) + SIGNAL_NS for c, _ in ws), default=0.0)
        finish = np.maximum(free, ready) + t.cost
        sm = int(np.argmin(finish))
        free[sm] = finish[sm]
        queues[sm].append(idx)
        if t.signal is not None:
            done[t.signal[0]] = max(done.get(t.signal[0], 0.0), float(finish[sm]))
    return queues, float(free.max(initial=0.0))


def _random_tasks(rnd: random.Random, n: int) -> list[Task]:
    """A chain of ops (counter i signalled by op i) with costs that make ties, rounding ties included."""
    costs = [1.0, 2.5, 0.1, 0.2, 0.30000000000000004, 1e-12, 3e5]
    tasks, op = [], 0
    for tid in range(n):
        if rnd.random() < 0.2:
            op += 1
        waits = [(c, 0) for c in rnd.sample(range(op), min(op, rnd.randint(0, 2)))]
        tasks.append(Task(tid, None, None, (0, 0, 0), waits=waits, signal=(op, 1), cost=rnd.choice(costs)))
    return tasks


def test_list_schedule_equals_its_reference():
    rnd = random.Random(5)
    for _ in range(200):
        tasks, sms = _random_tasks(rnd, rnd.randint(0, 60)), rnd.randint(1, 9)
        assert list_schedule(tasks, sms) == _reference_list_schedule(tasks, sms)
    for spec, b, sms, t in ((LlamaSpec.tiny(), 3, 7, ScheduleTuning()), (LlamaSpec.tiny(), 16, 20, ScheduleTuning(
            attn_chunks=3, merge_in_partial=False, ksplit=(("down", 2),))),
            (LlamaSpec.from_json_file(MODELS / "llama-3.2-1b"), 1, 132, ScheduleTuning())):
        p = build_program(spec, b, sms, fallback=frozenset({"o_proj"}), tuning=t)
        for seg in p.segments:
            assert list_schedule(seg.tasks, sms, seg.waits) == _reference_list_schedule(seg.tasks, sms, seg.waits)
            assert (seg.queues, seg.predicted_ns) == _reference_list_schedule(seg.tasks, sms, seg.waits)


def test_qkv_tasks_write_their_units_regions():
    spec = LlamaSpec(hidden_size=320, num_layers=2, num_q_heads=6, num_kv_heads=2, head_dim=64, intermediate_size=688,
                     vocab_size=1000)
    p = build_program(spec, 5, 11)
    d = spec.head_dim
    for t in p.taskset.tasks:
        if t.op.name != "qkv_rope":
            continue
        want = []
        for u in range(t.args[0], t.args[0] + t.args[1]):   # the per-unit description of tasks.py
            kind, head, s = qkv_unit(spec, u)
            base = head * d if kind == "q" else (0 if kind == "k" else spec.kv_size) + head * d
            name = "Q" if kind == "q" else f"KV{t.op.layer}"
            want += [(name, 0, 5, c0, c0 + 8) for c0 in (base + s * 8, base + d // 2 + s * 8)]
        assert t.writes == want


def test_build_program_is_deterministic_and_leaves_gc_as_it_was():
    spec = LlamaSpec.tiny()
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            a, b = (build_program(spec, 3, 7, lm_head=True, fallback=frozenset({"attention"})) for _ in range(2))
            assert gc.isenabled() == enabled
            assert [s.encoded.tobytes() for s in a.segments] == [s.encoded.tobytes() for s in b.segments]
            assert [(s.queues, s.waits, s.predicted_ns) for s in a.segments] == \
                [(s.queues, s.waits, s.predicted_ns) for s in b.segments]
            assert a.taskset.tasks == b.taskset.tasks and a.counters == b.counters and a.op_ranges == b.op_ranges
    finally:
        (gc.enable if was else gc.disable)()
