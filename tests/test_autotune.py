"""The megakernel's schedule tuning (persistent/tuning.py), its search (persistent/autotune.py) and
bench/autotune.py's plumbing, on CPU: tuned programs are deadlock free, ordered and give the
default program's output in the VM; tables round-trip and are looked up per key; the search keeps
only checked, faster candidates."""
from __future__ import annotations

import importlib.util
import itertools
import json
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mk_plugin import reference as ref
from mk_plugin.config import ConfigError, MkConfig
from mk_plugin.persistent import tuning as tn
from mk_plugin.persistent import tuning_table as tt
from mk_plugin.persistent.autotune import autotune, effective_tasks, neighbours, seed_tunings
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.errors import ProgramMismatch
from mk_plugin.persistent.header import generate_header
from mk_plugin.persistent.schedule import build_program, check_ordering
from mk_plugin.persistent.tasks import attention_chunks, op_units
from mk_plugin.persistent.tuning import ScheduleTuning
from mk_plugin.persistent.tuning_table import TuningEntry, TuningKey, TuningTable
from mk_plugin.persistent.vm import check_deadlock_free
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import make_decode_batch
from mk_plugin.weights import random_weights

SPEC = LlamaSpec(name="odd", hidden_size=192, intermediate_size=400, num_layers=2, num_q_heads=6, num_kv_heads=2,
                 head_dim=64, vocab_size=333)
