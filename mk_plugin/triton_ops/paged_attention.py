"""Decode attention over vLLM's paged KV cache (FLASH_ATTN layout), flash-decoding style.

For request b with L = seq_lens[b] cached tokens (the new one included) and q head h, which reads
kv head kh = h // G with G = qh / kvh:

    out[b, h] = sum_t softmax_t(scale * q[b, h] . K[t, kh]) V[t, kh],   t < L;   out = 0 when L <= 0

K/V of token t live at kv_cache[block_table[b, t // bs], 0|1, t % bs, kh].

Split kernel, grid (B, kvh, S): program (b, kh, s) takes the s-th of S equal shares of request b's
tiles (TILE_N tokens each, token -> cache block looked up per token), runs an online softmax in fp32
over them for all G q heads of kv head kh at once (one tl.dot with the group padded to >= 16 rows,
so each K/V tile is read once per kv head), and writes the partial (m, l, acc[d]) in log2 units:
m = max_t s_t, l = sum_t 2^(s_t - m), acc = sum_t 2^(s_t - m) V_t with s_t = q.K_t * scale * log2(e).
A share past the request's end stays neutral (m = -inf, l = 0, acc = 0).
Combine kernel, grid (B, qh): out = sum_s w_s acc_s / sum_s w_s l_s with w_s = 2^(m_s - max m);
all-neutral rows (L = 0) give exactly 0. With S = 1 the split kernel writes out directly.

Nothing reads seq_lens on the host, so a call is CUDA-graph capturable (pass ``workspace`` and
``out`` to avoid allocation under capture).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._checks import check_device, check_tensor, check_tokens
from ._device import H200_SMS, device_sms, interpreting
from .rope_kv_append import SUPPORTED_HEAD_DIMS, check_kv_cache

ATTN_DTYPES = (torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634
# The combine kernel holds all S partials of a head in registers: [S_PAD, d] fp32.
MAX_SPLITS = 64
# Tokens per inner-loop tile: 64 rows of K and V (a 16-token cache block is 1/4 tile; a tile spans
# blocks through per-token block lookups) keep several independent loads in flight per iteration.
MIN_TILE_TOKENS = 64


def tile_tokens(block_size: int) -> int:
    """Tokens per inner-loop iteration: a whole number of cache blocks, at least MIN_TILE_TOKENS."""
    return max(MIN_TILE_TOKENS, block_size)


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """a @ b with fp32 accumulation. DOT_F32 (CPU interpreter only, whose tl.dot mishandles bf16
    operands in triton 3.6): upcast the 16-bit operands first; products of 16-bit values are exact
    in fp32, so the result matches the GPU's bf16 MMA up to summation order."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _paged_attn_split_kernel(
    q_ptr, kv_ptr, bt_ptr, sl_ptr, out_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr,
    stride_qb, stride_kv_blk, stride_kv_kind, stride_bt, sm_scale_log2, num_splits,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DIRECT_OUT: tl.constexpr, DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    NUM_Q_HEADS: tl.constexpr = NUM_KV_HEADS * GROUP

    seq_len = tl.maximum(tl.load(sl_ptr + b), 0)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    g_mask = offs_g < GROUP
    q_head = kh * GROUP + offs_g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + q_head[:, None] * HEAD_DIM + offs_d[None, :],
                mask=g_mask[:, None] & (seq_len > 0), other=0.0)

    # This program's share of the request's tiles: [lo, hi); empty past the end (neutral partial).
    n_tiles = (seq_len + TILE_N - 1) // TILE_N
    per_split = (n_tiles + num_splits - 1) // num_splits
    lo = s * per_split
    hi = tl.minimum(lo + per_split, n_tiles)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for t in range(lo, hi):
        tok = t * TILE_N + offs_n
        valid = tok < seq_len
        # Entries past the request's blocks are never read (vLLM leaves them stale).
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv_off = (blk * stride_kv_blk + (tok % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM)
                  + kh * HEAD_DIM)
        kv_off2 = kv_off[:, None] + offs_d[None, :]
        k = tl.load(kv_ptr + kv_off2, mask=valid[:, None], other=0.0)
        v = tl.load(kv_ptr + stride_kv_kind + kv_off2, mask=valid[:, None], other=0.0)
        scores = _dot(q, tl.trans(k), DOT_F32) * sm_scale_log2  # [GROUP_PAD, TILE_N], log2 units
        scores = tl.where(valid[None, :], scores, float("-inf"))
        # Every tile in [lo, hi) holds >= 1 valid token, so m_new is finite; 2^(-inf - m_new) = 0.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        # p enters the PV product rounded to the cache dtype; l sums the same rounded values so
        # the output stays an exact convex combination of V rows.
        p = tl.exp2(scores - m_new[:, None]).to(v.dtype)
        l_i = l_i * alpha + tl.sum(p.to(tl.float32), axis=1)
        acc = acc * alpha[:, None] + _dot(p, v, DOT_F32)
        m_i = m_new

    if DIRECT_OUT:
        # One split: normalise here (L = 0 -> l = 0, acc = 0 -> out 0).
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptr = out_ptr + (b * NUM_Q_HEADS + q_head)[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
        tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        row = ((b * NUM_Q_HEADS + q_head) * num_splits + s).to(tl.int64)  # [GROUP_PAD]
        tl.store(ws_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(ws_m_ptr + row, m_i, mask=g_mask)
        tl.store(ws_l_ptr + row, l_i, mask=g_mask)


@triton.jit
def _paged_attn_combine_kernel(
    out_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr, num_splits,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    row = ((b * NUM_Q_HEADS + h) * num_splits + offs_s).to(tl.int64)
    m = tl.load(ws_m_ptr + row, mask=s_mask, other=float("-inf"))
    l = tl.load(ws_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(ws_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    # All partials neutral (L = 0): use 0 as the reference so -inf - ref = -inf and w = 0 (no NaN).
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_ref)
    l_tot = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0)
    o = o / tl.where(l_tot > 0, l_tot, 1.0)
    tl.store(out_ptr + (b * NUM_Q_HEADS + h).to(tl.int64) * HEAD_DIM + offs_d, o.to(out_ptr.dtype.element_ty))


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, block_size: int = 16,
                       num_sms: int = H200_SMS) -> int:
    """Splits so that batch * kvh * splits covers ~num_sms programs, from host-known values only
    (max_context = block_table width * block_size, never the device seq_lens), and never more
    than the tiles (hence blocks) of max_context or MAX_SPLITS."""
    want = triton.cdiv(num_sms, max(1, batch * num_kv_heads))
    cap = max(1, triton.cdiv(max_context, tile_tokens(block_size)))
    return max(1, min(want, cap, MAX_SPLITS))


def paged_attention_num_splits(batch: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int,
                               device: torch.device | str | None = None) -> int:
    """The num_splits paged_attention picks when given None (block_table width max_blocks_per_seq):
    use it to size a workspace ahead of CUDA-graph capture."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return choose_num_splits(batch, num_kv_heads, max_blocks_per_seq * block_size, block_size, device_sms(dev))


def paged_attention_workspace_size(batch: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of the split partials: acc [B, qh, S, d] then m [B, qh, S] then l [B, qh, S].
    (With S = 1 no workspace is touched.) A buffer sized for (B, S) serves any (B', S') with
    B' * S' <= B * S: only the prefix this call needs is used."""
    return batch * num_q_heads * num_splits * (head_dim + 2)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, *, num_splits: int | None = None,
                    out: torch.Tensor | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of q [B, qh*d] or [B, qh, d] over the paged cache; returns out [B, qh*d]
    (q.dtype; written into ``out`` when given). block_table [num_reqs >= B, max_blocks] int32 (row
    stride honoured), seq_lens [num_reqs] int32 with 0 for padded entries (their output is 0)."""
    # ---- checks (shapes, dtypes and devices only: no device values are read) ------------------
    check_tensor("q", q, dtypes=ATTN_DTYPES, contiguous=False)
    check_device(q)
    dev, dt = q.device, q.dtype
    if q.dim() not in (2, 3):
        raise ValueError(f"q must be [B, qh*d] or [B, qh, d], got shape {tuple(q.shape)}")
    b = q.shape[0]
    check_tokens("q", b)
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 5:
        raise ValueError(f"kv_cache must be a 5-D tensor [num_blocks, 2, block_size, kv_heads, head_dim], "
                         f"got {getattr(kv_cache, 'shape', type(kv_cache).__name__)}")
    kvh, d, bs = kv_cache.shape[3], kv_cache.shape[4], kv_cache.shape[2]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={d} (kv_cache shape {tuple(kv_cache.shape)}) is not supported; "
                         f"use one of {SUPPORTED_HEAD_DIMS}")
    check_kv_cache(kv_cache, kvh, d, dt, dev)
    if q.dim() == 3:
        qh = q.shape[1]
        if q.shape[2] != d or q.stride(2) != 1 or q.stride(1) != d:
            raise ValueError(f"q of shape {tuple(q.shape)} stride {q.stride()} must be [B, qh, {d}] "
                             "with contiguous heads")
    else:
        if q.shape[1] % d or q.stride(1) != 1:
            raise ValueError(f"q of shape {tuple(q.shape)} stride {q.stride()} must be [B, qh*{d}] "
                             "with contiguous rows")
        qh = q.shape[1] // d
    if qh % kvh:
        raise ValueError(f"num_q_heads={qh} (q shape {tuple(q.shape)}) is not a multiple of the "
                         f"cache's num_kv_heads={kvh}")
    group = qh // kvh
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev, contiguous=False)
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table rows must be contiguous, got stride {block_table.stride()}")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=dev)
    if block_table.shape[0] < b or seq_lens.shape[0] < b:
        raise ValueError(f"batch B={b} exceeds num_reqs: block_table has {block_table.shape[0]} rows, "
                         f"seq_lens has {seq_lens.shape[0]} entries")
    try:
        scale_f = float(scale)
    except (TypeError, ValueError):
        scale_f = float("nan")
    if not (math.isfinite(scale_f) and scale_f > 0):
        raise ValueError(f"scale={scale!r} must be a positive finite float")
    if num_splits is None:
        num_splits = paged_attention_num_splits(b, kvh, block_table.shape[1], bs, dev)
    if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits!r} must be an int in 1..{MAX_SPLITS}")
    if out is None:
        out = torch.empty(b, qh * d, dtype=dt, device=dev)
    else:
        check_tensor("out", out, dtypes=(dt,), device=dev)
        if out.shape not in ((b, qh * d), (b, qh, d)):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected ({b}, {qh * d}) or ({b}, {qh}, {d})")
    direct = num_splits == 1
    if direct:
        ws = out  # unused by the kernel, any pointer of the right kind does
        ws_acc = ws_m = ws_l = ws
    else:
        need = paged_attention_workspace_size(b, qh, d, num_splits)
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.float32, device=dev)
        check_tensor("workspace", workspace, ndim=1, dtypes=(torch.float32,), device=dev)
        if workspace.numel() < need:
            raise ValueError(f"workspace has {workspace.numel()} elements; B={b}, qh={qh}, d={d}, "
                             f"num_splits={num_splits} need {need}")
        n_acc = b * qh * num_splits * d
        n_ml = b * qh * num_splits
        ws_acc = workspace[:n_acc]
        ws_m = workspace[n_acc:n_acc + n_ml]
        ws_l = workspace[n_acc + n_ml:n_acc + 2 * n_ml]

    _paged_attn_split_kernel[(b, kvh, num_splits)](
        q, kv_cache, block_table, seq_lens, out, ws_acc, ws_m, ws_l,
        q.stride(0), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        scale_f * LOG2E, num_splits,
        NUM_KV_HEADS=kvh, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_SIZE=bs, TILE_N=tile_tokens(bs), DIRECT_OUT=direct,
        DOT_F32=interpreting() and dt == torch.bfloat16, num_warps=4, num_stages=2,
    )
    if not direct:
        _paged_attn_combine_kernel[(b, qh)](
            out, ws_acc, ws_m, ws_l, num_splits,
            NUM_Q_HEADS=qh, HEAD_DIM=d, SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4,
        )
    return out


def paged_attention_bytes(seq_lens: Sequence[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype = torch.bfloat16, num_splits: int = 1,
                          block_size: int = 16) -> int:
    """Bytes one call moves: K and V of every cached token read once per kv head, q read, out
    written, seq_lens/block-table entries, and (num_splits > 1) the fp32 partials written + read."""
    el = torch.tensor([], dtype=dtype).element_size()
    lens = [max(0, int(s)) for s in seq_lens]
    b = len(lens)
    kv = 2 * num_kv_heads * head_dim * el * sum(lens)
    qo = 2 * b * num_q_heads * head_dim * el
    meta = 4 * b + 4 * sum(-(-s // block_size) for s in lens)
    ws = 0 if num_splits == 1 else 2 * 4 * paged_attention_workspace_size(b, num_q_heads, head_dim, num_splits)
    return kv + qo + meta + ws
