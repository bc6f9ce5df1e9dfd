"""Choices of the megakernel that the autotuner measures, and where its winners live.

A `ScheduleTuning` sets how the decode step is cut into tasks -- units (16 output columns) per task
of each weight-streaming op, and the attention's KV chunks -- and the ring depth the kernel is
compiled with (`num_stages`, variant.KernelVariant.num_stages: the one compile-time knob; the per-task scratch takes
the shared memory the ring gives up, so fewer stages stage larger activations). The task split
changes only the program, so a tuned program is as correct as the default one (the VM and the
deadlock/ordering checks run on any of them); the autotuner also compares each candidate's output
with the default program's before timing it.

Why these knobs: the H200 traces (bench/results/trace_*) show the small per-layer ops (qkv_rope,
o_proj: 12.6 and 8.4 MB at 1B) at ~1.5 TB/s, dominated by per-task fixed cost and counter waits,
while gate_up/down/lm_head stream at 2.6-4.3 TB/s. Fewer, larger tasks amortise the fixed cost;
more, smaller tasks balance the tail. Which wins depends on the GPU, the shape and the batch, which
is what a measurement per (GPU, shape, batch) settles. The ring depth trades bytes in flight for
scratch: 6 x 32 KiB in flight per SM is ~6x what Little's law asks for at the copy rate, while at
batch 8 the 32 KiB scratch cannot stage qkv_rope's, o_proj's or gate_up's activations (their tasks
then take 2x their batch-1 time in the H200 trace); 5 stages leave 64 KiB. The chunk width is not
searched.

Where measured winners are stored and looked up: tuning_table.py.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from .encoding import STAGE_CHOICES, Rounding
from .variant import (
    ATT_TMA_MAX_TOKENS,
    ATT_TMA_TUNED,
    INFLIGHT_MAX,
    RELEASE_GATE_DEFAULT,
    RELEASE_GATE_MASKS,
    WGA_NWS_STAGES,
    WGA_X_CHOICES,
    WGMMA_A_CHOICES,
    KernelVariant,
    int_in,
)

# Ops cut into tasks over output units (tasks.py); their task count is num_sms * factor.
SPLIT_OPS = ("qkv_rope", "o_proj", "gate_up", "down", "lm_head")
SPLIT_MIN, SPLIT_MAX = 0.125, 8.0
# Ops whose reduction (K) can be cut across tasks (tasks.py: K-split with a last-arriver merge) and the most
# parts: the parts' fp32 partials live in PART_K ([KSPLIT_MAX, MAX_BATCH, H], encoding.py).
KSPLIT_OPS = ("o_proj", "down")
KSPLIT_MAX = 4
MAX_ATTN_CHUNKS = 32    # = tasks.MAX_ATTN_CHUNKS (tasks imports this one)
# A tuning's explicit "no ring-fed attention": 0 means "the decoder's variant", which the base a table was
# measured from may have turned on (UNTUNED_TUNING), so turning the ring off needs a value of its own.
ATT_TMA_OFF = -1
# A tuning's explicit "no release gate" (MK_RELEASE_GATE=0), for the same reason: 0 means the decoder's variant.
RELEASE_GATE_OFF = -1
# The masks the autotuner tries besides the default (gate_up's): also after qkv_rope (34), after o_proj (48), both (50),
# after o_proj and down (112: qkv_rope's weights wait for down's release too). Session 8 measured them on the kernel of
# that time: 48 / 50 worse at 1B b1..8, -86 us at 8B b1; session 35's H100 traces put the ungated releases at 1.5-1.9
# us (o_proj 4.3 at 1B b16), so the choice is per batch; session 37 (H200, with ahead 2): 112 -3.7 / -2.8% at 1B b8.
RELEASE_GATE_TRIES = (34, 48, 50, 112)
# MK_GATE_AHEAD's chunks that a tuning may set: below every ring depth (STAGE_CHOICES), so any num_stages holds them.
# Session 36 (H100, the H200 table's tunings): with mask 48, ahead 2 -4.3% at 1B b1 and -5.2% at b16, 1 and 3 less,
# 4 and 5 nothing; ahead 2 with gate_up's mask alone -1%.
GATE_AHEAD_MAX = min(STAGE_CHOICES) - 1
GATE_AHEAD_TRIED = 2
# The masks the autotuner pairs with it as one step: 48 (gate_up's and o_proj's next tasks; session 36) and 112 (down's
# next task too; session 37, H200: 1B b8 -3.7 / -2.8%, 48's pair -3.5 / -2.5%; 8B b1 / b8 -1.1..-1.6%, 48's -0.5..-0.8%)
RELEASE_GATE_TRIED_WITH_AHEAD = (48, 112)


def _check_op_pairs(field_name: str, items: tuple, what: str, ops: tuple[str, ...], bad_op: str,
                    value_ok: Callable[[object], bool], bad_value: str) -> None:
    """(op, value) pairs of a ScheduleTuning field: each a pair, ops known and given once, values valid."""
    seen = set()
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"{field_name} entry {item!r} is not an (op, {what}) pair")
        op, v = item
        if op not in ops:
            raise ValueError(f"{field_name} op {op!r}{'' if bad_op.startswith(':') else ' '}{bad_op}")
        if op in seen:
            raise ValueError(f"{field_name} op {op!r} is given twice")
        seen.add(op)
        if not value_ok(v):
            raise ValueError(f"{field_name} {what} {v!r} for {op} {bad_value}")


def nws_depth(num_stages: int) -> bool:
    """Whether a tuning's ring depth (0: the decoder's, 6 slots) has wga_nws's buffer (variant.WGA_NWS_STAGES)."""
    return num_stages in (0, WGA_NWS_STAGES)

