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
from dataclasses import replace
from typing import ClassVar

import torch

from ..config import DEFAULT_WATCHDOG_MS
from ..decoding import DecodeInputs
from ..spec import LlamaSpec
from ..triton_ops._checks import check_tokens
from ..triton_ops._device import device_name
from ..triton_ops.step_ops import OpBuffers
from ..weights import ModelWeights
from .decoder_io import DecoderIOMixin
from .encoding import (
    COUNTER_STRIDE,
    ERROR_WORDS,
    LAYOUT,
    MAX_BATCH,
    TRACE_WORDS,
    VERSION,
    WATCHDOG_MS_MAX,
    Buf,
    spec_hash,
)
from .errors import MegakernelHang, ProgramMismatch
from .executors import CudaExecutorMixin, VMExecutorMixin, _Entry, _StepIO
from .graph import FusedOp, residual_source
from .program_meta import ProgramMeta, meta_mismatches, program_meta
from .schedule import Program, Segment, build_program
from .tasks import attention_chunks, class_build
from .tuning import DEFAULT_TUNING, KSPLIT_MAX, ScheduleTuning
from .tuning_table import resolve, spec_tuning_key
from .variant import KernelVariant
from .watchdog import WatchdogMixin

EXECUTORS = ("cuda", "vm")
ON_HANG = ("raise", "fallback")
# A child of the adapter's "vllm.mk_plugin": inside vLLM it logs with vLLM's format and level.
logger = logging.getLogger("vllm.mk_plugin.persistent")


