"""MegakernelDecoder: one decode step through the persistent megakernel (the drop-in twin of
mk_plugin.triton_ops.decode_step without spec/weights arguments).

Per padded batch size the decoder builds (lazily, or eagerly with prepare()) a Program
(schedule.build_program) and uploads its segment programs; a step then is: zero the counters (a
captured memset), launch each megakernel segment on torch's current stream, and run each
`fallback` op with the Triton kernels between segments, on the same buffers. Nothing is allocated
and the host never waits on the device inside a call once the batch size is prepared (CUDA-graph
capturable), except the optional `out` / `logits_out` allocations when they are not given.

executor="vm" runs the megakernel segments on the CPU interpreter (vm.py) instead of the GPU: the
same programs and fallback glue, for CPU tests. It also models the watchdog: a segment the VM
cannot finish (DeadlockError) fills the error record the way the kernel does.

Reliability (see errors.py and the README's failure-mode table):
- Watchdog: every wait in the kernel is bounded by watchdog_ms (MK_WATCHDOG_MS). A stuck wait
  fills `err` (encoding.ERROR_FIELDS; mirrored to a pinned host page on CUDA), every CTA leaves its
  queue and the launch ends; the record is sticky (later launches exit at once) until
  check_errors() reads it, raises MegakernelHang and clears it. pending_error() polls the host
  mirror without synchronising. __call__(check=True) synchronises after the step and, on a hang,
  recomputes the step with the Triton path (valid because an aborted launch writes only the
  locations a complete step writes, and the Triton step rewrites every one of them: see
  _recompute_triton), then raises (on_hang="raise") or returns (on_hang="fallback").
- Guard rails: every program gets a ProgramMeta (spec hash, batch, SM count, shared memory,
  encoding version, kernel source hash, lm_head, fallback ops), checked against this decoder and
  the live device before it is uploaded for launching (ProgramMismatch lists every mismatch).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from ..config import get_config
from ..spec import LlamaSpec
from ..triton_ops._checks import check_shape, check_tensor, check_tokens
from ..triton_ops._device import device_name
from ..weights import ModelWeights
from . import vm as _vm
from .encoding import (
    COUNTER_STRIDE,
    ERROR_FIELDS,
    ERROR_WORDS,
    HEADER_WORDS,
    LAYOUT,
    LP_COUNT,
    MAGIC,
    TASK_FIELDS,
    TASK_WORDS,
    TRACE_FIELDS,
    TRACE_WORDS,
    VERSION,
    WATCHDOG_MS_MAX,
    Buf,
    ErrorCode,
    F,
    H,
    LayerPtr,
    ModelPtr,
    decode,
    rounding_of,
    spec_hash,
)
from .errors import MegakernelHang, ProgramMismatch
from .graph import FusedOp, residual_source
from .schedule import FallbackStep, Program, Segment, build_program
from .tasks import attention_chunks
from .tuning import DEFAULT_TUNING, ScheduleTuning, resolve, spec_tuning_key

EXECUTORS = ("cuda", "vm")
ON_HANG = ("raise", "fallback")
logger = logging.getLogger("mk_plugin.persistent")


# ---- guard rails: program metadata ----------------------------------------------------------------
@dataclass(frozen=True)
class ProgramMeta:
    """What a compiled program was built for; checked before it is handed to a launch."""
    spec_hash: int          # encoding.spec_hash(spec): the model constants compiled into the kernel
    spec_name: str
    batch: int
    num_sms: int            # queues per segment = grid size (one CTA per SM, all co-resident)
    smem_bytes: int         # dynamic shared memory per CTA the kernel layout needs
    encoding_version: int   # encoding.VERSION of the program words
    source_hash: str        # runtime.source_hash(): the kernel text the layout belongs to
    lm_head: bool
    fallback: frozenset[str]
    attn_chunks: int = 0    # KV chunks per (request, kv head): sizes the partial-attention buffers


def program_meta(program: Program, source: str | None = None) -> ProgramMeta:
    """ProgramMeta of `program`. Header-backed fields (version, spec hash, batch, queues) are read
    from the encoded words of its segments, so a program whose words disagree with its Python
    attributes is caught; ProgramMismatch if the segments disagree among themselves."""
    from .runtime import source_hash

    p = program
    hdrs = [{k: int(seg.encoded[i]) for k, i in H.items()} for seg in p.segments]  # raw words: no decode checks
    vals: dict[str, set[int]] = {k: {h[k] for h in hdrs}
                                 for k in ("version", "spec_hash", "batch", "num_queues", "attn_chunks")}
    bad = [f"segments disagree on {k}: {sorted(v)}" for k, v in vals.items() if len(v) > 1]
    bad += [f"segment {i} is not a megakernel program (magic {h['magic']:#x})" for i, h in enumerate(hdrs)
            if h["magic"] != MAGIC]
    if bad:
        raise ProgramMismatch(bad)

    def one(k: str, default: int) -> int:
        return next(iter(vals[k])) if vals[k] else default

    return ProgramMeta(spec_hash=one("spec_hash", spec_hash(p.spec)), spec_name=p.spec.name, batch=one("batch", p.batch),
                       num_sms=one("num_queues", p.num_sms), smem_bytes=LAYOUT.smem_bytes,
                       encoding_version=one("version", VERSION), source_hash=source or source_hash(),
                       lm_head=p.lm_head, fallback=frozenset(p.fallback),
                       attn_chunks=one("attn_chunks", p.attn_chunks))


def meta_mismatches(meta: ProgramMeta, want: ProgramMeta, *, device_sms: int | None = None,
                    device_smem: int | None = None) -> list[str]:
    """Every field of `meta` (the program) that differs from `want` (what the decoder will launch),
    plus the live device's limits: the grid must fit the SMs (all CTAs co-resident, else the
    program deadlocks) and the shared memory must fit one block."""
    out = []
    if meta.spec_hash != want.spec_hash:
        out.append(f"model spec: program built for {meta.spec_name!r} (hash {meta.spec_hash:#x}), the decoder "
                   f"runs {want.spec_name!r} (hash {want.spec_hash:#x})")
    for f, label in (("batch", "batch size"), ("num_sms", "SM count (grid)"), ("smem_bytes", "shared memory bytes"),
                     ("encoding_version", "encoding version"), ("source_hash", "kernel source hash"),
                     ("lm_head", "lm_head"), ("fallback", "fallback ops"),
                     ("attn_chunks", "attention chunks (partial buffers are sized for the decoder's)")):
        a, b = getattr(meta, f), getattr(want, f)
        if a != b:
            if isinstance(a, frozenset):
                a, b = sorted(a), sorted(b)
            out.append(f"{label}: program {a!r}, decoder {b!r}")
    if device_sms is not None and meta.num_sms > device_sms:
        out.append(f"SM count: the program's grid of {meta.num_sms} CTAs exceeds the device's {device_sms} SMs "
                   "(the CTAs would not all be co-resident: the launch would deadlock)")
    if device_smem is not None and meta.smem_bytes > device_smem:
        out.append(f"shared memory: the kernel needs {meta.smem_bytes} bytes per block, the device allows "
                   f"{device_smem}")
    return out


def with_unsatisfiable_wait(program: Program, tid: int | None = None) -> Program:
    """A deliberately corrupted copy of `program` (tests of the watchdog): task `tid` (default: the
    first task of the middle op that has a wait) waits for its counter to reach one more than the
    counter's total, which never happens. vm.check_deadlock_free rejects the result; on the GPU the
    watchdog fires on the SM that runs that task."""
    segs = [s for s in program.steps if isinstance(s, Segment)]
    cands = [(si, i) for si, s in enumerate(segs) for i, w in enumerate(s.waits) if w]
    if tid is not None:
        cands = [(si, i) for si, i in cands if segs[si].tasks[i].tid == tid]
        if not cands:
            raise ValueError(f"task {tid} is not a megakernel task with a dependency wait")
    elif not cands:
        raise ValueError("the program has no megakernel task with a dependency wait")
    si, i = cands[len(cands) // 2] if tid is None else cands[0]
    seg = segs[si]
    (c, _), *rest = seg.waits[i]
    waits = [list(w) for w in seg.waits]
    waits[i] = [(c, program.counters[c].total + 1), *rest]
    words = seg.encoded.copy()
    at = int(words[H["tasks_at"]])
    pos = [t for q in seg.queues for t in q].index(i)   # the record's slot in the encoded task array
    rec = at + pos * TASK_WORDS
    assert words[rec + F["tid"]] == seg.tasks[i].tid and words[rec + F["wait0_ctr"]] == c
    words[rec + F["wait0_target"]] = program.counters[c].total + 1
    bad = replace(seg, waits=waits, encoded=words)
    return replace(program, steps=[bad if s is seg else s for s in program.steps])


@dataclass
class _Entry:
    program: Program
    seg_progs: list[torch.Tensor | None]   # device int32 program per step (None: fallback step)
    counters: torch.Tensor                 # int32 [num_counters * COUNTER_STRIDE]
    traces: list[torch.Tensor | None] | None = None  # int64 [num_tasks * TRACE_WORDS] per segment
    meta: ProgramMeta | None = field(default=None)


class MegakernelDecoder:
    """Decode steps of up to max_tokens (<= 16) tokens of one model on one device."""

    def __init__(self, spec: LlamaSpec, weights: ModelWeights, max_tokens: int, device: str | torch.device, *,
                 fallback: frozenset[str] = frozenset(), lm_head: bool = False, num_sms: int | None = None,
                 executor: str | None = None, trace: bool | None = None, watchdog_ms: int | None = None,
                 defines: tuple[str, ...] = (), tuning: str | dict[int, ScheduleTuning] | None = None):
        """tuning: per padded batch size, how the step is cut into tasks (persistent.tuning). A dict
        {batch: ScheduleTuning} (missing batches: default), or an MK_TUNING setting ("auto", "off",
        a table file); None reads MK_TUNING."""
        self.spec = spec
        self.weights = weights
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors report cuda:<index>
            self.device = torch.device("cuda", torch.cuda.current_device())
        check_tokens("max_tokens", max_tokens)
        self.max_tokens = max_tokens
        # Rounding points: the -DMK_ROUNDING of `defines` (one source for the kernel and the VM)
        self.defines = tuple(defines)
        self.rounding = rounding_of(self.defines)
        self.fallback = frozenset(fallback)
        self.lm_head = lm_head
        self.trace = get_config().trace if trace is None else trace
        self.executor = executor or ("cuda" if self.device.type == "cuda" else "vm")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor={self.executor!r}; choose one of {EXECUTORS}")
        if self.executor == "cuda" and self.device.type != "cuda":
            raise ValueError(f"executor 'cuda' needs a CUDA device, got {self.device}")
        if num_sms is None:
            num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                       if self.device.type == "cuda" else 132)
        self.num_sms = int(num_sms)
        self.watchdog_ms = get_config().watchdog_ms if watchdog_ms is None else watchdog_ms
        if isinstance(self.watchdog_ms, bool) or not isinstance(self.watchdog_ms, int) \
                or not 1 <= self.watchdog_ms <= WATCHDOG_MS_MAX:
            raise ValueError(f"watchdog_ms={self.watchdog_ms!r} must be an int in 1..{WATCHDOG_MS_MAX} "
                             "(every wait is bounded)")
        # The watchdog's error record (encoding.ERROR_FIELDS), and on CUDA a pinned host mirror the
        # kernel writes too: pending_error() reads it without synchronising (UVA: a pinned host
        # page is addressable from the device at its host address).
        self.err = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=self.device)
        self._err_host = (torch.zeros(ERROR_WORDS, dtype=torch.int32, pin_memory=True)
                          if self.device.type == "cuda" else None)
        self._err_host_np = self._err_host.numpy() if self._err_host is not None else None
        self.hangs: list[MegakernelHang] = []    # every hang check_errors()/check=True has seen
        self._resolve_tunings(get_config().tuning if tuning is None else tuning)
        self._check_weights()
        self._wptr = self._weight_table() if self.executor == "cuda" else None
        self._alloc_workspace()
        self._entries: dict[int, _Entry] = {}
        self._kv_key: tuple[int, ...] | None = None
        self._kvptr: torch.Tensor | None = None
        self._module = None       # the kernel of the decoder's own defines
        self._modules: dict[tuple[str, ...], object] = {}   # + a tuning's defines (ring depth)
        if self.executor == "cuda":
            self._module = self._module_with(())

    # ---- set-up --------------------------------------------------------------------------------
    def _resolve_tunings(self, tuning: str | dict[int, ScheduleTuning]) -> None:
        """self.tunings[b] / self.tuning_source[b] for every batch 1..max_tokens, fixed for the
        decoder's life (the workspace is sized from them)."""
        self.tunings: dict[int, ScheduleTuning] = {}
        self.tuning_source: dict[int, str] = {}
        if isinstance(tuning, dict):
            bad = [b for b in tuning if not isinstance(b, int) or not 1 <= b <= self.max_tokens]
            if bad:
                raise ValueError(f"tuning given for batch sizes {bad}; this decoder handles 1..{self.max_tokens}")
            for b in range(1, self.max_tokens + 1):
                self.tunings[b] = tuning.get(b, DEFAULT_TUNING)
                self.tuning_source[b] = "given" if b in tuning else "default"
            return
        sizes = range(1, self.max_tokens + 1)
        keys = [spec_tuning_key(self.spec, b, self.num_sms, self.lm_head, self.fallback) for b in sizes]
        for b, (t, src) in zip(sizes, resolve(tuning, device_name(self.device) or "cpu", keys)):
            self.tunings[b], self.tuning_source[b] = t, src

    def _module_with(self, extra: tuple[str, ...]):
        """The MegakernelModule of the decoder's defines plus `extra` (a tuning's), one per set."""
        from .runtime import MegakernelModule
        key = tuple(self.defines) + tuple(extra)
        if key not in self._modules:
            self._modules[key] = MegakernelModule(self.spec, defines=key)
        return self._modules[key]

    def module(self, batch: int):
        """The kernel that runs the program of `batch` tokens (CUDA executor)."""
        return self._module_with(self.tunings[batch].defines())

    def attn_chunks(self, batch: int) -> int:
        """KV chunks per (request, kv head) of the program for `batch` tokens."""
        return self.tunings[batch].attn_chunks or attention_chunks(batch, self.spec.num_kv_heads, self.num_sms)

    def _check_weights(self) -> None:
        s, dt, dev = self.spec, self.spec.torch_dtype, self.device
        w = self.weights
        if len(w.layers) != s.num_layers:
            raise ValueError(f"weights have {len(w.layers)} layers, spec.num_layers={s.num_layers}")

        def chk(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
            check_tensor(name, t, dtypes=(dt,), device=dev)
            check_shape(name, t, shape)
            if self.executor == "cuda" and t.data_ptr() % 16:
                raise ValueError(f"{name} is not 16-byte aligned (bulk copies need it)")

        h, i = s.hidden_size, s.intermediate_size
        for li, lw in enumerate(w.layers):
            chk(f"layers[{li}].qkv", lw.qkv, (s.qkv_size, h))
            chk(f"layers[{li}].o", lw.o, (h, s.q_size))
            chk(f"layers[{li}].gate_up", lw.gate_up, (2 * i, h))
            chk(f"layers[{li}].down", lw.down, (h, i))
            chk(f"layers[{li}].input_norm", lw.input_norm, (h,))
            chk(f"layers[{li}].post_norm", lw.post_norm, (h,))
        chk("final_norm", w.final_norm, (h,))
        if self.lm_head:
            chk("lm_head", w.lm_head, (s.vocab_size, h))

    def _weight_table(self) -> torch.Tensor:
        """[(L + 1) * LP_COUNT] int64 device addresses (encoding.LayerPtr / ModelPtr slots)."""
        rows = []
        for lw in self.weights.layers:
            row = [0] * LP_COUNT
            row[LayerPtr.QKV] = lw.qkv.data_ptr()
            row[LayerPtr.O] = lw.o.data_ptr()
            row[LayerPtr.GATE_UP] = lw.gate_up.data_ptr()
            row[LayerPtr.DOWN] = lw.down.data_ptr()
            row[LayerPtr.IN_NORM] = lw.input_norm.data_ptr()
            row[LayerPtr.POST_NORM] = lw.post_norm.data_ptr()
            rows += row
        last = [0] * LP_COUNT
        last[ModelPtr.FINAL_NORM] = self.weights.final_norm.data_ptr()
        last[ModelPtr.LM_HEAD] = self.weights.lm_head.data_ptr() if self.lm_head else 0
        rows += last
        return torch.tensor(rows, dtype=torch.int64).to(self.device)

    def _alloc_workspace(self) -> None:
        s, dt, dev, m = self.spec, self.spec.torch_dtype, self.device, self.max_tokens

        def buf(n: int, dtype: torch.dtype = dt) -> torch.Tensor:
            return torch.zeros(m, n, dtype=dtype, device=dev)

        self.ws = {Buf.RESID: buf(s.hidden_size), Buf.Q: buf(s.q_size), Buf.ATTN_O: buf(s.q_size),
                   Buf.ACT: buf(s.intermediate_size)}
        self._alloc_parts(max(b * s.num_kv_heads * self.attn_chunks(b) for b in range(1, m + 1)))
        # Triton fallback scratch: the qkv projection and split-KV attention partials.
        self.qkv_tmp = buf(s.qkv_size)
        from ..triton_ops.paged_attention import MAX_SPLITS, paged_attention_workspace_size
        self.attn_ws = torch.zeros(paged_attention_workspace_size(m, s.num_q_heads, s.head_dim, MAX_SPLITS),
                                   dtype=torch.float32, device=dev)

    def _alloc_parts(self, parts: int) -> None:
        """fp32 split-KV partials (o; m, l) of `parts` (request, kv head, chunk) triples."""
        s = self.spec
        self.part_o = torch.zeros(parts * s.gqa_group * s.head_dim, dtype=torch.float32, device=self.device)
        self.part_ml = torch.zeros(parts * s.gqa_group * 2, dtype=torch.float32, device=self.device)

    def program(self, batch: int) -> Program:
        return self._entry(batch).program

    def prepare(self, batch_sizes: list[int] | None = None) -> None:
        """Build (and for CUDA, compile and upload) the programs of these padded batch sizes now,
        outside any CUDA-graph capture. Default: 1..max_tokens."""
        sizes = batch_sizes or range(1, self.max_tokens + 1)
        for b in sizes:
            self._entry(b)
        if self._module is not None:
            idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
            for b in sizes:
                self.module(b).kernel(idx)

    def _entry(self, batch: int) -> _Entry:
        e = self._entries.get(batch)
        if e is not None:
            return e
        if not 1 <= batch <= self.max_tokens:
            raise ValueError(f"batch of {batch} tokens; this decoder handles 1..{self.max_tokens}")
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"megakernel program for batch {batch} is not built; call "
                               "MegakernelDecoder.prepare() before CUDA-graph capture")
        prog = build_program(self.spec, batch, self.num_sms, lm_head=self.lm_head, fallback=self.fallback,
                             tuning=self.tunings[batch])
        e = self._upload(prog, program_meta(prog, self._source_hash()))
        self._entries[batch] = e
        return e

    def install_program(self, program: Program) -> None:
        """Use `program` for its batch size from now on (e.g. a deliberately corrupted one in the
        watchdog test, or a rebuilt one). Its metadata is checked first (ProgramMismatch)."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("install_program() uploads a program: not during CUDA-graph capture")
        if not 1 <= program.batch <= self.max_tokens:
            raise ProgramMismatch([f"batch size: program {program.batch}, decoder handles 1..{self.max_tokens}"])
        self._entries[program.batch] = self._upload(program, program_meta(program, self._source_hash()))

    def expected_meta(self, batch: int) -> ProgramMeta:
        """The ProgramMeta a program must have to be launched by this decoder for `batch` tokens."""
        return ProgramMeta(spec_hash=spec_hash(self.spec), spec_name=self.spec.name, batch=batch,
                           num_sms=self.num_sms, smem_bytes=LAYOUT.smem_bytes, encoding_version=VERSION,
                           source_hash=self._source_hash(), lm_head=self.lm_head, fallback=self.fallback,
                           attn_chunks=self.attn_chunks(batch))

    def retune(self, batch: int, tuning: ScheduleTuning) -> None:
        """Build the program of `batch` with `tuning` from now on (the autotuner's A/B; a set-up call:
        graphs captured before it replay the old program). Grows the partial buffers if needed."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("retune() rebuilds a program: not during CUDA-graph capture")
        if not 1 <= batch <= self.max_tokens:
            raise ValueError(f"batch of {batch} tokens; this decoder handles 1..{self.max_tokens}")
        self.tunings[batch], self.tuning_source[batch] = tuning, "retune"
        self._entries.pop(batch, None)
        need = max(b * self.spec.num_kv_heads * self.attn_chunks(b) for b in range(1, self.max_tokens + 1))
        if need * self.spec.gqa_group * self.spec.head_dim > self.part_o.numel():
            self._alloc_parts(need)

    def check_meta(self, meta: ProgramMeta, batch: int | None = None) -> None:
        """Raise ProgramMismatch listing every way `meta` differs from this decoder and its device
        (a cheap host-side check, done before each program is handed to a launch, never per step)."""
        dev_sms = dev_smem = None
        if self.executor == "cuda" and self.device.type == "cuda":
            dev_sms, dev_smem = self._device_limits()
        bad = meta_mismatches(meta, self.expected_meta(meta.batch if batch is None else batch),
                              device_sms=dev_sms, device_smem=dev_smem)
        if bad:
            raise ProgramMismatch(bad)

    def _device_limits(self) -> tuple[int, int]:
        """(SM count, max dynamic shared memory per block) of the live device."""
        props = torch.cuda.get_device_properties(self.device)
        smem = getattr(props, "shared_memory_per_block_optin", None) or LAYOUT.smem_bytes
        return int(props.multi_processor_count), int(smem)

    def _source_hash(self) -> str:
        from .runtime import source_hash
        return source_hash()

    def _upload(self, prog: Program, meta: ProgramMeta) -> _Entry:
        self.check_meta(meta, prog.batch)
        segs = [torch.from_numpy(s.encoded).to(self.device) if isinstance(s, Segment) else None
                for s in prog.steps]
        counters = torch.zeros(max(1, prog.num_counters) * COUNTER_STRIDE, dtype=torch.int32, device=self.device)
        traces = None
        if self.trace:
            traces = [torch.zeros(len(s.tasks) * TRACE_WORDS, dtype=torch.int64, device=self.device)
                      if isinstance(s, Segment) else None for s in prog.steps]
        return _Entry(prog, segs, counters, traces, meta)

    # ---- watchdog: the error record ----------------------------------------------------------------
    def pending_error(self) -> bool:
        """True if a launch has recorded a watchdog failure that nobody has cleared yet. No host
        synchronisation: reads the pinned host mirror (CUDA) or the record itself (VM), so a failure
        of work still queued on the GPU is only seen once the GPU has got there."""
        if self._err_host_np is not None:
            return int(self._err_host_np[0]) != 0
        if self.device.type == "cuda":  # pragma: no cover - the mirror always exists on CUDA
            return False
        return int(self.err[0]) != 0

    def error_record(self) -> dict[str, int] | None:
        """The device error record as a dict (None if clear). Synchronises with the device."""
        if self.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("error_record() synchronises: not during CUDA-graph capture")
            torch.cuda.synchronize(self.device)
        words = self.err.cpu().tolist()
        if words[0] == 0:
            return None
        return {k: words[i] for i, k in enumerate(ERROR_FIELDS)}

    def clear_errors(self) -> None:
        """Reset the record (device and host mirror): later launches run again."""
        self.err.zero_()
        if self._err_host is not None:
            self._err_host.zero_()

    def check_errors(self, *, clear: bool = True) -> None:
        """Raise MegakernelHang if a launch recorded a watchdog failure (synchronises with the
        device); with clear=True (default) the record is reset first, so later launches run."""
        rec = self.error_record()
        if rec is None:
            return
        if clear:
            self.clear_errors()
        hang = self._hang(rec)
        self.hangs.append(hang)
        raise hang

    def _hang(self, rec: dict[str, int], *, recovered: bool = False) -> MegakernelHang:
        return MegakernelHang(rec, op=self._op_of(rec), recovered=recovered, diagnosis=self._diagnose(rec))

    def _diagnose(self, rec: dict[str, int]) -> str | None:
        """Post-mortem of a hang (host side, after the launch ended): does the CPU deadlock checker
        reject the program of the record's batch, and which counters (CUDA: read back from the
        device) stayed short of their totals."""
        e = self._entries.get(rec["batch"])
        if e is None or rec["code"] == ErrorCode.BAD_PROGRAM:
            return None
        try:
            _vm.check_deadlock_free(e.program)
            parts = [("the CPU deadlock checker accepts this program, so the hang came from the launch itself "
                      "(CTAs not all co-resident -- SMs held by another kernel, MPS or green contexts -- or a "
                      "kernel bug)")]
        except _vm.DeadlockError as x:
            parts = [f"the CPU deadlock checker rejects this program: {str(x).splitlines()[0]}"]
        if self.executor == "cuda":
            vals = e.counters.view(-1, COUNTER_STRIDE)[:, 0].cpu().tolist()
            short = [f"{c.name}={v}/{c.total}" for v, c in zip(vals, e.program.counters) if v < c.total]
            if short:
                parts.append(f"{len(short)} counter(s) short of their totals at the end of the step, first "
                             f"{', '.join(short[:4])}")
        return "; ".join(parts)

    def _op_of(self, rec: dict[str, int]) -> str | None:
        """The op key of the record's task (from the program of the record's batch)."""
        e = self._entries.get(rec["batch"])
        if e is None or rec["tid"] < 0:
            return None
        for key, (lo, hi) in e.program.op_ranges.items():
            if lo <= rec["tid"] < hi:
                return key
        return None

    def _kv_table(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        key = tuple(c.data_ptr() for c in kv_caches)
        if key != self._kv_key:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the kv cache tensors changed during CUDA-graph capture; run one "
                                   "eager step with the final kv caches before capturing")
            self._kvptr = torch.tensor(list(key), dtype=torch.int64).to(self.device)
            self._kv_key = key
        assert self._kvptr is not None
        return self._kvptr

    # ---- the step ------------------------------------------------------------------------------
    def _check_inputs(self, hidden, positions, kv_caches, block_table, seq_lens, slot_mapping, cos_sin_cache,
                      out, logits_out) -> None:
        s, dt, dev = self.spec, self.spec.torch_dtype, self.device
        check_tensor("hidden", hidden, ndim=2, dtypes=(dt,), device=dev)
        b = hidden.shape[0]
        check_tokens("hidden", b)
        check_shape("hidden", hidden, (b, s.hidden_size))
        check_tensor("positions", positions, ndim=1, dtypes=(torch.int64,), device=dev)
        check_shape("positions", positions, (b,))
        check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), device=dev)
        check_shape("slot_mapping", slot_mapping, (b,))
        check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=dev)
        check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev, contiguous=False)
        if block_table.stride(1) != 1:
            raise ValueError(f"block_table rows must be contiguous, got stride {block_table.stride()}")
        if block_table.shape[0] < b or seq_lens.shape[0] < b:
            raise ValueError(f"batch B={b} exceeds block_table rows {block_table.shape[0]} / "
                             f"seq_lens entries {seq_lens.shape[0]}")
        check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32, dt), device=dev,
                     contiguous=False)
        if cos_sin_cache.shape[1] != s.head_dim or cos_sin_cache.stride(1) != 1:
            raise ValueError(f"cos_sin_cache must be [max_pos, {s.head_dim}] with contiguous rows, got "
                             f"shape {tuple(cos_sin_cache.shape)} stride {cos_sin_cache.stride()}")
        if len(kv_caches) != s.num_layers:
            raise ValueError(f"got {len(kv_caches)} kv caches for {s.num_layers} layers")
        bs = None
        for i, c in enumerate(kv_caches):
            check_tensor(f"kv_caches[{i}]", c, ndim=5, dtypes=(dt,), device=dev)
            if c.shape[1] != 2 or c.shape[3] != s.num_kv_heads or c.shape[4] != s.head_dim:
                raise ValueError(f"kv_caches[{i}] has shape {tuple(c.shape)}, expected "
                                 f"[num_blocks, 2, block_size, {s.num_kv_heads}, {s.head_dim}]")
            if bs is not None and c.shape[2] != bs:
                raise ValueError(f"kv_caches[{i}] block size {c.shape[2]} != {bs} of layer 0")
            bs = c.shape[2]
            if self.executor == "cuda" and c.data_ptr() % 16:
                raise ValueError(f"kv_caches[{i}] is not 16-byte aligned")
        if out is not None:
            check_tensor("out", out, ndim=2, dtypes=(dt,), device=dev)
            check_shape("out", out, (b, s.hidden_size))
        if logits_out is not None:
            if not self.lm_head:
                raise ValueError("logits_out given but this decoder was built with lm_head=False")
            check_tensor("logits_out", logits_out, ndim=2, dtypes=(torch.float32,), device=dev)
            check_shape("logits_out", logits_out, (b, s.vocab_size))

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 block_table: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                 cos_sin_cache: torch.Tensor, *, out: torch.Tensor | None = None,
                 logits_out: torch.Tensor | None = None, stop_after: int | None = None,
                 check: bool = False, on_hang: str = "raise") -> torch.Tensor:
        """Run all layers for B = hidden.shape[0] decode tokens (token b is request b) and return
        the final-normed hidden [B, H]; this step's K/V are written into kv_caches at slot_mapping.
        With lm_head=True the fp32 logits [B, V] go to logits_out (allocated if not given).

        check=True (eager only: it synchronises): after the step, read the watchdog's error record.
        On a hang the step is recomputed with the Triton path into the same out / logits_out /
        kv_caches (all valid afterwards), the record is cleared, and then on_hang="raise" raises
        the MegakernelHang (recovered=True) while on_hang="fallback" logs it and returns. An error
        left by an earlier unchecked call is logged and cleared first (it would make this launch a
        no-op). Without check, nothing synchronises: see pending_error() / check_errors().

        stop_after=N (debugging/bisection, not graph-safe: builds and uploads a program) runs only
        the tasks with tid < N (Program.prefix), like vm.run(stop_after=N); inspect the
        intermediates with buffers(B) (and out/logits_out/kv_caches)."""
        self._check_inputs(hidden, positions, kv_caches, block_table, seq_lens, slot_mapping, cos_sin_cache,
                           out, logits_out)
        if on_hang not in ON_HANG:
            raise ValueError(f"on_hang={on_hang!r}; choose one of {ON_HANG}")
        if check:
            if stop_after is not None:
                raise ValueError("check=True recomputes whole steps; it cannot be combined with stop_after")
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("check=True synchronises with the device: not during CUDA-graph capture")
            stale = self.error_record()
            if stale is not None:
                self.clear_errors()
                old = self._hang(stale)
                self.hangs.append(old)
                logger.warning("mk_plugin: clearing a watchdog record left by an earlier unchecked step: %s", old)
        b = hidden.shape[0]
        e = self._entry(b)
        if stop_after is not None:
            prog = e.program.prefix(stop_after)
            e = self._upload(prog, replace(e.meta, batch=b) if e.meta is not None else program_meta(prog))
        if out is None:
            out = torch.empty_like(hidden)
        if self.lm_head and logits_out is None:
            logits_out = torch.empty(b, self.spec.vocab_size, dtype=torch.float32, device=self.device)
        io = _StepIO(hidden, positions, kv_caches, block_table, seq_lens, slot_mapping, cos_sin_cache, out,
                     logits_out)
        if self.executor == "vm":
            self._run_vm(e, io)
        else:
            self._run_cuda(e, io)
        if check:
            rec = self.error_record()
            if rec is not None:
                hang = self._hang(rec, recovered=True)
                self.hangs.append(hang)
                self.clear_errors()
                self._recompute_triton(io)
                if on_hang == "raise":
                    raise hang
                logger.warning("mk_plugin: %s", hang)
        return out

    def _recompute_triton(self, io: _StepIO) -> None:
        """The whole step again with the Triton decode path (triton_ops.decode_step, then the LM
        head), into the same out / logits / kv_caches. Correct after an aborted launch because
        (1) the megakernel never writes its inputs (hidden is read-only: layer 0's residual source
        is HIDDEN_IN, every later residual goes to RESID), (2) an aborted launch writes only the
        locations a complete step writes -- its workspace, out, logits and kv_caches at this step's
        slot_mapping (store addresses come from the task records and slot_mapping, never from
        computed data) -- and (3) decode_step rewrites every one of those KV slots (rope_kv_append
        of each layer, before that layer's attention reads them) and all of out. So the rerun
        replaces every value the aborted launch may have left: the KV writes are idempotent."""
        from ..triton_ops import decode_step, lm_head

        decode_step(self.spec, self.weights, io.hidden, io.positions, io.kv_caches, io.block_table, io.seq_lens,
                    io.slot_mapping, io.cos_sin, out=io.out)
        if self.lm_head and io.logits is not None:
            lm_head(io.out, self.weights.lm_head, out=io.logits)

    def buffers(self, batch: int) -> dict[Buf, torch.Tensor]:
        """Views of the workspace buffers (RESID, Q, ATTN_O, ACT, PART_O, PART_ML) for `batch`
        tokens, as the last step left them (for op-by-op comparisons with the VM)."""
        s = self.spec
        C = self.attn_chunks(batch)
        parts = batch * s.num_kv_heads * C
        out = {k: v[:batch] for k, v in self.ws.items()}
        out[Buf.PART_O] = self.part_o[: parts * s.gqa_group * s.head_dim].view(
            batch, s.num_kv_heads, C, s.gqa_group, s.head_dim)
        out[Buf.PART_ML] = self.part_ml[: parts * s.gqa_group * 2].view(batch, s.num_kv_heads, C, s.gqa_group, 2)
        return out

    def _bufs(self, b: int, io: _StepIO) -> dict[Buf, torch.Tensor]:
        bufs = self.buffers(b)
        bufs[Buf.HIDDEN_IN] = io.hidden
        bufs[Buf.OUT] = io.out
        if io.logits is not None:
            bufs[Buf.LOGITS] = io.logits
        return bufs

    def launch_args(self, e: _Entry, io: _StepIO, bufs: dict[Buf, torch.Tensor]) -> dict[str, object]:
        """Arguments of mk_decode by name (encoding.KERNEL_PARAMS), except `prog`."""
        cs = io.cos_sin
        return {
            "wptr": self._wptr, "kvptr": self._kv_table(io.kv_caches), "counters": e.counters,
            "positions": io.positions, "slots": io.slot_mapping, "seq_lens": io.seq_lens,
            "block_table": io.block_table, "bt_stride": io.block_table.stride(0),
            "block_size": io.kv_caches[0].shape[2], "cos_sin": cs, "cs_rows": cs.shape[0],
            "cs_stride": cs.stride(0), "cs_f32": 1 if cs.dtype == torch.float32 else 0,
            "hidden_in": bufs[Buf.HIDDEN_IN], "resid": bufs[Buf.RESID], "q": bufs[Buf.Q],
            "attn_o": bufs[Buf.ATTN_O], "act": bufs[Buf.ACT], "out": bufs[Buf.OUT],
            "logits": bufs.get(Buf.LOGITS), "part_o": bufs[Buf.PART_O], "part_ml": bufs[Buf.PART_ML],
            "trace": None, "err": self.err, "err_host": self._err_host, "watchdog_ms": self.watchdog_ms,
        }

    def _run_cuda(self, e: _Entry, io: _StepIO) -> None:
        b = io.hidden.shape[0]
        bufs = self._bufs(b, io)
        args = self.launch_args(e, io, bufs)
        e.counters.zero_()
        assert self._module is not None
        module = self.module(e.program.batch)
        for i, (step, prog) in enumerate(zip(e.program.steps, e.seg_progs)):
            if isinstance(step, FallbackStep):
                self._fallback(step.op, bufs, io)
            else:
                args["prog"] = prog
                args["trace"] = e.traces[i] if e.traces is not None else None
                module.launch(self.device, self.num_sms, args)

    def trace_records(self, batch: int) -> list[dict[str, int | str]]:
        """The per-task trace of the last step of `batch` tokens (decoder built with trace=True):
        one dict per task with its tid, op key, opcode and the encoding.TRACE_FIELDS values
        (%globaltimer ns; wait_cycles in SM clocks). Synchronises with the device."""
        e = self._entry(batch)
        if e.traces is None:
            raise RuntimeError("tracing is off: build the decoder with trace=True (or MK_TRACE=1)")
        rows = []
        for step, tr in zip(e.program.steps, e.traces):
            if tr is None:
                continue
            words = tr.view(-1, TRACE_WORDS).cpu().numpy()
            enc_ = step.encoded
            at = int(enc_[H["tasks_at"]])
            tids = enc_[at:].reshape(-1, TASK_WORDS)[:, TASK_FIELDS.index("tid")]
            by_tid = {t.tid: t for t in step.tasks}
            for i, tid in enumerate(tids.tolist()):
                row: dict[str, int | str] = {"tid": tid, "op": by_tid[tid].op.key}
                row.update({f: int(words[i, j]) for j, f in enumerate(TRACE_FIELDS)})
                rows.append(row)
        return rows

    def _run_vm(self, e: _Entry, io: _StepIO) -> None:
        b = io.hidden.shape[0]
        st = _vm.VMState(self.spec, b, e.program.attn_chunks, self.weights, self._bufs(b, io), io.kv_caches,
                         io.positions, io.slot_mapping, io.seq_lens, io.block_table, io.cos_sin,
                         [0] * e.program.num_counters, rounding=self.rounding)
        if Buf.LOGITS not in st.bufs:
            st.bufs[Buf.LOGITS] = torch.empty(b, self.spec.vocab_size, dtype=torch.float32)
        for step in e.program.steps:
            if isinstance(step, FallbackStep):
                self._fallback(step.op, st.bufs, io)
            elif int(self.err[0]) != 0:
                continue  # like the kernel: a launch that finds a record set exits at once
            else:
                try:
                    _vm.run_segment(step, st)
                except _vm.DeadlockError:
                    self._vm_watchdog(step, st)

    def _vm_watchdog(self, seg: Segment, st: _vm.VMState) -> None:
        """What the kernel's watchdog records when a segment cannot finish: the VM ran every task
        that could run (as the GPU's unblocked CTAs do); the first queue (lowest SM) whose head
        waits on an unreached counter reports it, as if its wait had timed out."""
        dp = decode(seg.encoded)
        done = set(st.executed)
        offs = [int(x) for x in seg.encoded[HEADER_WORDS: HEADER_WORDS + len(dp.queues) + 1]]
        for qi, q in enumerate(dp.queues):
            for pos, t in enumerate(q):
                if t["tid"] in done:
                    continue
                for k in ("wait0", "wait1"):
                    c, target = t[f"{k}_ctr"], t[f"{k}_target"]
                    if c >= 0 and st.counters[c] < target:
                        rec = dict.fromkeys(ERROR_FIELDS, 0)
                        rec.update(code=int(ErrorCode.COUNTER_TIMEOUT), sm=qi, thread=0, batch=dp.header["batch"],
                                   task_index=offs[qi] + pos, tid=t["tid"], opcode=t["opcode"], layer=t["layer"],
                                   counter=c, expected=target, seen=st.counters[c],
                                   elapsed_us=self.watchdog_ms * 1000, budget_ms=self.watchdog_ms)
                        self._write_record(rec)
                        return
                break  # this queue's head can run: look at the next queue
        raise AssertionError("DeadlockError without a blocked queue head")  # pragma: no cover

    def _write_record(self, rec: dict[str, int]) -> None:
        if int(self.err[0]) != 0:
            return  # the first failure wins, as with the kernel's atomicCAS
        words = torch.tensor([rec[k] for k in ERROR_FIELDS] + [0] * (ERROR_WORDS - len(ERROR_FIELDS)),
                             dtype=torch.int32)
        self.err.copy_(words)
        if self._err_host is not None:
            self._err_host.copy_(words)

    # ---- Triton fallback of one op, on the megakernel's buffers ---------------------------------
    def _fallback(self, op: FusedOp, bufs: dict[Buf, torch.Tensor], io: _StepIO) -> None:
        from .. import triton_ops as T
        s, w = self.spec, self.weights
        b = io.hidden.shape[0]
        eps = s.rms_eps
        if op.layer >= 0:
            lw = w.layers[op.layer]
            h = bufs[residual_source(op.layer)]
        if op.name == "qkv_rope":
            qkv = T.linear(h, lw.qkv, norm_weight=lw.input_norm, eps=eps, out=self.qkv_tmp[:b])
            T.rope_kv_append(qkv, io.positions, io.cos_sin, io.kv_caches[op.layer], io.slot_mapping,
                             num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                             q_out=bufs[Buf.Q])
        elif op.name == "attention":
            T.paged_attention(bufs[Buf.Q], io.kv_caches[op.layer], io.block_table, io.seq_lens,
                              s.head_dim ** -0.5, out=bufs[Buf.ATTN_O], workspace=self.attn_ws)
        elif op.name == "o_proj":
            T.linear(bufs[Buf.ATTN_O], lw.o, residual=h, out=bufs[Buf.RESID])
        elif op.name == "gate_up":
            T.linear(bufs[Buf.RESID], lw.gate_up, norm_weight=lw.post_norm, eps=eps, activation="silu_and_mul",
                     out=bufs[Buf.ACT])
        elif op.name == "down":
            T.linear(bufs[Buf.ACT], lw.down, residual=bufs[Buf.RESID], out=bufs[Buf.RESID])
        elif op.name == "final_norm":
            T.rms_norm(bufs[Buf.RESID], w.final_norm, eps, out=bufs[Buf.OUT])
        elif op.name == "lm_head":
            T.lm_head(bufs[Buf.OUT], w.lm_head, out=bufs[Buf.LOGITS])
        else:  # pragma: no cover
            raise AssertionError(op.name)


@dataclass
class _StepIO:
    hidden: torch.Tensor
    positions: torch.Tensor
    kv_caches: list[torch.Tensor]
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin: torch.Tensor
    out: torch.Tensor
    logits: torch.Tensor | None