SMS = 7
REPO = Path(__file__).resolve().parents[1]


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
    dec = MegakernelDecoder(spec, random_weights(spec), 3, "cpu", num_sms=6,
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


def test_a_tunings_weight_maps_are_checked_against_the_model():
    """A tuning with w_tma compiles MK_W_TMA into its batch's variant; the decoder checks at construction that the
    model's K sizes allow it (a clear error, as for the decoder's own variant), and builds no maps on CPU."""
    from dataclasses import replace

    from mk_plugin.persistent.backend import MegakernelDecoder
    from mk_plugin.persistent.variant import KernelVariant
    from mk_plugin.weights import random_weights

    ok = replace(LlamaSpec.tiny(), hidden_size=128, intermediate_size=256)
    dec = MegakernelDecoder(ok, random_weights(ok), 2, "cpu", num_sms=6, tuning={2: ScheduleTuning(w_tma=True)})
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


# ---- tables and lookup -------------------------------------------------------------------------------
def entry(batch: int, tuning: ScheduleTuning, best: float, default: float, lm_head: bool = False) -> TuningEntry:
    return TuningEntry(tt.spec_tuning_key(SPEC, batch, SMS, lm_head), tuning, best, default, {"spec": SPEC.name})


def test_table_round_trip_min_gain_and_nearest(tmp_path):
    fast = ScheduleTuning((("o_proj", 0.5),), 2)
    tab = TuningTable("NVIDIA H200", [entry(1, fast, 90.0, 100.0), entry(8, fast, 99.5, 100.0),
                                      entry(4, ScheduleTuning(), 100.0, 100.0)])
    p = tab.save(tmp_path / "t.json")
    back = TuningTable.load(p, "x")
    assert back.gpu == "NVIDIA H200" and back.entries.keys() == tab.entries.keys()
    k = lambda b, lm=False: tt.spec_tuning_key(SPEC, b, SMS, lm)
    assert back.winner(k(1)).tuning == fast
    assert back.winner(k(8)) is None            # 0.5% faster: inside replay noise, not used
    assert back.winner(k(4)) is None            # the default won
    near = back.nearest(k(2))                   # batch 1's split, default chunks
    assert near.tuning == ScheduleTuning((("o_proj", 0.5),), 0) and near.meta["from_batch"] == 1
    assert back.nearest(k(2, lm=True)) is None  # other lm_head: nothing
    assert back.nearest(k(4)) is None and back.nearest(k(3)) is None   # measured "default wins", and nearest to it
    assert back.nearest(k(6)) is None and back.nearest(k(16)) is None  # nearest measured: batch 4 / 8, no winner
    assert TuningTable.load(tmp_path / "missing.json", "x").entries == {}
    (tmp_path / "bad.json").write_text('{"format": 99, "entries": []}')
    with pytest.raises(ValueError, match="bad.json is malformed"):
        TuningTable.load(tmp_path / "bad.json", "x")


def test_a_table_measured_from_the_ring_keeps_it_where_nothing_won(tmp_path):
    """Session 26's trap: bench/autotune.py searched from the plain default at ctx 512, where the ring cannot win,
    and a table it wrote made the model "measured", so its batch sizes without a winner lost the ring that an
    unmeasured model gets. A table records the base its search started from; a batch size without a winner runs
    that base, a winner keeps the ring unless it turned it off (ATT_TMA_OFF)."""
    base = tn.UNTUNED_TUNING
    meta = {"spec": SPEC.name, "base": base.to_json()}
    k = lambda b: tt.spec_tuning_key(SPEC, b, SMS, False)
    split = base.with_split("down", 0.5)
    tab = TuningTable("NVIDIA H200", [TuningEntry(k(1), split, 90.0, 100.0, meta),
                                      TuningEntry(k(4), base, 100.0, 100.0, meta),
                                      TuningEntry(k(16), base.with_att_tma(tn.ATT_TMA_OFF), 90.0, 100.0, meta)])
    back = TuningTable.load(tab.save(tmp_path / "t.json"), "x")
    assert back.entries[k(4)].base == base and back.winner(k(4)) is None   # the base won: no winner ...
    assert back.base_for(k(4)) == base and back.base_for(k(3)) == base     # ... it runs the base, as its neighbours
    assert back.winner(k(1)).tuning == split and back.nearest(k(2)).tuning == split   # a winner keeps the ring
    assert back.winner(k(16)).tuning.att_tma == tn.ATT_TMA_OFF              # measured slower: off
    assert back.base_for(tt.spec_tuning_key(SPEC, 1, SMS, True)) is None    # another lm_head: not measured
    old = TuningEntry(k(8), ScheduleTuning(), 100.0, 100.0, {"spec": SPEC.name})   # tables before session 27
    assert old.base == tn.DEFAULT_TUNING and TuningTable("x", [old]).base_for(k(8)) == tn.DEFAULT_TUNING
    p = back.save(tmp_path / "pkg.json")
    got = dict(zip((1, 3, 4, 16), tt.resolve(str(p), "NVIDIA H200", [k(1), k(3), k(4), k(16)])))
    assert got[1][0] == split and got[4][0] == base and "measured base" in got[4][1]
    assert got[3][0] == base    # its nearest measured batch size is 4: no winner there, so the base
    assert got[16][0].att_tma == tn.ATT_TMA_OFF


def test_resolve_order_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tt, "TUNED_DIR", tmp_path / "pkg")
    key = tt.spec_tuning_key(SPEC, 1, SMS, False)
    user, pkg = ScheduleTuning((("down", 0.5),)), ScheduleTuning((("gate_up", 2.0),))
    # a model no table has measured on this GPU: the ring-fed attention for long tasks (session 26); on the CPU the
    # plain default
    t, why = tt.resolve("auto", "NVIDIA H200", [key])[0]
    assert t == tn.UNTUNED_TUNING == ScheduleTuning(att_tma=128) and "not in the tables" in why
    assert tt.resolve("auto", "cpu", [key])[0] == (tn.DEFAULT_TUNING, "default (no measured winner)")
    TuningTable("NVIDIA H200", [entry(1, pkg, 90, 100)]).save(tt.tuned_file("NVIDIA H200"))
    assert tt.resolve("auto", "NVIDIA H200", [key])[0][0] == pkg
    # a measured model's batch size without a winner keeps the plain default ("default won" is a measurement)
    k4 = tt.spec_tuning_key(SPEC, 4, SMS, False)
    TuningTable("NVIDIA H200", [entry(1, pkg, 90, 100), entry(4, ScheduleTuning(), 100, 100)]).save(
        tt.tuned_file("NVIDIA H200"))
    assert tt.resolve("auto", "NVIDIA H200", [k4])[0] == (tn.DEFAULT_TUNING, "default (no measured winner)")
    TuningTable("NVIDIA H200", [entry(1, pkg, 90, 100)]).save(tt.tuned_file("NVIDIA H200"))
    TuningTable("NVIDIA H200", [entry(1, user, 80, 100)]).save(tt.user_cache_file("NVIDIA H200"))
    t, why = tt.resolve("auto", "NVIDIA H200", [key])[0]
    assert t == user and "80.0 vs 100.0 us" in why                      # the user cache wins
    assert tt.resolve("off", "NVIDIA H200", [key])[0][0] == tn.DEFAULT_TUNING
    assert tt.resolve(str(tt.tuned_file("NVIDIA H200")), "NVIDIA H200", [key])[0][0] == pkg
    assert tt.tuned_file("NVIDIA H200").name == "megakernel_nvidia_h200.json"
    # MK_TUNING: auto (default), off, a file; anything else is refused with the value named
    assert MkConfig.from_env({}).tuning == "auto" and MkConfig.from_env({"MK_TUNING": "OFF"}).tuning == "off"
    f = str(tt.tuned_file("NVIDIA H200"))
    assert MkConfig.from_env({"MK_TUNING": f}).tuning == f
    with pytest.raises(ConfigError, match="MK_TUNING='fast' is neither auto, off nor an existing"):
        MkConfig.from_env({"MK_TUNING": "fast"})


