"""The megakernel's intra-kernel timeline, as data: per-task records -> bytes moved and a per-op table (the
Chrome/Perfetto trace JSON and the Gantt chart: trace_views.py). Pure functions (no GPU); the CLI that records
a step on the GPU is mk_plugin/trace.py (`python -m mk_plugin.trace`).

A record is one task of one traced step, as MegakernelDecoder.trace_records returns it: its tid, op
key (e.g. "L3.o_proj") and the encoding.TRACE_FIELDS values:
    start       %globaltimer ns when the consumer warps pick the task up (before its counter waits)
    ready       ... once its counter waits are done          (counter wait = ready - start)
    end         ... once its stores are done, before the release of its signal
    prod_first  when the producer warp starts issuing the task's weight chunks, or under att_tma an attention
                task's K/V tiles (since session 39; 0: none)
    prod_last   when it has issued the last of them
    wait_cycles SM clock cycles the first consumer warp waited for weight chunks (ring empty)
    sm, opcode
annotate() adds the task type (opcode name), layer and the task's bytes (task_bytes, the ONE place
that turns task metadata into bytes), so a saved records file is self-contained.

Table definitions (one row per task type, all layers together):
    busy_us     sum over tasks of (end - ready): compute time with the inputs available
    sm_max_us   the busiest SM's share of busy_us (max over SMs of its busy time for this type): the
                per-SM critical path, a lower bound of the op's wall time on this schedule
    step_us     the type's share of the step: op instances (e.g. L3.o_proj) in tid order, each
                credited max(0, its last end - the latest end so far); sums to the step's span
    wait_us     sum over tasks of (ready - start): time spent waiting for counters
    wgt_wait_us sum of wait_cycles / clock: time the consumers starved for weights
    bytes       unique bytes: sum of the tasks' own bytes (weights, KV, private activations) plus,
                once per op instance, the input rows every task of the instance reads
    GB/s        bytes / step_us, against the 4.8 TB/s datasheet and the 4.26 TB/s measured
                device-to-device copy rate of the H200
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..spec import Llama3RopeScaling, LlamaSpec
from .encoding import TRACE_FIELDS, UNIT, Opcode, ksplit_parts, ksplit_range
from .schedule import FallbackStep, Program, Segment, build_program
from .tasks import Task, unit_weight_bytes
from .tuning import DEFAULT_TUNING, ScheduleTuning
from .vm import _chunk, _rows

FORMAT = "mk-trace/1"
HBM_PEAK_GBPS = 4800.0      # H200 datasheet HBM3e bandwidth
COPY_GBPS = 4260.0          # measured device-to-device copy rate on the H200 (bench/NOTES.md)
DEFAULT_CLOCK_GHZ = 1.98    # H200 max SM clock: converts wait_cycles when the real clock is unknown
PRODUCER_TRACK = 10_000     # Perfetto tid of SM s's producer track: PRODUCER_TRACK + s
BYTE_FIELDS = ("weight_bytes", "kv_bytes", "act_bytes", "act_shared_bytes")
TYPES = tuple(op.name.lower() for op in Opcode if op != Opcode.NOP)  # table order


def task_type(opcode: int) -> str:
    """'qkv_rope', 'attn_partial', 'attn_combine', 'o_proj', 'gate_up', 'down', 'final_norm', 'lm_head'."""
    return Opcode(int(opcode)).name.lower()


# --------------------------------------------------------------------------------------------
# Bytes per task
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TaskBytes:
    """Bytes one task moves. weight: its weight tiles (rows x K of its units; the final norm's
    columns); kv: K and V of its chunk of the context; act: activations only it touches (output
    columns written, residual columns read, attention's q slice and partials); act_shared: what
    every task of the same op instance reads again (the whole input rows and, for norm-fused ops,
    the rms_norm weight), served from L2 after the first read."""
    weight: int = 0
    kv: int = 0
    act: int = 0
    act_shared: int = 0

    @property
    def traffic(self) -> int:
        """Everything the task reads and writes (shared inputs included)."""
        return self.weight + self.kv + self.act + self.act_shared


def task_bytes(spec: LlamaSpec, task: Task, batch: int, seq_lens: Sequence[int], attn_chunks: int) -> TaskBytes:
    """Bytes of one task of a `batch`-token step with these context lengths (seq_lens[b] tokens
    cached for request b, the new one included; missing entries are padded requests, 0 tokens).
    Weight rows come from tasks.unit_weight_bytes, KV chunks from the kernel's chunk rule
    (vm._chunk), output columns from vm._rows: no tiling math of its own."""
    el = spec.torch_dtype.itemsize
    G, d, B = spec.gqa_group, spec.head_dim, batch
    op = task.opcode
    if op == Opcode.ATTN_PARTIAL:
        b, _, c = task.args
        lo, hi = _chunk(int(seq_lens[b]) if b < len(seq_lens) else 0, attn_chunks, c)
        out = G * d * el if attn_chunks == 1 else G * (d + 2) * 4   # ATTN_O, or fp32 partial o, m, l
        return TaskBytes(kv=2 * (hi - lo) * d * el, act=G * d * el + out)
    if op == Opcode.ATTN_COMBINE:
        return TaskBytes(act=attn_chunks * G * (d + 2) * 4 + G * d * el)
    name = task.op.name
    limit = spec.vocab_size if op == Opcode.LM_HEAD else 1 << 62
    r = _rows({"arg0": task.args[0], "arg1": task.args[1]}, limit)
    cols = r.stop - r.start                                      # output columns of the task
    h = spec.hidden_size
    if op == Opcode.QKV_ROPE:        # x rows + input norm; writes q (or K/V into the cache)
        return TaskBytes(unit_weight_bytes(spec, name) * cols // UNIT, 0, B * cols * el, B * h * el + h * el)
    if op in (Opcode.O_PROJ, Opcode.DOWN) and task.args[2]:   # one K part: its columns, fp32 partial out
        part, parts = ksplit_parts(task.args[2])
        K = spec.q_size if op == Opcode.O_PROJ else spec.intermediate_size
        lo, hi = ksplit_range(K, part, parts)
        return TaskBytes(unit_weight_bytes(spec, name) * cols // UNIT * (hi - lo) // K, 0, B * cols * 4,
                         B * (hi - lo) * el)
    if op == Opcode.O_PROJ:          # attn_o rows; residual columns read and written
        return TaskBytes(unit_weight_bytes(spec, name) * cols // UNIT, 0, 2 * B * cols * el, B * spec.q_size * el)
    if op == Opcode.GATE_UP:         # x rows + post norm; writes act columns (gate and up rows: weight)
        return TaskBytes(unit_weight_bytes(spec, name) * cols // UNIT, 0, B * cols * el, B * h * el + h * el)
    if op == Opcode.DOWN:            # act rows; residual columns read and written
        return TaskBytes(unit_weight_bytes(spec, name) * cols // UNIT, 0, 2 * B * cols * el,
                         B * spec.intermediate_size * el)
    if op == Opcode.FINAL_NORM:      # whole rows for the statistics; its norm-weight columns
        return TaskBytes(cols * el, 0, B * cols * el, B * h * el)
    if op == Opcode.LM_HEAD:         # fp32 logits
        return TaskBytes(unit_weight_bytes(spec, name) * cols // UNIT, 0, B * cols * 4, B * h * el)
    raise ValueError(f"task {task.tid} has opcode {int(op)} with no byte model")


def _tasks_by_tid(program: Program) -> dict[int, Task]:
    if program.taskset is None:
        raise ValueError("program has no taskset (build it with schedule.build_program)")
    return {t.tid: t for t in program.taskset.tasks}


def _padded_seq_lens(program: Program, seq_lens: Sequence[int]) -> list[int]:
    lens = [int(s) for s in seq_lens]
    if len(lens) > program.batch:
        raise ValueError(f"{len(lens)} seq_lens for a program of batch {program.batch}")
    return lens + [0] * (program.batch - len(lens))


def annotate(records: Iterable[dict], program: Program, seq_lens: Sequence[int]) -> list[dict]:
    """Copies of the records with 'type', 'layer' and the TaskBytes fields (BYTE_FIELDS) of their
    task in `program`. Raises ValueError when a record's tid or opcode does not match the program."""
    tasks = _tasks_by_tid(program)
    lens = _padded_seq_lens(program, seq_lens)
    out = []
    for r in records:
        t = tasks.get(int(r["tid"]))
        if t is None or int(t.opcode) != int(r["opcode"]):
            raise ValueError(f"record of tid {r['tid']} (opcode {r['opcode']}) does not match the program")
        tb = task_bytes(program.spec, t, program.batch, lens, program.attn_chunks)
        row = dict(r)
        row.update(type=task_type(t.opcode), layer=t.op.layer, op=t.op.key, weight_bytes=tb.weight,
                   kv_bytes=tb.kv, act_bytes=tb.act, act_shared_bytes=tb.act_shared)
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------
# Records files
# --------------------------------------------------------------------------------------------

def spec_to_dict(spec: LlamaSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)


def spec_from_dict(d: dict[str, Any]) -> LlamaSpec:
    rs = d.get("rope_scaling")
    return LlamaSpec(**{**d, "rope_scaling": Llama3RopeScaling(**rs) if rs else None})


def program_meta(program: Program, seq_lens: Sequence[int], **extra: Any) -> dict[str, Any]:
    """What convert needs to rebuild the program and re-derive the bytes (plus any provenance). The tuning is part
    of it: a tuned program (splits, K-splits, attention chunks) has other tasks than the default one."""
    return {"model": program.spec.name, "spec": spec_to_dict(program.spec), "layers": program.spec.num_layers,
            "batch": program.batch,
            "num_sms": program.num_sms, "lm_head": program.lm_head, "fallback": sorted(program.fallback),
            "attn_chunks": program.attn_chunks, "tuning": program.tuning.to_json(),
            "seq_lens": _padded_seq_lens(program, seq_lens), **extra}


def program_from_meta(meta: dict[str, Any]) -> Program:
    """The traced program again (records saved before the tuning was in the meta: the default tuning's)."""
    tuning = ScheduleTuning.from_json(meta["tuning"]) if "tuning" in meta else DEFAULT_TUNING
    return build_program(spec_from_dict(meta["spec"]), int(meta["batch"]), int(meta["num_sms"]),
                         lm_head=bool(meta.get("lm_head", False)), fallback=frozenset(meta.get("fallback", ())),
                         tuning=tuning)


def save_records(path: str | Path, records: Sequence[dict], meta: dict[str, Any] | None = None) -> Path:
    """Write {"format", "meta", "records"} as JSON (integers stay exact: timestamps are ns), gzipped when
    the name ends in .gz (a 1B step's records: 3.3 MB of JSON, ~10x less compressed)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    # one record per line: readable, diffable, and half the size of an indented dump
    body = ",\n".join(json.dumps(r, separators=(",", ":")) for r in records)
    text = f'{{"format": {json.dumps(FORMAT)},\n"meta": {json.dumps(meta or {})},\n"records": [\n{body}\n]}}\n'
    p.write_bytes(gzip.compress(text.encode()) if p.suffix == ".gz" else text.encode())
    return p


def load_records(path: str | Path) -> tuple[list[dict], dict[str, Any]]:
    """(records, meta) from save_records' file, or from a bare JSON list of trace_records rows.
    Records without bytes get them (annotate) when meta can rebuild the program."""
    raw = Path(path).read_bytes()
    doc = json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)
    if isinstance(doc, list):
        records, meta = doc, {}
    elif isinstance(doc, dict) and doc.get("format") == FORMAT:
        records, meta = doc["records"], doc.get("meta", {})
    else:
        raise ValueError(f"{path}: not a megakernel trace (expected format {FORMAT!r} or a list of records)")
    check_records(records)
    if records and any(f not in records[0] for f in BYTE_FIELDS) and "spec" in meta:
        records = annotate(records, program_from_meta(meta), meta.get("seq_lens", ()))
    return records, meta


def check_records(records: Sequence[dict]) -> None:
    """Every record has its fields and start <= ready <= end (ValueError naming the tid)."""
    if not records:
        raise ValueError("no trace records")
    need = ("tid", "op", *(f for f in TRACE_FIELDS if not f.startswith("ph_")))  # phases: MK_TRACE_PHASES only
    for r in records:
        miss = [f for f in need if f not in r]
        if miss:
            raise ValueError(f"trace record {r.get('tid', '?')} lacks {miss}")
        if not 0 < r["start"] <= r["ready"] <= r["end"]:
            raise ValueError(f"task {r['tid']} ({r['op']}): timestamps start={r['start']} ready={r['ready']} "
                             f"end={r['end']} are not 0 < start <= ready <= end (was the step traced?)")


def _type(r: dict) -> str:
    return r.get("type") or task_type(r["opcode"])


def type_order(types: Iterable[str]) -> list[str]:
    """Task types in table order (TYPES), any other name after them, sorted."""
    present = set(types)
    return [t for t in TYPES if t in present] + sorted(present - set(TYPES))


def step_t0(records: Sequence[dict]) -> int:
    """Time origin of the step: the first start (or earlier producer activity)."""
    return min(min(r["start"] for r in records), min((r["prod_first"] for r in records if r["prod_first"]),
                                                     default=1 << 63))


def step_span_ns(records: Sequence[dict]) -> int:
    return max(r["end"] for r in records) - min(r["start"] for r in records)


def timer_granularity_ns(records: Sequence[dict]) -> int:
    """gcd of all start/ready/end offsets from the first start: the %globaltimer update step seen
    (on some GPUs it ticks in whole microseconds, which makes short tasks look 0 or 1 us long)."""
    t0 = min(r["start"] for r in records)
    g = 0
    for r in records:
        for f in ("start", "ready", "end"):
            g = math.gcd(g, r[f] - t0)
    return g


# --------------------------------------------------------------------------------------------
# Per-op table
# --------------------------------------------------------------------------------------------

@dataclass
class OpRow:
    op: str                   # task type, or "total"
    tasks: int
    instances: int            # op instances (layers) it appears in
    busy_us: float
    sm_max_us: float
    step_us: float
    wait_us: float
    wgt_wait_us: float
    prod_lead_us: float       # mean (ready - prod_first): how early the weights started streaming
    bytes: int | None         # None when the records carry no bytes

    @property
    def gbps(self) -> float | None:
        return None if self.bytes is None or self.step_us <= 0 else self.bytes / (self.step_us * 1e3)

    @property
    def pct_peak(self) -> float | None:
        return None if self.gbps is None else 100.0 * self.gbps / HBM_PEAK_GBPS

    @property
    def pct_copy(self) -> float | None:
        return None if self.gbps is None else 100.0 * self.gbps / COPY_GBPS


def _instances(records: Sequence[dict]) -> list[tuple[tuple[str, str], list[dict]]]:
    """Records grouped by op instance (op key, task type), in order of their first tid."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["op"], _type(r))].append(r)
    return sorted(groups.items(), key=lambda kv: min(r["tid"] for r in kv[1]))


def _unique_bytes(rs: Sequence[dict]) -> int:
    """Unique bytes of one op instance: own bytes of each task + the shared input once."""
    return sum(r["weight_bytes"] + r["kv_bytes"] + r["act_bytes"] for r in rs) + max(r["act_shared_bytes"] for r in rs)


def op_table(records: Sequence[dict], clock_ghz: float = DEFAULT_CLOCK_GHZ) -> list[OpRow]:
    """One OpRow per task type present (TYPES order), then a "total" row (see the module doc)."""
    check_records(records)
    has_bytes = all(f in records[0] for f in BYTE_FIELDS)
    step: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)
    inst: dict[str, int] = defaultdict(int)
    t_prev = min(r["start"] for r in records)
    for (_, typ), rs in _instances(records):
        end = max(r["end"] for r in rs)
        step[typ] += max(0, end - t_prev) / 1e3
        t_prev = max(t_prev, end)
        inst[typ] += 1
        if has_bytes:
            nbytes[typ] += _unique_bytes(rs)
    by_type: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_type[_type(r)].append(r)

    def row(name: str, rs: list[dict], step_us: float, n_inst: int, b: int | None) -> OpRow:
        per_sm: dict[int, int] = defaultdict(int)
        for r in rs:
            per_sm[r["sm"]] += r["end"] - r["ready"]
        lead = [r["ready"] - r["prod_first"] for r in rs if r["prod_first"]]
        return OpRow(name, len(rs), n_inst, sum(r["end"] - r["ready"] for r in rs) / 1e3, max(per_sm.values()) / 1e3,
                     step_us, sum(r["ready"] - r["start"] for r in rs) / 1e3,
                     sum(r["wait_cycles"] for r in rs) / (clock_ghz * 1e3),
                     sum(lead) / len(lead) / 1e3 if lead else 0.0, b)

    rows = [row(t, by_type[t], step[t], inst[t], nbytes[t] if has_bytes else None) for t in TYPES if t in by_type]
    rows.append(row("total", list(records), step_span_ns(records) / 1e3, sum(inst.values()),
                    sum(nbytes.values()) if has_bytes else None))
    return rows


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def op_table_markdown(rows: Sequence[OpRow]) -> str:
    """The table as markdown (times in us, bytes in MB = 1e6 B)."""
    head = ("| op | tasks | busy us | us/task | busiest SM us | step us | wait us | wgt wait us | prod lead us "
            "| MB | GB/s | % of 4.8 TB/s | % of 4.26 TB/s |")
    out = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        op = f"**{r.op}**" if r.op == "total" else r.op
        out.append(f"| {op} | {r.tasks} | {r.busy_us:.1f} | {r.busy_us / max(1, r.tasks):.2f} | {r.sm_max_us:.1f} "
                   f"| {r.step_us:.1f} | {r.wait_us:.1f} | {r.wgt_wait_us:.1f} | {r.prod_lead_us:.2f} "
                   f"| {_f(None if r.bytes is None else r.bytes / 1e6, '.2f')} | {_f(r.gbps, '.0f')} "
                   f"| {_f(r.pct_peak, '.1f')} | {_f(r.pct_copy, '.1f')} |")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Modelled timeline (for tests and for a measured-vs-model comparison)
