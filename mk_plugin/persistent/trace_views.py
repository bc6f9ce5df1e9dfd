"""Views of a traced step's records (persistent/trace.py): a Chrome/Perfetto trace JSON with a track per SM and
its producer, and a Gantt chart (PNG). Pure functions (no GPU)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .trace import BYTE_FIELDS, PRODUCER_TRACK, _type, check_records, step_span_ns, step_t0, type_order

# --------------------------------------------------------------------------------------------
# Perfetto / Chrome trace
# --------------------------------------------------------------------------------------------

def to_perfetto(records: Sequence[dict], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Chrome trace-event JSON (Perfetto loads it): one process, one track per SM (tid = SM index)
    with every task as one complete event "X" [start, end] named by its type, its counter wait a
    nested "wait" slice [start, ready] (emitted after its parent: same-ts events nest in file
    order), and a producer track per SM (tid PRODUCER_TRACK + SM) with [prod_first, prod_last].
    Times are us from step_t0, so the float timestamps keep ns precision."""
    check_records(records)
    meta = meta or {}
    t0 = step_t0(records)

    def us(ns: int) -> float:
        return (ns - t0) / 1e3

    title = f"megakernel {meta.get('model', '')} batch {meta.get('batch', '?')}".strip()
    ev: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": title}}]
    sms = sorted({r["sm"] for r in records})
    for s in sms:
        ev += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": s, "args": {"name": f"SM {s}"}},
               {"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": s, "args": {"sort_index": 2 * s}},
               {"ph": "M", "name": "thread_name", "pid": 0, "tid": PRODUCER_TRACK + s,
                "args": {"name": f"SM {s} weights"}},
               {"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": PRODUCER_TRACK + s,
                "args": {"sort_index": 2 * s + 1}}]
    for r in sorted(records, key=lambda r: (r["sm"], r["start"], r["tid"])):
        typ = _type(r)
        args: dict[str, Any] = {"tid": r["tid"], "op": r["op"], "wait_us": (r["ready"] - r["start"]) / 1e3,
                                "busy_us": (r["end"] - r["ready"]) / 1e3, "wait_cycles": r["wait_cycles"]}
        if "weight_bytes" in r:
            own = r["weight_bytes"] + r["kv_bytes"] + r["act_bytes"]
            args.update({f: r[f] for f in BYTE_FIELDS})
            if r["end"] > r["ready"]:
                args["own_GBps"] = round(own / (r["end"] - r["ready"]), 2)
        ev.append({"ph": "X", "name": typ, "cat": "task", "pid": 0, "tid": r["sm"], "ts": us(r["start"]),
                   "dur": (r["end"] - r["start"]) / 1e3, "args": args})
        if r["ready"] > r["start"]:
            ev.append({"ph": "X", "name": "wait", "cat": "wait", "pid": 0, "tid": r["sm"], "ts": us(r["start"]),
                       "dur": (r["ready"] - r["start"]) / 1e3, "args": {"tid": r["tid"], "op": r["op"]}})
        if r["prod_first"] and r["prod_last"] >= r["prod_first"]:
            ev.append({"ph": "X", "name": f"{typ} weights", "cat": "producer", "pid": 0, "tid": PRODUCER_TRACK + r["sm"],
                       "ts": us(r["prod_first"]), "dur": (r["prod_last"] - r["prod_first"]) / 1e3,
                       "args": {"tid": r["tid"], "op": r["op"]}})
    other = {k: v for k, v in meta.items() if k != "spec"}
    other["t0_ns"] = t0
    return {"traceEvents": ev, "displayTimeUnit": "ns", "otherData": other}


# --------------------------------------------------------------------------------------------
# Gantt chart
# --------------------------------------------------------------------------------------------

# One colour per task type (tab10), stable across charts.
COLORS = {"qkv_rope": "#1f77b4", "attn_partial": "#ff7f0e", "attn_combine": "#8c564b", "o_proj": "#2ca02c",
          "gate_up": "#d62728", "down": "#9467bd", "final_norm": "#7f7f7f", "lm_head": "#17becf"}


def plot_gantt(records: Sequence[dict], path: str | Path, title: str = "", dpi: int = 120) -> Path:
    """PNG Gantt chart: one row per SM, a bar per task coloured by type over [ready, end], its
    counter wait [start, ready] hatched in the same colour; x in us from the step's first start."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    check_records(records)
    t0 = min(r["start"] for r in records)
    sms = sorted({r["sm"] for r in records})
    fig = Figure(figsize=(16, max(4.0, 1.5 + 0.06 * len(sms))), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    def box(a: int, b: int, y: int) -> list[tuple[float, float]]:
        x0, x1 = (a - t0) / 1e3, (b - t0) / 1e3
        return [(x0, y - 0.4), (x1, y - 0.4), (x1, y + 0.4), (x0, y + 0.4)]

    busy: dict[str, list] = defaultdict(list)
    wait: dict[str, list] = defaultdict(list)
    for r in records:
        busy[_type(r)].append(box(r["ready"], r["end"], r["sm"]))
        if r["ready"] > r["start"]:
            wait[_type(r)].append(box(r["start"], r["ready"], r["sm"]))
    handles = []
    for typ in type_order(busy):
        c = COLORS.get(typ, "#bcbd22")
        ax.add_collection(PolyCollection(busy[typ], facecolors=c, edgecolors="none"))
        if wait[typ]:
            ax.add_collection(PolyCollection(wait[typ], facecolors="white", edgecolors=c, linewidths=0.0,
                                             hatch="////"))
        handles.append(Patch(facecolor=c, label=typ))
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="////", label="counter wait"))
    ax.set_xlim(0, step_span_ns(records) / 1e3)
    ax.set_ylim(max(sms) + 0.6, min(sms) - 0.6)
    ax.set_xlabel("us since the step's first task")
    ax.set_ylabel("SM")
    ax.set_title(title or f"megakernel timeline: {len(records)} tasks on {len(sms)} SMs")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=dpi)
    return p
