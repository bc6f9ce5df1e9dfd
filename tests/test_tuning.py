"""The megakernel's schedule tuning (persistent/tuning.py) on CPU: ScheduleTuning's checks, labels and JSON, the
variant each per-batch knob reaches, and tuned programs that are deadlock free, ordered and give the default
program's output in the VM."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mk_plugin import reference as ref
from mk_plugin.persistent import tuning as tn
from mk_plugin.persistent.autotune import neighbours
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.errors import ProgramMismatch
from mk_plugin.persistent.schedule import build_program, check_ordering
from mk_plugin.persistent.tasks import attention_chunks, op_units
from mk_plugin.persistent.tuning import ScheduleTuning
from mk_plugin.persistent.vm import check_deadlock_free
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import make_decode_batch
from mk_plugin.weights import random_weights

SPEC = LlamaSpec(name="odd", hidden_size=192, intermediate_size=400, num_layers=2, num_q_heads=6, num_kv_heads=2,
                 head_dim=64, vocab_size=333)
SMS = 7


def op_task_counts(program) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in program.taskset.tasks:
        if t.op.layer <= 0:
            out[t.op.name] = out.get(t.op.name, 0) + 1
    return out


# ---- ScheduleTuning ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, msg", [
    ({"split": (("attention", 2.0),)}, "'attention' is not tunable"),
    ({"split": (("o_proj", 0.0),)}, "must be a number in"),
    ({"split": (("o_proj", 9.0),)}, "must be a number in"),
    ({"split": (("o_proj", True),)}, "must be a number in"),
    ({"split": (("o_proj", 2.0), ("o_proj", 0.5))}, "given twice"),
    ({"split": ("o_proj",)}, "not an (op, factor) pair"),
    ({"attn_chunks": 33}, "0..32"),
    ({"attn_chunks": -1}, "0..32"),
    ({"num_stages": 3}, "num_stages=3: choose 0"),
    ({"num_stages": True}, "num_stages=True"),
    ({"merge_in_partial": 1}, "merge_in_partial=1 must be true or false"),
    ({"ksplit": (("gate_up", 2),)}, "ksplit op 'gate_up': only o_proj, down"),
    ({"ksplit": (("down", 5),)}, "ksplit parts 5 for down must be an int in 2..4"),
    ({"ksplit": (("down", 1),)}, "ksplit parts 1 for down"),
    ({"ksplit": (("down", 2), ("down", 3))}, "ksplit op 'down' is given twice"),
    ({"ksplit": ("down",)}, "ksplit entry 'down' is not an"),
])
def test_tuning_rejects_bad_values(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        ScheduleTuning(**kw)


def test_tuning_json_label_and_helpers():
    t = ScheduleTuning().with_split("gate_up", 2.0).with_split("o_proj", 0.5).with_chunks(4).with_stages(5)
    assert t.label() == "gate_upx2,o_projx0.5,chunks4,stages5" and not t.is_default
    assert ScheduleTuning.from_json(json.loads(json.dumps(t.to_json()))) == t
    assert ScheduleTuning.from_json({"split": {}, "attn_chunks": 2}) == ScheduleTuning(attn_chunks=2)  # older tables
    assert t.with_split("gate_up", 1.0) == ScheduleTuning((("o_proj", 0.5),), 4, 5)  # factor 1 = not listed
    assert t.tasks_for("gate_up", 132) == 264 and t.tasks_for("down", 132) == 132 and t.tasks_for("o_proj", 3) == 2
    assert ScheduleTuning().label() == "default" and ScheduleTuning().is_default
    with pytest.raises(ValueError, match="unknown tuning field"):
        ScheduleTuning.from_json({"splits": {}})
    m = t.with_merge(False)   # combine tasks: no longer the default
    assert m.label().endswith(",combine_tasks") and ScheduleTuning.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert "merge_in_partial" not in t.to_json() and not ScheduleTuning().with_merge(False).is_default
    assert ScheduleTuning().merge_in_partial and ScheduleTuning.from_json({"split": {}}).merge_in_partial
    k = ScheduleTuning().with_ksplit("down", 4).with_ksplit("o_proj", 2)   # cut over K
    assert k.ksplit == (("down", 4), ("o_proj", 2)) and k.label() == "down/k4,o_proj/k2" and not k.is_default
    assert ScheduleTuning.from_json(json.loads(json.dumps(k.to_json()))) == k and "ksplit" not in t.to_json()
    assert k.ksplit_for("down") == 4 and k.ksplit_for("gate_up") == 1 and k.with_ksplit("down", 1).ksplit_for("down") == 1
    c = ScheduleTuning().with_inflight(2)   # the producer's in-flight cap (MK_INFLIGHT), a compiled variant
    assert c.label() == "inflight2" and not c.is_default and c.to_json()["inflight"] == 2
    assert ScheduleTuning.from_json(json.loads(json.dumps(c.to_json()))) == c and "inflight" not in t.to_json()
    for bad in (4, -1, True):   # 4 would not fit a 4-stage ring: every tuning's cap must fit every ring depth
        with pytest.raises(ValueError, match=r"inflight=.*1\.\.3"):
            ScheduleTuning(inflight=bad)
    m = ScheduleTuning().with_w_tma(True)   # one tensor-map copy per weight chunk (MK_W_TMA)
    assert m.label() == "w_tma" and not m.is_default and ScheduleTuning.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert "w_tma" not in t.to_json()
    with pytest.raises(ValueError, match="w_tma=1 must be true or false"):
        ScheduleTuning(w_tma=1)


def test_a_tuning_can_turn_the_ring_off_where_its_base_has_it():
    """att_tma 0 is "the decoder's variant"; ATT_TMA_OFF turns the ring-fed attention off even in a variant that has
    it (a search that started from UNTUNED_TUNING and measured the ring slower)."""
    from mk_plugin.persistent.variant import KernelVariant

    off = ScheduleTuning(att_tma=tn.ATT_TMA_OFF)
    assert off.label() == "att_tma_off" and not off.is_default and off.to_json()["att_tma"] == -1
    assert ScheduleTuning.from_json(json.loads(json.dumps(off.to_json()))) == off
    ring = KernelVariant(att_tma=128)
    assert tn.tuned_variant(ring, off) == KernelVariant() and tn.tuned_variant(ring, ScheduleTuning()) == ring
    assert tn.tuned_variant(KernelVariant(), ScheduleTuning(att_tma=64)).att_tma == 64
    assert tn.tuned_variant(KernelVariant(), ScheduleTuning(att_tma=64), att_tma_ok=False).att_tma == 0
    for bad in (-2, 4096 * 1024, True):
        with pytest.raises(ValueError, match=r"att_tma=.*\(off\)"):
            ScheduleTuning(att_tma=bad)


def test_a_tunings_inflight_cap_is_its_batch_variant():
    from mk_plugin.persistent.backend import MegakernelDecoder
    from mk_plugin.persistent.variant import KernelVariant
    from mk_plugin.weights import random_weights

    spec = LlamaSpec.tiny()
    dec = MegakernelDecoder(spec, random_weights(spec), 3, "cpu", num_sms=6, class_builds=False,
                            tuning={2: ScheduleTuning(inflight=2, num_stages=4)})
    assert dec.variant_for(1) == KernelVariant() and dec.variant_for(2) == KernelVariant(num_stages=4, inflight=2)
    assert dec.variant_for(2).defines() == ("-DMK_NUM_STAGES=4", "-DMK_INFLIGHT=2")


def test_rstd_epi_and_wgmma_a_are_per_batch_and_exclude_each_other():
    """The two kernel builds of session 29's table: a tuning sets either for its batch (tuned_variant), turning one on
    turns the other off, a STOCK-rounding base ignores rstd_epi, and the autotuner offers both (wgmma_a at batch > 8)."""
    from mk_plugin.persistent.encoding import Rounding
    from mk_plugin.persistent.tuning import tuned_variant
    from mk_plugin.persistent.variant import KernelVariant

    wa = ScheduleTuning().with_wgmma_a(4)
    assert wa.w_tma and wa.wgmma_a == 4 and ScheduleTuning.from_json(wa.to_json()) == wa
    assert wa.with_rstd_epi(True) == ScheduleTuning(w_tma=True, rstd_epi=True)
    assert ScheduleTuning(rstd_epi=True).with_wgmma_a(4) == wa
    assert tuned_variant(KernelVariant(), wa) == KernelVariant(w_tma=True, wgmma_a=4)
    assert tuned_variant(KernelVariant(), ScheduleTuning(rstd_epi=True)) == KernelVariant(rstd_epi=True)
    assert tuned_variant(KernelVariant(rounding=Rounding.STOCK), ScheduleTuning(rstd_epi=True)).rstd_epi is False
    spec = LlamaSpec.from_json_file(Path(__file__).resolve().parents[1] / "bench" / "models" / "llama-3.2-1b")
    knobs = {b: dict(neighbours(spec, b, 132, ScheduleTuning())) for b in (8, 16)}
    assert "wgmma_a" not in knobs[8] and knobs[16]["wgmma_a"] == wa
    assert knobs[8]["rstd_epi"] == ScheduleTuning(rstd_epi=True)
    from_wa = dict(neighbours(spec, 16, 132, wa))   # the autotuner's moves from a wgmma_a tuning stay valid
    assert from_wa["rstd_epi"] == ScheduleTuning(w_tma=True, rstd_epi=True)
    assert from_wa["w_tma"] == ScheduleTuning() and from_wa["wgmma_a"] == ScheduleTuning(w_tma=True)


def test_wga_x_is_a_per_batch_knob_of_the_wgmma_path():
    """Session 30's wga_x (the wgmma path's rstd epilogue): only with wgmma_a, dropped with it (and by the moves that
    drop it), round-trips through JSON, reaches the batch's variant (with the fused rounding only), and the autotuner
    toggles it from a wgmma_a tuning."""
    from mk_plugin.persistent.encoding import Rounding
    from mk_plugin.persistent.tuning import tuned_variant
    from mk_plugin.persistent.variant import KernelVariant

    wx = ScheduleTuning().with_wgmma_a(4).with_wga_x(1)
    assert ScheduleTuning.from_json(wx.to_json()) == wx and "wga_x1" in wx.label()
    assert wx.with_wgmma_a(0) == ScheduleTuning(w_tma=True)
    assert wx.with_w_tma(False) == ScheduleTuning() and wx.with_rstd_epi(True).wga_x == 0
    with pytest.raises(ValueError, match="wga_x=1 is the wgmma path's x staging"):
        ScheduleTuning(wga_x=1)
    with pytest.raises(ValueError, match="wga_x=3"):
        ScheduleTuning(w_tma=True, wgmma_a=4, wga_x=3)
    assert tuned_variant(KernelVariant(), wx) == KernelVariant(w_tma=True, wgmma_a=4, wga_x=1)
    assert tuned_variant(KernelVariant(rounding=Rounding.STOCK), wx).wga_x == 0
    # an A/B build's own value is not replaced by the table's (session 31: MK_WGA_X=2 on the 8B b16 entry's wga_x 1)
    assert tuned_variant(KernelVariant(w_tma=True, wgmma_a=4, wga_x=2), wx).wga_x == 2
    spec = LlamaSpec.from_json_file(Path(__file__).resolve().parents[1] / "bench" / "models" / "llama-3.2-1b")
    moves = [t for k, t in neighbours(spec, 16, 132, wx) if k == "wga_x"]
    assert [t.wga_x for t in moves] == [0, 2] and all(t.wgmma_a == 4 for t in moves)
    assert not [k for k, _ in neighbours(spec, 16, 132, ScheduleTuning()) if k == "wga_x"]


def test_wga_nws_is_a_knob_of_wga_x_2_at_six_slots():
    """Session 47's wga_nws (the norm weights by cp.async with wga_x 2's x groups): only with wga_x 2 at the 6-slot
    ring, dropped by every move that leaves it (another wga_x, no wgmma_a, no tensor maps, rstd_epi, another depth),
    round-trips through JSON, reaches the batch's variant only where the base is at 6 slots with wga_x 2, and the
    autotuner toggles it from a wgmma_a tuning."""
    from mk_plugin.persistent.tuning import tuned_variant
    from mk_plugin.persistent.variant import KernelVariant

    x2 = ScheduleTuning().with_wgmma_a(4).with_wga_x(2)
    nws = x2.with_wga_nws(True)
    assert ScheduleTuning.from_json(nws.to_json()) == nws and "wga_nws" in nws.label() and not nws.is_default
    assert "wga_nws" not in x2.to_json()
    for moved in (nws.with_wga_x(1), nws.with_wgmma_a(0), nws.with_w_tma(False), nws.with_rstd_epi(True),
                  nws.with_stages(5)):
        assert moved.wga_nws is False
    assert nws.with_stages(6).wga_nws and nws.with_wga_x(2).wga_nws
    with pytest.raises(ValueError, match=r"wga_nws=True .* \(got wga_x=1, num_stages=0\)"):
        x2.with_wga_x(1).with_wga_nws(True)
    with pytest.raises(ValueError, match="num_stages=5"):
        ScheduleTuning(num_stages=5, w_tma=True, wgmma_a=4, wga_x=2, wga_nws=True)
    with pytest.raises(ValueError, match="wga_nws=1 must be true or false"):
        ScheduleTuning(w_tma=True, wgmma_a=4, wga_x=2, wga_nws=1)
    assert tuned_variant(KernelVariant(), nws) == KernelVariant(w_tma=True, wgmma_a=4, wga_x=2, wga_nws=True)
    # a base of another depth, or one whose own wga_x is not 2, runs without it (its buffer is the 6-slot tail)
    assert tuned_variant(KernelVariant(num_stages=5), nws).wga_nws is False
    assert tuned_variant(KernelVariant(w_tma=True, wgmma_a=4, wga_x=1), nws).wga_nws is False
    spec = LlamaSpec.from_json_file(Path(__file__).resolve().parents[1] / "bench" / "models" / "llama-3.2-1b")
    assert [t for k, t in neighbours(spec, 16, 132, x2) if k == "wga_nws"] == [nws]
    assert [t for k, t in neighbours(spec, 16, 132, nws) if k == "wga_nws"] == [x2]
    from_wa = [t for k, t in neighbours(spec, 16, 132, ScheduleTuning().with_wgmma_a(4)) if k == "wga_nws"]
    assert from_wa == [nws]
    assert not [k for k, _ in neighbours(spec, 8, 132, ScheduleTuning()) if k == "wga_nws"]


def test_x_groups_is_a_per_batch_knob_where_x_would_be_staged_whole():
    """Session 48's x_groups (x by column groups at every batch size): round-trips through JSON, reaches the batch's
    variant, and the autotuner toggles it only at the batch sizes where the ring depth stages some op's x whole (at 6
    slots o_proj's: 1B <= 7, 8B <= 3; the norm-fused ops' 1B <= 6, 8B <= 2), where it changes the program."""
    from mk_plugin.persistent.tuning import tuned_variant
    from mk_plugin.persistent.variant import KernelVariant

    xg = ScheduleTuning(rstd_epi=True).with_x_groups(True)
    assert ScheduleTuning.from_json(xg.to_json()) == xg and "x_groups" in xg.label() and not xg.is_default
    assert "x_groups" not in ScheduleTuning(rstd_epi=True).to_json()
    with pytest.raises(ValueError, match="x_groups=1 must be true or false"):
        ScheduleTuning(x_groups=1)
    assert tuned_variant(KernelVariant(), xg) == KernelVariant(rstd_epi=True, x_groups=True)
    assert tuned_variant(KernelVariant(), ScheduleTuning(rstd_epi=True)).x_groups is False
    models = Path(__file__).resolve().parents[1] / "bench" / "models"
    one, eight = (LlamaSpec.from_json_file(models / m) for m in ("llama-3.2-1b", "llama-3.1-8b"))
    for spec, staged, grouped in ((one, (1, 4, 7), (8, 9, 16)), (eight, (1, 3), (4, 8, 16))):
        for b in staged:
            assert [t for k, t in neighbours(spec, b, 132, ScheduleTuning()) if k == "x_groups"] == [
                ScheduleTuning(x_groups=True)], (spec.name, b)
            assert [t for k, t in neighbours(spec, b, 132, xg) if k == "x_groups"] == [ScheduleTuning(rstd_epi=True)]
        for b in grouped:
            assert not [k for k, _ in neighbours(spec, b, 132, ScheduleTuning()) if k == "x_groups"], (spec.name, b)
    # asked per task, as the kernel asks it: a K-split part is staged whole where its op's full K is not (8B down in 4
    # parts of 3584 columns at batch 4), and a task on MK_WGMMA_A's path (batch > 8) never is
    ks4 = ScheduleTuning(ksplit=(("down", 4),))
    assert [t for k, t in neighbours(eight, 4, 132, ks4) if k == "x_groups"] == [ks4.with_x_groups(True)]
    assert not [k for k, _ in neighbours(eight, 5, 132, ks4) if k == "x_groups"]
    four = ScheduleTuning().with_stages(4)
    assert [k for k, _ in neighbours(one, 12, 132, four) if k == "x_groups"] == ["x_groups"]
    assert not [k for k, _ in neighbours(one, 12, 132, four.with_wgmma_a(4)) if k == "x_groups"]


def test_a_tunings_weight_maps_are_checked_against_the_model():
    """A tuning with w_tma compiles MK_W_TMA into its batch's variant; the decoder checks at construction that the
    model's K sizes allow it (a clear error, as for the decoder's own variant), and builds no maps on CPU."""

    from mk_plugin.persistent.backend import MegakernelDecoder
    from mk_plugin.persistent.variant import KernelVariant
    from mk_plugin.weights import random_weights

    ok = replace(LlamaSpec.tiny(), hidden_size=128, intermediate_size=256)
    dec = MegakernelDecoder(ok, random_weights(ok), 2, "cpu", num_sms=6, tuning={2: ScheduleTuning(w_tma=True)},
                            class_builds=False)
    assert dec.variant_for(1) == KernelVariant() and dec.variant_for(2) == KernelVariant(w_tma=True)
    assert dec._wmaps is None   # the CPU executor has no weight table
    with pytest.raises(ValueError, match="MK_W_TMA needs every matrix's K to be a multiple of 64"):
        MegakernelDecoder(SPEC, random_weights(SPEC), 2, "cpu", num_sms=6, tuning={2: ScheduleTuning(w_tma=True)})


def test_ksplit_program_cuts_ranges_over_k():
    """A K-split op keeps about its task count (ranges = tasks / parts, rounded); each unit range's parts
    share one ticket and cover K once."""
    from mk_plugin.persistent.encoding import ksplit_parts, ksplit_range
    p = build_program(SPEC, 3, SMS, tuning=ScheduleTuning(ksplit=(("down", 3),)))
    d = build_program(SPEC, 3, SMS)
    lo, hi = p.op_ranges["L0.down"]
    tasks = p.taskset.tasks[lo:hi]
    assert hi - lo == 3 * round((d.op_ranges["L0.down"][1] - d.op_ranges["L0.down"][0]) / 3)
    by_ticket: dict[int, list] = {}
    for t in tasks:
        by_ticket.setdefault(t.ticket, []).append(t)
    assert None not in by_ticket and sum(t.args[1] for t in tasks) == 3 * op_units(SPEC, "down")
    K = SPEC.intermediate_size
    for parts in by_ticket.values():
        assert [ksplit_parts(t.args[2]) for t in parts] == [(p, 3) for p in range(3)]
        cols = [ksplit_range(K, *ksplit_parts(t.args[2])) for t in parts]
        assert cols[0][0] == 0 and cols[-1][1] == K and all(a[1] == b[0] for a, b in itertools.pairwise(cols))
    check_deadlock_free(p)
    check_ordering(p)


def test_tuned_program_has_the_asked_task_counts():
    t = ScheduleTuning((("gate_up", 2.0), ("o_proj", 0.5)), attn_chunks=3)
    p = build_program(SPEC, 2, SMS, lm_head=True, tuning=t)
    d = build_program(SPEC, 2, SMS, lm_head=True)
    n, nd = op_task_counts(p), op_task_counts(d)
    assert n["gate_up"] == min(14, op_units(SPEC, "gate_up")) and n["o_proj"] == 4
    assert nd["gate_up"] == SMS and nd["o_proj"] == SMS
    assert n["down"] == nd["down"] and n["qkv_rope"] == nd["qkv_rope"]
    assert p.attn_chunks == 3 and d.attn_chunks == attention_chunks(2, SPEC.num_kv_heads, SMS)
    assert n["attention"] == 2 * SPEC.num_kv_heads * 3   # partials; the last of each (b, g) merges
    nc = op_task_counts(build_program(SPEC, 2, SMS, lm_head=True, tuning=t.with_merge(False)))
    assert nc["attention"] == 2 * SPEC.num_kv_heads * 3 + 2 * SPEC.num_kv_heads   # partials + combines
    assert p.tuning == t and p.predicted_ns > 0


tunings = st.builds(
    lambda fs, c, ks: ScheduleTuning(tuple(sorted((op, f) for op, f in zip(tn.SPLIT_OPS, fs) if f != 1.0)), c,
                                     ksplit=tuple(sorted((op, n) for op, n in zip(tn.KSPLIT_OPS, ks) if n > 1))),
    st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 4.0]), min_size=5, max_size=5), st.integers(0, 6),
    st.lists(st.sampled_from([1, 1, 2, 3, 4]), min_size=2, max_size=2))


@settings(max_examples=12, deadline=None)
@given(t=tunings, batch=st.integers(1, 4))
def test_any_tuning_is_deadlock_free_ordered_and_gives_the_default_output(t, batch):
    w = random_weights(SPEC, seed=3)
    seq = [23, 1, 40, 17][:batch]
    outs = []
    for tuning in (ScheduleTuning(), t):
        p = build_program(SPEC, batch, SMS, lm_head=True, tuning=tuning)
        check_deadlock_free(p)
        check_ordering(p)
        dec = MegakernelDecoder(SPEC, w, batch, "cpu", num_sms=SMS, lm_head=True, tuning={batch: tuning})
        b = make_decode_batch(SPEC, seq, block_size=16, seed=5)
        logits = torch.full((batch, SPEC.vocab_size), float("nan"))
        dec(w.embed[b.input_ids], b.positions, b.kv_caches, b.block_table, b.seq_lens, b.slot_mapping,
            ref.rope_cos_sin_cache(SPEC, 64).to(SPEC.torch_dtype), logits_out=logits)
        assert dec.program(batch).tuning == tuning
        outs.append(logits)
    if t.attn_chunks in (0, attention_chunks(batch, SPEC.num_kv_heads, SMS)) and not t.ksplit:
        # only the split changed: every dot product keeps its order (a K-split sums its parts' partials)
        assert torch.equal(outs[0], outs[1])
    else:
        torch.testing.assert_close(outs[1], outs[0], atol=5e-2, rtol=5e-2)


def test_decoder_retune_grows_partial_buffers_and_checks_chunks():
    w = random_weights(SPEC, seed=1)
    dec = MegakernelDecoder(SPEC, w, 2, "cpu", num_sms=SMS, tuning="off")
    before = dec.part_o.numel()
    dec.retune(2, ScheduleTuning(attn_chunks=32))
    assert dec.attn_chunks(2) == 32 and dec.part_o.numel() >= 2 * SPEC.num_kv_heads * 32 * SPEC.gqa_group * 64
    assert dec.part_o.numel() > before and dec.program(2).attn_chunks == 32 and dec.tuning_source[2] == "retune"
    with pytest.raises(ValueError, match="handles 1..2"):
        dec.retune(3, ScheduleTuning())
    with pytest.raises(ValueError, match=r"batch sizes \[5\]"):
        MegakernelDecoder(SPEC, w, 2, "cpu", num_sms=SMS, tuning={5: ScheduleTuning()})
    # a program with other chunks than the decoder's buffers: refused before launch
    with pytest.raises(ProgramMismatch, match="attention chunks"):
        dec.install_program(build_program(SPEC, 2, SMS, tuning=ScheduleTuning(attn_chunks=3)))


def test_release_gate_is_a_per_batch_knob():
    """Session 35's release_gate: 0 = the decoder's variant, RELEASE_GATE_OFF = no gate, else an opcode mask; it reaches
    the batch's variant only where the base has the default mask (an A/B build with its own keeps it, and one that moves
    the gate's wait with gate_ahead is never left without a gate); JSON round trip; the autotuner offers the tried masks
    and the default back."""
    from mk_plugin.persistent.tuning import RELEASE_GATE_OFF, RELEASE_GATE_TRIES, tuned_variant
    from mk_plugin.persistent.variant import RELEASE_GATE_DEFAULT, KernelVariant

    g48 = ScheduleTuning(release_gate=48)
    assert g48.label() == "gate48" and not g48.is_default and g48.to_json()["release_gate"] == 48
    assert ScheduleTuning.from_json(json.loads(json.dumps(g48.to_json()))) == g48
    assert "release_gate" not in ScheduleTuning().to_json() and ScheduleTuning().label() == "default"
    off = ScheduleTuning(release_gate=RELEASE_GATE_OFF)
    assert off.label() == "gate_off" and ScheduleTuning.from_json(off.to_json()) == off
    assert tuned_variant(KernelVariant(), g48).release_gate == 48
    assert tuned_variant(KernelVariant(), off).release_gate == 0
    assert tuned_variant(KernelVariant(), ScheduleTuning()).release_gate == RELEASE_GATE_DEFAULT
    assert tuned_variant(KernelVariant(release_gate=34), g48).release_gate == 34          # the A/B build's own
    ahead = KernelVariant(gate_ahead=2)
    assert tuned_variant(ahead, off) == ahead and tuned_variant(ahead, g48).release_gate == 48
    assert tuned_variant(KernelVariant(), g48).defines() == ("-DMK_RELEASE_GATE=48",)
    for bad in (-2, 512, True, 1.5):
        with pytest.raises(ValueError, match=r"release_gate=.*mask of opcodes"):
            ScheduleTuning(release_gate=bad)
    got = [t.release_gate for k, t in neighbours(SPEC, 2, SMS, ScheduleTuning(), lm_head=False) if k == "release_gate"]
    assert got == list(RELEASE_GATE_TRIES)
    got = [t.release_gate for k, t in neighbours(SPEC, 2, SMS, g48, lm_head=False) if k == "release_gate"]
    assert got == [0, *(m for m in RELEASE_GATE_TRIES if m != 48)]


def test_gate_ahead_is_a_per_batch_knob():
    """Session 36's gate_ahead: MK_GATE_AHEAD per batch size (0 = the decoder's variant); it reaches the variant only
    where that has a gate and no head start of its own; it needs a gate (not RELEASE_GATE_OFF) and stays below every
    ring depth; JSON round trip; the autotuner offers it alone and with masks 48 and 112 as one step each (session 36: each alone
    ~1%, together -4..-5% at 1B b1 / b16 on the H100)."""
    from mk_plugin.persistent.tuning import (
        GATE_AHEAD_MAX,
        GATE_AHEAD_TRIED,
        RELEASE_GATE_OFF,
        RELEASE_GATE_TRIED_WITH_AHEAD,
        tuned_variant,
    )
    from mk_plugin.persistent.variant import RELEASE_GATE_DEFAULT, KernelVariant

    t = ScheduleTuning(release_gate=48, gate_ahead=2)
    assert t.label() == "gate48,ahead2" and not t.is_default and t.to_json()["gate_ahead"] == 2
    assert ScheduleTuning.from_json(json.loads(json.dumps(t.to_json()))) == t
    assert "gate_ahead" not in ScheduleTuning(release_gate=48).to_json()
    v = tuned_variant(KernelVariant(), t)
    assert (v.release_gate, v.gate_ahead) == (48, 2)
    assert set(v.defines()) == {"-DMK_RELEASE_GATE=48", "-DMK_GATE_AHEAD=2"}
    only = tuned_variant(KernelVariant(), ScheduleTuning(gate_ahead=1))       # the default mask keeps its head start
    assert (only.release_gate, only.gate_ahead) == (RELEASE_GATE_DEFAULT, 1)
    assert tuned_variant(KernelVariant(release_gate=48, gate_ahead=3), t).gate_ahead == 3   # the A/B build's own
    assert tuned_variant(KernelVariant(release_gate=0), ScheduleTuning(gate_ahead=2)).gate_ahead == 0   # no gate
    assert tuned_variant(KernelVariant(num_stages=4), t).gate_ahead == 2   # below the shallowest ring (4)
    for bad in (-1, GATE_AHEAD_MAX + 1, True, 1.5):
        with pytest.raises(ValueError, match=r"gate_ahead=.*1\.\." + str(GATE_AHEAD_MAX)):
            ScheduleTuning(gate_ahead=bad)
    with pytest.raises(ValueError, match="gate_ahead=2 moves the release gate's wait.*choose one"):
        ScheduleTuning(release_gate=RELEASE_GATE_OFF, gate_ahead=2)
    cands = neighbours(SPEC, 2, SMS, ScheduleTuning(), lm_head=False)
    assert [c.gate_ahead for k, c in cands if k == "gate_ahead"] == [GATE_AHEAD_TRIED]
    assert [(c.release_gate, c.gate_ahead) for k, c in cands if k == "release_gate+gate_ahead"] == \
        [(m, GATE_AHEAD_TRIED) for m in RELEASE_GATE_TRIED_WITH_AHEAD] == [(48, 2), (112, 2)]
    # a base at mask 48 without a head start: the 48 pair is its gate_ahead step, so only 112's pair is added
    cands48 = neighbours(SPEC, 2, SMS, ScheduleTuning(release_gate=48), lm_head=False)
    assert [(c.release_gate, c.gate_ahead) for k, c in cands48 if k == "release_gate+gate_ahead"] == [(112, 2)]
    assert [(c.release_gate, c.gate_ahead) for k, c in cands48 if k == "gate_ahead"] == [(48, 2)]
    cands = neighbours(SPEC, 2, SMS, t, lm_head=False)
    assert [c.gate_ahead for k, c in cands if k == "gate_ahead"] == [0]
    assert not [k for k, _ in cands if k == "release_gate+gate_ahead"]
    assert (112, 2) in [(c.release_gate, c.gate_ahead) for k, c in cands if k == "release_gate"]   # the mask, head start kept
    assert not [k for k, _ in neighbours(SPEC, 2, SMS, ScheduleTuning(release_gate=RELEASE_GATE_OFF), lm_head=False)
                if k == "gate_ahead"]


def test_ntiles_builds_are_per_batch_class():
    """MK_NTILES (session 49's A/B): a decoder variant with it on gives each batch size the build of its class (1 for
    batch 1..8, 2 for 9..16), with -DMK_NTILES; off, every batch size shares the build of both classes."""
    from mk_plugin.persistent.variant import KernelVariant, batch_class

    assert [batch_class(b) for b in (1, 8, 9, 16)] == [1, 1, 2, 2]
    on = KernelVariant(ntiles=1)
    assert on.for_batch(3) == on and on.for_batch(9) == KernelVariant(ntiles=2)
    assert "-DMK_NTILES=2" in on.for_batch(16).defines()
    assert KernelVariant().for_batch(12) == KernelVariant() and "ntiles=2" in on.for_batch(12).label()
    for bad in (3, True, -1):
        with pytest.raises(ValueError, match="ntiles="):
            KernelVariant(ntiles=bad)
    src = (Path(__file__).resolve().parents[1] / "csrc" / "megakernel.cu").read_text()
    assert "(MK_NTILES && batch_class(P.batch) != MK_NTILES)) bad |= HDRCHK_BATCH" in src


def test_wga_only_builds_where_every_task_has_whole_chunks():
    """MK_WGA_ONLY (session 49's A/B, on top of MK_NTILES): a batch-9..16 build puts every task on the wgmma path only
    where every matvec task's reduction width is whole 256-column chunks under that batch's tuning (a K-split part
    too); elsewhere, and for batch 1..8, the decoder drops it from the batch's build. MK_X_WHOLE likewise only where
    every task's x is staged whole."""
    from mk_plugin.persistent.backend import MegakernelDecoder
    from mk_plugin.persistent.tasks import task_k_widths
    from mk_plugin.persistent.variant import KernelVariant
    from mk_plugin.weights import random_weights

    spec = replace(LlamaSpec.tiny(), intermediate_size=512)   # K 256 / 256 / 256 / 512: whole chunks
    v = KernelVariant(w_tma=True, wgmma_a=4, ntiles=1, wga_only=True)
    cut = ScheduleTuning(ksplit=(("down", 3),))   # 512 columns in 3 parts of 128 / 192 / 192
    assert task_k_widths(spec, cut)["down"] == {128, 192} and task_k_widths(spec, cut, lm_head=False).keys() == {
        "qkv_rope", "o_proj", "gate_up", "down"}
    dec = MegakernelDecoder(spec, random_weights(spec), 16, "cpu", num_sms=6, variant=v, tuning={13: cut})
    assert dec.variant_for(12) == replace(v, ntiles=2) and "-DMK_WGA_ONLY=1" in dec.variant_for(12).defines()
    assert dec.variant_for(13) == replace(v, ntiles=2, wga_only=False)
    assert dec.variant_for(4) == replace(v, ntiles=1, wga_only=False)
    assert KernelVariant(ntiles=1, wga_only=True).for_batch(12) == KernelVariant(ntiles=2)   # no wgmma path: dropped
    with pytest.raises(ValueError, match="wga_only puts every task"):
        KernelVariant(w_tma=True, wgmma_a=4, wga_only=True)
    wide = replace(spec, intermediate_size=8192)   # down's K: 1 row of 8192 fits the scratch, 4 do not
    xw = KernelVariant(ntiles=1, x_whole=True)
    one = MegakernelDecoder(wide, random_weights(wide), 16, "cpu", num_sms=6, variant=xw)
    assert one.variant_for(1) == xw and xw.stages_x_whole(8192, 16, True)
    assert one.variant_for(4) == KernelVariant(ntiles=1) and one.variant_for(16) == KernelVariant(ntiles=2)
    with pytest.raises(ValueError, match="x_whole stages every task"):
        KernelVariant(ntiles=1, x_whole=True, x_groups=True)


def test_class_builds_give_batch_one_its_class_build_with_x_whole():
    """Session 50 (H100: -2.8% at 1B batch 1, -1.2% at 8B batch 1; -0.3..-1.6% at batch 10..16): by default
    (class_builds) a batch size whose every matvec task stages its x whole runs MK_NTILES + MK_X_WHOLE's build of its
    class, one whose every task takes the wgmma path MK_NTILES + MK_WGA_ONLY's, the same program bit for bit; other
    batch sizes, a variant that sets ntiles or x_groups itself (variant or tuning), and class_builds=False keep the
    build of both classes. variant_for is cached per batch; retune() drops its batch's entry."""
    from mk_plugin.persistent.backend import MegakernelDecoder
    from mk_plugin.persistent.variant import KernelVariant
    from mk_plugin.weights import random_weights

    wide = replace(LlamaSpec.tiny(), intermediate_size=8192)   # down's K: 1 row of 8192 fits the scratch, 4 do not
    w = random_weights(wide)
    dec = MegakernelDecoder(wide, w, 16, "cpu", num_sms=6)
    xw = KernelVariant(ntiles=1, x_whole=True)
    assert dec.variant_for(1) == xw and dec.variant_for(1) is dec.variant_for(1)
    assert dec.variant_for(4) == dec.variant_for(12) == KernelVariant()
    assert "-DMK_X_WHOLE=1" in dec.variant_for(1).defines() and "-DMK_NTILES=1" in dec.variant_for(1).defines()
    assert MegakernelDecoder(wide, w, 2, "cpu", num_sms=6, class_builds=False).variant_for(1) == KernelVariant()
    assert MegakernelDecoder(wide, w, 2, "cpu", num_sms=6, variant=KernelVariant(x_groups=True)).variant_for(1) == \
        KernelVariant(x_groups=True)
    dec.retune(1, ScheduleTuning(x_groups=True))
    assert dec.variant_for(1) == KernelVariant(x_groups=True)
    dec.retune(1, ScheduleTuning(ksplit=(("down", 2),)))   # a part of 4096 columns still fits at batch 1
    assert dec.variant_for(1) == xw
    tiny = LlamaSpec.tiny()   # every task fits at every batch size: a build per class
    small = MegakernelDecoder(tiny, random_weights(tiny), 16, "cpu", num_sms=6)
    assert small.variant_for(8) == xw and small.variant_for(9) == KernelVariant(ntiles=2, x_whole=True)
    with pytest.raises(ValueError, match="class_builds=1"):
        MegakernelDecoder(tiny, random_weights(tiny), 2, "cpu", num_sms=6, class_builds=1)
    # every task on the wgmma path (whole 256-column chunks, batch 9..16): MK_WGA_ONLY's build, x_whole moot there
    chunky = replace(tiny, intermediate_size=512)
    wg = KernelVariant(w_tma=True, wgmma_a=4)
    cut = ScheduleTuning(ksplit=(("down", 3),))   # 512 columns in 3 parts of 128 / 192 / 192: not whole chunks
    mixed = MegakernelDecoder(chunky, random_weights(chunky), 16, "cpu", num_sms=6, variant=wg, tuning={13: cut})
    assert mixed.variant_for(12) == replace(wg, ntiles=2, wga_only=True)
    assert mixed.variant_for(13) == replace(wg, ntiles=2, x_whole=True)   # the parts fit: staged whole instead
    assert mixed.variant_for(4) == replace(wg, ntiles=1, x_whole=True)
