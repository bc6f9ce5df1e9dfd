"""bench/ab_table.py: the A/B table of a GPU call's log (builds alternated over rounds)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ab_table

LOG = """date 2026-12-01T17:10:21Z call 1 commit abc1234
== round 1 1b: default
llama-3.2-1b: 16 layers, ctx 512, lm_head in megakernel: False, 132 SMs, defines none
path        batch   step_us     GB/s  % of 4.8TB/s
megakernel     12    1300.0     1700         35.4%
megakernel     16    1400.0     1560         32.5%
== round 1 1b: --define MK_NT2_SLOTS=8
megakernel     12    1250.0     1770         36.9%
megakernel     16    1330.0     1640         34.2%
== round 2 1b: default
megakernel     12    1302.0     1700         35.4%
megakernel     16    1404.0     1560         32.5%
== round 2 1b: --define MK_NT2_SLOTS=8
megakernel     12    1246.0     1770         36.9%
megakernel     16    1336.0     1640         34.2%
"""


def test_rows_per_build_and_differences_from_the_default():
    builds = ab_table.parse(LOG.splitlines())
    assert builds["default"][("1b", 16)] == [1400.0, 1404.0]
    assert builds["MK_NT2_SLOTS=8"][("1b", 12)] == [1250.0, 1246.0]
    text = ab_table.table(builds)
    lines = text.splitlines()
    assert lines[0] == "| build | 1b b12 | 1b b16 |"
    assert lines[2] == "| default | 1300.0 / 1302.0 | 1400.0 / 1404.0 |"
    # means 1248 vs 1301 and 1333 vs 1402
    assert lines[3] == "| MK_NT2_SLOTS=8 | 1250.0 / 1246.0 (-53) | 1330.0 / 1336.0 (-69) |"


def test_logs_without_groups_take_the_given_one(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("== round 1: default\nmegakernel      1     839.1     2340   48.7%\n"
                 "== round 1: --define MK_X=1\nmegakernel      1     819.1     2397   49.9%\n")
    b.write_text("== round 1: default\nmegakernel      1    4261.6     3291   68.6%\n")
    out = tmp_path / "t.md"
    assert ab_table.main([f"{a}=1B", f"{b}=8B", "--out", str(out)]) == 0
    text = out.read_text().splitlines()
    assert text[0] == "| build | 1B b1 | 8B b1 |"
    assert text[3] == "| MK_X=1 | 819.1 (-20) |  |"


def test_rows_of_other_blocks_are_not_a_builds():
    builds = ab_table.parse([*LOG.splitlines(), "== control: something else", "megakernel 8 999.0 1 1%"])
    assert all(("1b", 8) not in cols and ("", 8) not in cols for cols in builds.values())


def test_a_log_without_the_default_build_is_refused():
    with pytest.raises(ValueError, match="no 'default' build"):
        ab_table.table(ab_table.parse(["== round 1: --define MK_X=1", "megakernel 1 800.0 1 1%"]))


def test_mk_ab_builds_and_labels_read_back_by_the_table():
    """bench/mk_ab.py's build strings parse to variants whose header labels ab_table.parse reads back."""
    import mk_ab
    b = mk_ab.parse_build("MK_RELEASE_GATE=96,MK_NUM_STAGES=5")
    v = b.variant
    assert b.tuning is None and b.class_builds
    assert mk_ab.build_label(b) == " ".join(f"--define {d.removeprefix('-D')}" for d in v.defines())
    assert mk_ab.build_label(mk_ab.parse_build("default")) == "default"
    assert mk_ab.build_label(mk_ab.parse_build("")) == "default"
    k = mk_ab.parse_build("ksplit.o_proj=2,ksplit.down=4")   # a program item: tuning.ksplit
    assert k.variant == mk_ab.parse_build("default").variant and k.tuning.ksplit == (("down", 4), ("o_proj", 2))
    assert mk_ab.build_label(k) == "tuning down/k4,o_proj/k2"
    off = mk_ab.parse_build("class_builds=0,MK_RELEASE_GATE=96")   # a decoder item: class_builds
    assert not off.class_builds and off.variant == v.__class__(release_gate=96)
    assert mk_ab.build_label(off) == "--define MK_RELEASE_GATE=96 class_builds=0"
    assert mk_ab.build_label(mk_ab.parse_build("class_builds=1")) == "default"
    log = (f"== round 1 1b: {mk_ab.build_label(mk_ab.parse_build('default'))}\nmegakernel    16    1400.0  1 1%\n"
           f"== round 1 1b: {mk_ab.build_label(b)}\nmegakernel    16    1300.0  1 1%\n"
           f"== round 1 1b: {mk_ab.build_label(k)}\nmegakernel    16    1200.0  1 1%\n"
           f"== round 1 1b: {mk_ab.build_label(mk_ab.parse_build('class_builds=0'))}\nmegakernel    16    1500.0  1 1%\n")
    builds = ab_table.parse(log.splitlines())
    assert builds["default"][("1b", 16)] == [1400.0]
    assert builds[mk_ab.build_label(b).replace("--define ", "")][("1b", 16)] == [1300.0]
    assert builds["tuning down/k4,o_proj/k2"][("1b", 16)] == [1200.0]
    assert builds["class_builds=0"][("1b", 16)] == [1500.0]
    with pytest.raises(ValueError, match="MK_NOPE"):
        mk_ab.parse_build("MK_NOPE=1")
    with pytest.raises(ValueError, match="class_builds takes 0 or 1"):
        mk_ab.parse_build("class_builds=2")
    with pytest.raises(ValueError, match="ksplit parts 9 for down"):
        mk_ab.parse_build("ksplit.down=9")
    with pytest.raises(ValueError, match="ksplit item 'down': give OP=N"):   # an item without its parts
        mk_ab.parse_build("ksplit.down")
    c = mk_ab.parse_build("MK_ATT_TMA=128,chunks=4")   # a program item: tuning.attn_chunks
    assert c.variant.att_tma == 128 and c.tuning.attn_chunks == 4 and c.tuning.ksplit == ()
    assert mk_ab.build_label(c).endswith("tuning chunks4")
    assert not c.on_table
    t = mk_ab.parse_build("MK_ATT_TMA=1,chunks=4,on_table")   # the items change the configured tuning's knobs only
    assert t.on_table and t.variant.att_tma == 1 and mk_ab.build_label(t).endswith("tuning chunks4 on_table")
    from mk_plugin.persistent.tuning import ScheduleTuning
    entry = ScheduleTuning(release_gate=48, gate_ahead=2, ksplit=(("down", 4),))
    kept = mk_ab.on_table(entry, t.tuning)
    assert kept.attn_chunks == 4 and kept.release_gate == 48 and kept.gate_ahead == 2 and kept.ksplit == (("down", 4),)
    assert mk_ab.on_table(entry, mk_ab.parse_build("ksplit.down=2,on_table").tuning).ksplit == (("down", 2),)
    with pytest.raises(ValueError, match="on_table changes the configured tuning"):
        mk_ab.parse_build("MK_ATT_TMA=1,on_table")
    with pytest.raises(ValueError, match="give one chunks=N"):
        mk_ab.parse_build("chunks=x")
    q = mk_ab.parse_build("ksplit.down=4,piece_deps")   # a program item: tuning.piece_deps
    assert q.variant == mk_ab.parse_build("default").variant and q.tuning.piece_deps
    assert mk_ab.build_label(q) == "tuning down/k4,piece_deps"
    with pytest.raises(ValueError, match="attn_chunks=99"):
        mk_ab.parse_build("chunks=99")


