"""The decoder's side of the kernel watchdog: the device error record (with its pinned host mirror),
MegakernelHang with a post-mortem diagnosis, and the VM's model of what the kernel records when a
segment cannot finish. A mixin of MegakernelDecoder (backend.py), which owns err, _err_host,
_err_host_np, _entries, hangs, executor, device and watchdog_ms."""
from __future__ import annotations

import torch

from . import vm as _vm
from .encoding import COUNTER_STRIDE, ERROR_FIELDS, ERROR_WORDS, HEADER_WORDS, ErrorCode, decode
from .errors import MegakernelHang
from .schedule import Segment


class WatchdogMixin:
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
