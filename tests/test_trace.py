"""The timeline tooling on CPU: records synthesized from real compiled programs (tiny spec, Llama-3.2-1B)
with timestamps consistent with each SM's queue order and the counters (trace.simulate_records), then
the bytes per task, the Perfetto JSON structure, the per-op table sums, the PNG and the records-file
round trip through `python -m mk_plugin.trace convert`. No timing numbers are checked."""
from __future__ import annotations

import importlib.util
import itertools
import json
from collections import defaultdict
from pathlib import Path

import pytest

from mk_plugin.persistent import trace as T
from mk_plugin.persistent import trace_views as TV
from mk_plugin.persistent.encoding import TRACE_FIELDS
from mk_plugin.persistent.schedule import build_program
from mk_plugin.persistent.tuning import ScheduleTuning
from mk_plugin.spec import LlamaSpec

REPO = Path(__file__).resolve().parents[1]
SPEC_1B = LlamaSpec.from_json_file(REPO / "bench" / "models" / "llama-3.2-1b")
TINY = LlamaSpec(hidden_size=320, num_layers=2, num_q_heads=6, num_kv_heads=2, head_dim=64, intermediate_size=688,
                 vocab_size=1000, name="tiny")


def _traced(spec: LlamaSpec, seq_lens: list[int], num_sms: int, **kw):
    prog = build_program(spec, len(seq_lens), num_sms, **kw)
    raw = T.simulate_records(prog, seq_lens, seed=len(seq_lens))
    return prog, raw, T.annotate(raw, prog, seq_lens)


@pytest.fixture(scope="module")
def tiny():
    # padded last request, context not a multiple of any chunk or block size
    return _traced(TINY, [37, 5, 0], 12, lm_head=True)


@pytest.fixture(scope="module")
def big():
    return _traced(SPEC_1B, [517, 300, 1], 132, lm_head=True)


# ---- bytes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,seq,lm", [(TINY, [37, 5, 0], True), (TINY, [100], False),
                                         (SPEC_1B, [517, 300, 1], True), (SPEC_1B, [513] * 8, False)])
def test_task_bytes_add_up_to_the_model(spec, seq, lm):
    """Weights: every matrix once plus the final norm (layer norms are the shared input of their op);
    KV: every cached token of every layer once."""
    prog = build_program(spec, len(seq), 132 if spec is SPEC_1B else 7, lm_head=lm)
    tb = [T.task_bytes(spec, t, prog.batch, seq, prog.attn_chunks) for t in prog.taskset.tasks]
    el = spec.torch_dtype.itemsize
    assert sum(b.weight for b in tb) == spec.weight_bytes_per_step(lm) - 2 * spec.num_layers * spec.hidden_size * el
    assert sum(b.kv for b in tb) == spec.kv_bytes_per_step(seq)
    assert all(b.act > 0 for b in tb)
    # the shared input is the same for every task of one op instance
    shared = defaultdict(set)
    for t, b in zip(prog.taskset.tasks, tb):
        shared[(t.op.key, int(t.opcode))].add(b.act_shared)
    assert all(len(v) == 1 for v in shared.values())


def test_annotate_rejects_records_of_another_program(tiny):
    prog, raw, _ = tiny
    other = build_program(TINY, 3, 12, lm_head=False)
    bad = [dict(r) for r in raw if r["op"] == "lm_head"]
    with pytest.raises(ValueError, match="does not match"):
        T.annotate(bad, other, [37, 5, 0])
    with pytest.raises(ValueError, match="seq_lens"):
        T.annotate(raw, prog, [1, 2, 3, 4])


