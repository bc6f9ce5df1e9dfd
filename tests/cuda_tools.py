"""Where the CUDA compilers are on a CPU machine (CI carries nvcc 13.0 and, with the wheels, libnvrtc):
shared by the compile tests of the megakernel (test_csrc_compile.py) and of the bulk probe."""
from __future__ import annotations

import glob
import os
import shutil
import sys


def nvcc_path() -> str | None:
    for c in ("/usr/local/cuda/bin/nvcc", shutil.which("nvcc")):
        if c and os.path.exists(c):
            return c
    return None


def libnvrtc_path() -> str | None:
    cands = []
    for p in sys.path:
        cands += glob.glob(os.path.join(p, "nvidia", "cu1*", "lib", "libnvrtc.so*"))
        cands += glob.glob(os.path.join(p, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*"))
    cands += glob.glob("/usr/local/cuda/lib64/libnvrtc.so*")
    cands = [c for c in cands if "builtins" not in c and "alt" not in os.path.basename(c)]
    return cands[0] if cands else None


def nvrtc_compile(lib_path: str, source: str, name: str, options: tuple[str, ...] | list[str]) -> tuple[int, str]:
    """Compile `source` with NVRTC (what cupy.RawModule does on the GPU host): (result code, log)."""
    import ctypes

    lib = ctypes.CDLL(lib_path)
    opts = [o.encode() for o in options]
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None) == 0
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode()
