"""The ONE source of truth for the megakernel's binary task program and its launch constants.

Everything the CUDA code (csrc/) and the Python side (tasks, schedule, VM, runtime) must agree on is
declared here once: opcodes, buffer ids, per-layer weight pointer slots, the task record's fields,
the program header, the kernel's thread/shared-memory layout, and the per-model compile-time
constants. :func:`header.generate_header` renders them as C++ (``csrc/tasks.h``, with static_asserts on
sizes); :func:`kernel_defines` renders the per-model ``-D`` options. runtime.py feeds NVRTC the
generator output directly, and a test checks that the committed ``csrc/tasks.h`` equals it.

Program layout (int32 words, one array per megakernel launch):

    header[HEADER_WORDS]                      see HEADER_FIELDS
    queue_offsets[num_queues + 1]             task index range of queue i = [off[i], off[i+1])
    (zero padding to a multiple of TASK_WORDS words, so every record is 64-byte aligned)
    tasks[num_tasks][TASK_WORDS]              see TASK_FIELDS; queue i's tasks are contiguous
"""
from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass, replace

import numpy as np

from ..spec import LlamaSpec

MAGIC = 0x4D4B5031  # "MKP1"
# 2: the kernel takes an error record and a watchdog budget (err, err_host, watchdog_ms) and exits
#    cleanly on a stuck wait instead of trapping.
# 3: the last task word is ticket_ctr (was reserved, 0): a counter an ATTN_PARTIAL task increments
#    once its partial is stored; the task that brings it to attn_chunks merges the chunks.
# 4: O_PROJ/DOWN may be cut over K (arg2 = ksplit_arg(part, parts), ticket_ctr their range's ticket) with
#    fp32 partials in PART_K, a new kernel parameter.
VERSION = 4


class Opcode(enum.IntEnum):
    NOP = 0
    QKV_ROPE = 1       # rms_norm + qkv linear + RoPE + KV append, over qkv units of one kv group
    ATTN_PARTIAL = 2   # attention of (request b, kv head g, KV chunk c): partial (m, l, o)
    ATTN_COMBINE = 3   # merge the chunks of (b, g) into ATTN_O
    O_PROJ = 4         # ATTN_O @ Wo^T + residual
    GATE_UP = 5        # rms_norm + gate_up linear + silu_and_mul
    DOWN = 6           # ACT @ Wdown^T + residual
    FINAL_NORM = 7     # final rms_norm of the residual stream
    LM_HEAD = 8        # OUT @ Wlm^T


class Buf(enum.IntEnum):
    """Activation buffers, addressed by id in task records (the kernel keeps a pointer table)."""
    HIDDEN_IN = 0   # [B, H]   caller's embedded input (read only; layer 0's residual source)
    RESID = 1       # [B, H]   residual stream after layer 0's o_proj
    Q = 2           # [B, q_size] roped q
    ATTN_O = 3      # [B, q_size] attention output
    ACT = 4         # [B, I]   silu(gate) * up
    OUT = 5         # [B, H]   final-normed hidden (caller's `out`)
    LOGITS = 6      # fp32 [B, V]
    PART_O = 7      # fp32 [B, nkv, C, G, d]   attention chunk partial o (unnormalised)
    PART_ML = 8     # fp32 [B, nkv, C, G, 2]   attention chunk partial (max score, sum of exp)
    PART_K = 9      # fp32 [KSPLIT_MAX, MAX_BATCH, H]   K-split o_proj/down partial sums (part, request, row)
    NONE = 15


NUM_BUFS = 10


class LayerPtr(enum.IntEnum):
    """Slots of one row of the device weight-pointer table ([num_layers + 1, LP_COUNT] uint64)."""
    QKV = 0
    O = 1
    GATE_UP = 2
    DOWN = 3
    IN_NORM = 4
    POST_NORM = 5


class ModelPtr(enum.IntEnum):
    """Slots of the extra last row (index num_layers) of the weight-pointer table."""
    FINAL_NORM = 0
    LM_HEAD = 1
    WEIGHT_MAPS = 2     # MK_W_TMA: device address of the weights' tensor maps (tensormap.weight_maps)


LP_COUNT = 6

