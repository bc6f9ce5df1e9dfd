"""Exceptions of the persistent megakernel's reliability layer.

MegakernelHang: a wait inside the kernel exceeded the watchdog budget (MK_WATCHDOG_MS); built from
the device error record (encoding.ERROR_FIELDS) by MegakernelDecoder.check_errors().
ProgramMismatch: a compiled program's metadata (backend.ProgramMeta) disagrees with the decoder or
the live device it is about to be launched on; the message lists every mismatch.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from .encoding import (
    ERROR_FIELDS,
    MBAR_TAG_DRAIN,
    MBAR_TAG_EMPTY,
    MBAR_TAG_FULL,
    MBAR_TAG_INFLIGHT,
    ErrorCode,
    HeaderCheck,
    Opcode,
)


class MegakernelError(RuntimeError):
    """Base class of the megakernel's run-time failures."""


class MegakernelHang(MegakernelError):
    """The megakernel's watchdog stopped a launch: one wait exceeded its budget (or the launch's
    program failed the kernel's header check). Every field of the device error record is an
    attribute (code, sm, thread, batch, task_index, tid, opcode, layer, counter, expected, seen,
    elapsed_us, budget_ms); `op` is the op key of the task (e.g. "L3.o_proj") when known.
    `recovered` is True when the step was recomputed with the Triton path before raising (its
    outputs and KV writes are then valid). `diagnosis` is the host's post-mortem (the CPU deadlock
    checker's verdict on the program, counters left short of their totals), when available.

    The waiter that reports is the first whose budget ran out, which need not be the root cause:
    tasks blocked behind the stuck one time out too, and the earliest waiter wins. The diagnosis
    names the program's own unsatisfiable wait when there is one."""

    def __init__(self, record: Mapping[str, int], *, op: str | None = None, recovered: bool = False,
                 diagnosis: str | None = None):
        self.record = {k: int(record.get(k, -1)) for k in ERROR_FIELDS}
        for k, v in self.record.items():
            setattr(self, k, v)
        self.op = op
        self.recovered = recovered
        self.diagnosis = diagnosis
        super().__init__(self.describe())

    @classmethod
    def from_words(cls, words: Sequence[int], **kw) -> MegakernelHang:
        return cls({k: int(words[i]) for i, k in enumerate(ERROR_FIELDS)}, **kw)

    @property
    def error_code(self) -> ErrorCode | int:
        try:
            return ErrorCode(self.record["code"])
        except ValueError:
            return self.record["code"]

    def describe(self) -> str:
        r = self.record
        code = self.error_code
        name = code.name if isinstance(code, ErrorCode) else f"code {code}"
        where = f"SM {r['sm']} thread {r['thread']}"
        task = "no task"
        if r["task_index"] >= 0:
            try:
                opname = Opcode(r["opcode"]).name
            except ValueError:
                opname = f"opcode {r['opcode']}"
            task = (f"task #{r['task_index']} of the launch (tid {r['tid']}, "
                    f"{self.op or opname}, {opname}, layer {r['layer']})")
        if code == ErrorCode.COUNTER_TIMEOUT:
            what = (f"counter wait: counter {r['counter']} >= {r['expected']} expected, "
                    f"{r['seen']} seen after {r['elapsed_us'] / 1000:.1f} ms")
        elif code == ErrorCode.MBAR_TIMEOUT:
            tag, slot = divmod(r["counter"], 1000)
            side = {MBAR_TAG_EMPTY // 1000: "producer waiting for a free ring slot",
                    MBAR_TAG_FULL // 1000: "consumer waiting for a weight chunk",
                    MBAR_TAG_DRAIN // 1000: "producer draining its in-flight copies",
                    MBAR_TAG_INFLIGHT // 1000: "producer waiting for an earlier chunk to land (MK_INFLIGHT)"}.get(tag, f"tag {r['counter']}")
            what = (f"mbarrier wait ({side}): slot {slot}, phase parity {r['expected']}, weight chunk "
                    f"{r['seen']}, after {r['elapsed_us'] / 1000:.1f} ms")
        elif code == ErrorCode.BAD_PROGRAM:
            bits = [f.name for f in HeaderCheck if r["seen"] & f.value]
            what = f"program header check failed: {', '.join(bits) or r['seen']}"
        else:
            what = f"record {r}"
        return (f"MegakernelHang [{name}] on {where}, {task}: {what} (watchdog budget {r['budget_ms']} ms, "
                f"batch {r['batch']})" + ("; the step was recomputed with the Triton path" if self.recovered else "")
                + (f". Diagnosis: {self.diagnosis}" if self.diagnosis else ""))


class ProgramMismatch(ValueError):
    """A megakernel program does not fit the decoder / device it is handed to. `mismatches` lists
    every disagreement (field: program value vs live value)."""

    def __init__(self, mismatches: Sequence[str], *, what: str = "megakernel program"):
        self.mismatches = list(mismatches)
        lines = "\n".join(f"  - {m}" for m in self.mismatches)
        super().__init__(f"{what} does not match the runtime ({len(self.mismatches)} mismatch"
                         f"{'es' if len(self.mismatches) != 1 else ''}):\n{lines}")
