"""The megakernel's tuning tables (persistent/tuning_table.py), its search (persistent/autotune.py) and
bench/autotune.py's plumbing, on CPU: tables round-trip and are looked up per key; the search keeps only checked,
faster candidates. (ScheduleTuning itself: tests/test_tuning.py.)"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from mk_plugin.config import ConfigError, MkConfig
from mk_plugin.persistent import tuning as tn
from mk_plugin.persistent import tuning_table as tt
from mk_plugin.persistent.autotune import PROGRAM_KNOBS, autotune, effective_tasks, neighbours, seed_tunings
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.header import generate_header
from mk_plugin.persistent.tasks import attention_chunks
from mk_plugin.persistent.tuning import ScheduleTuning
from mk_plugin.persistent.tuning_table import TuningEntry, TuningKey, TuningTable
from mk_plugin.spec import LlamaSpec
from mk_plugin.weights import random_weights

SPEC = LlamaSpec(name="odd", hidden_size=192, intermediate_size=400, num_layers=2, num_q_heads=6, num_kv_heads=2,
                 head_dim=64, vocab_size=333)
SMS = 7
REPO = Path(__file__).resolve().parents[1]


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
                            variant=KernelVariant(rounding=Rounding.STOCK), class_builds=False)
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


def test_autotune_program_knobs_change_no_kernel_build_and_unknown_knobs_are_refused():
    """knobs=PROGRAM_KNOBS (bench/autotune.py --knobs program): every candidate differs from the base only in the
    encoded program (splits, K cuts, attention chunks, merge, piece deps), so tuned_variant is the base's for each;
    an unknown knob name is refused before any trial."""
    truth = torch.linspace(-1, 1, 50, dtype=torch.bfloat16)
    base = ScheduleTuning(release_gate=48, gate_ahead=2, w_tma=True, inflight=2)
    built: list[ScheduleTuning] = []
    autotune(spec=SPEC, batch=2, num_sms=SMS, lm_head=False, retune=built.append, run_step=truth.clone,
             measure=lambda: 100.0, predict=lambda: 1.0, rounds=1, base=base, knobs=PROGRAM_KNOBS, log=lambda s: None)
    v0 = tn.tuned_variant(tn.KernelVariant(), base)
    assert len(built) > 5 and built[0] == base
    assert all(tn.tuned_variant(tn.KernelVariant(), t) == v0 for t in built)
    assert any(t.ksplit_for("down") != base.ksplit_for("down") for t in built)
    with pytest.raises(ValueError, match="not knobs of the search"):
        autotune(spec=SPEC, batch=2, num_sms=SMS, lm_head=False, retune=built.append, run_step=truth.clone,
                 measure=lambda: 100.0, predict=lambda: 1.0, base=base, knobs=("ring",), log=lambda s: None)


def test_bench_autotune_start_table_descends_from_the_keys_own_entry(tmp_path):
    """--start table: the search's first trial is the key's own table entry (its base where the base won), no seeds;
    a key without an entry starts from the base as before."""
    bench = _load_bench()
    own = ScheduleTuning((("o_proj", 0.5),), 2)
    tab = TuningTable("cpu", [entry(1, own, 90.0, 100.0), entry(4, ScheduleTuning(), 100.0, 100.0)])
    p = tab.save(tmp_path / "t.json")
    assert bench.table_entry(SPEC, 1, SMS, False, [tmp_path / "missing.json", p]) == own
    assert bench.table_entry(SPEC, 4, SMS, False, [p]) == tab.entries[tt.spec_tuning_key(SPEC, 4, SMS, False)].base
    assert bench.table_entry(SPEC, 8, SMS, False, [p]) is None
    spec = LlamaSpec.tiny()
    start = ScheduleTuning((("down", 0.5),))
    cache = TuningTable("cpu", [TuningEntry(tt.spec_tuning_key(spec, 1, 6, False), start, 90.0, 100.0, {})])
    cpath = cache.save(tmp_path / "cache.json")
    rc = bench.main(["--device", "cpu", "--models", "tiny", "--batch", "1", "--lm-head", "off", "--num-sms", "6",
                     "--rounds", "1", "--start", "table", "--knobs", "program", "--outdir", str(tmp_path),
                     "--cache", str(cpath)])
    assert rc == 0
    report = next(tmp_path.glob("autotune_*_tiny_cpu.md")).read_text()
    first = report.split("## tiny batch 1 lm_head False")[1].split("\n")[4]
    assert first.startswith(f"| {start.label()} |")
    # the cache's entry keeps its record: as it was, or with the move as an `updates` record naming the report
    after = TuningTable.load(cpath, "cpu").entries[tt.spec_tuning_key(spec, 1, 6, False)]
    before = cache.entries[tt.spec_tuning_key(spec, 1, 6, False)]
    if after.tuning == start:
        assert after.to_json() == before.to_json()
    else:
        (up,) = after.meta["updates"]
        assert up["source"].endswith(".md") and "--start table" in up["change"] and after.default_us >= 100.0


def test_a_search_from_an_entry_keeps_its_record():
    """bench/autotune.py --start table merges with TuningTable.merge_from_entry: an unmoved entry keeps its record, a
    key the nearest entry already serves with the found tuning gets no entry of its own (session 54: 1B b12 on the
    H100), a moved entry keeps its base, default_us and provenance and gains an `updates` record."""
    base = ScheduleTuning(att_tma=128)
    b16 = ScheduleTuning((("o_proj", 0.75),), att_tma=128)
    old = TuningEntry(tt.spec_tuning_key(SPEC, 16, SMS, False), b16, 90.0, 120.0,
                      {"spec": SPEC.name, "base": base.to_json(), "source": "h100_tables", "updates": [{"n": 1}]})
    tab = TuningTable("NVIDIA H100", [old, entry(4, ScheduleTuning(), 100.0, 100.0)])
    k = lambda b: tt.spec_tuning_key(SPEC, b, SMS, False)
    meta = {"spec": SPEC.name, "base": b16.to_json(), "date": "d", "commit": "c"}
    same = TuningEntry(k(16), b16, 88.0, 88.0, meta)
    assert tab.merge_from_entry(same, {"n": 2}) == "unchanged" and tab.entries[k(16)] is old
    near = TuningEntry(k(14), b16.with_chunks(0), 87.0, 95.0, meta)   # what nearest(14) gives: batch 16's program
    assert tab.runs(k(14)) == b16.with_chunks(0)
    assert tab.merge_from_entry(near, {"n": 2}).startswith("not added") and k(14) not in tab.entries
    moved = TuningEntry(k(16), replace(b16, attn_chunks=4), 85.0, 89.0, meta)
    assert tab.merge_from_entry(moved, {"n": 2}).startswith("updated")
    e = tab.entries[k(16)]
    assert e.tuning == replace(b16, attn_chunks=4) and e.best_us == 85.0 and e.default_us == 120.0
    assert e.base == base and e.meta["source"] == "h100_tables" and e.meta["updates"] == [{"n": 1}, {"n": 2}]
    assert tab.winner(k(16)) is e
    # the entry was its base ("default wins" at batch 4): the move's own start time becomes default_us
    b4 = TuningEntry(k(4), ScheduleTuning((("down", 0.5),)), 90.0, 101.0, meta | {"base": ScheduleTuning().to_json()})
    assert tab.merge_from_entry(b4, {"n": 3}).startswith("updated") and tab.entries[k(4)].default_us == 101.0
    fresh = TuningEntry(k(1), ScheduleTuning((("qkv_rope", 0.5),)), 80.0, 100.0, meta)
    assert tab.merge_from_entry(fresh, {"n": 4}) == "new entry" and tab.entries[k(1)] is fresh


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


def test_bench_autotune_several_contexts(tmp_path):
    """--ctx 40 70: each candidate is run at both contexts (the time: their mean step), the entry records both."""
    bench = _load_bench()
    table = tmp_path / "table.json"
    rc = bench.main(["--device", "cpu", "--models", "tiny", "--batch", "2", "--lm-head", "off", "--num-sms", "6",
                     "--rounds", "1", "--ctx", "40", "70", "--outdir", str(tmp_path), "--cache", str(table)])
    assert rc == 0
    report = next(tmp_path.glob("autotune_*_tiny_cpu.md")).read_text()
    assert "context 40, 70 (the mean step) tokens" in report
    (e,) = TuningTable.load(table, "cpu").entries.values()
    assert e.meta["ctx"] == [40, 70]


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