@dataclass(frozen=True)
class ScheduleTuning:
    """How one decode step is cut into tasks. Defaults reproduce the untuned program.

    split: (op, factor) pairs; op `op` is cut into round(num_sms * factor) tasks (at most one per
      unit). Ops not listed use factor 1.0 (about one task per SM).
    attn_chunks: KV chunks per (request, kv head); 0 = tasks.attention_chunks (one wave of partials).
    num_stages: weight ring depth (encoding.STAGE_CHOICES); 0 = the layout's default (6).
    merge_in_partial: with more than one KV chunk, the last partial task of each (request, kv head) to
      finish merges the chunks (a ticket counter says which is last) instead of a separate combine task:
      one hand-off less per layer on the attention chain (tasks.py). False = combine tasks. The default
      since session 7 (measured -3..-7 us at 1B batch 1/4/8, bench/results/mk_ab_2026-12-01_b200d73.md);
      tables written before then record the default program of their time, read as today's default.
    ksplit: (op, parts) pairs, op in KSPLIT_OPS, parts 2..KSPLIT_MAX: each of the op's unit ranges is cut
      into `parts` tasks over K, so a task holds parts x the rows for 1/parts of x (at batch 16 a one-unit
      down task reads as many activation bytes as weight bytes; bench/NOTES.md session 13). Each part
      stores fp32 partial sums; the last of a range's parts to finish (a ticket counter) adds them in part
      order to the residual. The op keeps its task count (tasks_for); unlisted ops are not cut.
    att_tma: the ring-fed attention for this batch size (variant.KernelVariant.att_tma, a compile-time switch
      like num_stages): attention tasks of >= att_tma tokens stream their K/V through the weight ring;
      0 = the decoder's variant (off by default), ATT_TMA_OFF = off even where the base has it. Session 18: 128
      wins at 8B batch 8/16 (-45 / -48 us at ctx 512, -351 / -669 at ctx 4096) and loses +18..+21 us at 1B batch
      1..8 ctx 512.
    inflight: the producer's cap on weight chunks in flight per SM for this batch size (variant.KernelVariant.
      inflight, a compile-time switch like num_stages), 1..INFLIGHT_MAX; 0 = the decoder's variant (no cap).
      Session 20: 2 chunks -46 / -6 / -55 us at 8B batch 1 / 8 / 16, +2..+19 at 1B (bench/NOTES.md).
    piece_deps: with down cut over K (ksplit), gate_up's units cut at down's part boundaries, one counter per
      piece, and down's part p waits for piece p only (tasks.gate_up_pieces): a part whose ACT columns are done
      starts while the rest of gate_up still runs. A program change only (no kernel switch); no effect without
      a down K-split.
    w_tma: one tensor-map copy per weight ring chunk for this batch size (variant.KernelVariant.w_tma); False = the
      decoder's variant. Session 19: -67 / -65 us at 8B batch 1 / 8, +409 at 8B batch 16, +2..+37 at 1B.
    rstd_epi: norm-fused ops whose x is not staged whole scale their sums by rstd in the epilogue instead of
      computing it first (variant.KernelVariant.rstd_epi); False = the decoder's variant. Session 29 (H200, ctx
      512): -2.5 / -6.3% at 1B batch 8 / 16, -1.1 / -2.2 / -3.2% at 8B batch 3 / 8 / 16, but +3% at 1B batch 2 and
      +1.2% at 8B batch 10 / 11 on batch 8's entry: a per-batch choice. Only with the fused rounding (a STOCK
      decoder ignores it).
    wgmma_a: batch 9..16 matvec tasks on wgmma with the weights as A, R (1, 2, 4) 64-row blocks per pass of x
      (variant.KernelVariant.wgmma_a); 0 = the decoder's variant; needs w_tma (its chunks are tensor-map copies).
      Session 29: R = 4 -9% at 8B batch 12..16 and -4..-5% at 1B batch 9..16, +-1% at 8B batch 9..11 on batch
      8's entry. Not with rstd_epi (it normalises x' before its MMAs).
    wga_x: the wgmma path's rstd epilogue (variant.KernelVariant.wga_x; fused rounding, bf16); 0 = the decoder's
      variant; only with wgmma_a. Session 30 (H200, ctx 512): -2.1% at 8B batch 16, -3.3% at 1B batch 16 against
      the tables' builds, -0.6..-0.8% at 8B batch 9 / 12. 2: x staged per warpgroup (sessions 33-35, H100: -2..-4% at
      8B batch 12 / 16 and 1B batch 16).
    wga_nws: with wga_x 2 at 6 ring slots, the norm weights by cp.async with the x groups (variant.KernelVariant.
      wga_nws; the same answer bit for bit). Session 47 (H100, ctx 512): -2..-4% at 1B batch 12..16, -10% at 1B batch
      9..11 with the wgmma path on batch 8's program, -3% at 8B batch 9 / 10, -1..-2% at 8B batch 11..16.
    x_groups: a matvec task's x by column groups at every batch size, never staged whole (variant.KernelVariant.
      x_groups), so rstd_epi applies where x would be staged (1B batch <= 6, 8B <= 2); at larger batches the same
      program from a smaller build (the whole-x paths compiled out). Session 48 (H100, ctx 512, the H200 table's
      programs): -5..-8% at 1B batch 4..6, -2.1% at 8B batch 2, -1.4% at 8B batch 1 and at 1B batch 8 (the same
      program), +4% at 1B batch 1 (its entry has no rstd_epi): a per-batch choice.
    release_gate: the opcode mask of MK_RELEASE_GATE for this batch size (variant.KernelVariant.release_gate: the
      task after one of these ops gets its weights only once that op's release is out); 0 = the decoder's variant
      (gate_up's by default), RELEASE_GATE_OFF = no gate. A base variant that sets its own mask keeps it.
    gate_ahead: MK_GATE_AHEAD for this batch size (variant.KernelVariant.gate_ahead: a gated task issues its first
      gate_ahead chunks before the release it waits for), 1..GATE_AHEAD_MAX; 0 = the decoder's variant. Needs a gate
      (not RELEASE_GATE_OFF). A base variant that sets its own keeps it.
    """
    split: tuple[tuple[str, float], ...] = ()
    attn_chunks: int = 0
    num_stages: int = 0
    merge_in_partial: bool = True
    ksplit: tuple[tuple[str, int], ...] = ()
    att_tma: int = 0
    inflight: int = 0
    w_tma: bool = False
    piece_deps: bool = False
    rstd_epi: bool = False
    wgmma_a: int = 0
    wga_x: int = 0
    release_gate: int = 0
    gate_ahead: int = 0
    wga_nws: bool = False
    x_groups: bool = False

    def __post_init__(self) -> None:
        _check_op_pairs("split", self.split, "factor", SPLIT_OPS, "is not tunable; tunable ops: " + ", ".join(SPLIT_OPS),
                        lambda f: not isinstance(f, bool) and isinstance(f, (int, float)) and SPLIT_MIN <= f <= SPLIT_MAX,
                        f"must be a number in [{SPLIT_MIN}, {SPLIT_MAX}] (tasks per SM)")
        _check_op_pairs("ksplit", self.ksplit, "parts", KSPLIT_OPS, f": only {', '.join(KSPLIT_OPS)} can be cut over K",
                        lambda n: not isinstance(n, bool) and isinstance(n, int) and 2 <= n <= KSPLIT_MAX,
                        f"must be an int in 2..{KSPLIT_MAX}")
        if not int_in(self.attn_chunks, 0, MAX_ATTN_CHUNKS):
            raise ValueError(f"attn_chunks={self.attn_chunks!r} must be an int in 0..{MAX_ATTN_CHUNKS} "
                             "(0 = one wave of partial tasks)")
        for name in ("merge_in_partial", "w_tma", "piece_deps", "rstd_epi", "wga_nws", "x_groups"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")  # noqa: TRY004
        if not int_in(self.att_tma, ATT_TMA_OFF, ATT_TMA_MAX_TOKENS):
            raise ValueError(f"att_tma={self.att_tma!r}: 0 (the decoder's variant), {ATT_TMA_OFF} (off) or the ring "
                             f"path's minimum tokens per attention task, 1..{ATT_TMA_MAX_TOKENS}")
        if not int_in(self.inflight, 0, INFLIGHT_MAX):
            raise ValueError(f"inflight={self.inflight!r}: 0 (the decoder's variant) or the weight chunks in flight "
                             f"per SM, 1..{INFLIGHT_MAX} (below every ring depth)")
        if isinstance(self.wgmma_a, bool) or self.wgmma_a not in WGMMA_A_CHOICES:
            raise ValueError(f"wgmma_a={self.wgmma_a!r}: 0 (the decoder's variant) or the 64-row blocks per pass, "
                             f"{', '.join(str(c) for c in WGMMA_A_CHOICES if c)}")
        if self.wgmma_a and not self.w_tma:
            raise ValueError(f"wgmma_a={self.wgmma_a} streams its chunks by tensor maps: set w_tma too")
        if self.wgmma_a and self.rstd_epi:
            raise ValueError(f"wgmma_a={self.wgmma_a} and rstd_epi exclude each other (wgmma_a normalises x' before "
                             "its MMAs): choose one")
        if isinstance(self.wga_x, bool) or self.wga_x not in WGA_X_CHOICES:
            raise ValueError(f"wga_x={self.wga_x!r}: 0 (the decoder's variant), 1 (the wgmma path's rstd epilogue) or 2 "
                             "(and x staged per warpgroup)")
        if self.wga_x and not self.wgmma_a:
            raise ValueError(f"wga_x={self.wga_x} is the wgmma path's x staging: set wgmma_a too")
        if self.wga_nws and (self.wga_x != 2 or not nws_depth(self.num_stages)):
            raise ValueError(f"wga_nws=True stages the norm weights with wga_x 2's x groups at {WGA_NWS_STAGES} ring slots "
                             f"(got wga_x={self.wga_x}, num_stages={self.num_stages})")
        if not (int_in(self.release_gate, RELEASE_GATE_OFF, RELEASE_GATE_OFF)
                or int_in(self.release_gate, 0, RELEASE_GATE_MASKS - 1)):
            raise ValueError(f"release_gate={self.release_gate!r}: 0 (the decoder's variant), {RELEASE_GATE_OFF} (no "
                             f"gate) or a mask of opcodes (bit Opcode.X), 1..{RELEASE_GATE_MASKS - 1}")
        if not int_in(self.gate_ahead, 0, GATE_AHEAD_MAX):
            raise ValueError(f"gate_ahead={self.gate_ahead!r}: 0 (the decoder's variant) or the chunks a gated task "
                             f"issues before its release, 1..{GATE_AHEAD_MAX}")
        if self.gate_ahead and self.release_gate == RELEASE_GATE_OFF:
            raise ValueError(f"gate_ahead={self.gate_ahead} moves the release gate's wait, and release_gate="
                             f"{RELEASE_GATE_OFF} turns the gate off: choose one")
        if isinstance(self.num_stages, bool) or self.num_stages not in (0, *STAGE_CHOICES):
            raise ValueError(f"num_stages={self.num_stages!r}: choose 0 (the default ring) or one of "
                             f"{', '.join(map(str, STAGE_CHOICES))}")

    def factor(self, op: str) -> float:
        return dict(self.split).get(op, 1.0)

    def tasks_for(self, op: str, num_sms: int) -> int:
        """Tasks op `op` is cut into on num_sms SMs (split_units caps it at the op's unit count)."""
        return max(1, round(num_sms * self.factor(op)))

    def with_split(self, op: str, factor: float) -> ScheduleTuning:
        rest = tuple((o, f) for o, f in self.split if o != op)
        new = rest if factor == 1.0 else rest + ((op, float(factor)),)
        return replace(self, split=tuple(sorted(new)))

    def with_chunks(self, chunks: int) -> ScheduleTuning:
        return replace(self, attn_chunks=chunks)

    def with_stages(self, num_stages: int) -> ScheduleTuning:
        """The ring depth; a depth other than 6 turns wga_nws off (its buffer is the 6-slot layout's spare tail)."""
        return replace(self, num_stages=num_stages, wga_nws=self.wga_nws and nws_depth(num_stages))

    def with_merge(self, merge_in_partial: bool) -> ScheduleTuning:
        return replace(self, merge_in_partial=merge_in_partial)

    def with_att_tma(self, att_tma: int) -> ScheduleTuning:
        return replace(self, att_tma=att_tma)

    def with_inflight(self, inflight: int) -> ScheduleTuning:
        return replace(self, inflight=inflight)

    def with_w_tma(self, w_tma: bool) -> ScheduleTuning:
        """Tensor-map copies on or off; off turns wgmma_a off too (its chunks are tensor-map copies)."""
        return replace(self, w_tma=w_tma, wgmma_a=self.wgmma_a if w_tma else 0, wga_x=self.wga_x if w_tma else 0,
                       wga_nws=self.wga_nws and w_tma)

    def with_piece_deps(self, piece_deps: bool) -> ScheduleTuning:
        return replace(self, piece_deps=piece_deps)

    def with_rstd_epi(self, rstd_epi: bool) -> ScheduleTuning:
        """The rstd epilogue on or off; on turns wgmma_a off (they exclude each other), w_tma as it was."""
        return replace(self, rstd_epi=rstd_epi, wgmma_a=self.wgmma_a if not rstd_epi else 0,
                       wga_x=self.wga_x if not rstd_epi else 0, wga_nws=self.wga_nws and not rstd_epi)

    def with_wgmma_a(self, wgmma_a: int) -> ScheduleTuning:
        """R row blocks per pass on wgmma (and the tensor-map copies it needs); 0 turns it off, w_tma as it was."""
        return replace(self, wgmma_a=wgmma_a, w_tma=self.w_tma or bool(wgmma_a), rstd_epi=self.rstd_epi and not wgmma_a,
                       wga_x=self.wga_x if wgmma_a else 0, wga_nws=self.wga_nws and bool(wgmma_a))

    def with_wga_x(self, wga_x: int) -> ScheduleTuning:
        """The wgmma path's rstd epilogue: 0 off, 1 on, 2 on with x staged per warpgroup; needs wgmma_a (a ValueError
        names it otherwise); a value other than 2 turns wga_nws off."""
        return replace(self, wga_x=wga_x, wga_nws=self.wga_nws and wga_x == 2)

    def with_wga_nws(self, wga_nws: bool) -> ScheduleTuning:
        """The norm weights by cp.async with wga_x 2's x groups; needs wga_x 2 at 6 slots (a ValueError names it)."""
        return replace(self, wga_nws=wga_nws)

    def with_x_groups(self, x_groups: bool) -> ScheduleTuning:
        return replace(self, x_groups=x_groups)

    def with_release_gate(self, release_gate: int) -> ScheduleTuning:
        return replace(self, release_gate=release_gate)

    def with_gate_ahead(self, gate_ahead: int) -> ScheduleTuning:
        return replace(self, gate_ahead=gate_ahead)

    def ksplit_for(self, op: str) -> int:
        """Parts op `op`'s reduction is cut into (1: not cut)."""
        return dict(self.ksplit).get(op, 1)

    def with_ksplit(self, op: str, parts: int) -> ScheduleTuning:
        rest = tuple((o, n) for o, n in self.ksplit if o != op)
        return replace(self, ksplit=tuple(sorted(rest if parts == 1 else rest + ((op, int(parts)),))))

    @property
    def is_default(self) -> bool:
        return (not self.split and self.attn_chunks == 0 and self.num_stages == 0 and self.merge_in_partial
                and not self.ksplit and self.att_tma == 0 and self.inflight == 0
                and not self.w_tma and not self.piece_deps and not self.rstd_epi and not self.wgmma_a
                and not self.wga_x and not self.release_gate and not self.gate_ahead and not self.wga_nws
                and not self.x_groups)

    def label(self) -> str:
        parts = [f"{op}x{f:g}" for op, f in self.split]
        if self.attn_chunks:
            parts.append(f"chunks{self.attn_chunks}")
        if self.num_stages:
            parts.append(f"stages{self.num_stages}")
        if not self.merge_in_partial:
            parts.append("combine_tasks")
        parts += [f"{op}/k{n}" for op, n in self.ksplit]
        if self.att_tma == ATT_TMA_OFF:
            parts.append("att_tma_off")
        elif self.att_tma:
            parts.append(f"att_tma{self.att_tma}")
        if self.inflight:
            parts.append(f"inflight{self.inflight}")
        if self.w_tma:
            parts.append("w_tma")
        if self.piece_deps:
            parts.append("piece_deps")
        if self.rstd_epi:
            parts.append("rstd_epi")
        if self.wgmma_a:
            parts.append(f"wgmma_a{self.wgmma_a}")
        if self.wga_x:
            parts.append(f"wga_x{self.wga_x}")
        if self.wga_nws:
            parts.append("wga_nws")
        if self.x_groups:
            parts.append("x_groups")
        if self.release_gate == RELEASE_GATE_OFF:
            parts.append("gate_off")
        elif self.release_gate:
            parts.append(f"gate{self.release_gate}")
        if self.gate_ahead:
            parts.append(f"ahead{self.gate_ahead}")
        return ",".join(parts) or "default"

    def to_json(self) -> dict:
        d = {"split": {op: f for op, f in self.split}, "attn_chunks": self.attn_chunks,
             "num_stages": self.num_stages}
        if not self.merge_in_partial:   # absent = the default (True)
            d["merge_in_partial"] = False
        if self.ksplit:                 # absent = no op cut over K
            d["ksplit"] = dict(self.ksplit)
        if self.att_tma:                # absent = the decoder's variant; ATT_TMA_OFF = off
            d["att_tma"] = self.att_tma
        if self.inflight:               # absent = the decoder's variant
            d["inflight"] = self.inflight
        if self.w_tma:                  # absent = the decoder's variant
            d["w_tma"] = True
        if self.piece_deps:             # absent = one counter per op
            d["piece_deps"] = True
        if self.rstd_epi:               # absent = the decoder's variant
            d["rstd_epi"] = True
        if self.wgmma_a:                # absent = the decoder's variant
            d["wgmma_a"] = self.wgmma_a
        if self.wga_x:                  # absent = the decoder's variant
            d["wga_x"] = self.wga_x
        if self.wga_nws:                # absent = the decoder's variant
            d["wga_nws"] = True
        if self.x_groups:               # absent = the decoder's variant
            d["x_groups"] = True
        if self.release_gate:           # absent = the decoder's variant; RELEASE_GATE_OFF = no gate
            d["release_gate"] = self.release_gate
        if self.gate_ahead:             # absent = the decoder's variant
            d["gate_ahead"] = self.gate_ahead
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> ScheduleTuning:
        known = ("split", "attn_chunks", "num_stages", "merge_in_partial", "ksplit", "att_tma", "inflight", "w_tma",
                 "piece_deps", "rstd_epi", "wgmma_a", "wga_x", "release_gate", "gate_ahead", "wga_nws",
                 "x_groups")
        unknown = set(d) - set(known)
        if unknown:
            raise ValueError(f"unknown tuning field(s) {sorted(unknown)}; known: {', '.join(known)}")
        split = tuple(sorted((str(k), float(v)) for k, v in dict(d.get("split", {})).items()))
        ksplit = tuple(sorted((str(k), v) for k, v in dict(d.get("ksplit", {})).items()))
        return cls(split, int(d.get("attn_chunks", 0)), int(d.get("num_stages", 0)),
                   d.get("merge_in_partial", True), ksplit, int(d.get("att_tma", 0)), int(d.get("inflight", 0)),
                   d.get("w_tma", False), d.get("piece_deps", False), d.get("rstd_epi", False),
                   int(d.get("wgmma_a", 0)), int(d.get("wga_x", 0)), int(d.get("release_gate", 0)),
                   int(d.get("gate_ahead", 0)), d.get("wga_nws", False), d.get("x_groups", False))


DEFAULT_TUNING = ScheduleTuning()
# The wgmma path's row blocks per pass that the autotuner tries: R = 4 beat 1 and 2 at 1B and 8B batch 10..16 (session 29,
# H200: 8B b16 4882-4894 us against 5022 at R = 2 and 5463-5471 at R = 1)
WGMMA_A_TUNED = 4
# A model that no table has measured on this GPU: the default program with the ring-fed attention for tasks of
# >= ATT_TMA_TUNED tokens. Since its consumers run on the tensor cores (session 26, H200, 1B and 8B at batch 1..16)
# it cost <= 1% at ctx 512 and gained 2-19% at ctx 4096 and 13-27% at ctx 8192; contexts grow while serving. A
# measured model keeps its entries, a measured "default won" included (1B batch 1).
UNTUNED_TUNING = ScheduleTuning(att_tma=ATT_TMA_TUNED)


def parse_ksplit(items: Iterable[str]) -> tuple[tuple[str, int], ...]:
    """"OP=N" strings (bench/mk_step.py --ksplit, bench/mk_ab.py ksplit.OP=N) as ScheduleTuning.ksplit pairs,
    sorted; a malformed item raises ValueError naming it (ops and parts are checked by ScheduleTuning)."""
    out = []
    for item in items:
        op, sep, n = item.partition("=")
        if not sep or not n.isdigit():
            raise ValueError(f"ksplit item {item!r}: give OP=N, e.g. down=4")
        out.append((op, int(n)))
    return tuple(sorted(out))


def tuned_variant(base: KernelVariant, t: ScheduleTuning, *, att_tma_ok: bool = True) -> KernelVariant:
    """The kernel variant a batch with tuning `t` runs on: `base` with the ring depth, ring-fed attention (where the
    model and caches allow it), in-flight cap, weight-map copies, rstd epilogue and wgmma path of `t` where it sets
    them. rstd_epi applies to a fused-rounding base without wgmma_a, wgmma_a to a base without rstd_epi, wga_x to a
    base without its own (the table's choices are measured on the default base; a user's variant that excludes one,
    or sets wga_x, keeps its own); wga_nws where the variant then has wga_x 2 at 6 ring slots; x_groups; the release
    gate's mask where the base has the default one, and its head start (gate_ahead) where the variant then has a gate
    and no head start of its own."""
    v = base.with_stages(t.num_stages) if t.num_stages else base
    if t.att_tma == ATT_TMA_OFF:
        v = replace(v, att_tma=0)
    elif t.att_tma and att_tma_ok:
        v = replace(v, att_tma=t.att_tma)
    if t.inflight:
        v = replace(v, inflight=t.inflight)
    if t.w_tma:
        v = replace(v, w_tma=True)
    if t.rstd_epi and v.rounding == Rounding.FUSED and not v.wgmma_a:
        v = replace(v, rstd_epi=True)
    if t.wgmma_a and not v.rstd_epi:
        v = replace(v, wgmma_a=t.wgmma_a)
    # the rstd epilogue: fused rounding only; a base that sets its own (an A/B build: bench/mk_ab.py) keeps it
    if t.wga_x and not v.wga_x and v.wgmma_a and v.rounding == Rounding.FUSED:
        v = replace(v, wga_x=t.wga_x)
    # the norm weights with the x groups: only on wga_x 2's 6-slot layout (a base of another depth runs without)
    if t.wga_nws and v.wga_x == 2 and v.num_stages == WGA_NWS_STAGES:
        v = replace(v, wga_nws=True)
    if t.x_groups:   # x by column groups at every batch size (where it already comes by groups: a smaller build)
        v = replace(v, x_groups=True)
    # the gate: a base with a mask of its own (an A/B build) keeps it; no gate only where nothing moves its wait
    if t.release_gate and v.release_gate == RELEASE_GATE_DEFAULT:
        if t.release_gate > 0:
            v = replace(v, release_gate=t.release_gate)
        elif not v.gate_ahead:
            v = replace(v, release_gate=0)
    # its head start: where the variant has a gate and no head start of its own (an A/B build keeps its own)
    if t.gate_ahead and v.release_gate and not v.gate_ahead:
        v = replace(v, gate_ahead=t.gate_ahead)
    return v
