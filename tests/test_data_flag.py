"""MK_DATA_FLAG (session 21, an A/B switch): the gate_up -> down hand-off as data where down stages ACT whole. On a
CPU: which edges a program marks, how the record carries the marks, and that the marked program is the same
dependency graph (the VM and the ordering checker read the data waits as waits: the same bits under random
interleavings). The kernel side (tagged stores and polled loads) runs in tests/test_persistent_gpu.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mk_plugin import reference as ref
from mk_plugin.persistent import vm
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.encoding import BUF_TAGGED, CTR_DATA, LAYOUT, Buf, Opcode, data_tag, decode
from mk_plugin.persistent.schedule import build_program, check_ordering
from mk_plugin.persistent.tuning import ScheduleTuning
from mk_plugin.persistent.variant import KernelVariant
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import make_decode_batch
from mk_plugin.weights import random_weights

SMS = 7
ROOT = Path(__file__).resolve().parents[1]


def _records(prog):
    return [t for seg in prog.segments for q in decode(seg.encoded).queues for t in q]


def test_the_edges_marked_where_down_stages_act_whole():
    spec = LlamaSpec.tiny()   # intermediate 400: ACT staged whole at every batch size
    p = build_program(spec, 3, SMS, data_flag=True)
    assert p.tagged_act
    recs = _records(p)
    gate_up = [t for t in recs if t["opcode"] == Opcode.GATE_UP]
    down = [t for t in recs if t["opcode"] == Opcode.DOWN]
    assert gate_up and all(t["out_tagged"] and t["signal_data"] and t["out_buf"] == Buf.ACT for t in gate_up)
    assert all(t["in_tagged"] and t["in_buf"] == Buf.ACT for t in down)
    # down: the data wait on gate_up, and a real wait on o_proj of its layer (its residual)
    by_ctr = {c.name: i for i, c in enumerate(p.counters)}
    for t in down:
        L = t["layer"]
        waits = {(t["wait0_ctr"], t["wait0_data"]), (t["wait1_ctr"], t["wait1_data"])}
        assert waits == {(by_ctr[f"L{L}.gate_up"], True), (by_ctr[f"L{L}.o_proj"], False)}
    # nothing else is tagged or data
    for t in recs:
        if t["opcode"] not in (Opcode.GATE_UP, Opcode.DOWN):
            assert not (t["in_tagged"] or t["out_tagged"] or t["wait0_data"] or t["wait1_data"] or t["signal_data"])
    # the raw words carry the bits the kernel masks off (csrc/common.cuh load_task)
    seg = p.segments[0]
    i = [t.op.name for t in seg.tasks].index("down")
    raw = seg.tasks[i].record(seg.waits[i])
    assert raw[5] & BUF_TAGGED and any(w >= 0 and w & CTR_DATA for w in raw[8:12:2])
    assert data_tag(0) == 1   # 0 is the memset's value: never a tag
    assert "data_tag(int layer) { return (unsigned)(layer + 1); }" in (ROOT / "csrc" / "common.cuh").read_text()


@pytest.mark.parametrize("why,kw", [
    ("the default build", {"data_flag": False}),
    ("down cut over K", {"data_flag": True, "tuning": ScheduleTuning(ksplit=(("down", 2),))}),
    ("gate_up in Triton", {"data_flag": True, "fallback": frozenset({"gate_up"})}),
])
def test_no_edges_marked(why, kw):
    p = build_program(LlamaSpec.tiny(), 3, SMS, **kw)
    assert not p.tagged_act, why
    assert not any(t["in_tagged"] or t["out_tagged"] or t["signal_data"] for t in _records(p)), why


def test_the_ring_depth_decides_what_is_staged():
    spec = LlamaSpec.from_json_file(ROOT / "bench" / "models" / "llama-3.2-1b")   # I = 8192: 16400 bytes per staged row
    assert LAYOUT.staged_fits(8192, 1, False) and not LAYOUT.staged_fits(8192, 2, False)
    assert LAYOUT.with_stages(5).staged_fits(8192, 3, False)
    assert build_program(spec, 1, 132, data_flag=True).tagged_act
    assert not build_program(spec, 2, 132, data_flag=True).tagged_act
    assert build_program(spec, 2, 132, data_flag=True, tuning=ScheduleTuning(num_stages=5)).tagged_act
    # the kernel's formula (csrc/matvec.cuh staged_fits) is the one mirrored
    src = (ROOT / "csrc" / "matvec.cuh").read_text()
    assert "return (B + (norm ? 1 : 0)) * (K * 2 + 16) <= UNION_BYTES - STAGE_PART_BYTES;" in src
    assert "constexpr int STAGE_PART_BYTES = 4 * CONSUMER_WARPS * MAX_BATCH;" in src


def test_a_data_flag_program_is_the_same_dependency_graph():
    """The marks change no wait the VM or the checker sees (a data wait is still a wait): the VM's step is the default
    program's bit for bit under random interleavings, and the ordering checker passes."""
    spec = LlamaSpec.tiny()
    w = random_weights(spec, seed=3, dtype=torch.bfloat16)
    batch = make_decode_batch(spec, [9, 0, 33], block_size=16, seed=4, dtype=torch.bfloat16)
    cs = ref.rope_cos_sin_cache(spec, 48)
    hidden = w.embed[batch.input_ids].to(torch.bfloat16)
    outs = []
    for flag, order, seed in ((False, "round_robin", 0), (True, "random", 1), (True, "random", 2)):
        p = build_program(spec, 3, SMS, lm_head=True, data_flag=flag)
        check_ordering(p)
        caches = batch.clone_caches()
        st = vm.make_state(p, w, hidden, batch.positions, caches, batch.block_table, batch.seq_lens,
                           batch.slot_mapping, cs)
        vm.run(p, st, order=order, seed=seed)
        outs.append((st.bufs[Buf.OUT].clone(), st.bufs[Buf.LOGITS].clone(), [c.clone() for c in caches]))
    for o, lg, c in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(lg, outs[0][1])
        assert all(torch.equal(a, b) for a, b in zip(c, outs[0][2]))


