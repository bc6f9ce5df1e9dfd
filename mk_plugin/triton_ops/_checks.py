"""Input checks shared by the op wrappers: each raises ValueError naming the offending value."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from ._device import interpreting

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_DECODE_TOKENS = 16


def check_tensor(name: str, t: object, *, ndim: int | None = None, dtypes: Iterable[torch.dtype] | None = None,
                 device: torch.device | None = None, contiguous: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        # ValueError, not TypeError: every bad input of an op is one exception type for callers
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dts = tuple(dtypes)
        if t.dtype not in dts:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: {', '.join(map(str, dts))}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    return t


def check_device(t: torch.Tensor) -> None:
    """Triton needs CUDA tensors, except under the CPU interpreter (TRITON_INTERPRET=1)."""
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(f"tensor on {t.device} given to a GPU op; move it to CUDA "
                         "(CPU tensors are accepted only with TRITON_INTERPRET=1)")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def check_tokens(name: str, m: int) -> None:
    if not 1 <= m <= MAX_DECODE_TOKENS:
        raise ValueError(f"{name} has {m} rows; decode ops support 1..{MAX_DECODE_TOKENS} tokens")