# The megakernel's parameter list, (name, C type), in order: the generated header defines
# MK_DECODE_PARAMS from it and runtime.MegakernelModule.launch packs arguments by these names.
KERNEL_PARAMS: tuple[tuple[str, str], ...] = (
    ("prog", "const int* __restrict__"),                 # this launch's program (int32 words)
    ("wptr", "const unsigned long long* __restrict__"),  # [(L + 1) * LP_COUNT] weight addresses
    ("kvptr", "const unsigned long long* __restrict__"), # [L] kv cache base addresses
    ("counters", "unsigned*"),                           # [num_counters * COUNTER_STRIDE], zeroed
    ("positions", "const long long*"),                   # [B] int64
    ("slots", "const long long*"),                       # [B] int64 slot_mapping (-1: padded)
    ("seq_lens", "const int*"),                          # [>= B] int32 (0: padded)
    ("block_table", "const int*"),                       # [>= B, max_blocks] int32, row stride below
    ("bt_stride", "int"),
    ("block_size", "int"),
    ("cos_sin", "const void*"),                          # [max_pos, d] fp32 or model dtype
    ("cs_rows", "int"),
    ("cs_stride", "int"),
    ("cs_f32", "int"),
    ("hidden_in", "void*"),                              # Buf pointers (see Buf)
    ("resid", "void*"),
    ("q", "void*"),
    ("attn_o", "void*"),
    ("act", "void*"),
    ("out", "void*"),
    ("logits", "void*"),
    ("part_o", "void*"),
    ("part_ml", "void*"),
    ("part_k", "void*"),
    ("trace", "unsigned long long*"),                    # null, or [num_tasks * TRACE_WORDS]
    ("err", "int*"),                                     # [ERROR_WORDS] device error record (sticky)
    ("err_host", "int*"),                                # null, or a pinned host mirror of `err`
    ("watchdog_ms", "int"),                              # budget of every wait, in ms (>= 1)
)

# Watchdog error record (MegakernelDecoder.err, int32 words; see errors.MegakernelHang). Every wait
# of the kernel is bounded by watchdog_ms. The first wait to exceed it wins an atomicCAS on `code`
# (0 -> code), fills the other fields and, when err_host is given, copies the record there (a
# pinned host page the host can poll without synchronising). Other waits see code != 0 and bail
# out; every CTA then leaves its queue and the launch ends normally (no trap: the CUDA context
# stays usable). A launch that starts while code != 0 exits at once: the record is sticky until
# the host clears it, so a captured graph replaying a hung program does not wait again.
#   code        ErrorCode
#   sm, thread  blockIdx.x / threadIdx.x of the waiter
#   batch       the program's batch (header)
#   task_index  position of the task in this launch's task array (-1: not in a task)
#   tid, opcode, layer   of that task's record
#   counter     counter id (COUNTER_TIMEOUT), MBAR_TAG_* + ring slot (MBAR_TIMEOUT), -1
#   expected    counter target / mbarrier phase parity / 0
#   seen        counter value read last / weight chunk number / failed HeaderCheck bits
#   elapsed_us  how long the waiter waited;  budget_ms  the budget in force
ERROR_FIELDS: tuple[str, ...] = ("code", "sm", "thread", "batch", "task_index", "tid", "opcode", "layer",
                                 "counter", "expected", "seen", "elapsed_us", "budget_ms")
ERROR_WORDS = 16
E = {name: i for i, name in enumerate(ERROR_FIELDS)}


class Rounding(enum.IntEnum):
    """Where the megakernel rounds to the activation dtype (-DMK_ROUNDING=<value>; vm.py mirrors it).
    FUSED rounds once per fused op (q/k after RoPE, gate/up after silu*mul, the linear output together
    with its residual add, the norm's x * rstd * w). STOCK also rounds where vLLM's unfused ops store:
    the qkv GEMM output before RoPE, gate and up before silu*mul, o_proj/down outputs before the
    residual add, and the norm as round(round(x * rstd) * w) (vLLM's rms_norm kernels, eager and
    compiled). Attention's internals are not matched (FlashAttention's tiling is not reproducible)."""
    FUSED = 0
    STOCK = 1