def test_mk_ab_check_leaves_out_a_build_that_disagrees_with_the_first():
    """mk_ab.check_builds on the CPU (the VM executes the program): a build with another rounding agrees with the
    default within the whole-step bound; a build whose output is off is left out of the timed rounds."""
    import common
    import mk_ab
    import torch

    from mk_plugin import reference as ref
    from mk_plugin.persistent.backend import MegakernelDecoder
    from mk_plugin.spec import LlamaSpec
    from mk_plugin.weights import random_weights

    spec = LlamaSpec.tiny()
    w = random_weights(spec, device="cpu")
    cs = ref.rope_cos_sin_cache(spec, 64)
    variants = [mk_ab.parse_build(b) for b in ("default", "MK_ROUNDING=1", "default")]
    decs = [MegakernelDecoder(spec, w, 3, "cpu", variant=b.variant) for b in variants]

    class Off:   # the third build: right program, wrong answer
        def __call__(self, hidden, *a, out, **k):
            decs[0](hidden, *a, out=out, **k)
            out.mul_(1.5)

    inputs = {}
    for bsz in (1, 3):
        b, caches, pos, sl, bt, slots = common.bench_decode_batch(spec, [9, 40, 17][:bsz], bsz, "cpu")
        hidden = w.embed[b.input_ids]
        inputs[bsz] = (hidden, pos, caches, bt, sl, slots, torch.empty_like(hidden), 0)
    assert mk_ab.check_builds(variants, decs[:2] + [Off()], inputs, cs) == [True, True, False]


def test_the_rule_verdict(tmp_path, capsys):
    """--rule: every round at least G% faster at the named columns and no column slower than --worst: MK_NT2_SLOTS=8 is
    3.9% / 4.2% faster at b12 and 5.1% / 4.7% at b16 in its rounds, so it passes 3% at both and fails 4.5% at b12."""
    builds = ab_table.parse(LOG.splitlines())
    assert ab_table.verdict(builds, 3.0, [("1b", 12), ("1b", 16)], 0.5).startswith("PASS MK_NT2_SLOTS=8: 1b b12")
    v = ab_table.verdict(builds, 4.5, [("1b", 12)], 0.5)
    assert v.startswith("FAIL") and "worst round -3.9%" in v
    assert "not measured at 1b b1" in ab_table.verdict(builds, 1.0, [("1b", 1)], 0.5)
    (tmp_path / "log").write_text(LOG)
    assert ab_table.main([str(tmp_path / "log"), "--rule", "3", "--at", "1b 16"]) == 0
    assert "PASS MK_NT2_SLOTS=8: 1b b16: worst round -4.7%" in capsys.readouterr().out