# ---- the search --------------------------------------------------------------------------------------
def test_ring_depth_variants_share_the_shared_memory():
    from mk_plugin.persistent import encoding as enc
    from mk_plugin.persistent.variant import KernelVariant
    six = KernelVariant().layout
    assert six == enc.LAYOUT and six.num_stages == 6
    for n in enc.STAGE_CHOICES:
        lay = KernelVariant(rounding=enc.Rounding.STOCK, num_stages=n).layout
        assert lay.num_stages == n and lay.smem_bytes == six.smem_bytes
        assert lay.union_bytes == six.union_bytes + (6 - n) * six.slot_bytes
    # 5 stages stage batch-8 activations of K = 2048 norm-fused ops ((8 + 1) rows of 2 K + 16 bytes,
    # csrc/x_frags.cuh staged_fits, with its 512 bytes of per-warp sums); 6 do not
    need = 9 * (2 * 2048 + 16) + 4 * 8 * 16
    assert KernelVariant(num_stages=5).layout.union_bytes >= need > six.union_bytes
    with pytest.raises(ValueError, match="num_stages=3: choose one of 4, 5, 6"):
        KernelVariant(num_stages=3)
    h = generate_header()
    assert "#ifndef MK_NUM_STAGES" in h and "constexpr int NUM_STAGES = MK_NUM_STAGES;" in h
    assert f"UNION_BYTES = {six.union_bytes} + (6 - NUM_STAGES) * SLOT_BYTES" in h


def test_decoder_keeps_one_kernel_per_ring_depth(monkeypatch):
    """CUDA decoders launch each batch size's program on the kernel of its tuning's ring depth; the
    modules are built lazily and shared between batch sizes (checked here without a GPU)."""
    from mk_plugin.persistent import runtime
    w = random_weights(SPEC, seed=1)
    from mk_plugin.persistent.encoding import Rounding
    from mk_plugin.persistent.variant import KernelVariant
    dec = MegakernelDecoder(SPEC, w, 4, "cpu", num_sms=SMS, tuning={2: ScheduleTuning(num_stages=5),
                                                                    3: ScheduleTuning(num_stages=5)},
                            variant=KernelVariant(rounding=Rounding.STOCK))
    m1, m2, m3 = dec.module(1), dec.module(2), dec.module(3)
    assert isinstance(m1, runtime.MegakernelModule) and m2 is m3 and m1 is not m2
    assert m1.variant.defines() == ("-DMK_ROUNDING=1",)
    assert m2.variant.defines() == ("-DMK_ROUNDING=1", "-DMK_NUM_STAGES=5")
    assert m2.layout.num_stages == 5 and m1.layout.num_stages == 6 and m1.key != m2.key


