"""What one build of the megakernel compiles in: the compile-time switches of csrc/ as typed values.

The field defaults are the default build: header.py renders them as the switches' #ifndef defaults in
csrc/tasks.h, and defines() passes -D only for the fields a build changes, so the default build has none.
Besides the rounding points, the ring depth and the bench-only diagnostics, a switch is either a measured
default (the release gate) or an A/B experiment waiting for its GPU measurement (bench/NOTES.md). A
switch whose A/B is measured leaves: the winner becomes the code, the loser's record stays in the notes
(session 9: the poll acquires, the early pointers, the early RoPE table loads, the attention overlap and
the batched merge won; the column groups at batch 1 and the gate word's volatile/relaxed forms lost;
session 10: five attention load steps in flight won over four and six, the packed half-size ring slots at
batch 9..16 lost; session 11: full-width ring chunks at batch 9..16, taken in two halves, won over
half-width chunks; session 12: the chain L2 prefetch, split MMA chains for one-M-tile passes and more
norm-statistics rows per round all lost; session 18 removed the bulk-copy hand-offs MK_BULK_RELEASE and
MK_BULK_QKV: they raced, bench/NOTES.md session 17; session 21: a later pass's x copied early or kept staged,
MK_PASS_PREFETCH, lost at every shape; session 24: the branch-free one-n-tile fragment build, MK_XFRAG, won
and is the code; session 25: MK_XPIPE and MK_FULLK lost; session 26: MK_RING_MMA, the ring-fed attention on the
tensor cores, won and is the code; measured 2026-12-05: MK_WGMMA_B, wgmma with the weights as B at batch <= 8,
and MK_WARP_ARRIVE, one ring-slot release per warp, lost; session 39: MK_TICKET_SIGNAL, one release per ticket, the
completer's, lost at 1B b4 / b8; session 42: MK_EVICT_FIRST, the weight copies evict-first in L2, won at every shape
and is the code; MK_EVICT_LAST, the re-read loads evict-last on top of it, gained nothing and left; session 43:
MK_ATT_EARLY, attention's cached K / V loaded before the counter wait, lost at every shape but 1B b8 and left, as
session 14's MK_ATT_PRELOAD, the same idea through shared memory, had; session 50: the builds per batch class without
the paths a program never takes, MK_NTILES + MK_X_WHOLE / MK_WGA_ONLY, won and are the decoder's default where a
program allows, tasks.class_build; session 52: the ring-fed attention's newest rows loaded beside q, MK_ATT_NEWEST, and
its 16-token blocks a warp at head_dim <= 64, MK_AM_BLOCK, won and are the code; the attention chunks merged in
o_proj's staging, tuning.merge_in_oproj with MK_OPROJ_MERGE, lost at 1B and 8B batch 1 and left).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from .encoding import LAYOUT, STAGE_CHOICES, KernelLayout, Opcode, Rounding

# MK_RELEASE_GATE's default (session 8, measured): hold the weights of the task after a gate_up until
# gate_up's release, whose fence otherwise waits for those copies (-29..-41 us at 1B batch 1/4/8, -41/-58
# at 8B batch 1/8, even at 1B batch 16; masks 96, 48, 50 and 126 measured slower at 1B: bench/NOTES.md).
RELEASE_GATE_DEFAULT = 1 << Opcode.GATE_UP
RELEASE_GATE_MASKS = 1 << len(Opcode)   # MK_RELEASE_GATE's masks: a bit per opcode
# KernelVariant's fields as builds name them: (-D name, field, label key), in defines() / label() order
VARIANT_DEFINES = (("MK_ROUNDING", "rounding", "rounding"), ("MK_NUM_STAGES", "num_stages", "stages"),
                   ("MK_DIAG", "diag", "diag"), ("MK_TRACE_PHASES", "phases", "phases"),
                   ("MK_RELEASE_GATE", "release_gate", "release_gate"), ("MK_ATT_TMA", "att_tma", "att_tma"),
                   ("MK_W_TMA", "w_tma", "w_tma"), ("MK_INFLIGHT", "inflight", "inflight"),
                   ("MK_RSTD_EPI", "rstd_epi", "rstd_epi"), ("MK_WGMMA_A", "wgmma_a", "wgmma_a"),
                   ("MK_WGA_X", "wga_x", "wga_x"), ("MK_LINEINFO", "lineinfo", "lineinfo"),
                   ("MK_GATE_AHEAD", "gate_ahead", "gate_ahead"), ("MK_DIAG_L2_FROM", "diag_l2_from", "diag_l2_from"),
                   ("MK_DIAG_L2_N", "diag_l2_n", "diag_l2_n"), ("MK_WGA_NWS", "wga_nws", "wga_nws"),
                   ("MK_X_GROUPS", "x_groups", "x_groups"), ("MK_NTILES", "ntiles", "ntiles"),
                   ("MK_WGA_ONLY", "wga_only", "wga_only"), ("MK_X_WHOLE", "x_whole", "x_whole"))
# MK_DIAG_L2_FROM / _N's largest value (chunks of a task counted in the producer's issue order)
DIAG_L2_MAX_CHUNKS = 64
# MK_ATT_TMA's threshold where a tuning turns it on (session 18's A/B: 128 beat 1 and 1024); off by default, as
# it costs +18..+21 us at 1B batch 1..8 ctx 512 even where every task takes the default loop (bench/NOTES.md)
ATT_TMA_TUNED = 128
ATT_TMA_MAX_TOKENS = 1 << 20   # MK_ATT_TMA's largest threshold (longer than any context the kernel runs)
# MK_INFLIGHT's largest cap a tuning may set: below every ring depth (STAGE_CHOICES), so any tuning's ring takes it
INFLIGHT_MAX = min(STAGE_CHOICES) - 1
# MK_WGMMA_A's values: off, or the 64-row blocks a pass holds (8 accumulator registers a thread each)
WGMMA_A_CHOICES = (0, 1, 2, 4)
# MK_WGA_X's values: off, the wgmma path's rstd epilogue (session 30: its x pipeline without the epilogue, then value 1,
# measured +0.7% and left), and that with each warpgroup staging its own half of x (sessions 33-35: the tables' value
# at 1B batch 12..16 and 8B batch 11..16)
WGA_X_CHOICES = (0, 1, 2)
# MK_WGA_NWS's one ring depth: its norm-weight buffer is the 6-slot layout's spare tail after the misc block, and only
# there does wga_x 2 keep one x group ahead (csrc/wga_x.cuh's static_assert on WGA_AHEAD)
WGA_NWS_STAGES = 6
# the cap a tuning turns on (session 20's A/B: 2 chunks beat 4 at 8B; 1 loses 20% of the streaming rate)
INFLIGHT_TUNED = 2


def batch_class(batch: int) -> int:
    """The n-tiles (8 tokens each) of a batch size's matvec path: 1 for batch 1..8, 2 for 9..16 (csrc/matvec_plan.cuh
    batch_class)."""
    return 1 if batch <= 8 else 2


def int_in(value: object, lo: int, hi: int) -> bool:
    """An int (a bool is not one here) in lo..hi: the type and range check of every integer switch and knob
    (KernelVariant, tuning.ScheduleTuning)."""
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


@dataclass(frozen=True)
class KernelVariant:
    """What one build of the megakernel compiles in, as typed values: its rounding points, its weight
    ring's depth (the per-task scratch takes the rest of the shared memory) and, for bench only, the
    timing-only MK_DIAG mask (1 no counter waits, 2 no weight copies, 4 no MMAs, 8 activations staged for a matvec
    task's first pass only, 16 a pass's first activation fragments reused for its other chunks at NT = 1, 32 every
    weight chunk from layer 0's first 512 rows, L2-resident, with w_tma, 64 the wgmma path's x groups after a pass's
    first used without their copies' wait, normalisation or barrier, with wga_x, 128 the wgmma path's next-group
    norm-weight loads skipped, with wga_x, 256 a whole-x staging's norm statistics skipped (the sum-of-squares pass,
    its shuffles and two barriers; rstd left as it was): wrong results).
    defines() renders the -D options; nothing reads a variant back from option strings: parse() is the
    command-line boundary (bench --define, pytest --mk-define), used once where the values come in."""
    rounding: Rounding = Rounding.FUSED
    num_stages: int = LAYOUT.num_stages
    diag: int = 0
    phases: bool = False   # MK_TRACE_PHASES: per-phase ns of matvec tasks in the trace (bench only)
    release_gate: int = RELEASE_GATE_DEFAULT  # MK_RELEASE_GATE: opcode mask; the next task's weights wait for the release
    # MK_ATT_TMA = N: the K/V of every attention task of >= N tokens streamed through the weight ring by
    # tensor-map copies (csrc/attention_tma.cuh; 0 off, 1 every task; the decoder builds one CUtensorMap per
    # layer cache: tensormap.py). Needs block_size 16 and 1-4 query heads per kv head: the decoder turns it
    # off (0) with one warning for a model or caches without them. Per batch size from the tuning table
    # (tuning.ScheduleTuning.att_tma), like the ring depth.
    att_tma: int = 0
    # MK_W_TMA (A/B switch, session 19): every ring chunk of qkv_rope / o_proj / gate_up / down / lm_head weights
    # is one tensor-map copy of 32 KB (16 rows x 1024 columns, 128-byte swizzled) instead of 16 bulk copies of one
    # 2 KB row each (tensormap.weight_maps; csrc/weight_tma.cuh). Needs K a multiple of 64 for every matrix.
    w_tma: bool = False
    # MK_INFLIGHT = N (A/B switch, session 20; 0 = off): the producer keeps at most N weight chunks in flight (issued,
    # not landed) per SM, waiting for chunk i - N to land before it issues chunk i (csrc/producer.cuh:
    # producer_slot_wait). 1 .. num_stages - 1.
    inflight: int = 0
    # MK_RSTD_EPI (A/B switch, session 26; off): a norm-fused op (qkv_rope, gate_up) whose x is not staged whole
    # (1B batch >= 7, 8B >= 3) takes the norm's 1/rms out of its fragments (x' = round(x * w)) and scales its
    # accumulators by rstd[b] in the epilogue; the first pass sums x^2 from the column groups as they go by, so the
    # task starts its chunk loop without rows_rstd's L2 rounds (four at batch 16). FUSED rounding only.
    rstd_epi: bool = False
    # MK_WGMMA_A = R (A/B switch, session 28; 0 = off; needs w_tma): a matvec task at batch 9..16 streams 64-row x
    # 256-column chunks and runs them on wgmma with the weights as its A operand (M = a row block of 64 rows) and x' as
    # its B operand (N = 16 tokens), both from shared memory, up to R row blocks (1, 2 or 4) per pass of x
    # (csrc/matvec_wgmma_a.cuh).
    wgmma_a: int = 0
    # MK_WGA_X (session 30; 0 = off; needs wgmma_a; a per-batch knob of the tables): the wgmma path's norm-fused ops
    # take rstd in the epilogue (x' = round(x * w), x^2 summed from the first pass's groups: no rows_rstd round trips),
    # with the norm weights loaded a group ahead and, at num_stages <= 5, 3 groups of x copies in flight (csrc/
    # wga_x.cuh). Fused rounding; bf16 models (a compile-time check). 2 (session 30; the 1B / 8B batch-16 table
    # entries since sessions 33 / 34): each warpgroup copies, waits for and normalises only the x columns its wgmmas read,
    # behind its own barrier.
    wga_x: int = 0
    # MK_WGA_NWS (session 46; off; needs wga_x 2 at 6 ring slots; a per-batch knob of the tables since session 47:
    # tuning.ScheduleTuning.wga_nws): a norm-fused op's norm weights travel with its x groups by cp.async into shared
    # memory, so the ready step's return waits for no load (the register load of the next group's weights put an L2
    # round trip on every group: bench/NOTES.md session 46). The same answer bit for bit; H100: -1..-4% at batch 11..16.
    wga_nws: bool = False
    # MK_X_GROUPS (session 47; off; a per-batch knob of the tables since session 48: tuning.ScheduleTuning.x_groups): a
    # matvec task's x comes by column groups at every batch size, never staged whole (csrc/x_frags.cuh staged_fits), so
    # MK_RSTD_EPI applies at 1B batch <= 6 and 8B batch <= 2 too. Why:
    # on the H100 a 1B batch-4 step (the batch-8 program, x staged whole per pass) costs as much as batch 8's (997 /
    # 969 us, session 47), where the staged path restages x once per pass after the wait while the group path's copies
    # run under the chunk loop. Without rstd_epi the group path's x' is the staged path's bit for bit (rows_rstd's rstd).
    x_groups: bool = False
    # MK_NTILES (session 49; 0 = off): a build of one batch class only, 1 (batch 1..8, one n-tile of 8 tokens) or 2
    # (batch 9..16), so the compiler drops the other class's matvec path (and, at 1, the wgmma path). Alone it measured
    # +-0.5% (session 50: a function never called is never fetched); it carries MK_X_WHOLE / MK_WGA_ONLY, which the
    # decoder builds by default where a program allows (tasks.class_build). A decoder whose variant has ntiles != 0
    # builds each batch size's kernel for its own class (for_batch); the kernel's header check refuses a batch of the
    # other class (HeaderCheck.BATCH).
    ntiles: int = 0
    # MK_WGA_ONLY (session 49; off; needs ntiles; applies to builds with wgmma_a; the decoder's default where a program
    # allows since session 50: -0.3..-1.6% at 1B / 8B batch 10..16, tasks.class_build): where every matvec task
    # of a batch-9..16 program has whole 256-column chunks (tasks.task_k_widths), every task takes the wgmma path, so
    # matvec_task<2> and the producer's default chunk loop leave that batch's build too (1B b16's table build: 4167 more
    # instructions). The decoder keeps it only for such a batch size's build (for_batch; tasks.class_build checks the
    # widths).
    wga_only: bool = False
    # MK_X_WHOLE (session 49; off; needs ntiles, not x_groups; the decoder's default where a program allows since
    # session 50: -2.8% at 1B batch 1, -1.2% at 8B, tasks.class_build): where every matvec task of a program stages
    # its x whole (1B and 8B at batch 1), staged_fits is constant true, so the column-group path leaves the build (the
    # mirror of x_groups). The decoder keeps it only for such a batch size's build (tasks.class_build).
    x_whole: bool = False
    # MK_LINEINFO (bench only): compiled with NVRTC's --generate-line-info, so Nsight Compute's source page maps SASS
    # to csrc lines (session 13's stall samples could not be read against the source); the code is the same
    lineinfo: bool = False
    # MK_GATE_AHEAD = G (A/B switch, session 35; 0 = off): a task that MK_RELEASE_GATE holds issues its first G weight
    # chunks before the previous task's release and holds the rest (csrc/producer.cuh: producer_slot_wait).
    # 1 .. num_stages - 1; needs a release gate.
    gate_ahead: int = 0
    # MK_DIAG_L2_FROM = A, MK_DIAG_L2_N = N (timing only, wrong results; session 40; N = 0: diag bit 32 folds every
    # chunk): bit 32's L2 fold only for gate_up's chunks A .. A + N - 1 of each task, in the producer's issue order;
    # every other chunk streams its own weights. The step where those chunks come from L2 bounds what a prefetch of
    # them into L2 during the qkv -> attention -> o_proj chain (by SMs with no release to make) could gain.
    diag_l2_from: int = 0
    diag_l2_n: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.rounding, Rounding):
            raise TypeError(f"rounding={self.rounding!r} must be a Rounding ({', '.join(r.name for r in Rounding)})")
        if isinstance(self.num_stages, bool) or self.num_stages not in STAGE_CHOICES:
            raise ValueError(f"num_stages={self.num_stages!r}: choose one of {', '.join(map(str, STAGE_CHOICES))}")
        if not int_in(self.release_gate, 0, RELEASE_GATE_MASKS - 1):
            raise ValueError(f"release_gate={self.release_gate!r}: a mask of opcodes (bit Opcode.X), "
                             f"0..{RELEASE_GATE_MASKS - 1}")
        if not int_in(self.att_tma, 0, ATT_TMA_MAX_TOKENS):
            raise ValueError(f"att_tma={self.att_tma!r}: the ring path's minimum tokens per attention task, "
                             f"0 (off) .. {ATT_TMA_MAX_TOKENS}")
        if not int_in(self.inflight, 0, self.num_stages - 1):
            raise ValueError(f"inflight={self.inflight!r}: 0 (off) or the weight chunks in flight per SM, "
                             f"1 .. {self.num_stages - 1} (num_stages - 1)")
        for name in ("phases", "w_tma", "rstd_epi", "lineinfo", "wga_nws", "x_groups", "wga_only", "x_whole"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")  # noqa: TRY004 (a bad value)
        if not int_in(self.gate_ahead, 0, self.num_stages - 1):
            raise ValueError(f"gate_ahead={self.gate_ahead!r}: 0 (off) or the chunks a gated task issues before the "
                             f"release, 1 .. {self.num_stages - 1} (num_stages - 1)")
        if self.gate_ahead and not self.release_gate:
            raise ValueError(f"gate_ahead={self.gate_ahead} moves MK_RELEASE_GATE's wait: set release_gate too "
                             "(it is 0)")
        if isinstance(self.ntiles, bool) or self.ntiles not in (0, 1, 2):
            raise ValueError(f"ntiles={self.ntiles!r}: 0 (both batch classes) or the one class built, 1 (batch 1..8) "
                             "or 2 (batch 9..16)")
        if self.wga_only and not self.ntiles:
            raise ValueError("wga_only puts every task of a batch-9..16 build on the wgmma path: set ntiles too (a "
                             "build per batch class; it is 0)")
        if self.x_whole and (self.x_groups or not self.ntiles):
            raise ValueError(f"x_whole stages every task's x whole in a build per batch class: set ntiles (it is "
                             f"{self.ntiles}), not x_groups (it is {self.x_groups})")
        if isinstance(self.wgmma_a, bool) or self.wgmma_a not in WGMMA_A_CHOICES:
            raise ValueError(f"wgmma_a={self.wgmma_a!r}: 0 (off) or the 64-row blocks per pass, "
                             f"{', '.join(map(str, WGMMA_A_CHOICES[1:]))}")
        self._needs_w_tma(self.wgmma_a, f"wgmma_a={self.wgmma_a} copies its chunks with MK_W_TMA's tensor maps")
        if self.wgmma_a and self.rstd_epi:
            raise ValueError(f"wgmma_a={self.wgmma_a} normalises x' with the rows' rstd before its MMAs: it is not "
                             "built with rstd_epi=True (MK_RSTD_EPI=1)")
        if isinstance(self.wga_x, bool) or self.wga_x not in WGA_X_CHOICES:
            raise ValueError(f"wga_x={self.wga_x!r}: 0 (off), 1 (the wgmma path's rstd epilogue) or 2 (and x staged "
                             "per warpgroup)")
        if self.wga_nws and (self.wga_x != 2 or self.num_stages != WGA_NWS_STAGES):
            raise ValueError(f"wga_nws=True: the norm weights one x group ahead, with wga_x 2 at {WGA_NWS_STAGES} ring "
                             f"slots (got wga_x={self.wga_x}, num_stages={self.num_stages})")
        if self.wga_x and not self.wgmma_a:
            raise ValueError(f"wga_x={self.wga_x} is MK_WGMMA_A's x staging: set wgmma_a too (MK_WGMMA_A=1, 2 or 4)")
        if self.wga_x and self.rounding != Rounding.FUSED:
            raise ValueError(f"wga_x={self.wga_x} needs the fused rounding (rounding={self.rounding.name}: STOCK rounds "
                             "x * rstd before the norm weight)")
        if self.rstd_epi and self.rounding != Rounding.FUSED:
            raise ValueError(f"rstd_epi=True needs the fused rounding (rounding={self.rounding.name}: STOCK rounds "
                             "x * rstd before the norm weight)")
        if not int_in(self.diag, 0, 511):
            raise ValueError(f"diag={self.diag!r}: a mask in 0..511 (1 no waits, 2 no weight copies, 4 no MMAs, "
                             "8 activations staged for a matvec task's first pass only, 16 the first chunk's "
                             "activation fragments reused for a pass's other chunks at NT = 1, 32 weights from L2: "
                             "layer 0's first 512 rows, with w_tma, 64 the wgmma path's x groups after a pass's "
                             "first used without their wait, normalisation or barrier, with wga_x, 128 the wgmma "
                             "path's next-group norm-weight loads skipped, with wga_x, 256 a whole-x staging's norm "
                             "statistics skipped)")
        if self.diag & (64 | 128) and not self.wga_x:
            raise ValueError(f"diag={self.diag} (64 / 128: the wgmma path's x ready steps / norm-weight loads "
                             "skipped) changes MK_WGA_X's staging: set wga_x too (MK_WGMMA_A=4,MK_W_TMA=1,MK_WGA_X=2)")
        for name in ("diag_l2_from", "diag_l2_n"):
            if not int_in(getattr(self, name), 0, DIAG_L2_MAX_CHUNKS):
                raise ValueError(f"{name}={getattr(self, name)!r}: gate_up chunks of a task, 0 .. {DIAG_L2_MAX_CHUNKS}")
        if (self.diag_l2_from or self.diag_l2_n) and not (self.diag & 32 and self.diag_l2_n):
            raise ValueError(f"diag_l2_from={self.diag_l2_from}, diag_l2_n={self.diag_l2_n}: the window of diag bit "
                             "32's L2 fold (gate_up's chunks A .. A + N - 1): set diag's bit 32 and N >= 1")
        if self.diag_l2_n and self.wgmma_a:
            raise ValueError(f"diag_l2_n={self.diag_l2_n}: the fold window is the default chunk loop's (batch <= 8), "
                             f"not the wgmma path's (wgmma_a={self.wgmma_a})")
        self._needs_w_tma(self.diag & 32, f"diag={self.diag} (32: weights folded into L2) folds the tensor-map copies' rows")

    def _needs_w_tma(self, on: object, why: str) -> None:
        """A switch that is on (`on` truthy) and works only through MK_W_TMA's tensor-map copies: the error says why."""
        if on and not self.w_tma:
            raise ValueError(f"{why}: set w_tma=True too (MK_W_TMA=1)")

    def _changed(self) -> list[tuple[str, str, object]]:
        """(-D name, label key, value) of each field that differs from its default (VARIANT_DEFINES order)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [(name, key, getattr(self, f)) for name, f, key in VARIANT_DEFINES if getattr(self, f) != defaults[f]]

    def defines(self) -> tuple[str, ...]:
        """The -D options of this build (defaults are left out: the default build has none)."""
        return tuple(f"-D{name}={int(v)}" for name, _, v in self._changed())  # type: ignore[call-overload]

    @property
    def layout(self) -> KernelLayout:
        return LAYOUT.with_stages(self.num_stages)

    def stages_x_whole(self, k: int, batch: int, norm: bool) -> bool:
        """Whether this build stages a matvec task's x [batch, k] whole (csrc/x_frags.cuh staged_fits): where it fits
        the ring depth's scratch (KernelLayout.staged_fits), never with MK_X_GROUPS, always with MK_X_WHOLE."""
        return self.x_whole or (not self.x_groups and self.layout.staged_fits(k, batch, norm))

    def for_batch(self, batch: int) -> KernelVariant:
        """The build that runs `batch` tokens: with MK_NTILES on (ntiles != 0), the one of batch's class (wga_only kept
        for class 2 with wgmma_a only: the wgmma path runs at two n-tiles)."""
        if not self.ntiles:
            return self
        c = batch_class(batch)
        return replace(self, ntiles=c, wga_only=self.wga_only and c == 2 and bool(self.wgmma_a))

    def with_stages(self, num_stages: int) -> KernelVariant:
        """The same build with another ring depth (0: the layout's default)."""
        return replace(self, num_stages=num_stages or LAYOUT.num_stages)

    def label(self) -> str:
        # a boolean switch reads as its name when on, name=0 when a default-on switch is turned off
        parts = [(key if v else f"{key}=0") if isinstance(v, bool)
                 else f"{key}={v.name.lower() if isinstance(v, Rounding) else v}"
                 for _, key, v in self._changed()]
        return ",".join(parts) or "default"

    @classmethod
    def parse(cls, items: list[str] | tuple[str, ...]) -> KernelVariant:
        """From NAME=VALUE strings, NAME one of VARIANT_DEFINES (a "-D" prefix is allowed): MK_ROUNDING takes
        0/1 or fused/stock, the boolean fields' switches 0/1, the others an int (MK_RELEASE_GATE an opcode
        mask). Anything else is a ValueError naming it and the supported names."""
        fields = {name: f for name, f, _ in VARIANT_DEFINES}
        flags = {f.name for f in dataclasses.fields(cls) if isinstance(f.default, bool)}
        kw: dict[str, object] = {}
        for item in items:
            name, sep, raw = item.removeprefix("-D").partition("=")
            if not sep:
                raise ValueError(f"kernel variant {item!r} must look like NAME=VALUE")
            if name not in fields:
                raise ValueError(f"unknown kernel variant {name!r}; supported: {', '.join(fields)}")
            try:
                if name == "MK_ROUNDING":
                    kw["rounding"] = Rounding(int(raw)) if raw.isdigit() else Rounding[raw.upper()]
                elif fields[name] in flags:   # 0/1 switches
                    if raw not in ("0", "1"):
                        raise ValueError(raw)
                    kw[fields[name]] = raw == "1"
                else:
                    kw[fields[name]] = int(raw, 0)
            except (KeyError, ValueError):
                raise ValueError(f"{item}: bad value {raw!r} for {name}") from None
        return cls(**kw)  # type: ignore[arg-type]
