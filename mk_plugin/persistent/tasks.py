"""Split each fused op of the decode step into tasks, and express their dependencies as counters.

Units. Every linear op's output is cut into units of 16 columns (one m16 MMA tile of weight rows,
two for gate_up):
- qkv_rope: unit (head, s) = the 8 rows s*8..s*8+7 of the head's first half plus the matching 8
  rows of its second half, so RoPE's pairs (j, j + d/2) sit in one tile (rows r and r+8). Units are
  numbered group-major: for kv group g, q heads g*G..g*G+G-1, then k head g, then v head g, each
  with d/16 units, so the units a group's attention reads are one contiguous range.
- gate_up: unit u = gate rows [16u, 16u+16) and up rows [I+16u, I+16u+16) (act columns 16u..).
- o_proj, down, lm_head: unit u = weight rows [16u, 16u+16) (lm_head's last unit may be partial).
- final_norm: unit u = output columns [16u, 16u+16) (no weight matrix).
A task covers a contiguous range of units; each op is split into about one task per SM.

Attention: one partial task per (request b, kv head g, chunk c), c < C chunks chosen so that
B * nkv * C covers the SMs; chunk c of a request with L tokens covers tokens
[min(L, c*cs), min(L, (c+1)*cs)) with cs = ceil(L / C) (read from seq_lens at run time). With C > 1
one combine task per (b, g) merges the chunks; with C == 1 the partial writes ATTN_O directly. With
tuning.merge_in_partial there is no combine task: each partial, once its chunk is stored, increments a
ticket counter of (b, g) (counters[ticket] is never waited on), and the one that brings it to C merges
the C chunks in fixed order into ATTN_O before it signals attn[l] (target B * nkv * C): the counter's
final value then implies every merge is done. The merge is the combine task's arithmetic, so the output
is the same bit for bit whichever chunk is last.

Dependencies are monotonic uint32 counters in global memory. A task waits until counter >= target
and, once its stores are visible, adds signal_add to its signal counter. Every target equals the
counter's final value (all the producing tasks have finished), so "wait" means "after all writers":
- qkv_rope of layer l waits on down(l-1) (all units: rms_norm reads the whole row);
  each qkv task signals its group's counter qkv[l][g] with its unit count (target: units of group).
- attention partial (b, g, c) waits on qkv[l][g] only: the q heads of group g and K/V head g are
  the only tiles it reads (tile granularity). It signals part[l][b][g] (target C), or attn[l] when
  C == 1. combine (b, g) waits on part[l][b][g] and signals attn[l] (target B * nkv).
- o_proj waits on attn[l] (it reads all heads); gate_up on o_proj[l] (rms_norm reads the row);
  down on gate_up[l] (the reduction reads all of ACT); final_norm on down[L-1]; lm_head on final.
- o_proj / down cut over K (tuning.ksplit, n parts): the n tasks of a unit range read K columns
  encoding.ksplit_range(K, p, n) each, store fp32 partial sums in PART_K[p] and take a ticket of the
  range (counters[ticket], never waited on); the one that brings it to n adds PART_K[0..n-1] in part order
  to the residual and stores the output before its signal. Every part signals its unit count, so the
  op's counter reaches its target only after every range's merge, as with attention's merge-in-partial.
Write-after-read reuse of Q, ATTN_O, ACT, PART_* and RESID across layers is ordered transitively
through these chains; schedule.check_ordering proves it for a program.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..spec import LlamaSpec
from .encoding import NUM_WAITS, TASK_WORDS, UNIT, Buf, Opcode, ksplit_arg, ksplit_range, wga_takes
from .graph import FusedOp, decode_graph, residual_source
from .tuning import DEFAULT_TUNING, MAX_ATTN_CHUNKS, ScheduleTuning, tuned_variant
from .variant import KernelVariant, batch_class

# Scheduling time model (ns), fitted to the first H200 trace (2026-11-30, bench/NOTES.md v1, 1B
# batch 1): a weight-streaming task costs TASK_FIXED_NS (counter wake-up, norm statistics, activation
# staging, cross-warp reduction, epilogue: a few L2 round trips) plus its weight bytes at its SM's
# share of the measured copy rate; attention tasks are latency-bound (dependent L2/HBM round trips);
# a counter release reaches a waiting SM after SIGNAL_NS. Only relative values matter: the
# scheduler (schedule.list_schedule) uses them to predict when each SM becomes free.
HBM_BYTES_PER_NS = 4260.0
TASK_FIXED_NS = 2500.0
ATTN_PARTIAL_NS = 3300.0
ATTN_COMBINE_NS = 2800.0
ATTN_MERGE_NS = 1500.0   # the last partial's ticket round trip + merge (predicted; not yet fitted to a trace)
FINAL_NORM_NS = 1500.0
KSPLIT_MERGE_NS = 1000.0  # a K-split part's ticket round trip (+ the last part's merge; predicted, not fitted)
SIGNAL_NS = 500.0

OP_OPCODE = {"qkv_rope": Opcode.QKV_ROPE, "o_proj": Opcode.O_PROJ, "gate_up": Opcode.GATE_UP,
             "down": Opcode.DOWN, "final_norm": Opcode.FINAL_NORM, "lm_head": Opcode.LM_HEAD}

# A region of a buffer touched by a task: (buffer, row_lo, row_hi, col_lo, col_hi), half-open.
# "KV<l>" regions: row = request, col = (k|v) * kv_size + head * d + dim. Used by schedule.check_ordering.
Region = tuple[str, int, int, int, int]
_NO_WAIT = (-1, 0)   # the (counter, target) words of an unused wait slot


@dataclass
class Counter:
    name: str
    producer: str          # FusedOp.key of the op whose tasks signal it
    total: int = 0         # sum of all signal_add (the value once every signaller is done)


@dataclass(slots=True)
class Task:
    tid: int               # position in the global topological order of the step
    opcode: Opcode
    op: FusedOp
    args: tuple[int, int, int]
    in_buf: Buf = Buf.NONE
    res_buf: Buf = Buf.NONE
    out_buf: Buf = Buf.NONE
    waits: list[tuple[int, int]] = field(default_factory=list)   # (counter id, target)
    signal: tuple[int, int] | None = None                       # (counter id, add)
    cost: float = 0.0      # predicted duration in ns (the time model above)
    reads: list[Region] = field(default_factory=list)
    writes: list[Region] = field(default_factory=list)
    # What only the task that completes its ticket touches, after every task of the ticket (a K-split part's
    # merge: the other parts' partials, the residual, the output); schedule.check_ordering orders them so
    merge_reads: list[Region] = field(default_factory=list)
    merge_writes: list[Region] = field(default_factory=list)
    phase: int = 0          # sub-phase within the op (attention: 0 partial, 1 combine)
    ticket: int | None = None  # merge-in-partial attention: the (b, g) ticket counter (encoding ticket_ctr)

    def record(self, waits: list[tuple[int, int]] | None = None) -> list[int]:
        """The TASK_WORDS int32 words of this task (encoding.TASK_FIELDS order)."""
        ws = self.waits if waits is None else waits
        if len(ws) > NUM_WAITS:
            raise ValueError(f"task {self.tid} has {len(ws)} waits; the record holds {NUM_WAITS}")
        rec = [int(self.opcode), self.op.layer, *self.args, int(self.in_buf), int(self.res_buf),
               int(self.out_buf)]
        for c, t in ws:
            rec += (c, t)
        rec += _NO_WAIT * (NUM_WAITS - len(ws))
        sig = self.signal or (-1, 0)
        rec += (sig[0], sig[1], self.tid, -1 if self.ticket is None else self.ticket)
        assert len(rec) == TASK_WORDS
        return rec


@dataclass
class TaskSet:
    spec: LlamaSpec
    batch: int
    num_sms: int
    attn_chunks: int
    ops: list[FusedOp]
    tasks: list[Task]                      # tid order
    counters: list[Counter]
    op_ranges: dict[str, tuple[int, int]]  # FusedOp.key -> [first tid, last tid + 1)


def attention_chunks(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Chunks per (request, kv head): as many partial tasks as fit in one wave over the SMs."""
    return max(1, min(MAX_ATTN_CHUNKS, num_sms // (batch * num_kv_heads)))


def split_units(start: int, count: int, parts: int) -> list[tuple[int, int]]:
    """[start, start+count) cut into min(parts, count) contiguous ranges of near-equal size."""
    parts = max(1, min(parts, count))
    base, extra = divmod(count, parts)
    out, s = [], start
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((s, n))
        s += n
    return out


def qkv_units_per_group(spec: LlamaSpec) -> int:
    return (spec.gqa_group + 2) * (spec.head_dim // UNIT)


def qkv_unit(spec: LlamaSpec, u: int) -> tuple[str, int, int]:
    """Unit u of qkv_rope -> (kind 'q'|'k'|'v', head index within its kind, sub-tile s)."""
    ug = qkv_units_per_group(spec)
    g, r = divmod(u, ug)
    hl, s = divmod(r, spec.head_dim // UNIT)
    if hl < spec.gqa_group:
        return "q", g * spec.gqa_group + hl, s
    return ("k" if hl == spec.gqa_group else "v"), g, s


def qkv_unit_rows(spec: LlamaSpec, u: int) -> list[int]:
    """The 16 weight rows of qkv unit u, in MMA row order (8 first-half rows, then their pairs)."""
    kind, head, s = qkv_unit(spec, u)
    d = spec.head_dim
    row0 = {"q": head * d, "k": spec.q_size + head * d, "v": spec.q_size + spec.kv_size + head * d}[kind]
    return [row0 + s * 8 + i for i in range(8)] + [row0 + d // 2 + s * 8 + i for i in range(8)]


def qkv_unit_dims(spec: LlamaSpec, u: int) -> list[int]:
    """Head dims (0..d-1) of the 16 rows of qkv unit u, in MMA row order."""
    _, _, s = qkv_unit(spec, u)
    d = spec.head_dim
    return [s * 8 + i for i in range(8)] + [d // 2 + s * 8 + i for i in range(8)]


def op_units(spec: LlamaSpec, name: str) -> int:
    return {
        "qkv_rope": spec.num_kv_heads * qkv_units_per_group(spec),
        "o_proj": spec.hidden_size // UNIT,
        "gate_up": spec.intermediate_size // UNIT,
        "down": spec.hidden_size // UNIT,
        "final_norm": spec.hidden_size // UNIT,
        "lm_head": -(-spec.vocab_size // UNIT),
    }[name]


def weight_k(spec: LlamaSpec, name: str) -> int:
    """Reduction length K of the op's weight matrix (0: no matrix)."""
    return {"qkv_rope": spec.hidden_size, "o_proj": spec.q_size, "gate_up": spec.hidden_size,
            "down": spec.intermediate_size, "lm_head": spec.hidden_size, "final_norm": 0}[name]


def unit_weight_bytes(spec: LlamaSpec, name: str) -> int:
    el = 2 if spec.dtype in ("bfloat16", "float16") else 4
    rows = 2 * UNIT if name == "gate_up" else UNIT
    return rows * weight_k(spec, name) * el


MATVEC_OPS = ("qkv_rope", "o_proj", "gate_up", "down", "lm_head")
NORM_FUSED_OPS = ("qkv_rope", "gate_up")   # csrc/megakernel.cu norm_weight: these ops' x is staged with a weight row


def task_k_widths(spec: LlamaSpec, tuning: ScheduleTuning, *, lm_head: bool = True) -> dict[str, set[int]]:
    """The reduction widths of each matvec op's tasks under `tuning`, as csrc/megakernel.cu matvec_dispatch sees them:
    the op's own K (weight_k), or a K-split task's part of it (ksplit_range over tuning.ksplit_for(op) parts)."""
    out = {}
    for op in MATVEC_OPS:
        if op == "lm_head" and not lm_head:
            continue
        k, parts = weight_k(spec, op), tuning.ksplit_for(op)
        out[op] = {hi - lo for lo, hi in (ksplit_range(k, p, parts) for p in range(parts))}
    return out


def class_build(base: KernelVariant, spec: LlamaSpec, tuning: ScheduleTuning, batch: int, *, lm_head: bool,
                att_tma_ok: bool = True, auto: bool = True) -> KernelVariant:
    """The build that runs `batch` tokens' program under `tuning` (MegakernelDecoder.variant_for): `base` with the
    tuning's knobs (tuning.tuned_variant) in batch's class (KernelVariant.for_batch), its MK_WGA_ONLY / MK_X_WHOLE
    dropped where a task does not qualify, and with `auto` (MegakernelDecoder's class_builds) and neither ntiles nor
    x_groups set, the build of batch's class with MK_X_WHOLE where every task stages its x whole (csrc/x_frags.cuh
    staged_fits) or MK_WGA_ONLY where every task takes the wgmma path (encoding.wga_takes): the same program bit for
    bit, with the path no task takes compiled out."""
    v = tuned_variant(base, tuning, att_tma_ok=att_tma_ok).for_batch(batch)
    auto = auto and not (v.ntiles or v.x_groups)
    if not (v.wga_only or v.x_whole or auto):
        return v
    widths = task_k_widths(spec, tuning, lm_head=lm_head)
    wga = bool(v.wgmma_a) and all(wga_takes(w, batch) for ws in widths.values() for w in ws)
    if v.wga_only and not wga:
        v = replace(v, wga_only=False)   # a task whose chunks are not whole keeps the default path
    whole = all(v.layout.staged_fits(w, batch, op in NORM_FUSED_OPS) for op, ws in widths.items() for w in ws)
    if v.x_whole and not whole:
        v = replace(v, x_whole=False)    # a task whose x does not fit keeps the column groups
    if auto and (whole or wga):
        # session 50 (H100, the H200 table's programs, bench/NOTES.md): MK_X_WHOLE -2.8% at 1B batch 1 and -1.2% at 8B
        # batch 1; MK_WGA_ONLY -0.3..-1.6% at 1B / 8B batch 10 / 12 / 16, faster in each of 18 paired rounds; MK_NTILES
        # alone +-0.5%. (With every task on the wgmma path no task stages x: x_whole is moot there.)
        v = replace(v, ntiles=batch_class(batch), x_whole=whole and not wga, wga_only=wga)
    return v


def matvec_ns(spec: LlamaSpec, name: str, units: int, num_sms: int) -> float:
    """Predicted duration of a weight-streaming task of `units` units (the time model above)."""
    return TASK_FIXED_NS + units * unit_weight_bytes(spec, name) / (HBM_BYTES_PER_NS / num_sms)


def gate_up_pieces(spec: LlamaSpec, tuning: ScheduleTuning) -> list[tuple[int, int]]:
    """tuning.piece_deps with down cut over K in n > 1 parts: gate_up's units cut at the parts' K boundaries,
    [(first unit, units)] per part (ksplit_range's boundaries are multiples of 16 columns: whole units); else [].
    Each piece signals its own counter and down's part p waits for piece p only, so the parts whose ACT columns
    are done start while the rest of gate_up still runs."""
    n = tuning.ksplit_for("down")
    if not tuning.piece_deps or n == 1:
        return []
    out = []
    for p in range(n):
        lo, hi = ksplit_range(spec.intermediate_size, p, n)
        out.append((lo // UNIT, (hi - lo) // UNIT))
    return out if all(u > 0 for _, u in out) else []


def _row_op(spec: LlamaSpec, op: FusedOp) -> tuple[Buf, int, Buf, Buf, str]:
    """An op over output units whose tasks read a whole input row and maybe the residual columns
    they add to: (input buffer, its width, residual buffer, output buffer, the counter it waits on)."""
    L, h = op.layer, spec.hidden_size
    return {
        "o_proj": (Buf.ATTN_O, spec.q_size, residual_source(L), Buf.RESID, f"L{L}.attn"),
        "gate_up": (Buf.RESID, h, Buf.NONE, Buf.ACT, f"L{L}.o_proj"),
        "down": (Buf.ACT, spec.intermediate_size, Buf.RESID, Buf.RESID, f"L{L}.gate_up"),
        "final_norm": (Buf.RESID, h, Buf.NONE, Buf.OUT, f"L{spec.num_layers - 1}.down"),
        "lm_head": (Buf.OUT, h, Buf.NONE, Buf.LOGITS, "final_norm"),
    }[op.name]


class _Builder:
    """Tasks and counters of one step, in tid order. Waits are kept as counter ids and given their targets
    (the counters' totals) once every task exists (finish). Region tuples are immutable and shared between
    tasks where equal; every task gets its own lists."""

    def __init__(self, spec: LlamaSpec, batch: int, num_sms: int):
        self.spec, self.batch, self.num_sms = spec, batch, num_sms
        self.tasks: list[Task] = []
        self.counters: list[Counter] = []
        self.by_name: dict[str, int] = {}
        self.totals: list[int] = []              # per counter, the sum of its signallers' adds so far
        self.wait_ids: list[tuple[int, ...]] = []  # per task, the counters it waits on
        self._costs: dict[tuple[str, int], float] = {}

    def counter(self, name: str, producer: str) -> int:
        if name not in self.by_name:
            self.by_name[name] = len(self.counters)
            self.counters.append(Counter(name, producer))
            self.totals.append(0)
        return self.by_name[name]

    def ids(self, *names: str) -> tuple[int, ...]:
        """The ids of existing counters (those an op waits on: made by earlier ops)."""
        return tuple(self.by_name[n] for n in names)

    def add(self, task: Task, wait_ids: tuple[int, ...]) -> None:
        """Append `task` as the next tid; it waits on counters `wait_ids` (targets: finish)."""
        task.tid = len(self.tasks)
        if task.signal is not None:
            self.totals[task.signal[0]] += task.signal[1]
        self.tasks.append(task)
        self.wait_ids.append(wait_ids)

    def matvec_cost(self, name: str, units: int) -> float:
        """matvec_ns, computed once per (op, units): an op's tasks take one or two unit counts."""
        key = (name, units)
        c = self._costs.get(key)
        if c is None:
            c = self._costs[key] = matvec_ns(self.spec, name, units, self.num_sms)
        return c

    def finish(self) -> None:
        """Counter totals and every task's (counter, target) waits, once all signallers exist."""
        for c, total in zip(self.counters, self.totals):
            c.total = total
        totals = self.totals
        for t, ids in zip(self.tasks, self.wait_ids):
            t.waits = [(i, totals[i]) for i in ids]


def _qkv_unit_cols(spec: LlamaSpec) -> list[tuple[bool, int, int]]:
    """Per qkv unit: (writes Q, else the layer's KV), and the first columns of its two 8-column pieces
    (Q columns, or KV<l> columns: (k|v) * kv_size + head * d + dim)."""
    d = spec.head_dim
    out = []
    for u in range(op_units(spec, "qkv_rope")):
        kind, head, s = qkv_unit(spec, u)
        base = head * d if kind == "q" else (0 if kind == "k" else spec.kv_size) + head * d
        out.append((kind == "q", base + s * 8, base + d // 2 + s * 8))
    return out


def _qkv_tasks(bld: _Builder, op: FusedOp, tuning: ScheduleTuning, unit_cols: list[tuple[bool, int, int]]) -> None:
    spec, B, L = bld.spec, bld.batch, op.layer
    nkv, ug = spec.num_kv_heads, qkv_units_per_group(spec)
    per_group = max(1, round(tuning.tasks_for(op.name, bld.num_sms) / nkv))
    src = residual_source(L)
    kv = f"KV{L}"
    unit_writes = [((("Q" if q else kv), 0, B, a, a + 8), (("Q" if q else kv), 0, B, b, b + 8)) for q, a, b in unit_cols]
    read = (src.name, 0, B, 0, spec.hidden_size)
    waits_on = bld.ids(f"L{L - 1}.down") if L > 0 else ()
    for g in range(nkv):
        ctr = bld.counter(f"L{L}.qkv.g{g}", op.key)
        for u0, n in split_units(g * ug, ug, per_group):
            writes: list[Region] = []
            for pair in unit_writes[u0:u0 + n]:
                writes.extend(pair)
            bld.add(Task(0, Opcode.QKV_ROPE, op, (u0, n, 0), src, Buf.NONE, Buf.Q, [], (ctr, n),
                         bld.matvec_cost(op.name, n), [read], writes, [], []), waits_on)


def _attention_tasks(bld: _Builder, op: FusedOp, tuning: ScheduleTuning, C: int) -> None:
    spec, B, L = bld.spec, bld.batch, op.layer
    G, d, nkv = spec.gqa_group, spec.head_dim, spec.num_kv_heads
    merge = C > 1 and tuning.merge_in_partial
    # C == 1 and merge-in-partial write ATTN_O (the latter: whichever chunk finishes last, after reading
    # every chunk's partial) and signal attn[l]; else PART and part[l][b][g]
    to_o = C == 1 or merge
    out_buf = Buf.ATTN_O if to_o else Buf.PART_O
    cost = ATTN_PARTIAL_NS + (ATTN_MERGE_NS if merge else 0.0)
    kv = f"KV{L}"
    for b in range(B):
        for g in range(nkv):
            ticket = bld.counter(f"L{L}.ticket.b{b}.g{g}", op.key) if merge else None
            sig = (bld.counter(f"L{L}.attn" if to_o else f"L{L}.part.b{b}.g{g}", op.key), 1)
            o_region = ("ATTN_O", b, b + 1, g * G * d, (g + 1) * G * d)
            reads = [("Q", b, b + 1, g * G * d, (g + 1) * G * d), (kv, b, b + 1, g * d, (g + 1) * d),
                     (kv, b, b + 1, spec.kv_size + g * d, spec.kv_size + (g + 1) * d)]
            if merge:
                reads.append(("PART", b, b + 1, g * C, (g + 1) * C))
            waits_on = bld.ids(f"L{L}.qkv.g{g}")
            for c in range(C):
                w = [] if C == 1 else [("PART", b, b + 1, g * C + c, g * C + c + 1)]
                if to_o:
                    w.append(o_region)
                bld.add(Task(0, Opcode.ATTN_PARTIAL, op, (b, g, c), Buf.Q, Buf.NONE, out_buf, [], sig, cost,
                             list(reads), w, [], [], 0, ticket), waits_on)
    if C > 1 and not merge:
        for b in range(B):
            for g in range(nkv):
                bld.add(Task(0, Opcode.ATTN_COMBINE, op, (b, g, 0), Buf.PART_O, Buf.NONE, Buf.ATTN_O, [],
                             (bld.counter(f"L{L}.attn", op.key), 1), ATTN_COMBINE_NS,
                             [("PART", b, b + 1, g * C, (g + 1) * C)],
                             [("ATTN_O", b, b + 1, g * G * d, (g + 1) * G * d)], [], [], 1), bld.ids(f"L{L}.part.b{b}.g{g}"))


def _row_tasks(bld: _Builder, op: FusedOp, tuning: ScheduleTuning) -> None:
    spec, B, L, name = bld.spec, bld.batch, op.layer, op.name
    in_buf, in_width, res_buf, out_buf, dep = _row_op(spec, op)
    units = op_units(spec, name)
    parts = bld.num_sms if name == "final_norm" else tuning.tasks_for(name, bld.num_sms)
    ks = tuning.ksplit_for(name)   # > 1: each unit range cut into ks tasks over K (KSPLIT_OPS only)
    # (counter, unit ranges) per piece: one piece (the op's counter) unless tuning.piece_deps cuts gate_up
    # at down's K parts, each piece with its counter, so down's part p waits for piece p only
    pieces = [(bld.counter(f"{op.key}.p{i}", op.key), split_units(lo, n, max(1, round(parts * n / units))))
              for i, (lo, n) in enumerate(gate_up_pieces(spec, tuning))] if name == "gate_up" else []
    if not pieces:
        ctr = bld.counter(op.key, op.key)
        pieces = [(ctr, split_units(0, units, max(1, round(parts / ks))))]
    # down's part p reads ACT columns [klo, khi): gate_up's piece p wrote exactly those
    piece_dep = name == "down" and bool(gate_up_pieces(spec, tuning))
    waits_on = [bld.ids(f"{dep}.p{p}" if piece_dep else dep) for p in range(ks)]
    kranges = [ksplit_range(in_width, p, ks) if ks > 1 else (0, in_width) for p in range(ks)]
    opcode, in_name, res_name, out_name = OP_OPCODE[name], in_buf.name, res_buf.name, out_buf.name
    col_end = spec.vocab_size if name == "lm_head" else 1 << 30
    for ctr, u0, n in [(c, u0, n) for c, rs in pieces for u0, n in rs]:
        c0, c1 = u0 * UNIT, min((u0 + n) * UNIT, col_end)
        ticket = bld.counter(f"L{L}.{name}.ticket.u{u0}", op.key) if ks > 1 else None
        cost = FINAL_NORM_NS if name == "final_norm" else bld.matvec_cost(name, n)
        out_read = (res_name, 0, B, c0, c1) if res_buf is not Buf.NONE else None
        out_write = (out_name, 0, B, c0, c1)
        if ks > 1:   # PART_K regions: row = part, col = output column (all requests)
            # a part stores its partial; the residual and the output are the merge's (the last part)
            cost = TASK_FIXED_NS + (cost - TASK_FIXED_NS) / ks + KSPLIT_MERGE_NS
            merge_read = ("PART_K", 0, ks, c0, c1)
        for p in range(ks):
            read = (in_name, 0, B, *kranges[p])
            if ks > 1:
                t = Task(0, opcode, op, (u0, n, ksplit_arg(p, ks)), in_buf, res_buf, out_buf, [], (ctr, n), cost,
                         [read], [("PART_K", p, p + 1, c0, c1)],
                         [merge_read] if out_read is None else [merge_read, out_read], [out_write], 0, ticket)
            else:
                t = Task(0, opcode, op, (u0, n, 0), in_buf, res_buf, out_buf, [], (ctr, n), cost,
                         [read] if out_read is None else [read, out_read], [out_write], [], [], 0, ticket)
            bld.add(t, waits_on[p])


def build_tasks(spec: LlamaSpec, batch: int, num_sms: int, lm_head: bool = False,
                tuning: ScheduleTuning = DEFAULT_TUNING) -> TaskSet:
    """Every task of one decode step of `batch` tokens for a GPU with `num_sms` SMs, in a global
    topological order (tid), with counters and targets. Waits are filled in after all counters
    exist (targets are the counters' totals). `tuning` sets the tasks per op and the attention
    chunks (tuning.py); the default is about one task per SM and one wave of partials."""
    if not 1 <= batch <= 16:
        raise ValueError(f"batch={batch}; the megakernel supports 1..16 decode tokens")
    if num_sms < 1:
        raise ValueError(f"num_sms={num_sms} must be >= 1")
    bld = _Builder(spec, batch, num_sms)
    ops = decode_graph(spec, lm_head)
    C = tuning.attn_chunks or attention_chunks(batch, spec.num_kv_heads, num_sms)
    unit_cols = _qkv_unit_cols(spec)
    op_ranges: dict[str, tuple[int, int]] = {}
    for op in ops:
        first = len(bld.tasks)
        if op.name == "qkv_rope":
            _qkv_tasks(bld, op, tuning, unit_cols)
        elif op.name == "attention":
            _attention_tasks(bld, op, tuning, C)
        else:
            _row_tasks(bld, op, tuning)
        op_ranges[op.key] = (first, len(bld.tasks))
    bld.finish()
    return TaskSet(spec, batch, num_sms, C, ops, bld.tasks, bld.counters, op_ranges)
