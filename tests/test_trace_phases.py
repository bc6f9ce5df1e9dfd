"""The MK_TRACE_PHASES table (mk_plugin.persistent.trace_phases) on synthetic records, and the variant
that builds it: on a CPU (the phase stamps themselves need a GPU: bench/mk_step.py --trace)."""
from __future__ import annotations

import pytest

from mk_plugin.persistent import trace_phases as tp
from mk_plugin.persistent.encoding import TRACE_FIELDS, Opcode
from mk_plugin.persistent.trace import check_records
from mk_plugin.persistent.variant import KernelVariant


def rec(tid: int, opcode: Opcode, ready: int, end: int, stage: int, chunks: int, reduce: int,
        release: int = 0) -> dict:
    r = {"tid": tid, "op": f"L0.{opcode.name.lower()}", **dict.fromkeys(TRACE_FIELDS, 0), "start": ready - 100,
         "ready": ready, "end": end, "opcode": int(opcode), "ph_stage": stage, "ph_chunks": chunks,
         "ph_reduce": reduce, "ph_release": release}
    return r


def test_phase_table_medians_and_remainder():
    rs = [rec(0, Opcode.O_PROJ, 1000, 6000, 1000, 2000, 1500),     # busy 5.0 us, other 0.5
          rec(1, Opcode.O_PROJ, 1000, 8000, 1000, 4000, 1500),     # busy 7.0, other 0.5
          rec(2, Opcode.O_PROJ, 1000, 7000, 2000, 3000, 1500),     # busy 6.0, other -0.5 (clock granularity)
          rec(3, Opcode.DOWN, 1000, 12000, 500, 9000, 1000, 250),
          rec(4, Opcode.ATTN_PARTIAL, 1000, 4000, 0, 0, 0, 600)]   # attention: release and other only
    check_records(rs)
    rows = {r.op: r for r in tp.phase_table(rs)}
    assert list(rows) == ["attn_partial", "o_proj", "down"]
    o = rows["o_proj"]
    assert (o.tasks, o.busy_us, o.stage_us, o.chunks_us, o.reduce_us, o.other_us) == (3, 6.0, 1.0, 3.0, 1.5, 0.5)
    assert rows["down"].other_us == pytest.approx(0.25) and rows["down"].release_us == pytest.approx(0.25)
    assert rows["attn_partial"].release_us == pytest.approx(0.6) and rows["attn_partial"].other_us == pytest.approx(2.4)
    md = tp.phase_table_markdown(tp.phase_table(rs))
    assert md.splitlines()[3].startswith("| o_proj | 3 | 6.00 | 0.00 | 1.00 | 3.00 | 1.50 | 0.00 | 0.50 |")
    rs[0]["ph_entry"] = rs[0]["ready"] + 300   # the call took 0.3 us: out of "other"
    assert tp.phase_table(rs)[1].entry_us == 0.0 and tp.phase_table(rs[:1])[0].entry_us == pytest.approx(0.3)
    assert tp.phase_table(rs[:1])[0].other_us == pytest.approx(0.2)


def test_records_without_phases_are_valid_but_have_no_table():
    r = rec(0, Opcode.GATE_UP, 1000, 2000, 0, 0, 0)
    for f in tp.PHASES:
        del r[f]   # records saved before the phase fields existed
    check_records([r])
    assert not tp.has_phases([r])
    with pytest.raises(ValueError, match="MK_TRACE_PHASES=1"):
        tp.phase_table([r])


def test_phase_variant_is_a_define():
    v = KernelVariant.parse(["MK_TRACE_PHASES=1"])
    assert v.phases and v.defines() == ("-DMK_TRACE_PHASES=1",) and v.label() == "phases"
    assert KernelVariant.parse(["MK_TRACE_PHASES=0"]) == KernelVariant()
    with pytest.raises(ValueError, match="MK_TRACE_PHASES=2: bad value"):
        KernelVariant.parse(["MK_TRACE_PHASES=2"])


def test_release_by_lag_buckets_by_the_next_weights_start():
    def r(tid, op, start, end, release, pf=0, sm=0):
        x = rec(tid, op, start + 10, end, 0, 1, 0, release)
        x.update(start=start, sm=sm, prod_first=pf)
        return x
    rs = [r(0, Opcode.GATE_UP, 1000, 10000, 3000, pf=500),            # next weights began 1.0 us before release
          r(1, Opcode.DOWN, 10000, 20000, 1000, pf=6000),             # its next (qkv) began 7.0 us before: >= 5
          r(2, Opcode.QKV_ROPE, 20000, 30000, 400, pf=12000),         # o_proj weights begin after: not started
          r(3, Opcode.O_PROJ, 30000, 40000, 500, pf=39000),           # no later weights task on this SM
          r(4, Opcode.GATE_UP, 1000, 5000, 800, pf=500, sm=1)]        # alone on its SM
    got = tp.release_by_lag(rs)
    assert got["gate_up"] == {"0-2 us": (1, 3.0), "no later weights": (1, 0.8)}
    assert got["down"] == {">= 5 us": (1, 1.0)} and got["qkv_rope"] == {"not started": (1, 0.4)}
    assert got["o_proj"] == {"no later weights": (1, 0.5)}