def test_neighbours_drop_equivalent_values():
    base = ScheduleTuning()
    cands = neighbours(SPEC, 2, SMS, base, lm_head=False)
    assert sorted(t.num_stages for k, t in cands if k == "num_stages") == [4, 5]
    assert all(k != "lm_head" for k, _ in cands)
    for op in ("qkv_rope", "o_proj", "gate_up", "down"):
        counts = [effective_tasks(SPEC, op, t.factor(op), SMS) for k, t in cands if k == op]
        assert len(counts) == len(set(counts)) and effective_tasks(SPEC, op, 1.0, SMS) not in counts
    c = [t.attn_chunks for k, t in cands if k == "attn_chunks"]
    assert c and all(1 <= x <= 32 for x in c)
    merge = [t for k, t in cands if k == "merge_in_partial"]
    assert (merge == [base.with_merge(False)]) == (attention_chunks(2, SPEC.num_kv_heads, SMS) > 1)
    assert [t.ksplit for k, t in cands if k == "ksplit.down"] == [(("down", 2),), (("down", 4),)]
    k4 = [t.ksplit for k, t in neighbours(SPEC, 2, SMS, base.with_ksplit("down", 4), lm_head=False) if k == "ksplit.down"]
    assert k4 == [(), (("down", 2),)]
    assert [t.att_tma for k, t in cands if k == "att_tma"] == [128]   # the ring-fed attention: on, then off again
    assert [t.att_tma for k, t in neighbours(SPEC, 2, SMS, base.with_att_tma(128), lm_head=False) if k == "att_tma"] == [0]
    # a search from the ring (UNTUNED_TUNING) turns it off explicitly, and back on from there
    ring = neighbours(SPEC, 2, SMS, tn.UNTUNED_TUNING, lm_head=False, att_off=tn.ATT_TMA_OFF)
    assert [t.att_tma for k, t in ring if k == "att_tma"] == [tn.ATT_TMA_OFF]
    off = neighbours(SPEC, 2, SMS, ScheduleTuning(att_tma=tn.ATT_TMA_OFF), lm_head=False, att_off=tn.ATT_TMA_OFF)
    assert [t.att_tma for k, t in off if k == "att_tma"] == [128]
    assert [t.inflight for k, t in cands if k == "inflight"] == [2]   # the in-flight cap: on, then off again
    assert [t.inflight for k, t in neighbours(SPEC, 2, SMS, base.with_inflight(2), lm_head=False) if k == "inflight"] == [0]
    # SPEC's hidden size 192 is a multiple of 64 but its intermediate 400 is not: no weight-map copies
    assert all(k != "w_tma" for k, _ in cands)
    k64 = replace(LlamaSpec.tiny(), hidden_size=128, intermediate_size=256)   # every K a multiple of 64
    assert [t.w_tma for k, t in neighbours(k64, 2, SMS, base, lm_head=False) if k == "w_tma"] == [True]
    assert [t.w_tma for k, t in neighbours(k64, 2, SMS, base.with_w_tma(True), lm_head=False) if k == "w_tma"] == [False]
    # the tensor maps and the cap also as one step (they paid together, not alone: session 21), on and off again
    pair = [t for k, t in neighbours(k64, 2, SMS, base, lm_head=False) if k == "w_tma+inflight"]
    assert pair == [ScheduleTuning(w_tma=True, inflight=2)]
    both = ScheduleTuning(w_tma=True, inflight=2)
    assert [t for k, t in neighbours(k64, 2, SMS, both, lm_head=False) if k == "w_tma+inflight"] == [ScheduleTuning()]
    assert all(k != "w_tma+inflight" for k, _ in neighbours(k64, 2, SMS, base.with_w_tma(True), lm_head=False))
    one = [t for k, t in neighbours(SPEC, 2, SMS, ScheduleTuning(attn_chunks=1), lm_head=False) if k == "merge_in_partial"]
    assert one == []   # one chunk: nothing to merge