# ---- synthesized records are what a GPU could record --------------------------------------------------
@pytest.mark.parametrize("which", ["tiny", "big"])
def test_synthesized_records_follow_queues_and_counters(which, request):
    prog, raw, _ = request.getfixturevalue(which)
    T.check_records(raw)
    assert sorted(r["tid"] for r in raw) == sorted(t.tid for s in prog.segments for t in s.tasks)
    assert all(set(r) == {"tid", "op", *TRACE_FIELDS} for r in raw)
    by_tid = {r["tid"]: r for r in raw}
    for seg in prog.segments:
        for sm, q in enumerate(seg.queues):
            rs = [by_tid[seg.tasks[i].tid] for i in q]
            assert all(r["sm"] == sm for r in rs)
            assert all(a["end"] <= b["start"] for a, b in itertools.pairwise(rs))
        signallers = defaultdict(list)
        for t in seg.tasks:
            if t.signal is not None:
                signallers[t.signal[0]].append(t.tid)
        for t, waits in zip(seg.tasks, seg.waits):
            for c, _ in waits:
                assert by_tid[t.tid]["ready"] >= max(by_tid[s]["end"] for s in signallers[c])


# ---- Perfetto -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["tiny", "big"])
def test_perfetto_structure(which, request):
    prog, _, recs = request.getfixturevalue(which)
    doc = json.loads(json.dumps(TV.to_perfetto(recs, T.program_meta(prog, [1]))))
    ev = doc["traceEvents"]
    t0 = doc["otherData"]["t0_ns"]
    assert doc["otherData"]["batch"] == prog.batch and "spec" not in doc["otherData"]
    names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    tasks = defaultdict(list)
    waits = defaultdict(list)
    prod = defaultdict(list)
    pos = {}
    for i, e in enumerate(ev):
        if e["ph"] == "X":
            {"task": tasks, "wait": waits, "producer": prod}[e["cat"]][e["args"]["tid"]].append(e)
            pos[id(e)] = i
    for r in recs:
        (te,) = tasks[r["tid"]]                       # exactly one complete event per task ...
        assert te["tid"] == r["sm"] and names[r["sm"]] == f"SM {r['sm']}"   # ... on its SM's track
        assert te["name"] == r["type"] and te["args"]["op"] == r["op"]
        assert te["ts"] == pytest.approx((r["start"] - t0) / 1e3, abs=1e-6)
        assert te["dur"] == pytest.approx((r["end"] - r["start"]) / 1e3, abs=1e-6)
        if r["ready"] > r["start"]:                   # the counter wait: its own slice, nested in the task
            (we,) = waits[r["tid"]]
            assert we["tid"] == r["sm"] and we["name"] == "wait"
            assert we["ts"] == te["ts"] and we["dur"] == pytest.approx((r["ready"] - r["start"]) / 1e3, abs=1e-6)
            assert pos[id(we)] > pos[id(te)]        # parent first: same-ts slices nest in file order
        else:
            assert not waits[r["tid"]]
        if r["prod_first"]:
            (pe,) = prod[r["tid"]]
            assert pe["tid"] == T.PRODUCER_TRACK + r["sm"] and pe["ts"] >= 0
    assert sum(len(v) for v in tasks.values()) == len(recs)
    # task slices of one SM never overlap (one queue, in order)
    per_sm = defaultdict(list)
    for r in recs:
        per_sm[r["sm"]].append((r["start"], r["end"]))
    for iv in per_sm.values():
        iv.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(iv))