def test_attention_phases_fill_the_same_columns():
    # since session 14 attention records q/block-table loads (stage), its KV loop (chunks) and the merges
    # (reduce); the ticket and the chunk merge stay in "other"
    r = rec(0, Opcode.ATTN_PARTIAL, 1000, 5400, 800, 2000, 700, 400)
    r["ph_entry"] = 1000
    row = tp.phase_table([r])[0]
    assert (row.op, row.stage_us, row.chunks_us, row.reduce_us, row.release_us) == ("attn_partial", 0.8, 2.0, 0.7, 0.4)
    assert row.entry_us == 0.0 and row.other_us == pytest.approx(0.5)


def _lrec(tid: int, layer: int, opcode: Opcode, ready: int, end: int, wbytes: int = 0, chunks: int = 0) -> dict:
    r = rec(tid, opcode, ready, end, 0, chunks, 0)
    r.update(layer=layer, op=f"L{layer}.{opcode.name.lower()}", weight_bytes=wbytes)
    return r


def test_layer_budget_windows_gaps_and_bytes():
    """Two layers of two SMs: each op's window is its first ready to its last end, the gap its last end to the next
    op's first ready (down: the next layer's qkv), the weight bytes summed over the op's tasks of a layer."""
    rs, tid = [], 0
    for lay in (0, 1):
        t0 = lay * 30_000
        plan = [(Opcode.QKV_ROPE, 0, 4000, 4_500_000), (Opcode.ATTN_PARTIAL, 4500, 7000, 0),
                (Opcode.O_PROJ, 7400, 10_000, 2_250_000), (Opcode.GATE_UP, 10_500, 20_000, 22_500_000),
                (Opcode.DOWN, 20_300, 29_000, 9_000_000)]
        for op, a, b, wb in plan:
            for sm in (0, 1):   # SM 1 finishes each op 1 us later
                rs.append(_lrec(tid, lay, op, t0 + a, t0 + b + 1000 * sm, wb // 2, chunks=500))
                tid += 1
    rows, per_layer = tp.layer_budget(rs)
    by = {r.op: r for r in rows}
    assert list(by) == list(tp.CHAIN)
    q, g, d = by["qkv_rope"], by["gate_up"], by["down"]
    assert (q.window_us, q.gap_us, q.weight_mb) == (5.0, -0.5, 4.5)   # attention starts before qkv's slowest task ends
    assert g.window_us == 10.5 and g.gap_us == pytest.approx(-0.7) and g.bytes_us == pytest.approx(22.5 / 4.5)
    assert d.gap_us == pytest.approx(0.0) and per_layer == 30.0   # layer 0's down ends at 30.0 us, layer 1 starts then
    assert q.busy_us == 4.5 and q.chunks_us == 0.5
    md = tp.budget_markdown(rows, per_layer)
    assert "| qkv_rope | 4.5 | 1.00 | 4.50 | 0.50 | 5.00 | -0.50 |" in md and "median layer" in md
    with pytest.raises(ValueError, match="without 'layer'"):
        tp.layer_budget([rec(0, Opcode.O_PROJ, 0, 10, 0, 0, 0)])


def test_phase_delta_is_b_minus_a_per_common_op():
    a = tp.phase_table([rec(0, Opcode.O_PROJ, 1000, 6000, 1000, 2000, 1500, 200),
                        rec(1, Opcode.DOWN, 1000, 9000, 500, 6000, 1000, 250)])
    b = tp.phase_table([rec(0, Opcode.O_PROJ, 1000, 5000, 800, 2000, 1500, 100),
                        rec(2, Opcode.GATE_UP, 1000, 3000, 100, 1000, 100)])
    d = tp.phase_delta(a, b)
    assert [r.op for r in d] == ["o_proj"]   # gate_up is only in b, down only in a
    o = d[0]
    assert (o.busy_us, o.stage_us, o.chunks_us, o.release_us) == pytest.approx((-1.0, -0.2, 0.0, -0.1))
    assert tp.phase_table_markdown(d, signed=True).splitlines()[2].startswith("| o_proj | 1 | -1.00 | +0.00 | -0.20 | +0.00 |")


def test_stage_by_lead_splits_each_type_by_the_producers_lead():
    def r(tid, op, ready, stage, pf):
        x = rec(tid, op, ready, ready + 9000, stage, 1, 0)
        x.update(prod_first=pf)
        return x
    rs = [r(i, Opcode.GATE_UP, 10000, 1000 * (8 - i), 10000 - 1000 * i) for i in range(8)]   # lead 0..7 us
    rs.append(r(8, Opcode.O_PROJ, 10000, 1500, 9000))
    rs.append(r(9, Opcode.O_PROJ, 10000, 0, 9000))          # no stage time: not counted
    got = tp.stage_by_lead(rs)
    assert got["gate_up"] == [(2, 0.5, 7.5), (2, 2.5, 5.5), (2, 4.5, 3.5), (2, 6.5, 1.5)]
    assert got["o_proj"] == [(1, 1.0, 1.5)]
