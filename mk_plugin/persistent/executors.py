"""How MegakernelDecoder (backend.py) runs one step's program: on the GPU (CudaExecutorMixin: counters
zeroed, each segment launched on torch's current stream, fallback ops between them) or on the CPU
interpreter (VMExecutorMixin: the same programs through vm.py). Both share the per-batch _Entry and
the step's tensors (_StepIO); the decoder provides _bufs, _fallback, module(), err and the rest."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..decoding import DecodeInputs
from . import vm as _vm
from .encoding import TASK_FIELDS, TASK_WORDS, TRACE_FIELDS, TRACE_WORDS, Buf, H
from .program_meta import ProgramMeta
from .schedule import FallbackStep, Program


@dataclass
class _Entry:
    program: Program
    seg_progs: list[torch.Tensor | None]   # device int32 program per step (None: fallback step)
    counters: torch.Tensor                 # int32 [num_counters * COUNTER_STRIDE]
    traces: list[torch.Tensor | None] | None = None  # int64 [num_tasks * TRACE_WORDS] per segment
    meta: ProgramMeta | None = field(default=None)


@dataclass(frozen=True)
class _StepIO(DecodeInputs):
    """A step's inputs and where its results go."""
    out: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class CudaExecutorMixin:
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
            "part_k": bufs[Buf.PART_K],
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


class VMExecutorMixin:
    def _run_vm(self, e: _Entry, io: _StepIO) -> None:
        b = io.hidden.shape[0]
        v = self.variant_for(b)   # the build the GPU would run: the VM rounds where it rounds
        st = _vm.VMState(self.spec, b, e.program.attn_chunks, self.weights, self._bufs(b, io), io.kv_caches,
                         io.positions, io.slot_mapping, io.seq_lens, io.block_table, io.cos_sin,
                         [0] * e.program.num_counters, variant=v)
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
