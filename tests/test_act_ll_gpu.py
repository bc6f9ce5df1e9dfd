"""MK_ACT_LL on the GPU: gate_up hands ACT to down as flagged words (csrc/act_ll.cuh) where the program
allows it (batch 1: down stages all of ACT). It changes how ACT travels, not what is computed, so every
result must be bitwise the counter hand-off's; across CUDA-graph replays with other inputs (the words are
zeroed with the counters each step: a stale word of the previous step carries the same layer flag); and a
missing writer ends in the watchdog's ACT_TIMEOUT record, never a hang or a silently wrong step."""
from __future__ import annotations

from dataclasses import replace

import pytest
import test_persistent_gpu as _pg  # tests/test_persistent_gpu.py
import torch
from test_persistent_gpu import DEV, _run_mk, gpu_batch

from mk_plugin import reference as ref
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.encoding import TASK_WORDS, ErrorCode, F, H, Opcode
from mk_plugin.persistent.errors import MegakernelHang
from mk_plugin.persistent.schedule import Segment

pytestmark = pytest.mark.gpu
models = _pg.models   # its weights fixture, shared
ACT_LL = 2   # the mode under test (variant.KernelVariant.act_ll)


def _decoders(spec, w, mk_variant):
    mk = lambda ll: MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=replace(mk_variant, act_ll=ll))
    return mk(0), mk(ACT_LL)


@pytest.mark.parametrize("name,layers,seq_lens", [
    ("llama-3.2-1b", 2, [300]),
    ("llama-3.1-8b", 1, [4000]),
    ("llama-3.2-1b", 2, [17, 0, 300]),   # batch 3: down streams ACT by column groups, the program has no words
])
def test_act_ll_is_bitwise_the_counter_hand_off(models, mk_variant, name, layers, seq_lens):
    spec, w = models(name, layers)
    batch = gpu_batch(spec, seq_lens, seed=21)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    base, ll = _decoders(spec, w, mk_variant)
    assert all(bool(s.act_ll) == (len(seq_lens) == 1) for s in ll.program(len(seq_lens)).segments)
    want = _run_mk(base, spec, w, batch, cs)
    got = _run_mk(ll, spec, w, batch, cs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for a, b in zip(got[2], want[2]):
        assert torch.equal(a, b)
    assert not ll.pending_error()


def test_act_ll_graph_replays_take_this_steps_words(models, mk_variant):
    spec, w = models("llama-3.2-1b", 2)
    batch = gpu_batch(spec, [300], seed=22)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    base, ll = _decoders(spec, w, mk_variant)
    ll.prepare([1])
    ids = [batch.input_ids, (batch.input_ids + 7) % spec.vocab_size]
    wants = [_run_mk(base, spec, w, replace(batch, input_ids=i), cs) for i in ids]
    caches = [c.clone() for c in batch.kv_caches]
    hidden = w.embed[batch.input_ids].clone()
    out = torch.empty_like(hidden)
    logits = torch.empty((1, spec.vocab_size), device=DEV)
    args = (hidden, batch.positions, caches, batch.block_table, batch.seq_lens, batch.slot_mapping, cs)
    ll(*args, out=out, logits_out=logits)  # warm-up on the capture inputs (kv pointer table)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        ll(*args, out=out, logits_out=logits)
    torch.cuda.current_stream().wait_stream(s)
    for r in range(4):   # the inputs alternate: a step that took the previous step's words would differ
        k = r % 2
        hidden.copy_(w.embed[ids[k]])
        for c, c0 in zip(caches, batch.kv_caches):
            c.copy_(c0)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, wants[k][0]) and torch.equal(logits, wants[k][1]), f"replay {r}"
    assert not ll.pending_error()


def test_act_ll_missing_writer_is_a_watchdog_record(models, mk_variant):
    """One gate_up task turned into a NOP: the down tasks that read its columns never see their flag. The
    launch ends on its own with an ACT_TIMEOUT record; afterwards the good program is bitwise as before."""
    spec, w = models("llama-3.2-1b", 2)
    batch = gpu_batch(spec, [300], seed=23)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    ll = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, watchdog_ms=200, variant=replace(mk_variant, act_ll=ACT_LL))
    good_out, good_logits, _c = _run_mk(ll, spec, w, batch, cs)
    good = ll.program(1)
    seg = good.segments[0]
    assert seg.act_ll
    words = seg.encoded.copy()
    at = int(words[H["tasks_at"]])
    recs = [at + i * TASK_WORDS for i in range(int(words[H["num_tasks"]]))]
    ups = [r for r in recs if words[r + F["opcode"]] == Opcode.GATE_UP and words[r + F["layer"]] == 1]
    words[ups[len(ups) // 2] + F["opcode"]] = Opcode.NOP
    ll.install_program(replace(good, steps=[replace(seg, encoded=words) if s is seg else s for s in good.steps]))
    _run_mk(ll, spec, w, batch, cs)   # synchronises: returns only because every CTA exited
    assert ll.pending_error()
    with pytest.raises(MegakernelHang) as e:
        ll.check_errors()
    h = e.value
    assert h.error_code == ErrorCode.ACT_TIMEOUT and h.expected == 2 and h.elapsed_us >= 200_000, str(h)
    assert "flagged ACT word" in str(h)
    assert float((torch.ones(4, device=DEV) * 2).sum()) == 8.0  # the context is healthy
    ll.install_program(good)
    out2, logits2, _c2 = _run_mk(ll, spec, w, batch, cs)
    assert torch.equal(out2, good_out) and torch.equal(logits2, good_logits)
    assert not ll.pending_error()


def test_act_ll_programs_keep_their_words_in_prefixes(models, mk_variant):
    """stop_after bisection re-encodes the segments: the header word survives, and a prefix that ends
    inside a layer's gate_up (its down tasks cut off) finishes without waiting on any word."""
    spec, w = models("llama-3.2-1b", 2)
    batch = gpu_batch(spec, [300], seed=24)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    base, ll = _decoders(spec, w, mk_variant)
    prog = ll.program(1)
    lo, hi = prog.op_ranges["L1.gate_up"]
    for n in (lo + (hi - lo) // 2, prog.op_end("L1.down")):
        pre = prog.prefix(n)
        assert all(isinstance(s, Segment) and s.act_ll == prog.segments[0].act_ll for s in pre.steps)
        _run_mk(base, spec, w, batch, cs, stop_after=n)
        want = base.buffers(1)
        _run_mk(ll, spec, w, batch, cs, stop_after=n)
        got = ll.buffers(1)
        for b, t in want.items():   # poisoned (NaN) where the prefix wrote nothing, in both
            assert torch.equal(torch.isnan(got[b]), torch.isnan(t)) and torch.equal(got[b].nan_to_num(), t.nan_to_num()), b
        assert not ll.pending_error()