class ErrorCode(enum.IntEnum):
    NONE = 0
    COUNTER_TIMEOUT = 1  # a task's dependency counter did not reach its target within the budget
    MBAR_TIMEOUT = 2     # a weight-ring mbarrier phase did not complete within the budget
    BAD_PROGRAM = 3      # the launch's program header failed the kernel's check (see HeaderCheck)


class HeaderCheck(enum.IntFlag):
    """Bits of `seen` in a BAD_PROGRAM record: which header check failed."""
    MAGIC = 1
    VERSION = 2
    SPEC_HASH = 4
    NUM_QUEUES = 8      # != grid size
    BATCH = 16          # not in 1..MAX_BATCH, or not the batch class of an MK_NTILES build
    BLOCK = 32          # blockDim.x != NUM_THREADS
    SMEM_ALIGN = 64     # MK_W_TMA: dynamic shared memory not 1024-byte aligned (the 128-byte swizzle's unit)


# `counter` of an MBAR_TIMEOUT record = tag + ring slot: which side waited for what.
MBAR_TAG_EMPTY = 1000   # producer waiting for the consumers to free a slot
MBAR_TAG_FULL = 2000    # consumer waiting for a weight chunk to land
MBAR_TAG_DRAIN = 3000   # producer waiting, before it exits, for its in-flight copies to land
MBAR_TAG_INFLIGHT = 4000   # producer waiting for an earlier chunk to land (MK_INFLIGHT's cap)
# The producer runs ahead of the consumers, so its slot waits start earlier than the counter wait
# that is really stuck: it uses this multiple of the budget, and the counter wait is reported.
PRODUCER_BUDGET_MULT = 2
WATCHDOG_MS_MAX = 600_000

# Per-task trace record (MK_TRACE / MegakernelDecoder(trace=True)), uint64 words: %globaltimer ns
# when the consumers start the task (before its waits), are ready (waits done), end (before the
# release); when the producer starts / finishes issuing the task's weight chunks; clock cycles the
# first consumer warp spent waiting for weight chunks; the SM (block) index; the opcode; and, in the
# MK_TRACE_PHASES=1 build only (else 0), a matvec task's ns in its phases, summed over its passes:
# activation staging (pass start to the chunk loop), the chunk loop (to the barrier after it: all warps
# done), the cross-warp reduction and epilogue (to the pass's last barrier); and for every task the ns of
# its release (the signal's red.release, whose fence waits for the CTA's stores: end - this = its start),
# and a matvec task's %globaltimer on entering matvec_task (ph_entry - ready: the dispatch and the call).
TRACE_FIELDS: tuple[str, ...] = ("start", "ready", "end", "prod_first", "prod_last", "wait_cycles", "sm",
                                 "opcode", "ph_stage", "ph_chunks", "ph_reduce", "ph_release", "ph_entry")
TRACE_WORDS = 13

# Task record: 16 int32 words = 64 bytes. Meaning of arg0..arg2 per opcode:
#   QKV_ROPE, O_PROJ, GATE_UP, DOWN, FINAL_NORM, LM_HEAD: arg0 = first unit, arg1 = unit count
#     (a unit = 16 output columns; see tasks.py for the unit -> weight row map of each op)
#   ATTN_PARTIAL: arg0 = request b, arg1 = kv head g, arg2 = chunk c; ticket_ctr >= 0: merge in
#     the partial (the task that brings counters[ticket_ctr] to attn_chunks merges; out_buf ATTN_O)
#   ATTN_COMBINE: arg0 = request b, arg1 = kv head g
#   O_PROJ, DOWN cut over K (tuning.ksplit): arg2 = ksplit_arg(part p, parts n) (0 = not cut): the task sums
#     K columns ksplit_range(K, p, n) into PART_K[p]; ticket_ctr = its unit range's ticket: the task that
#     brings it to n adds PART_K[0..n-1] in that order to the residual and stores the output
# A wait is (counter, target): the task starts once counters[ctr] >= target; ctr -1 = no wait.
# The signal adds signal_add to counters[signal_ctr] once the task's stores are visible.
TASK_FIELDS: tuple[str, ...] = (
    "opcode", "layer", "arg0", "arg1", "arg2", "in_buf", "res_buf", "out_buf",
    "wait0_ctr", "wait0_target", "wait1_ctr", "wait1_target", "signal_ctr", "signal_add",
    "tid", "ticket_ctr",
)
TASK_WORDS = 16
NUM_WAITS = 2
F = {name: i for i, name in enumerate(TASK_FIELDS)}

