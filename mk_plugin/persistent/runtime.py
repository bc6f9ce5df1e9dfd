"""Build and launch csrc/megakernel.cu through CuPy's NVRTC (cupy.RawModule).

The source NVRTC compiles is ONE text: csrc/megakernel.cu with every `#include "..."` inlined and
tasks.h replaced by header.generate_header() (so the generated layout is always the one
compiled, and CuPy's on-disk cache, keyed by the text and options, never serves a stale binary).
The model comes in as -D options (encoding.kernel_defines). tests/test_csrc_compile.py compiles
exactly `build_source()` with `compile_options(spec)` through nvcc to check registers and spills.

cupy is imported only inside functions of this module (CPU CI has no cupy).
"""
from __future__ import annotations

import functools
import hashlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..spec import LlamaSpec
from .encoding import KERNEL_PARAMS, kernel_defines
from .header import generate_header
from .variant import KernelVariant

ENTRY = "megakernel.cu"
KERNEL_NAME = "mk_decode"
DEFAULT_ARCH = "sm_90a"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


_PKG = Path(__file__).resolve().parents[1]
CSRC_CANDIDATES = (_PKG / "csrc", _PKG.parent / "csrc")


def _find_csrc() -> Path:
    """The kernel sources: mk_plugin/csrc of an installed wheel, else csrc/ of the checkout (an
    editable install maps the package there without a folder of that name in mk_plugin/). When
    neither holds them, the package's path (build_source then names both places)."""
    return next((d for d in CSRC_CANDIDATES if (d / ENTRY).is_file()), CSRC_CANDIDATES[0])


CSRC = _find_csrc()


def build_source(csrc: Path = CSRC) -> str:
    """megakernel.cu with local includes inlined once each (pragma-once semantics) and tasks.h
    taken from the generator. System includes (<cuda_bf16.h>) are left to the compiler."""
    if not (csrc / ENTRY).is_file():
        raise FileNotFoundError(f"megakernel sources ({ENTRY}) not found in {' or '.join(map(str, CSRC_CANDIDATES))}"
                                " (installed package, checkout): a broken install; reinstall mk-plugin")
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = generate_header() if name == "tasks.h" else (csrc / name).read_text()
        out = [f"// ---- begin {name} ----"]
        for line in text.splitlines():
            m = _INCLUDE.match(line)
            if m:
                out.append(expand(m.group(1)))
            elif line.strip() == "#pragma once":
                continue
            else:
                out.append(line)
        out.append(f"// ---- end {name} ----")
        return "\n".join(out)

    return expand(ENTRY) + "\n"


@functools.lru_cache(maxsize=4)
def _source_hash(csrc: Path, stamp: tuple) -> str:
    return hashlib.sha256(build_source(csrc).encode()).hexdigest()[:16]


