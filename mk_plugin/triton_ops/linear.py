"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T with M = 1..16 tokens, fp32 accumulation.

Optional fusions (all computed in fp32, rounded once at the end):
- prologue rms-norm:  a = round_xdtype(x * rsqrt(mean(x^2) + eps) * norm_weight);  y = a @ W^T
- epilogue residual:  y = x @ W^T + residual
- silu_and_mul:       W = [gate; up] of [2I, K];  y[M, I] = silu(x @ Wg^T) * (x @ Wu^T)

Design (decode is memory-bound: every weight byte is read exactly once, x stays in L2):
- W is [N, K] row-major (vLLM layout), so a program owns BLOCK_N rows of W and streams them along
  K in BLOCK_K chunks: each thread loads 8 contiguous bf16 = one 16-byte vector.
- All M rows are handled by the program that reads a W tile, so W is read once whatever M is.
- M == 1: broadcast-multiply into a [BLOCK_N, BLOCK_K] fp32 accumulator, reduced along K once after
  the loop (plain FMA GEMV: no shared-memory round trip, no wasted tensor-core rows), with the
  next W tile loaded into registers before the current one is used (double buffering).
- M >= 2: "swap AB" tensor-core dot: acc[BLOCK_N, 16] += W_tile[BLOCK_N, BLOCK_K] @ x^T[BLOCK_K, 16]
  (the weight rows fill the MMA's M side, the tokens, padded to 16 by masking, its N side).
- Rows past N are clamped onto row N-1 instead of masked, so W loads carry no N mask (full
  vectors); the store mask drops them. K is masked only when K is not a multiple of BLOCK_K.
- Too few N tiles to fill the SMs (small N): split-K. Each (tile, split) program writes an fp32
  partial into a workspace; a second kernel sums the splits in a fixed order and applies the
  epilogue. Deterministic (no float atomics). The workspace is cached per (device, stream) and
  never freed, so no allocation happens after the first call with a given shape class (CUDA-graph
  capture safe once warmed up; the first call of a shape may allocate).
- Configs come from a small heuristic table (`select_config`), not triton.autotune: autotune
  benchmarks on first call, which breaks CUDA-graph capture and costs seconds at start-up.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_shape, check_tensor, check_tokens
from ._device import device_name, device_sms, interpreting
from .linear_config import (  # noqa: F401 (re-exported: linear's public configuration API)
    DEFAULT_NUM_SMS,
    MAX_SPLIT_K,
    MAX_WORKSPACE_BYTES,
    MIN_TILES_BEFORE_SPLIT,
    TUNED_DIR,
    TUNED_MIN_GAIN,
    LinearConfig,
    _cdiv,
    _floor_pow2,
    _tuned,
    select_config,
    tuned_file,
    tuned_table,
)

HALF_DTYPES = (torch.bfloat16, torch.float16)
ACTIVATIONS = (None, "silu_and_mul")


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _round_to(v, dt: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 v rounded to dt with round-to-nearest-even. Triton 3.6's CPU interpreter truncates
    fp32 -> bf16 casts (the GPU rounds to nearest), so under the interpreter the rounding is done
    with integer ops first (the cast then only drops zero bits). NaN/inf are not special-cased."""
    if INTERPRET and dt == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dt)


@triton.jit
def _rows_rstd(x_ptr, offs_m, m_mask, K, eps, M_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    """rstd[m] = rsqrt(mean_k(x[m, k]^2) + eps) over the whole row (x is tiny and L2-resident,
    so every program recomputes it rather than synchronising with the others). Squares are
    accumulated element-wise and reduced once, so the loop has no cross-warp reduction."""
    ss = tl.zeros([M_PAD, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xx = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                     mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
        ss += xx * xx
    return tl.rsqrt(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def _gemv_fma(x_ptr, nw_ptr, wg_rows, wu_rows, rstd, k_lo, k_hi, K, dt: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              HAS_NORM: tl.constexpr, SILU: tl.constexpr, INTERPRET: tl.constexpr):
    """M == 1: (x W_g^T, x W_u^T) over K range [k_lo, k_hi) as [BLOCK_N, 1] fp32.

    Broadcast-multiply into [BLOCK_N, BLOCK_K] fp32 accumulators, reduced once after the loop.
    The next chunk's W tile is loaded before the current one is consumed (register double
    buffering: Triton's pipeliner only stages loads that feed tl.dot), so two tiles per program
    are in flight. x is loaded as a [1, BLOCK_K] tile to share W's layout along K (no per-iteration
    shared-memory layout conversion when BLOCK_K = 8 * 32 * num_warps)."""
    offs = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # Chunks never straddle a split boundary (splits are BLOCK_K-aligned): a chunk is either
    # wholly inside [k_lo, k_hi) (scalar test) or partly past K (element test, only if not EVEN_K).
    offs_k = k_lo + offs
    if EVEN_K:
        cur_mask = (offs < BLOCK_K)[None, :] & (k_lo < k_hi)
    else:
        cur_mask = (offs_k < K)[None, :] & (k_lo < k_hi)
    # Weights evict-first in L2 (every weight load of this file): streamed once a step, they no longer evict what the
    # step reads again (K/V, norm weights, activations). Session 43, H100: 1B batch 1 -5.0%, 8B batch 1 -0.7%, the
    # batch > 1 kernel unchanged (bench/NOTES.md).
    wg = tl.load(wg_rows + offs_k[None, :], mask=cur_mask, other=0.0, eviction_policy="evict_first")
    if SILU:
        wu = tl.load(wu_rows + offs_k[None, :], mask=cur_mask, other=0.0, eviction_policy="evict_first")
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + offs
        nxt_k = offs_k + BLOCK_K
        if EVEN_K:
            nxt_mask = (offs < BLOCK_K)[None, :] & (k0 + BLOCK_K < k_hi)
            x_mask = (offs < BLOCK_K)[None, :]
        else:
            nxt_mask = (nxt_k < K)[None, :] & (k0 + BLOCK_K < k_hi)
            x_mask = (offs_k < K)[None, :]
        wg_nxt = tl.load(wg_rows + nxt_k[None, :], mask=nxt_mask, other=0.0, eviction_policy="evict_first")
        if SILU:
            wu_nxt = tl.load(wu_rows + nxt_k[None, :], mask=nxt_mask, other=0.0, eviction_policy="evict_first")
        xv = tl.load(x_ptr + offs_k[None, :], mask=x_mask, other=0.0)
        if HAS_NORM:
            nw = tl.load(nw_ptr + offs_k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            xv = _round_to(xv.to(tl.float32) * tl.sum(rstd) * nw, dt, INTERPRET)
        xf = xv.to(tl.float32)
        acc_g += wg.to(tl.float32) * xf
        wg = wg_nxt
        if SILU:
            acc_u += wu.to(tl.float32) * xf
            wu = wu_nxt
    return tl.sum(acc_g, axis=1)[:, None], tl.sum(acc_u, axis=1)[:, None]


@triton.jit
def _gemm_dot(x_ptr, nw_ptr, wg_rows, wu_rows, rstd, offs_m, m_mask, k_lo, k_hi, K, dt: tl.constexpr,
              M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              HAS_NORM: tl.constexpr, SILU: tl.constexpr, INTERPRET: tl.constexpr):
    """M >= 2: (x W_g^T, x W_u^T) over [k_lo, k_hi) as [BLOCK_N, M_PAD] fp32, "swap AB" on the
    tensor cores: acc[BLOCK_N, M_PAD] += W[BLOCK_N, BLOCK_K] @ x^T[BLOCK_K, M_PAD] (weight rows on
    the MMA's M side, tokens padded to 16 by masking on its N side). Triton's pipeliner stages the
    W tiles through shared memory (cp.async, num_stages deep)."""
    acc_g = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        offs_k = tl.max_contiguous(tl.multiple_of(offs_k, BLOCK_K), BLOCK_K)
        k_mask = offs_k < K  # splits are BLOCK_K-aligned: only the global tail is partial
        if EVEN_K:
            wg = tl.load(wg_rows + offs_k[None, :], eviction_policy="evict_first")
        else:
            wg = tl.load(wg_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
        if SILU:
            if EVEN_K:
                wu = tl.load(wu_rows + offs_k[None, :], eviction_policy="evict_first")
            else:
                wu = tl.load(wu_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
        xt = tl.load(x_ptr + offs_m[None, :] * K + offs_k[:, None],
                     mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        if HAS_NORM:
            nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            # Normalise in fp32, round to x.dtype: what a fused kernel feeds the tensor cores.
            xt = _round_to(xt.to(tl.float32) * rstd[None, :] * nw[:, None], dt, INTERPRET)
        if INTERPRET:
            # Triton 3.6's CPU interpreter multiplies bf16 bit patterns as integers in tl.dot;
            # upcasting is exact (bf16/fp16 products are exact in fp32).
            acc_g += tl.dot(wg.to(tl.float32), xt.to(tl.float32))
            if SILU:
                acc_u += tl.dot(wu.to(tl.float32), xt.to(tl.float32))
        else:
            acc_g = tl.dot(wg, xt, acc_g)
            if SILU:
                acc_u = tl.dot(wu, xt, acc_u)
    return acc_g, acc_u


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, nw_ptr, res_ptr, out_ptr, ws_ptr,
    M, N_OUT, K, K_PER_SPLIT, eps,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr,
    SILU: tl.constexpr, SPLIT_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Program (pid_n, pid_k): output columns [pid_n*BLOCK_N, +BLOCK_N) of all M rows, over the
    K range [pid_k*K_PER_SPLIT, +K_PER_SPLIT) (K_PER_SPLIT is a multiple of BLOCK_K)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dt: tl.constexpr = x_ptr.dtype.element_ty

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_OUT
    # Clamp rows past N onto the last row: loads need no N mask (whole 16-byte vectors).
    rows = tl.minimum(offs_n, N_OUT - 1).to(tl.int64)
    wg_rows = w_ptr + rows[:, None] * K
    wu_rows = w_ptr + (rows + N_OUT)[:, None] * K  # up rows (only read when SILU)

    offs_m = tl.arange(0, M_PAD)
    m_mask = offs_m < M
    if HAS_NORM:
        rstd = _rows_rstd(x_ptr, offs_m, m_mask, K, eps, M_PAD, BLOCK_K)
    else:
        rstd = tl.zeros([M_PAD], dtype=tl.float32)  # unused

    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    if USE_DOT:
        yg, yu = _gemm_dot(x_ptr, nw_ptr, wg_rows, wu_rows, rstd, offs_m, m_mask, k_lo, k_hi, K, dt,
                           M_PAD, BLOCK_N, BLOCK_K, EVEN_K, HAS_NORM, SILU, INTERPRET)
    else:
        yg, yu = _gemv_fma(x_ptr, nw_ptr, wg_rows, wu_rows, rstd, k_lo, k_hi, K, dt,
                           BLOCK_N, BLOCK_K, EVEN_K, HAS_NORM, SILU, INTERPRET)

    mask2 = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        if SILU:
            y = yg / (1.0 + tl.exp(-yg)) * yu
        else:
            y = yg
        offs_out = offs_m[None, :] * N_OUT + offs_n[:, None]
        if HAS_RES:
            y += tl.load(res_ptr + offs_out, mask=mask2, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_out, _round_to(y, out_ptr.dtype.element_ty, INTERPRET), mask=mask2)
    else:
        # Partials: ws[pid_k, m, n_w] fp32, n_w in [0, N_W) with gate at n and up at n + N_OUT.
        if SILU:
            n_w = 2 * N_OUT
        else:
            n_w = N_OUT
        offs_ws = (pid_k * M + offs_m[None, :]) * n_w + offs_n[:, None]
        tl.store(ws_ptr + offs_ws, yg, mask=mask2)
        if SILU:
            tl.store(ws_ptr + offs_ws + N_OUT, yu, mask=mask2)

@triton.jit
def _splitk_reduce_kernel(ws_ptr, res_ptr, out_ptr, M, N_OUT,
                          SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                          HAS_RES: tl.constexpr, SILU: tl.constexpr, INTERPRET: tl.constexpr):
    """out[m, n] = epilogue(sum_s ws[s, m, n]) with the splits summed in order s = 0, 1, ..."""
    pid = tl.program_id(0)
    m = tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N_OUT
    if SILU:
        n_w = 2 * N_OUT
    else:
        n_w = N_OUT
    g = tl.zeros([BLOCK], dtype=tl.float32)
    u = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        base = ws_ptr + (s * M + m) * n_w
        g += tl.load(base + offs, mask=mask, other=0.0)
        if SILU:
            u += tl.load(base + N_OUT + offs, mask=mask, other=0.0)
    if SILU:
        y = g / (1.0 + tl.exp(-g)) * u
    else:
        y = g
    if HAS_RES:
        y += tl.load(res_ptr + m * N_OUT + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * N_OUT + offs, _round_to(y, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


# Split-K partial buffers, keyed by (device, stream). Never freed or shrunk: a CUDA graph captured
# with one keeps its address, so replacing it would leave the graph writing into freed memory. A
# bigger need adds a new buffer next to the old ones.
_WORKSPACES: dict[tuple, list[torch.Tensor]] = {}


def _workspace(numel: int, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        key = (str(device), torch.cuda.current_stream(device).cuda_stream)
    else:
        key = (str(device), 0)
    bufs = _WORKSPACES.setdefault(key, [])
    if not bufs or bufs[-1].numel() < numel:
        size = max(numel, MAX_WORKSPACE_BYTES // 4 if device.type == "cuda" else numel)
        bufs.append(torch.empty(size, dtype=torch.float32, device=device))
    return bufs[-1]


# --------------------------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------------------------

def _ranges_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two contiguous tensors intersect."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0.0 < float(eps) < 1.0):
        raise ValueError(f"eps={eps!r} must be a float in (0, 1)")
    return float(eps)


def linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
           eps: float = 1e-5, residual: torch.Tensor | None = None, activation: str | None = None,
           out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = f(x) @ weight^T (+ residual), fp32 accumulation, for M = 1..16 decode rows.

    x [M, K] bf16/fp16; weight [N, K] same dtype (vLLM layout).
    norm_weight [K]: f(x) = round_to_x_dtype(x * rsqrt(mean(x^2) + eps) * norm_weight), else f(x) = x.
    activation "silu_and_mul": weight is [2I, K] gate|up; y[M, I] = silu(f(x) @ Wg^T) * (f(x) @ Wu^T).
    residual [M, N_out]: added in fp32 before the single rounding to out_dtype (default x.dtype).
    out [M, N_out] of out_dtype: written in place, nothing allocated (split-K shapes allocate a
    cached workspace on their first call only).
    """
    return _linear(x, weight, norm_weight=norm_weight, eps=eps, residual=residual,
                   activation=activation, out=out, out_dtype=out_dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
            eps: float = 1e-5, residual: torch.Tensor | None = None, activation: str | None = None,
            out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
            config: LinearConfig | None = None) -> torch.Tensor:
    """`linear` with an optional forced LinearConfig (tests and tuning sweeps)."""
    check_tensor("x", x, ndim=2, dtypes=HALF_DTYPES)
    check_device(x)
    dev = x.device
    m, k = x.shape
    check_tokens("x", m)
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), device=dev)
    if weight.shape[1] != k:
        raise ValueError(f"weight has shape {tuple(weight.shape)}: in_features {weight.shape[1]} "
                         f"!= x's K={k}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; use None or 'silu_and_mul'")
    silu = activation == "silu_and_mul"
    n_w = weight.shape[0]
    if silu and n_w % 2:
        raise ValueError(f"silu_and_mul needs an even number of weight rows (gate|up), got {n_w}")
    n_out = n_w // 2 if silu else n_w
    if n_out < 1 or k < 1:
        raise ValueError(f"empty linear: weight shape {tuple(weight.shape)}")
    eps = check_eps(eps)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
        check_shape("norm_weight", norm_weight, (k,))
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
        check_shape("residual", residual, (m, n_out))
    if out_dtype is None:
        out_dtype = x.dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} is not supported; use one of {FLOAT_DTYPES}")
    if out is None:
        out = torch.empty((m, n_out), dtype=out_dtype, device=dev)
    else:
        check_tensor("out", out, ndim=2, dtypes=(out_dtype,), device=dev)
        check_shape("out", out, (m, n_out))
        for name, t in (("x", x), ("weight", weight), ("norm_weight", norm_weight)):
            if t is not None and _ranges_overlap(out, t):
                raise ValueError(f"out overlaps {name}; other programs still read {name} while out is written")
        # out may alias residual exactly: each element is read then written by the same program.
        if residual is not None and _ranges_overlap(out, residual) and (
                out.data_ptr() != residual.data_ptr() or out.dtype != residual.dtype):
            raise ValueError("out partially overlaps residual; alias it exactly or not at all")

    cfg = config or select_config(m, n_out, k, silu=silu, num_sms=device_sms(dev), device_name=device_name(dev))
    if not cfg.use_dot and m != 1:
        raise ValueError(f"config {cfg} uses the FMA path, which handles M == 1 only (M={m})")
    m_pad = 16 if cfg.use_dot else 1
    k_per_split = _cdiv(_cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = _cdiv(k, k_per_split)  # drop empty splits
    even_k = k % cfg.block_k == 0
    tiles = _cdiv(n_out, cfg.block_n)
    ws = _workspace(split_k * m * n_w, dev) if split_k > 1 else out
    dummy = out  # stands in for absent optional pointers (never dereferenced)
    _linear_kernel[(tiles, split_k)](
        x, weight, norm_weight if norm_weight is not None else dummy,
        residual if residual is not None else dummy, out, ws,
        m, n_out, k, k_per_split, eps,
        M_PAD=m_pad, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot, EVEN_K=even_k,
        HAS_NORM=norm_weight is not None, HAS_RES=residual is not None, SILU=silu,
        SPLIT_K=split_k, INTERPRET=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split_k > 1:
        block = min(1024, triton.next_power_of_2(n_out))
        _splitk_reduce_kernel[(_cdiv(n_out, block), m)](
            ws, residual if residual is not None else dummy, out, m, n_out,
            SPLIT_K=split_k, BLOCK=block, HAS_RES=residual is not None, SILU=silu,
            INTERPRET=interpreting(), num_warps=4,
        )
    return out


def linear_bytes(m: int, n: int, k: int, dtype: torch.dtype, *, activation: str | None = None,
                 norm: bool = False, residual: bool = False,
                 out_dtype: torch.dtype | None = None) -> int:
    """Bytes one `linear` call must move to/from HBM: weight [n, k] + x [m, k] (+ norm weight [k])
    (+ residual [m, n_out]) + out [m, n_out], with n the weight's rows and n_out = n/2 under
    silu_and_mul. The floor for GB/s reporting (split-K partials and L2 re-reads not counted)."""
    es = torch.empty((), dtype=dtype).element_size()
    oes = torch.empty((), dtype=out_dtype or dtype).element_size()
    n_out = n // 2 if activation == "silu_and_mul" else n
    total = n * k * es + m * k * es + m * n_out * oes
    if norm:
        total += k * es
    if residual:
        total += m * n_out * es
    return total