def test_autotune_keeps_only_checked_faster_candidates():
    """A fake GPU: o_proj x0.5 is fastest but computes garbage (rejected, never timed); gate_up x2 is
    fast and right, and faster with 5 ring stages (chosen); down x0.5 is 1% faster (inside min_gain:
    not taken)."""
    state = {"t": ScheduleTuning()}
    truth = torch.linspace(-1, 1, 50, dtype=torch.bfloat16)
    times = {"o_projx0.5": 50.0, "gate_upx2,stages5": 70.0, "gate_upx2": 80.0, "downx0.5": 99.0}
    measured: list[str] = []

    def retune(t):
        state["t"] = t

    def run_step():
        return truth + 1 if state["t"].factor("o_proj") == 0.5 else truth.clone()

    def measure():
        measured.append(state["t"].label())
        return next((v for k, v in times.items() if k in state["t"].label()), 100.0)

    best, trials = autotune(spec=SPEC, batch=2, num_sms=SMS, lm_head=False, retune=retune, run_step=run_step,
                            measure=measure, predict=lambda: 1.0, ops=("o_proj", "gate_up", "down"),
                            factors=(0.5, 2.0), chunks=(), stages=(6, 5), rounds=2, log=lambda s: None)
    assert best.tuning == ScheduleTuning((("gate_up", 2.0),), num_stages=5) and state["t"] == best.tuning
    assert best.us == 70.0
    bad = [t for t in trials if t.tuning.factor("o_proj") == 0.5]
    assert bad and all(not t.ok and t.us is None for t in bad)
    assert not any("o_projx0.5" in m for m in measured)
    assert trials[0].tuning.is_default and trials[0].us == 100.0


def test_autotune_from_the_ring_turns_it_off_only_when_measured_slower():
    """From base UNTUNED_TUNING: the first trial is the base, and the ring goes only if its removal measured faster by
    more than min_gain (here 5%); at 1% (inside min_gain) the best stays the base."""
    truth = torch.linspace(-1, 1, 50, dtype=torch.bfloat16)
    off = ScheduleTuning(att_tma=tn.ATT_TMA_OFF)
    for off_us, want in ((95.0, off), (99.0, tn.UNTUNED_TUNING)):
        state = {"t": None, "off_us": off_us}
        best, trials = autotune(spec=SPEC, batch=2, num_sms=SMS, lm_head=False, retune=partial(state.__setitem__, "t"),
                                run_step=truth.clone, predict=lambda: 1.0, ops=(), factors=(), chunks=(), stages=(6,),
                                measure=lambda s=state: s["off_us"] if s["t"].att_tma == tn.ATT_TMA_OFF else 100.0,
                                rounds=2, base=tn.UNTUNED_TUNING, log=lambda s: None)
        assert trials[0].tuning == tn.UNTUNED_TUNING and best.tuning == want and state["t"] == want
        assert [t.tuning for t in trials].count(off) == 1


def test_autotune_tries_other_batch_sizes_winners_whole_first():
    """Seeds (other batch sizes' winners) are tried right after the base, whole: here a three-knob program is 10%
    faster while each of its knobs alone is within min_gain, so coordinate descent alone keeps the base. A seed with
    wgmma_a (two n-tiles only) is never built at batch <= 8, and a seed's attention chunks are reset."""
    truth = torch.linspace(-1, 1, 50, dtype=torch.bfloat16)
    three = ScheduleTuning(ksplit=(("down", 4),), release_gate=112, gate_ahead=2)
    wga = ScheduleTuning(w_tma=True, wgmma_a=4)
    built: list[ScheduleTuning] = []

    def measure(s):
        t = s["t"]
        return 90.0 if t == three else 99.5 if t.ksplit_for("down") == 4 or t.release_gate == 112 else 100.0

    for seeds, want in (((), ScheduleTuning()), ((wga, three.with_chunks(3), three), three)):
        state = {"t": None}
        best, trials = autotune(spec=SPEC, batch=2, num_sms=SMS, lm_head=False,
                                retune=lambda t, s=state: (built.append(t), s.__setitem__("t", t)),
                                run_step=truth.clone, measure=partial(measure, state), predict=lambda: 1.0, ops=(),
                                factors=(), chunks=(), stages=(6,), rounds=2, seeds=seeds, log=lambda s: None)
        assert best.tuning == want and state["t"] == want
        if seeds:
            assert trials[1].tuning == three and [t.tuning for t in trials].count(three) == 1
    assert wga not in built
    assert seed_tunings([wga, three.with_chunks(3), three], 12) == [wga, three]


