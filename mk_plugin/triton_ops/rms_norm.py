"""RMS norm with optional fused residual add, for M = 1..16 decode rows.

    h   = x + residual            (fp32; h = x when no residual)
    out = h * rsqrt(mean(h^2) + eps) * weight      (fp32, rounded once to x.dtype)

Returns (out, h rounded to x.dtype); with no residual the second value is x itself. One program
per row. Rows up to MAX_SINGLE_PASS elements are held in registers (one read of x and residual,
and out / residual_out may alias x / residual exactly, as vLLM's in-place fused_add_rms_norm
does); longer rows take two passes over the row and must not alias.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_shape, check_tensor, check_tokens
from ._device import interpreting
from .linear import _ranges_overlap, _round_to, check_eps

# 16384 fp32 values over 16 warps = 32 registers per thread: covers every Llama hidden size.
MAX_SINGLE_PASS = 16384
TWO_PASS_BLOCK = 4096


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, hout_ptr, H, eps,
                     BLOCK_H: tl.constexpr, SINGLE_PASS: tl.constexpr, HAS_RES: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """Row program_id(0): see the module docstring for the formula."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * H
    r_row = res_ptr + row * H
    h_row = hout_ptr + row * H
    o_row = out_ptr + row * H
    if SINGLE_PASS:
        offs = tl.arange(0, BLOCK_H)
        mask = offs < H
        h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            h += tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            tl.store(h_row + offs, _round_to(h, hout_ptr.dtype.element_ty, INTERPRET), mask=mask)
        tl.store(o_row + offs, _round_to(h * rstd * w, out_ptr.dtype.element_ty, INTERPRET), mask=mask)
    else:
        # Pass 1: sum of squares (and h rounded to x.dtype); pass 2 recomputes h in fp32 from
        # x and residual, so the output uses the unrounded h exactly as the single pass does.
        ss = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            mask = offs < H
            h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                h += tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(h_row + offs, _round_to(h, hout_ptr.dtype.element_ty, INTERPRET), mask=mask)
            ss += h * h
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / H + eps)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            mask = offs < H
            h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                h += tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(o_row + offs, _round_to(h * rstd * w, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


def _check_out(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    check_tensor(name, t, ndim=2, dtypes=(like.dtype,), device=like.device)
    check_shape(name, t, tuple(like.shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             *, out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, h): h = x + residual (fp32), out = h * rsqrt(mean(h^2) + eps) * weight in x.dtype.

    x [M, H] with M = 1..16, weight [H], residual [M, H] of x.dtype. h is returned rounded to
    x.dtype (written into residual_out when given); without residual h is x itself and
    residual_out must not be given. out / residual_out: written in place, nothing allocated.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_device(x)
    dev = x.device
    m, hdim = x.shape
    check_tokens("x", m)
    if hdim < 1:
        raise ValueError(f"x has shape {tuple(x.shape)}: hidden size must be >= 1")
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
    check_shape("weight", weight, (hdim,))
    eps = check_eps(eps)
    single = hdim <= MAX_SINGLE_PASS
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=dev)
        check_shape("residual", residual, (m, hdim))
    elif residual_out is not None:
        raise ValueError("residual_out given without residual (h would be x itself)")
    if out is None:
        out = torch.empty_like(x)
    else:
        _check_out("out", out, x)
    if residual is not None:
        if residual_out is None:
            residual_out = torch.empty_like(x)
        else:
            _check_out("residual_out", residual_out, x)
        if _ranges_overlap(out, residual_out):
            raise ValueError("out and residual_out overlap")
    # In-place use is safe only when each row is read completely before it is written.
    inputs = (("x", x), ("residual", residual))
    for oname, o in (("out", out), ("residual_out", residual_out)):
        for iname, t in inputs:
            if o is None or t is None or not _ranges_overlap(o, t):
                continue
            if not single:
                raise ValueError(f"{oname} aliases {iname}, which needs H <= {MAX_SINGLE_PASS} (H={hdim})")
            if o.data_ptr() != t.data_ptr():
                raise ValueError(f"{oname} partially overlaps {iname}; alias it exactly or not at all")
    if _ranges_overlap(out, weight) or (residual_out is not None and _ranges_overlap(residual_out, weight)):
        raise ValueError("an output overlaps weight")

    block = triton.next_power_of_2(hdim) if single else TWO_PASS_BLOCK
    num_warps = max(1, min(16, block // 256))
    hout = residual_out if residual is not None else out  # dummy pointer when no residual
    _rms_norm_kernel[(m,)](
        x, residual if residual is not None else x, weight, out, hout, hdim, eps,
        BLOCK_H=block, SINGLE_PASS=single, HAS_RES=residual is not None,
        INTERPRET=interpreting(), num_warps=num_warps,
    )
    return out, (residual_out if residual is not None else x)