def source_hash(csrc: Path = CSRC) -> str:
    """16 hex digits of sha256(build_source()): identifies the kernel text a program is built for
    (cached; recomputed when a csrc file changes)."""
    stamp = tuple(sorted((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in csrc.iterdir() if f.is_file()))
    return _source_hash(csrc, stamp)


def compile_options(spec: LlamaSpec, arch: str = DEFAULT_ARCH) -> tuple[str, ...]:
    """NVRTC options; nvcc takes the same -D/-std list with -arch instead of --gpu-architecture."""
    return ("-std=c++17", f"--gpu-architecture={arch}", *kernel_defines(spec))


def cache_key(source: str, options: tuple[str, ...]) -> str:
    return hashlib.sha256((source + "\0" + "\0".join(options)).encode()).hexdigest()[:16]


_MODULES: dict[tuple[str, int], object] = {}


@dataclass
class MegakernelModule:
    """Loader of the megakernel for one model spec and kernel variant: source, options, arch, cache
    key; the CuPy RawModule is compiled on first use per device and cached in-process (and by CuPy on
    disk). The variant's -D options (variant.KernelVariant.defines) are part of the cache key."""
    spec: LlamaSpec
    arch: str = DEFAULT_ARCH
    variant: KernelVariant = field(default_factory=KernelVariant)
    verbose: bool = False   # print each build (registers, stack, shared memory): MK_VERBOSE via the decoder

    def __post_init__(self) -> None:
        self.source = build_source()
        self.options = compile_options(self.spec, self.arch) + self.variant.defines() \
            + (("--generate-line-info",) if self.variant.lineinfo else ())
        self.layout = self.variant.layout   # ring depth; the same shared memory for every depth
        self.num_threads = self.layout.num_threads
        self.key = cache_key(self.source, self.options)

    def kernel(self, device_index: int):
        """The compiled `mk_decode` RawKernel for a device (compiles on first call)."""
        k = (self.key, device_index)
        if k in _MODULES:
            return _MODULES[k]
        import cupy as cp

        t0 = time.perf_counter()
        with cp.cuda.Device(device_index):
            mod = cp.RawModule(code=self.source, options=self.options, name_expressions=None)
            fn = mod.get_function(KERNEL_NAME)
            fn.max_dynamic_shared_size_bytes = self.layout.smem_bytes
        if self.verbose:
            print(f"[mk_plugin] megakernel {self.spec.name} key={self.key} arch={self.arch} built in "
                  f"{time.perf_counter() - t0:.2f}s: {fn.num_regs} registers, "
                  f"{fn.local_size_bytes} B local (stack), {self.layout.smem_bytes} B dynamic smem, "
                  f"{self.layout.num_stages} ring stages")
        _MODULES[k] = fn
        return fn

    def launch(self, device: torch.device, num_queues: int, args: dict[str, object]) -> None:
        """Launch one segment program on torch's current stream: grid = num_queues (one CTA per
        SM; the kernel refuses a program whose header disagrees), self.num_threads threads,
        self.layout.smem_bytes dynamic shared memory. `args` maps every name of encoding.KERNEL_PARAMS
        to a tensor / _Ptr / None (pointer parameters) or an int ("int" parameters).
        No host synchronisation."""
        import cupy as cp

        idx = device.index if device.index is not None else torch.cuda.current_device()
        fn = self.kernel(idx)
        stream = _external_stream(cp, torch.cuda.current_stream(device))
        with cp.cuda.Device(idx), stream:
            fn((num_queues,), (self.num_threads,), pack_args(cp, args), shared_mem=self.layout.smem_bytes)


def pack_args(cp, args: dict[str, object]) -> tuple:
    """Kernel arguments in KERNEL_PARAMS order: cp.int32 for "int" parameters, cp.uint64 addresses
    for pointers (tensor.data_ptr(), _Ptr, or 0 for None). Raises ValueError on a missing/extra name."""
    names = [n for n, _ in KERNEL_PARAMS]
    if set(args) != set(names):
        raise ValueError(f"kernel arguments: missing {sorted(set(names) - set(args))}, "
                         f"unexpected {sorted(set(args) - set(names))}")
    out = []
    for name, ctype in KERNEL_PARAMS:
        a = args[name]
        if ctype == "int":
            if not isinstance(a, int):
                raise ValueError(f"kernel argument {name} must be an int, got {type(a).__name__}")
            out.append(cp.int32(a))
        elif a is None:
            out.append(cp.uint64(0))
        elif isinstance(a, torch.Tensor):
            out.append(cp.uint64(a.data_ptr()))
        elif isinstance(a, _Ptr):
            out.append(cp.uint64(a.value))
        else:
            raise ValueError(f"kernel argument {name} must be a tensor, _Ptr or None, got {type(a).__name__}")
    return tuple(out)


@dataclass(frozen=True)
class _Ptr:
    """A raw device address passed as a pointer argument."""
    value: int


def ptr(value: int) -> _Ptr:
    return _Ptr(int(value))


def _external_stream(cp, torch_stream):
    """CuPy view of a torch stream (Stream.from_external in CuPy 14; ExternalStream before)."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(torch_stream)
        except (TypeError, ValueError, AttributeError):  # pragma: no cover - no __cuda_stream__ support
            pass
    return cp.cuda.ExternalStream(torch_stream.cuda_stream, torch_stream.device.index)