def test_table_other_batch_winners_are_the_seeds(tmp_path):
    fast = ScheduleTuning((("o_proj", 0.5),), 2)
    k8 = ScheduleTuning(ksplit=(("down", 4),))
    tab = TuningTable("NVIDIA H200", [entry(1, fast, 90.0, 100.0), entry(4, ScheduleTuning(), 100.0, 100.0),
                                      entry(8, k8, 90.0, 100.0), entry(8, k8, 90.0, 100.0, lm_head=True)])
    k = lambda b: tt.spec_tuning_key(SPEC, b, SMS, False)
    assert [e.tuning for e in tab.other_batch_winners(k(4))] == [fast, k8]   # batch 4's "default wins" is no seed
    assert [e.tuning for e in tab.other_batch_winners(k(8))] == [fast]       # not its own, not the lm_head key's
    bench = _load_bench()
    p = tab.save(tmp_path / "t.json")
    assert bench.table_seeds(SPEC, 16, SMS, False, [p, tmp_path / "missing.json"]) == [fast, k8]


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_autotune", REPO / "bench" / "autotune.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_autotune_cpu_plumbing_writes_a_table_the_decoder_uses(tmp_path, monkeypatch):
    bench = _load_bench()
    table = tmp_path / "table.json"
    rc = bench.main(["--device", "cpu", "--models", "tiny", "--batch", "1", "3", "--lm-head", "on", "--num-sms", "6",
                     "--rounds", "1", "--outdir", str(tmp_path), "--cache", str(table)])
    assert rc == 0
    report = next(tmp_path.glob("autotune_*_tiny_cpu.md")).read_text()
    assert "## Winners" in report and "time model" in report and "| default |" in report
    tab = TuningTable.load(table, "cpu")
    assert {k.batch for k in tab.entries} == {1, 3}
    spec = LlamaSpec.tiny()
    e = tab.entries[tt.spec_tuning_key(spec, 1, 6, True)]
    assert e.best_us <= e.default_us and e.meta["measured"].startswith("time model")
    # the decoder picks the table's winners up from the MK_TUNING value it is given (a file)
    dec = MegakernelDecoder(spec, random_weights(spec), 3, "cpu", num_sms=6, lm_head=True, tuning=str(table))
    for b in (1, 3):
        w = tab.winner(tt.spec_tuning_key(spec, b, 6, True))
        assert dec.tunings[b] == (w.tuning if w else tn.DEFAULT_TUNING)
    with pytest.raises(SystemExit, match="a cpu run has none"):
        bench.main(["--device", "cpu", "--models", "tiny", "--write-tuned"])


def test_tuning_key_ignores_fallback_order():
    assert TuningKey.of(1, 2, 3, True, ["o_proj", "down"]) == TuningKey.of(1, 2, 3, True, ("down", "o_proj"))


def test_every_packaged_non_default_entry_is_used():
    """A packaged entry whose recorded gain is under TUNED_MIN_GAIN is dropped by the lookup without a word:
    session 18's att_tma entries (default_us written as the previous winner's time) left 8B batch 8 / 16 and
    1B batch 16 on the default tuning, K-split included, until session 19 found it on the H200."""
    for path in sorted(tt.TUNED_DIR.glob("megakernel_*.json")):
        table = TuningTable.load(path, path.stem)
        for key, e in table.entries.items():
            if e.tuning != e.base:
                assert table.winner(key) is e, f"{path.name}: {key} ({e.tuning.label()}) gains only {e.gain:.3f}"


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