HEADER_FIELDS: tuple[str, ...] = (
    "magic", "version", "num_queues", "batch", "num_tasks", "attn_chunks", "tasks_at", "spec_hash",
)
HEADER_WORDS = 8
H = {name: i for i, name in enumerate(HEADER_FIELDS)}

KSPLIT_SHIFT = 8   # arg2 of a K-split task: parts << KSPLIT_SHIFT | part


def ksplit_arg(part: int, parts: int) -> int:
    if not 0 <= part < parts or parts < 2:
        raise ValueError(f"K-split part {part} of {parts}: need parts >= 2 and 0 <= part < parts")
    return parts << KSPLIT_SHIFT | part


def ksplit_parts(arg2: int) -> tuple[int, int]:
    """(part, parts) of a K-split task's arg2 (ksplit_arg's inverse; the kernel's ksplit_part/ksplit_parts)."""
    return arg2 & ((1 << KSPLIT_SHIFT) - 1), arg2 >> KSPLIT_SHIFT


def ksplit_range(K: int, part: int, parts: int) -> tuple[int, int]:
    """Columns [lo, hi) of K that part `part` of `parts` sums: steps of 64 columns shared out evenly (16 where K
    is not a multiple of 64), the kernel's ksplit_range (csrc/matvec.cuh). 64: MK_W_TMA copies a part's weights in
    64-column groups (one 128-byte swizzle line per row), so a part must start on one (session 19)."""
    g = 64 if K % 64 == 0 else 16
    steps = K // g
    return g * (steps * part // parts), g * (steps * (part + 1) // parts)


# csrc/wga_x.cuh WGA_KC (wga_takes): a task runs on MK_WGMMA_A's path at two n-tiles (batch > 8) with whole chunks of
# this many columns
WGA_KC = 256


def wga_takes(k: int, batch: int) -> bool:
    """csrc/wga_x.cuh wga_takes in an MK_WGMMA_A build: a task of reduction width k (a K-split task's part) runs on
    the wgmma path at batch > 8 (two n-tiles) with whole WGA_KC-column chunks. (MK_WGA_ONLY makes the kernel's form
    constant true, for programs where this holds for every task: tasks.class_build.)"""
    return batch > 8 and k % WGA_KC == 0

# Counters are uint32, one per COUNTER_STRIDE words (32 bytes: one L2 sector each).
COUNTER_STRIDE = 8
MAX_BATCH = 16
UNIT = 16  # output columns per unit (one m16 MMA tile of weight rows)


@dataclass(frozen=True)
class KernelLayout:
    """Thread roles and shared memory of one CTA (one per SM).

    Warps 0..CONSUMER_WARPS-1 compute tasks; warp CONSUMER_WARPS is the producer that streams the
    weights of its SM's queue, in queue order, through a ring of NUM_STAGES shared-memory slots
    (cp.async.bulk, completion on mbarriers) independent of the counters, so the weights of the
    next tasks arrive while the consumers wait. A slot holds one chunk: the 16 rows of one M-tile x
    CHUNK_COLS columns (16 bulk copies of 2 KiB), rows padded by 16 bytes (conflict-free ldmatrix).
    (A first version used chunks of up to 128 rows x 128 columns, i.e. 256-byte copies: a 1B step
    took 2.1 ms on the H200 against 1.4 ms with this layout, other things equal but x prefetch.)"""
    consumer_warps: int = 8
    producer_warps: int = 1
    num_stages: int = 6
    chunk_cols: int = 1024          # columns of a chunk (16-bit elements)
    union_bytes: int = 32768        # per-task scratch: matvec reduction / attention merge
    acc_tiles: int = 8              # m16n8 accumulator tiles per warp (M-tiles * N-tiles of a pass)
    misc_bytes: int = 768           # mbarriers, rstd[16], the step's per-request inputs, kernel parameters

    @property
    def row_bytes(self) -> int:
        """Shared-memory stride of a chunk row: 16 B of padding, an odd number of 16 B units."""
        return self.chunk_cols * 2 + 16

    @property
    def slot_bytes(self) -> int:
        return 16 * self.row_bytes

    @property
    def num_threads(self) -> int:
        return 32 * (self.consumer_warps + self.producer_warps)

    @property
    def smem_bytes(self) -> int:
        return self.num_stages * self.slot_bytes + self.union_bytes + self.misc_bytes


    def staged_fits(self, k: int, batch: int, norm: bool) -> bool:
        """Whether a matvec task's x [batch, k] (and a norm-fused op's weight row) is staged whole in the scratch,
        rows padded to k * 2 + 16 bytes, the per-warp row sums at its end (csrc/x_frags.cuh staged_fits); else its
        activations come by column groups (and MK_RSTD_EPI scales by 1/rms in the epilogue)."""
        stage_part_bytes = 4 * self.consumer_warps * MAX_BATCH
        return (batch + (1 if norm else 0)) * (k * 2 + 16) <= self.union_bytes - stage_part_bytes

    def with_stages(self, num_stages: int) -> KernelLayout:
        """The same shared memory with a ring of num_stages slots: the per-task scratch takes what the
        ring gives up (a deeper scratch stages larger activations: matvec.cuh staged_fits)."""
        return replace(self, num_stages=num_stages,
                       union_bytes=self.union_bytes + (self.num_stages - num_stages) * self.slot_bytes)


LAYOUT = KernelLayout()
SMEM_LIMIT = 232448  # sm_90 max dynamic shared memory per block (227 KiB)
# Ring depths a kernel can be compiled with (-DMK_NUM_STAGES; the autotuner's tuning.num_stages).
# 6 is the GPU-measured default; 5 gives the scratch 64.25 KiB, which stages batch-8 activations of
# qkv_rope, o_proj and gate_up (K = 2048: (8 + 1) x 4112 B) that 32 KiB cannot; 4 gives 96.5 KiB.
STAGE_CHOICES = (4, 5, 6)


def _check_layout() -> None:
    for n in STAGE_CHOICES:
        lay = LAYOUT.with_stages(n)
        assert lay.smem_bytes == LAYOUT.smem_bytes and lay.union_bytes % 128 == 0, n
    lay = LAYOUT
    assert lay.smem_bytes <= SMEM_LIMIT, lay.smem_bytes
    assert lay.chunk_cols % (16 * lay.consumer_warps) == 0
    assert (lay.row_bytes // 16) % 2 == 1  # odd number of 16 B units: conflict-free ldmatrix
    assert lay.union_bytes >= lay.consumer_warps * lay.acc_tiles * 32 * 16  # matvec reduction


_check_layout()


# --------------------------------------------------------------------------------------------
# Per-model compile-time constants
# --------------------------------------------------------------------------------------------

def kernel_defines(spec: LlamaSpec) -> list[str]:
    """The -D options that specialise csrc/ to one model (same list for NVRTC and nvcc)."""
    d = {
        "MK_HIDDEN": spec.hidden_size,
        "MK_INTER": spec.intermediate_size,
        "MK_NQ": spec.num_q_heads,
        "MK_NKV": spec.num_kv_heads,
        "MK_HEAD_DIM": spec.head_dim,
        "MK_VOCAB": spec.vocab_size,
        "MK_LAYERS": spec.num_layers,
        "MK_DTYPE_BF16": 1 if spec.dtype == "bfloat16" else 0,
    }
    out = [f"-D{k}={v}" for k, v in d.items()]
    out.append(f"-DMK_EPS={float(spec.rms_eps)!r}f")
    out.append(f"-DMK_SPEC_HASH={spec_hash_of(out)}")
    return out


def spec_hash_of(defines: list[str]) -> int:
    """31-bit hash of the model defines; stored in each program header and compiled into the
    kernel, which traps if a program built for another model is launched on it."""
    return zlib.crc32(" ".join(x for x in defines if not x.startswith("-DMK_SPEC_HASH")).encode()) & 0x7FFFFFFF


def spec_hash(spec: LlamaSpec) -> int:
    return spec_hash_of(kernel_defines(spec))


def megakernel_supports(spec: LlamaSpec) -> str | None:
    """None if the megakernel can run `spec`, else the reason (the caller falls back to Triton).
    Every valid LlamaSpec is supported today (head_dim 64/128, sizes multiples of 16, any GQA
    group: attention processes a group's q heads in passes of at most 4)."""
    del spec
    return None


# --------------------------------------------------------------------------------------------
# Encoding / decoding
# --------------------------------------------------------------------------------------------

def tasks_offset(num_queues: int) -> int:
    """Word index of the first task record: header + offsets, padded to TASK_WORDS."""
    n = HEADER_WORDS + num_queues + 1
    return -(-n // TASK_WORDS) * TASK_WORDS


def encode(records: list[list[int]], queues: list[list[int]], *, batch: int, attn_chunks: int,
           spec_hash: int) -> np.ndarray:
    """Pack task records (lists of TASK_WORDS ints, indexed by position in `records`) and per-SM
    queues (lists of record indices, in execution order) into one int32 program array."""
    nq = len(queues)
    order = [i for q in queues for i in q]
    if sorted(order) != list(range(len(records))):
        raise ValueError("every task must appear in exactly one queue")
    at = tasks_offset(nq)
    prog = np.zeros(at + len(order) * TASK_WORDS, dtype=np.int32)
    hdr = {"magic": MAGIC, "version": VERSION, "num_queues": nq, "batch": batch,
           "num_tasks": len(order), "attn_chunks": attn_chunks, "tasks_at": at, "spec_hash": spec_hash}
    for k, v in hdr.items():
        prog[H[k]] = v
    off = 0
    for i, q in enumerate(queues):
        prog[HEADER_WORDS + i] = off
        off += len(q)
    prog[HEADER_WORDS + nq] = off
    # One conversion of all records and one gather into queue order (a slice write per record was ~1 us each)
    try:
        table = np.array(records, dtype=np.int32) if records else np.zeros((0, TASK_WORDS), dtype=np.int32)
    except (ValueError, OverflowError):   # ragged records, or a word out of int32's range
        _check_record_lengths(records, order)
        raise
    if table.shape != (len(records), TASK_WORDS):
        _check_record_lengths(records, order)
        raise ValueError(f"records must be lists of {TASK_WORDS} ints, got an array of shape {table.shape}")
    prog[at:] = table[order].reshape(-1)
    return prog


def _check_record_lengths(records: list[list[int]], order: list[int]) -> None:
    """Raise ValueError naming the first record, in queue order, that is not TASK_WORDS words long."""
    for idx in order:
        if len(records[idx]) != TASK_WORDS:
            raise ValueError(f"record {idx} has {len(records[idx])} words, expected {TASK_WORDS}")


@dataclass(frozen=True)
class DecodedProgram:
    header: dict[str, int]
    queues: list[list[dict[str, int]]]  # per queue, the decoded task records in order

    @property
    def num_tasks(self) -> int:
        return sum(len(q) for q in self.queues)


def decode(prog: np.ndarray) -> DecodedProgram:
    """Inverse of :func:`encode` (checks magic, version and bounds)."""
    p = np.asarray(prog, dtype=np.int32)
    hdr = {k: int(p[i]) for k, i in H.items()}
    if hdr["magic"] != MAGIC or hdr["version"] != VERSION:
        raise ValueError(f"not a megakernel program (magic {hdr['magic']:#x}, version {hdr['version']})")
    nq = hdr["num_queues"]
    offs = [int(x) for x in p[HEADER_WORDS: HEADER_WORDS + nq + 1]]
    at = hdr["tasks_at"]
    if at != tasks_offset(nq) or offs[-1] != hdr["num_tasks"] or p.size != at + offs[-1] * TASK_WORDS:
        raise ValueError("corrupt program: offsets/size disagree with the header")
    queues = []
    for i in range(nq):
        q = []
        for t in range(offs[i], offs[i + 1]):
            w = p[at + t * TASK_WORDS: at + (t + 1) * TASK_WORDS]
            q.append({name: int(w[j]) for j, name in enumerate(TASK_FIELDS)})
        queues.append(q)
    return DecodedProgram(hdr, queues)