# ---- the table ----------------------------------------------------------------------------------------
def test_op_table_definitions_on_hand_made_records():
    """Two SMs, two op instances; every column computed by hand."""
    def rec(tid, op, sm, opcode, s, r, e, w=0, k=0, a=0, sh=0, pf=0):
        return {"tid": tid, "op": op, "sm": sm, "opcode": opcode, "start": s, "ready": r, "end": e,
                "prod_first": pf, "prod_last": pf, "wait_cycles": 1980, "weight_bytes": w, "kv_bytes": k,
                "act_bytes": a, "act_shared_bytes": sh}
    base = 10**18
    recs = [rec(0, "L0.o_proj", 0, 4, base, base + 1000, base + 5000, w=4000, a=10, sh=100, pf=base + 500),
            rec(1, "L0.o_proj", 1, 4, base, base + 2000, base + 4000, w=4000, a=10, sh=100, pf=base + 1000),
            rec(2, "L0.gate_up", 0, 5, base + 5000, base + 5000, base + 9000, w=8000, a=20, sh=50),
            rec(3, "L0.gate_up", 1, 5, base + 4000, base + 6000, base + 7000, w=8000, a=20, sh=50)]
    o, g, tot = T.op_table(recs, clock_ghz=1.98)
    assert (o.op, o.tasks, o.instances, g.op, tot.op) == ("o_proj", 2, 1, "gate_up", "total")
    assert o.busy_us == pytest.approx(6.0) and o.sm_max_us == pytest.approx(4.0)
    assert o.step_us == pytest.approx(5.0) and g.step_us == pytest.approx(4.0) and tot.step_us == pytest.approx(9.0)
    assert o.wait_us == pytest.approx(3.0) and g.wait_us == pytest.approx(2.0)
    assert o.wgt_wait_us == pytest.approx(2.0) and o.prod_lead_us == pytest.approx(0.75)
    assert o.bytes == 8020 + 100 and g.bytes == 16040 + 50 and tot.bytes == o.bytes + g.bytes
    assert o.gbps == pytest.approx(8120 / 5000) and tot.pct_copy == pytest.approx(100 * tot.gbps / 4260)
    assert tot.sm_max_us == pytest.approx(8.0) and tot.busy_us == pytest.approx(11.0)


@pytest.mark.parametrize("which", ["tiny", "big"])
def test_op_table_sums(which, request):
    prog, _, recs = request.getfixturevalue(which)
    rows = T.op_table(recs)
    *ops, tot = rows
    assert [r.op for r in ops] == [t for t in T.TYPES if any(x["type"] == t for x in recs)]
    assert tot.tasks == len(recs) == sum(r.tasks for r in ops)
    assert sum(r.step_us for r in ops) == pytest.approx(tot.step_us) == pytest.approx(T.step_span_ns(recs) / 1e3)
    for f in ("busy_us", "wait_us", "wgt_wait_us"):
        assert sum(getattr(r, f) for r in ops) == pytest.approx(getattr(tot, f))
    assert sum(r.bytes for r in ops) == tot.bytes
    assert all(0 < r.sm_max_us <= r.busy_us for r in rows)
    layers = prog.spec.num_layers
    assert {r.op: r.instances for r in ops}["gate_up"] == layers
    md = T.op_table_markdown(rows)
    assert md.count("\n") == len(rows) + 1 and "| **total** |" in md


def test_fallback_program_traces_only_megakernel_segments():
    prog, _, recs = _traced(TINY, [20, 9], 5, fallback=frozenset({"attention", "lm_head"}), lm_head=True)
    assert len(prog.segments) == 3
    types = {r["type"] for r in recs}
    assert "attn_partial" not in types and "lm_head" not in types and "o_proj" in types
    rows = T.op_table(recs)
    assert sum(r.step_us for r in rows[:-1]) == pytest.approx(rows[-1].step_us)


def test_check_records_names_the_bad_task(tiny):
    _, raw, _ = tiny
    bad = [dict(r) for r in raw]
    bad[3]["ready"] = bad[3]["start"] - 1
    with pytest.raises(ValueError, match=f"task {bad[3]['tid']} "):
        T.check_records(bad)
    bad = [dict(r) for r in raw]
    bad[0].update(start=0, ready=0, end=0)
    with pytest.raises(ValueError, match="was the step traced"):
        T.check_records(bad)


