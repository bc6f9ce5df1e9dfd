"""The persistent megakernel: a small compiler from (LlamaSpec, padded batch, SM count) to per-SM
task queues (graph -> tasks -> schedule -> encoding), a CPU VM of the encoded program, and the
CUDA runtime (runtime.py, imported lazily: CPU CI has no cupy) behind MegakernelDecoder."""
from .encoding import Buf, Opcode, kernel_defines
from .graph import FusedOp, decode_graph
from .header import generate_header
from .schedule import FallbackStep, Program, Segment, build_program, check_ordering
from .tasks import build_tasks
from .vm import DeadlockError, check_deadlock_free

__all__ = ["Buf", "DeadlockError", "FallbackStep", "FusedOp", "MegakernelDecoder", "Opcode", "Program",
           "Segment", "build_program", "build_tasks", "check_deadlock_free", "check_ordering",
           "decode_graph", "generate_header", "kernel_defines"]


def __getattr__(name: str):
    if name == "MegakernelDecoder":  # lazy: backend pulls in triton_ops
        from .backend import MegakernelDecoder
        return MegakernelDecoder
    raise AttributeError(name)
