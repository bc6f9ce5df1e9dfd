"""MK_CHAIN_L2 (session 40, an A/B switch, unmeasured): L2_PREFETCH tasks on the SMs idle during a layer's
qkv_rope -> attention -> o_proj chain ask L2 for gate_up rows (mk_plugin/persistent/prefetch.py). The program keeps
every other task on its SM, the tasks change no value (VM), the programs pass the ordering and deadlock checks, and the
byte ranges the kernel issues (prefetch_ranges, the mirror of csrc/l2_prefetch.cuh) are the tiles' whole rows."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mk_plugin import reference as ref
from mk_plugin.persistent import vm
from mk_plugin.persistent.encoding import UNIT, Buf, Opcode
from mk_plugin.persistent.prefetch import CHAIN_L2_FROM, CHAIN_OPS, prefetch_ranges
from mk_plugin.persistent.schedule import build_program, check_ordering
from mk_plugin.persistent.tuning import ScheduleTuning
from mk_plugin.persistent.variant import KernelVariant
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import make_decode_batch
from mk_plugin.weights import random_weights

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "bench" / "models"
# tiny on 8 SMs with the chain ops cut in half: 4 SMs a layer have no chain task (as 1B's 128-task ops on 132 SMs)
TINY_SPLIT = ScheduleTuning(split=(("qkv_rope", 0.5), ("o_proj", 0.5), ("down", 0.5), ("gate_up", 1.0)), attn_chunks=1)


def _placements(program):
    seg = program.segments[0]
    return {(t.op.key, t.args): sm for sm, q in enumerate(seg.queues) for i in q for t in [seg.tasks[i]]
            if t.opcode != Opcode.L2_PREFETCH}


def test_prefetch_tasks_sit_on_the_idle_sms_and_move_no_other_task():
    spec = LlamaSpec.from_json_file(MODELS / "llama-3.2-1b")
    plain, chain = build_program(spec, 1, 132), build_program(spec, 1, 132, chain_l2=True)
    assert not plain.chain_l2 and chain.chain_l2 and _placements(plain) == _placements(chain)
    seg = chain.segments[0]
    by_layer: dict[int, list] = {}
    for sm, q in enumerate(seg.queues):
        for pos, i in enumerate(q):
            t = seg.tasks[i]
            if t.opcode == Opcode.L2_PREFETCH:
                by_layer.setdefault(t.op.layer, []).append((sm, t))
                assert t.pin == sm and t.signal is None and t.cost == 0
                nxt = seg.tasks[q[pos + 1]]   # just before its SM's gate_up of the layer
                assert nxt.op.key == t.op.key and nxt.opcode == Opcode.GATE_UP
    assert sorted(by_layer) == list(range(spec.num_layers))
    for layer, pts in by_layer.items():
        chain_sms = {sm for sm, q in enumerate(seg.queues) for i in q
                     if seg.tasks[i].op.key in {f"L{layer}.{o}" for o in CHAIN_OPS} | {f"L{layer - 1}.down"}}
        assert not chain_sms & {sm for sm, _ in pts}
        # the layer's gate_up tasks split over them, each once
        parts = pts[0][1].args[2]
        covered = sorted(j for _, t in pts for j in range(t.args[0], t.args[0] + t.args[1]))
        assert covered == list(range(parts))
        # each waits for down(l-1) (the chain's start), none at layer 0
        down = next((i, c.total) for i, c in enumerate(chain.taskset.counters) if c.name == f"L{layer - 1}.down") \
            if layer else None
        assert {tuple(t.waits) for _, t in pts} == {(down,) if down else ()}
    # 8B: o_proj and down have 132 tasks, no SM is idle: the program is the plain one
    big = LlamaSpec.from_json_file(MODELS / "llama-3.1-8b")
    a, b = build_program(big, 1, 132), build_program(big, 1, 132, chain_l2=True)
    assert [t.record() for t in a.taskset.tasks] == [t.record() for t in b.taskset.tasks]


def test_prefetch_tasks_change_no_value_and_keep_the_checks():
    spec = LlamaSpec.tiny()
    w = random_weights(spec, seed=2, dtype=torch.bfloat16)
    batch = make_decode_batch(spec, [17], block_size=16, seed=3, dtype=torch.bfloat16)
    cs = ref.rope_cos_sin_cache(spec, 40)
    hidden = w.embed[batch.input_ids].to(torch.bfloat16)
    outs = []
    for chain_l2, order in ((False, "round_robin"), (True, "round_robin"), (True, "random")):
        p = build_program(spec, 1, 8, lm_head=True, tuning=TINY_SPLIT, chain_l2=chain_l2)
        n = sum(t.opcode == Opcode.L2_PREFETCH for t in p.taskset.tasks)
        assert (n > 0) == chain_l2
        caches = batch.clone_caches()
        st = vm.make_state(p, w, hidden, batch.positions, caches, batch.block_table, batch.seq_lens,
                           batch.slot_mapping, cs)
        vm.run(p, st, order=order, seed=5)
        outs.append((st.bufs[Buf.LOGITS].clone(), [c.clone() for c in caches]))
        check_ordering(p)
        vm.check_deadlock_free(p)
    for logits, caches in outs[1:]:
        assert torch.equal(logits, outs[0][0]) and all(torch.equal(x, y) for x, y in zip(caches, outs[0][1]))


def test_prefetch_ranges_are_whole_rows_of_the_tiles_past_the_head_start():
    spec = LlamaSpec.from_json_file(MODELS / "llama-3.2-1b")
    units, H, inter = spec.intermediate_size // UNIT, spec.hidden_size, spec.intermediate_size
    row = H * 2
    r = prefetch_ranges((0, 2, 132), units=units, hidden=H, inter=inter, elem_bytes=2, batch=1, tiles=3)
    # task 0: units 0..3 (512 units over 132 tasks: 116 of 4, 16 of 3); M-tiles 2, 3, 4 = unit 1 gate, unit 1 up,
    # unit 2 gate; task 1 (units 4..7) the same from unit 4
    assert r == [(1 * UNIT * row, UNIT * row), ((inter + UNIT) * row, UNIT * row), (2 * UNIT * row, UNIT * row),
                 (5 * UNIT * row, UNIT * row), ((inter + 5 * UNIT) * row, UNIT * row), (6 * UNIT * row, UNIT * row)]
    everything = prefetch_ranges((0, 132, 132), units=units, hidden=H, inter=inter, elem_bytes=2, batch=1, tiles=6)
    assert all(o % 16 == 0 and o + n <= 2 * inter * row for o, n in everything)
    # 116 tasks of 4 units (8 M-tiles a pass: tiles 2..7) and 16 of 3 (6 M-tiles: tiles 2..5), no range twice
    assert len({o for o, _ in everything}) == len(everything) == 116 * 6 + 16 * 4
    # a 3-unit task's pass has 6 M-tiles: tiles 2..5 only
    assert len(prefetch_ranges((131, 1, 132), units=units, hidden=H, inter=inter, elem_bytes=2, batch=1,
                               tiles=6)) == 4


def test_the_kernel_and_prefetch_py_agree_and_the_variant_checks_its_values():
    src = (ROOT / "csrc" / "l2_prefetch.cuh").read_text()
    assert int(re.search(r"constexpr int CHAIN_L2_FROM = (\d+);", src).group(1)) == CHAIN_L2_FROM
    v = KernelVariant.parse(["MK_W_TMA=1", "MK_CHAIN_L2=3"])
    assert v.chain_l2 == 3 and v.defines() == ("-DMK_W_TMA=1", "-DMK_CHAIN_L2=3")
    assert "#define MK_CHAIN_L2 0" in (ROOT / "csrc" / "tasks.h").read_text()
    for bad, msg in (({"chain_l2": 3}, "set w_tma=True"), ({"chain_l2": 7, "w_tma": True}, "chain_l2=7: 0 \\(off\\)")):
        with pytest.raises(ValueError, match=msg):
            KernelVariant(**bad)