def test_timer_granularity(tiny):
    _, _, recs = tiny
    coarse = [dict(r, **{f: r[f] // 1000 * 1000 for f in ("start", "ready", "end")}) for r in recs]
    assert T.timer_granularity_ns(coarse) % 1000 == 0
    assert T.timer_granularity_ns(recs) < 1000


# ---- PNG, files, CLI ----------------------------------------------------------------------------------
def test_gantt_png_is_written(tiny, tmp_path):
    _, _, recs = tiny
    p = TV.plot_gantt(recs, tmp_path / "sub" / "g.png", title="tiny")
    data = p.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_records_file_round_trip_and_convert(big, tmp_path, capsys):
    from mk_plugin.trace import main, write_outputs
    prog, raw, recs = big
    meta = T.program_meta(prog, [517, 300, 1], context=517, date="2026-12-01 10:00 UTC", gpu="NVIDIA H200",
                          commit="abc1234", command="python -m mk_plugin.trace run --batch 3")
    assert T.spec_from_dict(meta["spec"]) == SPEC_1B
    # a raw trace_records dump + metadata: load_records rebuilds the program and derives the bytes
    path = T.save_records(tmp_path / "x.records.json", raw, meta)
    got, got_meta = T.load_records(path)
    assert got == recs and got_meta == meta
    # convert writes what write_outputs writes from memory (no PNG here: the tiny test covers it)
    files = write_outputs(recs, meta, tmp_path / "mem", "x", source=path, png=False)
    assert main(["convert", str(path), "--outdir", str(tmp_path / "conv"), "--no-png"]) == 0
    out = capsys.readouterr().out
    conv = tmp_path / "conv"
    assert json.loads((conv / "x.perfetto.json").read_text()) == json.loads(files["perfetto"].read_text())
    assert (conv / "x.md").read_text() == files["markdown"].read_text()
    md = (conv / "x.md").read_text()
    for s in ("2026-12-01", "NVIDIA H200", "abc1234", "`python -m mk_plugin.trace run --batch 3`", "| **total** |",
              "x.perfetto.json"):
        assert s in md and s in out
    # annotated records saved and loaded again are unchanged (no re-annotation)
    p2 = T.save_records(tmp_path / "y.records.json", recs, meta)
    assert T.load_records(p2) == (recs, meta)
    # gzipped (what bench/mk_step.py --records-dir writes): the same content, several times smaller
    p3 = T.save_records(tmp_path / "y.records.json.gz", recs, meta)
    assert T.load_records(p3) == (recs, meta) and 4 * p3.stat().st_size < p2.stat().st_size
    assert main(["convert", str(p3), "--outdir", str(tmp_path / "gz"), "--no-png"]) == 0
    assert (tmp_path / "gz" / "y.md").is_file()


def test_a_tuned_programs_raw_records_are_annotated_with_that_program(tmp_path):
    """load_records rebuilds the traced program from the meta to derive the bytes: a tuned program (down cut over K,
    other splits) has other tasks than the default, so the meta carries the tuning (before session 38 it did not, and
    a tuned trace's raw records were annotated against the default program)."""
    tuned = ScheduleTuning((("o_proj", 0.5),), attn_chunks=3, ksplit=(("down", 2),))
    prog, raw, recs = _traced(TINY, [37, 5, 0], 12, lm_head=True, tuning=tuned)
    default = build_program(TINY, 3, 12, lm_head=True)
    assert [t.op.name for t in prog.taskset.tasks] != [t.op.name for t in default.taskset.tasks]
    meta = T.program_meta(prog, [37, 5, 0], context=37)
    assert ScheduleTuning.from_json(meta["tuning"]) == tuned
    got, got_meta = T.load_records(T.save_records(tmp_path / "t.records.json", raw, meta))
    assert got == recs and got_meta == meta
    old = {k: v for k, v in meta.items() if k != "tuning"}   # a file written before the tuning was recorded
    assert T.program_from_meta(old).tuning == ScheduleTuning()


def test_load_records_rejects_other_json(tmp_path):
    p = tmp_path / "z.json"
    p.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="not a megakernel trace"):
        T.load_records(p)


def test_roofline_from_records(tiny, tmp_path, capsys):
    prog, _, recs = tiny
    path = T.save_records(tmp_path / "t.records.json", recs, T.program_meta(prog, [37, 5, 0], context=37))
    spec = importlib.util.spec_from_file_location("bench_roofline", REPO / "bench" / "roofline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(path), "--out", str(tmp_path / "r.md")]) == 0
    text = (tmp_path / "r.md").read_text()
    assert text.strip() in capsys.readouterr().out
    for t in {r["type"] for r in recs} | {"**total**"}:
        assert f"| {t} |" in text