# --------------------------------------------------------------------------------------------

def simulate_records(program: Program, seq_lens: Sequence[int], *, gbps: float = COPY_GBPS,
                     overhead_ns: int = 800, launch_gap_ns: int = 4000, fallback_ns: int = 10_000,
                     t0_ns: int = 1_700_000_000_000_000_000, jitter: float = 0.2, seed: int = 0,
                     clock_ghz: float = DEFAULT_CLOCK_GHZ) -> list[dict]:
    """Records (trace_records' format, same order: segment by segment, queue-major) of a modelled
    step: SM s runs its queue in order; a task starts when its SM is free, is ready once every
    task signalling a counter it waits on has ended, and computes for overhead_ns + its own bytes
    (weight + kv + act) at gbps / num_sms, times 1 + U(0, jitter). Segments follow one another
    after launch_gap_ns (+ fallback_ns per Triton fallback op in between). The producer issues a
    task's weights from max(its previous issue end, the previous task's start) to 90% of its end."""
    rng = random.Random(seed)
    lens = _padded_seq_lens(program, seq_lens)
    per_sm_bps = gbps / program.num_sms          # bytes per ns of one SM
    t = t0_ns
    out: list[dict] = []
    for step in program.steps:
        if isinstance(step, FallbackStep):
            t += fallback_ns
            continue
        assert isinstance(step, Segment)
        sm_of = {i: s for s, q in enumerate(step.queues) for i in q}
        free = [t] * program.num_sms
        prod_free = [t] * program.num_sms
        last_start = [t] * program.num_sms
        done: dict[int, int] = defaultdict(int)      # counter -> latest end of its signallers
        rec: dict[int, dict] = {}
        for i in sorted(range(len(step.tasks)), key=lambda k: step.tasks[k].tid):
            task, s = step.tasks[i], sm_of[i]
            tb = task_bytes(program.spec, task, program.batch, lens, program.attn_chunks)
            start = free[s]
            ready = max([start] + [done[c] for c, _ in step.waits[i]])
            dur = int((overhead_ns + (tb.weight + tb.kv + tb.act) / per_sm_bps) * (1 + rng.uniform(0, jitter)))
            end = ready + dur
            pf = pl = 0
            if tb.weight and task.opcode != Opcode.FINAL_NORM:
                pf = max(prod_free[s], last_start[s])
                pl = max(pf, ready + (end - ready) * 9 // 10)
                prod_free[s] = pl
            free[s], last_start[s] = end, start
            if task.signal is not None:
                done[task.signal[0]] = max(done[task.signal[0]], end)
            rec[i] = {"tid": task.tid, "op": task.op.key, **dict.fromkeys(TRACE_FIELDS, 0),
                      "start": start, "ready": ready, "end": end,
                      "prod_first": pf, "prod_last": pl,
                      "wait_cycles": int(0.1 * (end - ready) * clock_ghz) if pf else 0,
                      "sm": s, "opcode": int(task.opcode)}
        out += [rec[i] for q in step.queues for i in q]
        t = max(free) + launch_gap_ns
    return out
