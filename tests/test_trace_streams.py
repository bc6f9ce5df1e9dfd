"""The weight-stream views of a traced step (mk_plugin.persistent.trace_streams) on synthetic records: on a CPU
(the timestamps themselves need a GPU: bench/mk_step.py --trace)."""
from __future__ import annotations

import pytest

from mk_plugin.persistent import trace_phases as tp
from mk_plugin.persistent import trace_streams as ts
from mk_plugin.persistent.encoding import TRACE_FIELDS, Opcode


def rec(tid: int, opcode: Opcode, sm: int, layer: int, ready: int, end: int, pf: int, pl: int, wbytes: int) -> dict:
    name = opcode.name.lower()
    return {"tid": tid, "op": f"L{layer}.{name}", **dict.fromkeys(TRACE_FIELDS, 0), "start": ready - 100,
            "ready": ready, "end": end, "opcode": int(opcode), "sm": sm, "prod_first": pf, "prod_last": pl,
            "layer": layer, "weight_bytes": wbytes, "kv_bytes": 0, "act_bytes": 0, "act_shared_bytes": 0}


def gate_up_layer(layer: int, tid0: int) -> list[dict]:
    """Three SMs, the partition's tile counts 2 / 2 / 1 (1 MB a unit): every SM streams at 50 GB/s (1 MB in
    20 us), the stream starting 5 us before the counter wait ends; the consumers finish 2 us after the last chunk."""
    t0 = layer * 100_000
    out = []
    for sm, units in enumerate((2, 2, 1)):
        pf = t0 + 5_000
        pl = pf + 20_000 * units
        out.append(rec(tid0 + sm, Opcode.GATE_UP, sm, layer, t0 + 10_000, pl + 2_000, pf, pl, 1_000_000 * units))
    return out


def test_stream_table_medians_and_rates():
    rs = gate_up_layer(0, 0) + gate_up_layer(1, 3)
    rs.append(rec(6, Opcode.ATTN_PARTIAL, 0, 0, 60_000, 70_000, 0, 0, 0))   # no weights: not a stream
    [g] = ts.stream_table(rs)
    assert (g.op, g.tasks, g.kb_per_task) == ("gate_up", 6, 2000.0)
    assert (g.lead_us, g.stream_us, g.tail_us) == (5.0, 40.0, 2.0)
    assert g.rate_gbps == pytest.approx(50.0)   # 1 MB / 20 us, per SM
    assert g.busy_us == pytest.approx(37.0)     # ready 10 us, last chunk at 45, end 47


def test_byte_groups_show_the_partitions_tile_counts():
    rs = gate_up_layer(0, 0) + gate_up_layer(1, 3)
    groups, imbalance = ts.byte_groups(rs)["gate_up"]
    assert [(g.kb_per_sm, g.sms, g.instances) for g in groups] == [(2000.0, 2, 4), (1000.0, 1, 2)]
    assert [g.busy_us for g in groups] == [pytest.approx(37.0), pytest.approx(17.0)]
    assert imbalance == pytest.approx(2000 / (5000 / 3))
    # two tasks of one SM in one layer's op are one group entry: their bytes add up
    two = [rec(0, Opcode.O_PROJ, 0, 0, 1000, 9000, 500, 4000, 300), rec(1, Opcode.O_PROJ, 0, 0, 9000, 12000, 4000, 8000, 200)]
    [g], imb = ts.byte_groups(two)["o_proj"]
    assert (g.kb_per_sm, g.sms, g.instances, g.busy_us, imb) == (0.5, 1, 1, 11.0, 1.0)


def test_markdown_and_the_cli_flag(capsys, tmp_path):
    rs = gate_up_layer(0, 0)
    md = ts.streams_markdown(rs)
    assert "| gate_up | 3 | 2000.0 | 5.00 | 40.00 | 50.0 | 2.00 | 37.00 |" in md
    assert "- gate_up: 2000.0 KB x 2 SMs (busy 37.00 us), 1000.0 KB x 1 SMs (busy 17.00 us); imbalance 1.200" in md
    from mk_plugin.persistent.trace import save_records
    p = save_records(tmp_path / "r.records.json.gz", rs, {"model": "synthetic"})
    assert tp.main(["--streams", str(p)]) == 0   # records without phase stamps: the streams only
    assert "weight streams" in capsys.readouterr().out


def test_records_without_bytes_are_refused():
    r = rec(0, Opcode.GATE_UP, 0, 0, 1000, 2000, 500, 1500, 100)
    del r["weight_bytes"]
    with pytest.raises(ValueError, match="no byte fields"):
        ts.stream_table([r])