class MegakernelDecoder(DecoderIOMixin, WatchdogMixin, CudaExecutorMixin, VMExecutorMixin):
    """Decode steps of up to max_tokens (<= 16) tokens of one model on one device."""
    backend: ClassVar[str] = "megakernel"  # the Decoder protocol's name of this path

    def __init__(self, spec: LlamaSpec, weights: ModelWeights, max_tokens: int, device: str | torch.device, *,
                 fallback: frozenset[str] = frozenset(), lm_head: bool = False, num_sms: int | None = None,
                 executor: str | None = None, trace: bool = False, watchdog_ms: int = DEFAULT_WATCHDOG_MS,
                 variant: KernelVariant | None = None, tuning: str | dict[int, ScheduleTuning] = "auto",
                 class_builds: bool = True, verbose: bool = False):
        """variant: what the kernel compiles in (rounding points, ring depth; variant.KernelVariant);
        a tuning's ring depth replaces the variant's for its batch sizes. tuning: per padded batch
        size, how the step is cut into tasks (persistent.tuning): a dict {batch: ScheduleTuning}
        (missing batches: default), or an MK_TUNING setting ("auto", "off", a table file). class_builds: a
        batch size whose every matvec task stages its x whole runs a build of its batch class with the
        column-group path compiled out (MK_NTILES + MK_X_WHOLE), and a batch size whose every task takes the
        wgmma path one with the default matvec path compiled out (MK_NTILES + MK_WGA_ONLY): the same step bit
        for bit (variant_for). The
        decoder reads no environment: whoever builds it passes the MK_* values (config.MkConfig)."""
        self.spec = spec
        self.weights = weights
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors report cuda:<index>
            self.device = torch.device("cuda", torch.cuda.current_device())
        check_tokens("max_tokens", max_tokens)
        self.max_tokens = max_tokens
        self.variant = variant or KernelVariant()
        if not isinstance(class_builds, bool):
            raise ValueError(f"class_builds={class_builds!r} must be true or false")  # noqa: TRY004 (a bad value)
        self.class_builds = class_builds
        self._variants: dict[int, KernelVariant] = {}   # variant_for's, per batch
        self.rounding = self.variant.rounding   # one source for the kernel and the VM
        self.verbose = verbose
        self.fallback = frozenset(fallback)
        self.lm_head = lm_head
        self.trace = trace
        self.executor = executor or ("cuda" if self.device.type == "cuda" else "vm")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor={self.executor!r}; choose one of {EXECUTORS}")
        if self.executor == "cuda" and self.device.type != "cuda":
            raise ValueError(f"executor 'cuda' needs a CUDA device, got {self.device}")
        if num_sms is None:
            num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                       if self.device.type == "cuda" else 132)
        self.num_sms = int(num_sms)
        self.watchdog_ms = watchdog_ms
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
        self._resolve_tunings(tuning)
        self._check_weights()
        self._wmaps: torch.Tensor | None = None   # MK_W_TMA's weight tensor maps, once a variant uses them
        self._wptr = self._weight_table() if self.executor == "cuda" else None
        self._alloc_workspace()
        self._entries: dict[int, _Entry] = {}
        self._kv_key: tuple | None = None
        self._kvptr: torch.Tensor | None = None
        self._kvmaps: torch.Tensor | None = None   # MK_ATT_TMA: the caches' tensor maps (kvptr points into it)
        self._module = None       # the kernel of the decoder's own variant
        self._modules: dict[KernelVariant, object] = {}   # one per ring depth the tunings use
        self._att_tma_ok = True    # False once the model or the caches turned the ring-fed attention off
        self._needs_maps = False   # whether some batch's variant has MK_ATT_TMA (the kvptr table holds maps)
        self._update_needs_maps()
        if self._wants_att_tma():
            from .tensormap import check_model
            try:
                check_model(spec)
            except ValueError as e:
                self._att_tma_off(str(e))
        if self.executor == "cuda":
            self._module = self._module_for(self.variant)

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

    def _module_for(self, variant: KernelVariant):
        """The MegakernelModule of `variant`, one per variant (ring depth) used."""
        from .runtime import MegakernelModule
        if variant not in self._modules:
            self._modules[variant] = MegakernelModule(self.spec, variant=variant, verbose=self.verbose)
        return self._modules[variant]

    def variant_for(self, batch: int) -> KernelVariant:
        """The kernel variant the program of `batch` tokens runs on: the decoder's, with the ring
        depth, ring-fed attention and in-flight cap of the batch's tuning where it sets them, and with
        class_builds the build of the batch's class where every task takes one matvec path (tasks.class_build)."""
        # (the weight maps of a tuning's w_tma: _ensure_weight_maps). Cached: this runs every eager step; retune()
        # drops its batch's entry, _att_tma_off all of them
        v = self._variants.get(batch)
        if v is None:
            v = self._variants[batch] = class_build(self.variant, self.spec, self.tunings[batch], batch,
                                                    lm_head=self.lm_head, att_tma_ok=self._att_tma_ok,
                                                    auto=self.class_builds)
        return v

    def _wants_w_tma(self) -> bool:
        """Whether the decoder's variant or some batch's tuning copies weight chunks by tensor maps."""
        return self.variant.w_tma or any(t.w_tma for t in self.tunings.values())

    def _wants_att_tma(self) -> bool:
        """Whether some batch's variant has the ring-fed attention (0 everywhere once it was turned off)."""
        return any(self.variant_for(b).att_tma for b in range(1, self.max_tokens + 1))

    def _update_needs_maps(self) -> None:
        # cached for _kv_table, which runs every eager step
        self._needs_maps = self.executor == "cuda" and self._wants_att_tma()

    def module(self, batch: int):
        """The kernel that runs the program of `batch` tokens (CUDA executor)."""
        return self._module_for(self.variant_for(batch))

    def attn_chunks(self, batch: int) -> int:
        """KV chunks per (request, kv head) of the program for `batch` tokens."""
        return self.tunings[batch].attn_chunks or attention_chunks(batch, self.spec.num_kv_heads, self.num_sms)

    def _alloc_workspace(self) -> None:
        s, dt, dev, m = self.spec, self.spec.torch_dtype, self.device, self.max_tokens

        def buf(n: int, dtype: torch.dtype = dt) -> torch.Tensor:
            return torch.zeros(m, n, dtype=dtype, device=dev)

        self.ws = {Buf.RESID: buf(s.hidden_size), Buf.Q: buf(s.q_size), Buf.ATTN_O: buf(s.q_size),
                   Buf.ACT: buf(s.intermediate_size)}
        self._alloc_parts(max(b * s.num_kv_heads * self.attn_chunks(b) for b in range(1, m + 1)))
        # K-split o_proj/down partials, [KSPLIT_MAX, MAX_BATCH, H] whatever the batch or tuning (the kernel's
        # indexing), so retune() never has to grow them
        self.part_k = torch.zeros(KSPLIT_MAX * MAX_BATCH * s.hidden_size, dtype=torch.float32, device=dev)
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
        outside any CUDA-graph capture. Default (None): 1..max_tokens; [] prepares nothing."""
        sizes = range(1, self.max_tokens + 1) if batch_sizes is None else batch_sizes
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
        if tuning.w_tma and self._wptr is not None:   # the maps (their model check first) before the program
            self._ensure_weight_maps(self._wptr)
        elif tuning.w_tma:   # the CPU executor builds no maps: the model check alone, so its error is the same
            from .tensormap import check_weights_model
            check_weights_model(self.spec)
        self.tunings[batch], self.tuning_source[batch] = tuning, "retune"
        self._entries.pop(batch, None)
        self._variants.pop(batch, None)   # variant_for's cache
        self._update_needs_maps()
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

    def _att_tma_off(self, why: str) -> None:
        """The ring-fed attention (MK_ATT_TMA) cannot serve this model or these caches: the kernel without it
        (same programs, same results up to the order of fp32 sums), with one warning."""
        logger.warning("megakernel: attention without the ring-fed K/V path (MK_ATT_TMA): %s", why)
        self._att_tma_ok = False
        self.variant = replace(self.variant, att_tma=0)
        self._variants = {}   # variant_for's cache
        self._update_needs_maps()
        self._modules = {}
        if self._module is not None:   # CUDA: compiled now, in the eager step that brought the caches
            self._module = self._module_for(self.variant)

    # ---- the step ------------------------------------------------------------------------------
    def decode(self, inputs: DecodeInputs, out: torch.Tensor, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """The Decoder protocol (mk_plugin.decoding): __call__ on the step's inputs."""
        return self(*inputs.args(), out=out, logits_out=logits_out)

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
        """Views of the workspace buffers (RESID, Q, ATTN_O, ACT, PART_O, PART_ML, PART_K) for `batch`
        tokens, as the last step left them (for op-by-op comparisons with the VM)."""
        s = self.spec
        C = self.attn_chunks(batch)
        parts = batch * s.num_kv_heads * C
        out = {k: v[:batch] for k, v in self.ws.items()}
        out[Buf.PART_O] = self.part_o[: parts * s.gqa_group * s.head_dim].view(
            batch, s.num_kv_heads, C, s.gqa_group, s.head_dim)
        out[Buf.PART_ML] = self.part_ml[: parts * s.gqa_group * 2].view(batch, s.num_kv_heads, C, s.gqa_group, 2)
        out[Buf.PART_K] = self.part_k.view(KSPLIT_MAX, MAX_BATCH, s.hidden_size)[:, :batch]
        return out

    def _bufs(self, b: int, io: _StepIO) -> dict[Buf, torch.Tensor]:
        bufs = self.buffers(b)
        bufs[Buf.HIDDEN_IN] = io.hidden
        bufs[Buf.OUT] = io.out
        if io.logits is not None:
            bufs[Buf.LOGITS] = io.logits
        return bufs

    # ---- Triton fallback of one op, on the megakernel's buffers ---------------------------------
    def _op_buffers(self, bufs: dict[Buf, torch.Tensor], io: _StepIO) -> OpBuffers:
        """The megakernel's buffers as the Triton op table sees them: layer L reads its residual
        source (the input for layer 0, RESID after), o_proj and down write RESID."""
        b = io.hidden.shape[0]
        return OpBuffers(io, h_src=lambda layer: bufs[residual_source(layer)], h_mid=bufs[Buf.RESID],
                         h_out=bufs[Buf.RESID], qkv=self.qkv_tmp[:b], q=bufs[Buf.Q], attn=bufs[Buf.ATTN_O],
                         act=bufs[Buf.ACT], attn_ws=self.attn_ws, out=bufs[Buf.OUT], logits=bufs.get(Buf.LOGITS))

    def _fallback(self, op: FusedOp, bufs: dict[Buf, torch.Tensor], io: _StepIO) -> None:
        from ..triton_ops.step_ops import TRITON_OPS

        TRITON_OPS[op.name](self.spec, self.weights, op.layer, self._op_buffers(bufs, io))
