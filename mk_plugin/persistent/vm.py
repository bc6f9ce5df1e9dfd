"""CPU interpreter of the encoded megakernel program, and the deadlock checker.

The VM decodes the same int32 arrays the GPU receives (encoding.decode), keeps the counters, and
interleaves the per-SM queues: it repeatedly picks a queue whose head task has all its waits
satisfied (round-robin, or at random with a seed), runs that task with torch ops (one function per
opcode, mirroring csrc/ including where results are rounded to the activation dtype), and adds the
task's signal to its counter. If no queue head can run before all tasks are done, the program would
deadlock on the GPU: DeadlockError names the stuck heads and what they wait for.

`check_deadlock_free` runs the same scheduler without numerics (fast enough for Llama-3.1-8B
programs). `run(..., stop_after=N)` runs only tasks with tid < N (Program.prefix) and returns the
state, whose buffers can be compared with the GPU running the same prefix (bisection).
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..spec import LlamaSpec
from ..weights import ModelWeights
from .encoding import (
    TASK_FIELDS,
    Buf,
    DecodedProgram,
    Opcode,
    Rounding,
    decode,
    ksplit_parts,
    ksplit_range,
    wga_takes,
)
from .graph import FusedOp
from .schedule import FallbackStep, Program, Segment
from .tasks import UNIT, qkv_unit, qkv_unit_dims, qkv_unit_rows
from .tuning import KSPLIT_MAX
from .variant import KernelVariant


class DeadlockError(RuntimeError):
    """No queue head can run, yet tasks remain: the GPU would hang on this program."""


def schedule_order(dp: DecodedProgram, counters: list[int], *, order: str = "round_robin",
                   seed: int = 0) -> Iterator[tuple[int, dict[str, int]]]:
    """Yield (queue, task record) in an order the GPU could run them: a task is yielded only when
    counters[ctr] >= target for each of its waits. The caller must apply the task's signal to
    `counters` before asking for the next task (run_segment and check_deadlock_free do)."""
    nq = len(dp.queues)
    pos = [0] * nq
    waiting: dict[int, list[int]] = {}      # counter -> queues whose head waits on it
    ready: deque[int] = deque()
    rng = random.Random(seed)

    def blocked_on(qi: int) -> int | None:
        t = dp.queues[qi][pos[qi]]
        for k in ("wait0", "wait1"):
            c, target = t[f"{k}_ctr"], t[f"{k}_target"]
            if c >= 0 and counters[c] < target:
                return c
        return None

    def consider(qi: int) -> None:
        if pos[qi] >= len(dp.queues[qi]):
            return
        c = blocked_on(qi)
        if c is None:
            ready.append(qi)
        else:
            waiting.setdefault(c, []).append(qi)

    for qi in range(nq):
        consider(qi)
    done, total = 0, dp.num_tasks
    while done < total:
        if not ready:
            stuck = []
            for qi in range(nq):
                if pos[qi] < len(dp.queues[qi]):
                    t = dp.queues[qi][pos[qi]]
                    stuck.append(f"queue {qi} head tid {t['tid']} op {Opcode(t['opcode']).name} waits "
                                 f"ctr {t['wait0_ctr']}>={t['wait0_target']} (is {counters[t['wait0_ctr']] if t['wait0_ctr'] >= 0 else '-'})"
                                 f", ctr {t['wait1_ctr']}>={t['wait1_target']}")
            raise DeadlockError(f"deadlock after {done}/{total} tasks; stuck heads:\n" + "\n".join(stuck[:20]))
        if order == "random":
            i = rng.randrange(len(ready))
            ready[i], ready[-1] = ready[-1], ready[i]
            qi = ready.pop()
        else:
            qi = ready.popleft()
        t = dp.queues[qi][pos[qi]]
        yield qi, t   # the caller applies t's signal to `counters` before resuming
        done += 1
        pos[qi] += 1
        consider(qi)
        sc = t["signal_ctr"]
        if sc >= 0 and sc in waiting:
            for wq in waiting.pop(sc):
                consider(wq)


@dataclass
class DeadlockReport:
    tasks: int
    max_counter: dict[int, int] = field(default_factory=dict)


def check_deadlock_free(program: Program) -> list[DeadlockReport]:
    """Simulate every segment of `program` (no numerics). Raises DeadlockError if some wait can never
    be satisfied; also checks every wait's target is reachable (<= the counter's total) and that
    each queue is in tid (topological) order."""
    reports = []
    for seg in program.segments:
        dp = decode(seg.encoded)
        for q in dp.queues:
            tids = [t["tid"] for t in q]
            if tids != sorted(tids):
                raise DeadlockError("a queue is not in topological (tid) order")
            for t in q:
                for k in ("wait0", "wait1"):
                    c = t[f"{k}_ctr"]
                    if c >= 0 and t[f"{k}_target"] > program.counters[c].total:
                        raise DeadlockError(f"task {t['tid']} waits for counter {c} >= {t[f'{k}_target']} "
                                            f"but its signals add up to {program.counters[c].total}")
        counters = [0] * program.num_counters
        n = 0
        for _, t in schedule_order(dp, counters):
            if t["signal_ctr"] >= 0:
                counters[t["signal_ctr"]] += t["signal_add"]
            n += 1
        reports.append(DeadlockReport(n))
    return reports


# --------------------------------------------------------------------------------------------
# Numerics
# --------------------------------------------------------------------------------------------

@dataclass
class VMState:
    """Everything a step reads and writes. Activation buffers are in the model dtype (fp32 for an
    fp32 run); PART_O / PART_ML are fp32. kv_caches are modified in place."""
    spec: LlamaSpec
    batch: int
    attn_chunks: int
    weights: ModelWeights
    bufs: dict[Buf, torch.Tensor]
    kv_caches: list[torch.Tensor]
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    cos_sin: torch.Tensor
    counters: list[int]
    executed: list[int] = field(default_factory=list)   # tids in execution order
    # the build the GPU runs for this batch (decoder.variant_for): the VM rounds where it rounds. Read here: its
    # rounding points (MK_ROUNDING), MK_ATT_TMA (attention tasks of >= att_tma tokens take the ring), MK_RSTD_EPI
    # (1/rms in the epilogue of norm-fused ops not staged whole) and the ring depth (what fits the scratch)
    variant: KernelVariant = field(default_factory=KernelVariant)

    @property
    def dtype(self) -> torch.dtype:
        return self.bufs[Buf.RESID].dtype

    @property
    def rounding(self) -> Rounding:
        return self.variant.rounding


def make_state(program: Program, weights: ModelWeights, hidden: torch.Tensor, positions: torch.Tensor,
               kv_caches: list[torch.Tensor], block_table: torch.Tensor, seq_lens: torch.Tensor,
               slot_mapping: torch.Tensor, cos_sin: torch.Tensor, variant: KernelVariant | None = None) -> VMState:
    """Fresh buffers (poisoned with NaN, so an unwritten read shows) for one VM step. variant: the build the GPU runs
    for this batch (decoder.variant_for(batch); default: the default build), so that the VM rounds where it rounds."""
    spec, b, C = program.spec, program.batch, program.attn_chunks
    dt, dev = hidden.dtype, hidden.device
    if hidden.shape != (b, spec.hidden_size):
        raise ValueError(f"hidden has shape {tuple(hidden.shape)}, the program is for ({b}, {spec.hidden_size})")

    def buf(n: int, dtype: torch.dtype = dt, *shape: int) -> torch.Tensor:
        return torch.full((b, *(shape or (n,))), float("nan"), dtype=dtype, device=dev)

    G, d, nkv = spec.gqa_group, spec.head_dim, spec.num_kv_heads
    bufs = {
        Buf.HIDDEN_IN: hidden,
        Buf.RESID: buf(spec.hidden_size),
        Buf.Q: buf(spec.q_size),
        Buf.ATTN_O: buf(spec.q_size),
        Buf.ACT: buf(spec.intermediate_size),
        Buf.OUT: buf(spec.hidden_size),
        Buf.LOGITS: buf(spec.vocab_size, torch.float32),
        Buf.PART_O: buf(0, torch.float32, nkv, C, G, d),
        Buf.PART_ML: buf(0, torch.float32, nkv, C, G, 2),
        Buf.PART_K: torch.full((KSPLIT_MAX, b, spec.hidden_size), float("nan"), dtype=torch.float32, device=dev),
    }
    return VMState(spec, b, C, weights, bufs, kv_caches, positions, slot_mapping, seq_lens, block_table,
                   cos_sin, [0] * program.num_counters, variant=variant or KernelVariant())


def _rnd(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """Round fp32 to the activation dtype (round to nearest even) and back: the kernel's stores."""
    return x.to(dt).float()