def test_the_switch_is_a_kernel_variant_and_the_decoder_builds_marked_programs():
    v = KernelVariant.parse(["MK_DATA_FLAG=1"])
    assert v.data_flag and v.defines() == ("-DMK_DATA_FLAG=1",) and v.label() == "data_flag"
    with pytest.raises(ValueError, match="data_flag=1 must be true or false"):
        KernelVariant(data_flag=1)   # type: ignore[arg-type]
    spec = LlamaSpec.tiny()
    dec = MegakernelDecoder(spec, random_weights(spec), 3, "cpu", num_sms=SMS, variant=v)
    assert dec._entry(2).program.tagged_act
    plain = MegakernelDecoder(spec, random_weights(spec), 3, "cpu", num_sms=SMS)
    assert not plain._entry(2).program.tagged_act


def test_a_data_wait_timeout_reads_as_one():
    from mk_plugin.persistent.encoding import DATA_WAIT_COUNTER, ERROR_FIELDS, ErrorCode
    from mk_plugin.persistent.errors import MegakernelHang

    rec = dict.fromkeys(ERROR_FIELDS, 0)
    rec.update(code=int(ErrorCode.COUNTER_TIMEOUT), batch=1, task_index=3, tid=40, opcode=int(Opcode.DOWN), layer=2,
               counter=DATA_WAIT_COUNTER, expected=data_tag(2), seen=2, elapsed_us=2_000_000, budget_ms=2000)
    msg = str(MegakernelHang(rec))
    assert "data wait (MK_DATA_FLAG)" in msg and "tag 3" in msg and "one showed 2" in msg, msg
    # a data edge's counter is never signalled on the GPU: it is marked, so a hang's diagnosis does not list it
    p = build_program(LlamaSpec.tiny(), 1, SMS, data_flag=True)
    assert {c.name for c in p.counters if c.data} == {f"L{i}.gate_up" for i in range(LlamaSpec.tiny().num_layers)}


def test_the_vm_executor_runs_a_data_flag_build_as_the_default():
    """On the CPU executor the decoder's data-flag build runs its marked programs on the VM: the step and the
    workspace (ACT included: the VM writes its logical buffers, not the tagged words) equal the default build's."""
    spec = LlamaSpec.tiny()
    w = random_weights(spec, seed=5, dtype=torch.bfloat16)
    batch = make_decode_batch(spec, [12, 3], block_size=16, seed=6, dtype=torch.bfloat16)
    cs = ref.rope_cos_sin_cache(spec, 32)
    hidden = w.embed[batch.input_ids].to(torch.bfloat16)
    runs = []
    for v in (KernelVariant(), KernelVariant(data_flag=True)):
        dec = MegakernelDecoder(spec, w, 2, "cpu", num_sms=SMS, variant=v)
        caches = batch.clone_caches()
        out = dec(hidden, batch.positions, caches, batch.block_table, batch.seq_lens, batch.slot_mapping, cs)
        runs.append((out, dec.buffers(2)[Buf.ACT].clone(), caches))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))
