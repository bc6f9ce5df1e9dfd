"""MK_CHAIN_PREFETCH (prefetch.py): the L2_PREFETCH tasks appear only in the variant's programs, only on SMs
with no task of the layer's chain, move no other task, prefetch only gate_up weight rows past the rings,
and change no value (the VM runs them as no-ops)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mk_plugin import reference as ref
from mk_plugin.persistent import vm
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.encoding import LAYOUT, UNIT, Buf, Opcode, decode
from mk_plugin.persistent.prefetch import idle_sms, prefetch_ranges, ring_units
from mk_plugin.persistent.schedule import build_program, check_ordering
from mk_plugin.persistent.tasks import split_units
from mk_plugin.persistent.variant import KernelVariant
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import make_decode_batch
from mk_plugin.weights import random_weights

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"
ONE_B = LlamaSpec.from_json_file(MODELS / "llama-3.2-1b")


def _prefetch_tasks(seg):
    return [(sm, seg.tasks[i]) for sm, q in enumerate(seg.queues) for i in q if seg.tasks[i].opcode == Opcode.L2_PREFETCH]


def _without_prefetch(p):
    """Per segment, per SM: the (op key, args) of its tasks other than L2_PREFETCH, in queue order."""
    return [[[(s.tasks[i].op.key, s.tasks[i].args) for i in q if s.tasks[i].opcode != Opcode.L2_PREFETCH]
             for q in s.queues] for s in p.segments]


@pytest.mark.parametrize("batch", [1, 16])
def test_prefetch_tasks_only_with_the_variant_and_only_on_idle_sms(batch):
    off = build_program(ONE_B, batch, 132, lm_head=True)
    on = build_program(ONE_B, batch, 132, lm_head=True, chain_prefetch=True)
    assert not any(t.opcode == Opcode.L2_PREFETCH for t in off.taskset.tasks) and not off.chain_prefetch
    # every other task keeps its SM and its place in the queue (the prefetch tasks cost 0 in the time model)
    assert _without_prefetch(on) == _without_prefetch(off)
    seg = on.segments[0]
    pf = _prefetch_tasks(seg)
    # 1B at 132 SMs: qkv_rope, attention, o_proj and down have 128 tasks, so SMs 128..131 are idle
    assert sorted({sm for sm, _ in pf}) == [128, 129, 130, 131] and len(pf) == 4 * ONE_B.num_layers
    down = {c.name: i for i, c in enumerate(on.counters)}
    for sm, t in pf:
        L = t.op.layer
        assert t.op.key == f"L{L}.gate_up" and sm in idle_sms(seg.tasks, seg.queues, L)
        assert t.signal is None and t.waits == ([] if L == 0 else [(down[f"L{L - 1}.down"], on.counters[down[f"L{L - 1}.down"]].total)])
        # just before its layer's gate_up tasks in tid order; its SM's gate_up task follows it in the queue
        assert on.op_ranges[t.op.key][0] <= t.tid < min(u.tid for u in seg.tasks if u.op.key == t.op.key
                                                        and u.opcode == Opcode.GATE_UP)
        q = [seg.tasks[i] for i in seg.queues[sm]]
        nxt = q[q.index(t) + 1]
        assert nxt.opcode == Opcode.GATE_UP and nxt.op.layer == L
    # per layer, the idle SMs split the gate_up tasks j = 0..parts-1 between them
    for L in range(ONE_B.num_layers):
        args = sorted(t.args for _, t in pf if t.op.layer == L)
        parts = sum(1 for t in seg.tasks if t.op.key == f"L{L}.gate_up" and t.opcode == Opcode.GATE_UP)
        assert [a[:2] for a in args] == split_units(0, parts, 4) and all(a[2] == parts for a in args)
    check_ordering(build_program(LlamaSpec.tiny(), 3, 39, lm_head=True, chain_prefetch=True))  # quadratic: small
    vm.check_deadlock_free(on)
    enc = decode(seg.encoded)
    assert sum(r["opcode"] == Opcode.L2_PREFETCH for q in enc.queues for r in q) == len(pf)


def test_no_idle_sm_no_prefetch_task():
    """8B at 132 SMs: o_proj and down have 132 tasks, so no SM is idle on the chain: the program is the default."""
    spec = LlamaSpec.from_json_file(MODELS / "llama-3.1-8b")
    for batch in (1, 8):
        on = build_program(spec, batch, 132, chain_prefetch=True)
        off = build_program(spec, batch, 132)
        assert [s.encoded.tobytes() for s in on.segments] == [s.encoded.tobytes() for s in off.segments]
    # a chain split across launches by a fallback op gets no prefetch task either
    fb = build_program(ONE_B, 1, 132, fallback=frozenset({"o_proj"}), chain_prefetch=True)
    assert not any(t.opcode == Opcode.L2_PREFETCH for t in fb.taskset.tasks)


def test_ring_units_follow_the_producer_order():
    # 1B batch 1: a 4-unit task is one pass of 8 tiles x 2 column chunks; the ring's 6 chunks are the first
    # column chunk of tiles 0..5 (units 0..2). Batch 16 (2 batch n-tiles): passes of 2 units, 4 tiles x 2
    # chunks: the ring holds pass 0 (units 0, 1). H <= CHUNK_COLS: one chunk per tile, 6 tiles = 3 units.
    assert ring_units(4, 1, 2048, 6) == 3 and ring_units(4, 16, 2048, 6) == 2
    assert ring_units(3, 1, 256, 6) == 3 and ring_units(7, 1, 4096, 4) == 2 and ring_units(1, 1, 2048, 6) == 1


@pytest.mark.parametrize("spec,batch,sms", [(ONE_B, 1, 132), (ONE_B, 16, 132), (LlamaSpec.tiny(), 3, 39)])
@pytest.mark.parametrize("cap_kb", [64, 128, 256, 4096])
def test_prefetch_ranges_lie_in_their_gate_up_rows(spec, batch, sms, cap_kb):
    p = build_program(spec, batch, sms, lm_head=True, chain_prefetch=True)
    el, H, inter = spec.torch_dtype.itemsize, spec.hidden_size, spec.intermediate_size
    row = H * el
    pf = [t for s in p.segments for _, t in _prefetch_tasks(s)]
    assert pf
    for t in pf:
        j0, jn, parts = t.args
        split = split_units(0, inter // UNIT, parts)
        rng = prefetch_ranges(t.args, units=inter // UNIT, hidden=H, inter=inter, elem_bytes=el, batch=batch,
                              num_stages=LAYOUT.num_stages, cap_kb=cap_kb)
        per_task = [0] * jn
        for off, size in rng:
            assert off % 16 == 0 and size % 16 == 0 and size > 0 and 0 <= off and off + size <= 2 * inter * row
            owner = [k for k, (s, n) in enumerate(split[j0:j0 + jn]) for base in (0, inter)
                     if (base + s * UNIT) * row <= off and off + size <= (base + (s + n) * UNIT) * row]
            assert len(owner) == 1, (off, size)
            per_task[owner[0]] += size
        for k, (s, n) in enumerate(split[j0:j0 + jn]):
            # the cap, or every byte of the task when the cap is larger; none of the ring-held units comes first
            assert per_task[k] == min(cap_kb * 1024 // 2, n * UNIT * row) * 2
        firsts = rng[:2 * jn]
        skip = [ring_units(n, batch, H, LAYOUT.num_stages) for _, n in split[j0:j0 + jn]]
        if all(sk < n for sk, (_, n) in zip(skip, split[j0:j0 + jn])):
            assert firsts[0][0] == (split[j0][0] + skip[0]) * UNIT * row


def test_vm_runs_the_variant_program_with_the_default_bits():
    spec = LlamaSpec.tiny()
    w = random_weights(spec, seed=2, dtype=torch.bfloat16)
    batch = make_decode_batch(spec, [9, 40, 3], block_size=16, seed=3, dtype=torch.bfloat16)
    cs = ref.rope_cos_sin_cache(spec, 64)
    hidden = w.embed[batch.input_ids].to(torch.bfloat16)
    outs = []
    for on, order in ((False, "round_robin"), (True, "round_robin"), (True, "random")):
        p = build_program(spec, 3, 39, lm_head=True, chain_prefetch=on)
        assert any(t.opcode == Opcode.L2_PREFETCH for t in p.taskset.tasks) == on
        caches = batch.clone_caches()
        st_ = vm.make_state(p, w, hidden, batch.positions, caches, batch.block_table, batch.seq_lens,
                            batch.slot_mapping, cs)
        vm.run(p, st_, order=order, seed=4)
        outs.append((st_.bufs[Buf.OUT].clone(), st_.bufs[Buf.LOGITS].clone(), caches))
    for o, lg, c in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(lg, outs[0][1])
        assert all(torch.equal(x, y) for x, y in zip(c, outs[0][2]))


def test_decoder_builds_the_variant_program():
    spec = LlamaSpec.tiny()
    w = random_weights(spec, seed=0, dtype=torch.bfloat16)
    on = MegakernelDecoder(spec, w, 3, "cpu", lm_head=True, num_sms=39, variant=KernelVariant(chain_prefetch=128))
    off = MegakernelDecoder(spec, w, 3, "cpu", lm_head=True, num_sms=39)
    assert on.program(3).chain_prefetch and not off.program(3).chain_prefetch
    assert KernelVariant(chain_prefetch=128).defines() == ("-DMK_CHAIN_PREFETCH=128",)