def _stock_rnd(st: VMState, x: torch.Tensor) -> torch.Tensor:
    """csrc stock_rnd: a value vLLM stores in the activation dtype, rounded under STOCK rounding."""
    return _rnd(x, st.dtype) if st.rounding == Rounding.STOCK else x


def _norm_elem(st: VMState, x: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """csrc norm_elem: x * rstd * w before its store; STOCK rounds x * rstd first."""
    return _stock_rnd(st, x * rstd) * w


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return torch.rsqrt(xf.pow(2).mean(-1) + eps)


def _normed(st: VMState, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The MMA's B operand of a norm-fused linear: round((x * rstd) * w) to the activation dtype."""
    r = _rstd(x, st.spec.rms_eps)
    return _rnd(_norm_elem(st, x.float(), r[:, None], w.float()[None, :]), st.dtype)


def _epi_rstd(st: VMState, x: torch.Tensor) -> bool:
    """Whether the kernel scales a norm-fused op's sums by 1/rms in the epilogue: MK_RSTD_EPI where x is not staged
    whole (the column-group path), MK_WGA_X where the task takes MK_WGMMA_A's path."""
    v, (b, k) = st.variant, x.shape
    if v.wgmma_a and v.wga_x and wga_takes(k, b):
        return True
    return v.rstd_epi and not v.stages_x_whole(k, b, True)


def _norm_operand(st: VMState, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A norm-fused linear's B operand and the per-token factor its sums take after the MMAs (None: none): where the
    kernel takes rstd in the epilogue (_epi_rstd), round(x * w) and 1/rms (csrc/matvec.cuh, matvec_wgmma_a.cuh: the
    epilogue scales the accumulators), else _normed's round(x * rstd * w)."""
    if _epi_rstd(st, x):
        return _rnd(x.float() * w.float()[None, :], st.dtype), _rstd(x, st.spec.rms_eps)[:, None]
    return _normed(st, x, w), None


def _scaled(y: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return y if scale is None else y * scale


def op_qkv_rope(st: VMState, t: dict[str, int]) -> None:
    spec, dt = st.spec, st.dtype
    lw = st.weights.layers[t["layer"]]
    xn, scale = _norm_operand(st, st.bufs[Buf(t["in_buf"])], lw.input_norm)
    d, half = spec.head_dim, spec.head_dim // 2
    pos = st.positions.long().clamp(0, st.cos_sin.shape[0] - 1)
    cs = st.cos_sin.float()[pos]                      # [B, d]
    cache = st.kv_caches[t["layer"]]
    bs = cache.shape[2]
    for u in range(t["arg0"], t["arg0"] + t["arg1"]):
        kind, head, s = qkv_unit(spec, u)
        y = _stock_rnd(st, _scaled(xn @ lw.qkv[qkv_unit_rows(spec, u)].float().t(), scale))   # [B, 16]
        dims = qkv_unit_dims(spec, u)
        if kind in ("q", "k"):
            cos, sin = cs[:, s * 8: s * 8 + 8], cs[:, half + s * 8: half + s * 8 + 8]
            y1, y2 = y[:, :8], y[:, 8:]
            y = torch.cat([y1 * cos - y2 * sin, y2 * cos + y1 * sin], dim=1)
        if kind == "q":
            st.bufs[Buf.Q][:, [head * d + j for j in dims]] = y.to(dt)
        else:
            kv = 0 if kind == "k" else 1
            for b, slot in enumerate(st.slot_mapping.tolist()):
                if slot >= 0:
                    cache[slot // bs, kv, slot % bs, head, dims] = y[b].to(cache.dtype)


def _chunk(L: int, C: int, c: int) -> tuple[int, int]:
    """Tokens [lo, hi) of chunk c of a request with L cached tokens (the kernel's rule)."""
    if L <= 0:
        return 0, 0
    cs = -(-L // C)
    lo = min(L, c * cs)
    return lo, min(L, lo + cs)


RING_ROWS = 16   # csrc/attention_tma.cuh ATT_TMA_ROWS: a ring slot holds whole 16-token blocks from the task's first
RING_GROUP = 8   # csrc/attention_ring_mma.cuh: tokens per group, groups g of a slot go to warp g % 8 (CONSUMER_WARPS)
RING_BLOCK = 16  # AM_BLOCK (head_dim <= 64): tokens per unit, the task's block u to warp u % 8
RING_WARPS = 8   # CONSUMER_WARPS


def ring_unit(head_dim: int) -> int:
    """Tokens a warp of the ring-fed attention takes at a time: csrc/attention_ring_mma.cuh AM_BLOCK (16-token blocks
    at head_dim <= 64, 8-token groups above)."""
    return RING_BLOCK if head_dim <= 64 else RING_GROUP


def ring_pv_weights(s: torch.Tensor, lo: int, dt: torch.dtype, unit: int = RING_GROUP) -> torch.Tensor:
    """The weights P V uses on the ring's tensor cores (csrc/attention_ring_mma.cuh), scaled to the task's maximum:
    round_dt(exp(s_j - m_n)) * exp(m_n - max(s)), where m_n is the running maximum of the warp that takes token j's
    unit (8-token group, or 16-token block at head_dim <= 64), up to and including that unit. s: [G, T] scores of
    tokens lo .. lo + T - 1.

    The kernel's warps each keep an online softmax over their units (windows of `unit` tokens counted from the task's
    first 16-token block; unit n goes to warp n % 8, and warp w's units come in order n = w, w + 8, ...: every slot is
    a multiple of 8 groups, and 16-token blocks are counted across slots) and round P to 16 bits for the MMA relative to
    that warp's running maximum; the row sums l use the unrounded P, so only O differs from exp(s - max) V."""
    G, T = s.shape
    tok = torch.arange(lo, lo + T, device=s.device)
    gidx = (tok - lo // RING_ROWS * RING_ROWS) // unit   # [T]
    ng = -(-(int(gidx[-1]) + 1) // RING_WARPS) * RING_WARPS   # padded to whole rows of 8 warps
    gm = torch.full((G, ng), float("-inf"), dtype=s.dtype, device=s.device).scatter_reduce(
        1, gidx.expand(G, T), s, "amax")
    run = gm.view(G, ng // RING_WARPS, RING_WARPS).cummax(1).values.reshape(G, ng)   # per warp, in unit order
    mt = run[:, gidx]                                                            # [G, T]
    top = s.max(-1, keepdim=True).values
    return _rnd(torch.exp(s - mt), dt) * torch.exp(mt - top)


def op_attn_partial(st: VMState, t: dict[str, int]) -> None:
    spec = st.spec
    b, g, c = t["arg0"], t["arg1"], t["arg2"]
    G, d, C = spec.gqa_group, spec.head_dim, st.attn_chunks
    L = int(st.seq_lens[b])
    lo, hi = _chunk(L, C, c)
    q = st.bufs[Buf.Q][b, g * G * d:(g + 1) * G * d].float().view(G, d)
    if hi > lo:
        cache = st.kv_caches[t["layer"]]
        bs = cache.shape[2]
        tok = torch.arange(lo, hi)
        blocks = st.block_table[b].long()[tok // bs]
        k = cache[blocks, 0, tok % bs, g].float()        # [T, d]
        v = cache[blocks, 1, tok % bs, g].float()
        ring = bool(st.variant.att_tma) and hi - lo >= st.variant.att_tma and G <= 4   # csrc att_tma_task (G == ATT_HG)
        slot = int(st.slot_mapping[b])
        if ring and hi == L and slot >= 0:
            # the ring path reads the newest token where qkv_rope stored it (csrc/attention_tma.cuh att_newest_row)
            k[-1] = cache[slot // bs, 0, slot % bs, g].float()
            v[-1] = cache[slot // bs, 1, slot % bs, g].float()
        s = (q @ k.t()) * (d ** -0.5)                    # [G, T]
        m = s.max(-1).values
        p = torch.exp(s - m[:, None])
        l_ = p.sum(-1)
        if ring:
            # a slot of 32 KB holds 1024 / d groups: a multiple of 8 (warp = group % 8) for d in 32, 64, 128
            assert d in (32, 64, 128), f"the VM's ring model assumes head_dim 32, 64 or 128, not {d}"
            o = ring_pv_weights(s, lo, st.dtype, ring_unit(d)) @ v
        else:
            o = p @ v
    else:
        m = torch.full((G,), float("-inf"))
        l_ = torch.zeros(G)
        o = torch.zeros(G, d)
    if t["out_buf"] == Buf.ATTN_O and t["ticket_ctr"] < 0:   # C == 1: normalise and store directly
        res = torch.where(l_[:, None] > 0, o / l_.clamp_min(1e-30)[:, None], torch.zeros_like(o))
        st.bufs[Buf.ATTN_O][b, g * G * d:(g + 1) * G * d] = res.reshape(-1).to(st.dtype)
    else:
        st.bufs[Buf.PART_O][b, g, c] = o
        st.bufs[Buf.PART_ML][b, g, c, :, 0] = m
        st.bufs[Buf.PART_ML][b, g, c, :, 1] = l_
    if t["ticket_ctr"] >= 0:   # merge in the partial: whoever completes the ticket merges (fixed order)
        st.counters[t["ticket_ctr"]] += 1
        if st.counters[t["ticket_ctr"]] == C:
            op_attn_combine(st, t)


def op_attn_combine(st: VMState, t: dict[str, int]) -> None:
    spec = st.spec
    b, g = t["arg0"], t["arg1"]
    G, d = spec.gqa_group, spec.head_dim
    m = st.bufs[Buf.PART_ML][b, g, :, :, 0]      # [C, G]
    l_ = st.bufs[Buf.PART_ML][b, g, :, :, 1]
    o = st.bufs[Buf.PART_O][b, g]                # [C, G, d]
    M = m.max(0).values                          # [G]
    w = torch.where(torch.isfinite(m), torch.exp(m - torch.where(torch.isfinite(M), M, 0.0)[None]), 0.0)
    L = (l_ * w).sum(0)
    num = (o * w[:, :, None]).sum(0)
    res = torch.where(L[:, None] > 0, num / L.clamp_min(1e-30)[:, None], torch.zeros_like(num))
    st.bufs[Buf.ATTN_O][b, g * G * d:(g + 1) * G * d] = res.reshape(-1).to(st.dtype)


def _rows(t: dict[str, int], limit: int) -> slice:
    lo = t["arg0"] * UNIT
    return slice(lo, min(limit, (t["arg0"] + t["arg1"]) * UNIT))


def _residual_linear(st: VMState, t: dict[str, int], x: torch.Tensor, w: torch.Tensor) -> None:
    """o_proj / down: out[:, rows] = residual[:, rows] + x @ w[rows]^T. Cut over K (arg2 != 0): this part's
    fp32 sum over its columns goes to PART_K[part]; the part that completes the ticket adds the parts in
    part order (the kernel's ksplit_merge) and stores the output."""
    r = _rows(t, st.spec.hidden_size)
    if t["arg2"] == 0:
        y = x.float() @ w[r].float().t()
    else:
        part, parts = ksplit_parts(t["arg2"])
        lo, hi = ksplit_range(x.shape[1], part, parts)
        st.bufs[Buf.PART_K][part, :, r] = x[:, lo:hi].float() @ w[r, lo:hi].float().t()
        st.counters[t["ticket_ctr"]] += 1
        if st.counters[t["ticket_ctr"]] < parts:
            return
        y = st.bufs[Buf.PART_K][0, :, r].clone()
        for p in range(1, parts):
            y = y + st.bufs[Buf.PART_K][p, :, r]
    res = st.bufs[Buf(t["res_buf"])][:, r].float()
    st.bufs[Buf(t["out_buf"])][:, r] = (res + _stock_rnd(st, y)).to(st.dtype)


def op_o_proj(st: VMState, t: dict[str, int]) -> None:
    _residual_linear(st, t, st.bufs[Buf.ATTN_O], st.weights.layers[t["layer"]].o)


def op_gate_up(st: VMState, t: dict[str, int]) -> None:
    lw = st.weights.layers[t["layer"]]
    I = st.spec.intermediate_size
    xn, scale = _norm_operand(st, st.bufs[Buf.RESID], lw.post_norm)
    r = _rows(t, I)
    g = _stock_rnd(st, _scaled(xn @ lw.gate_up[r].float().t(), scale))
    u = _stock_rnd(st, _scaled(xn @ lw.gate_up[I + r.start: I + r.stop].float().t(), scale))
    st.bufs[Buf.ACT][:, r] = (g / (1.0 + torch.exp(-g)) * u).to(st.dtype)


def op_down(st: VMState, t: dict[str, int]) -> None:
    _residual_linear(st, t, st.bufs[Buf.ACT], st.weights.layers[t["layer"]].down)


def op_final_norm(st: VMState, t: dict[str, int]) -> None:
    x = st.bufs[Buf.RESID]
    r = _rows(t, st.spec.hidden_size)
    rstd = _rstd(x, st.spec.rms_eps)
    st.bufs[Buf.OUT][:, r] = _norm_elem(st, x[:, r].float(), rstd[:, None],
                                        st.weights.final_norm[r].float()).to(st.dtype)


def op_lm_head(st: VMState, t: dict[str, int]) -> None:
    r = _rows(t, st.spec.vocab_size)
    y = st.bufs[Buf.OUT].float() @ st.weights.lm_head[r].float().t()
    st.bufs[Buf.LOGITS][:, r] = y   # fp32 logits


OPS: dict[Opcode, Callable[[VMState, dict[str, int]], None]] = {
    Opcode.QKV_ROPE: op_qkv_rope,
    Opcode.ATTN_PARTIAL: op_attn_partial,
    Opcode.ATTN_COMBINE: op_attn_combine,
    Opcode.O_PROJ: op_o_proj,
    Opcode.GATE_UP: op_gate_up,
    Opcode.DOWN: op_down,
    Opcode.FINAL_NORM: op_final_norm,
    Opcode.LM_HEAD: op_lm_head,
}


def run_segment(seg: Segment, st: VMState, *, order: str = "round_robin", seed: int = 0) -> None:
    """Run one launch's program on the VM, honouring counters and queue order."""
    dp = decode(seg.encoded)
    if dp.header["batch"] != st.batch or dp.header["attn_chunks"] != st.attn_chunks:
        raise ValueError("program header does not match the VM state (batch / attention chunks)")
    for _, t in schedule_order(dp, st.counters, order=order, seed=seed):
        OPS[Opcode(t["opcode"])](st, t)
        st.executed.append(t["tid"])
        if t["signal_ctr"] >= 0:
            st.counters[t["signal_ctr"]] += t["signal_add"]


def run_fallback_as_tasks(program: Program, op: FusedOp, st: VMState) -> None:
    """Default fallback runner of the VM: the op's own tasks in tid order (same numerics)."""
    assert program.taskset is not None
    lo, hi = program.op_ranges[op.key]
    for task in program.taskset.tasks[lo:hi]:
        rec = task.record()
        OPS[task.opcode](st, dict(zip(TASK_FIELDS, rec)))
        st.executed.append(task.tid)


def run(program: Program, st: VMState, *, stop_after: int | None = None, order: str = "round_robin",
        seed: int = 0,
        fallback_runner: Callable[[FusedOp, VMState], None] | None = None) -> VMState:
    """Run the whole program (every segment, fallback ops in between) on the VM and return the
    state. stop_after=N runs only tasks with tid < N. Counters are reset first (as on the GPU)."""
    prog = program if stop_after is None else program.prefix(stop_after)
    st.counters[:] = [0] * program.num_counters
    for step in prog.steps:
        if isinstance(step, FallbackStep):
            if fallback_runner is None:
                run_fallback_as_tasks(program, step.op, st)
            else:
                fallback_runner(step.op, st)
        else:
            run_segment(step, st, order=order, seed=seed)
    return st
