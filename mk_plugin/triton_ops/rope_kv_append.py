"""Neox RoPE on q and k of one decode step, fused with the K/V append into vLLM's paged cache.

For token b at position p = positions[b] and each head, with x = x1 | x2 (the two halves of d):

    rope(x) = (x1 * cos - x2 * sin) | (x2 * cos + x1 * sin),   cos | sin = cos_sin_cache[p]

computed in fp32 and rounded once to the output dtype. q heads go to ``q_out[b]``; k heads (roped)
and v heads (raw) go to ``kv_cache[slot // bs, 0|1, slot % bs]`` with slot = slot_mapping[b];
slot < 0 marks a padded token and writes nothing into the cache (its q row is still written).
Matches ``reference.apply_rope`` + ``reference.kv_append``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_device, check_shape, check_tensor, check_tokens

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BLOCK_SIZES = (16, 32, 64)
INDEX_DTYPES = (torch.int64, torch.int32)
# At most this many heads (q and k together) per program: for a 1B/8B layer (32 q + 8 k heads) a
# token takes 3 programs of <= 16x64 fp32 elements per half, enough parallelism for B=1.
MAX_HEADS_PER_PROGRAM = 16


@triton.jit
def _rope_kv_append_kernel(
    qkv_ptr, pos_ptr, cs_ptr, kv_ptr, slot_ptr, q_out_ptr,
    stride_qkv, stride_cs, stride_kv_blk, stride_kv_kind, stride_q_out, max_pos,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
):
    """Program (b, hb): heads hb*HEADS_PER_PROG.. of token b, indexed over the q|k head range of the
    qkv row (k heads directly follow q heads there). v head j sits NUM_KV_HEADS heads after k head j."""
    b = tl.program_id(0)
    hb = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_h = hb * HEADS_PER_PROG + tl.arange(0, HEADS_PER_PROG)
    offs_d = tl.arange(0, HALF)
    in_range = offs_h < NUM_Q_HEADS + NUM_KV_HEADS

    # Padded tokens may carry any position; clamping keeps the cache read in bounds (the reference
    # clamps at 0; in-range positions are unaffected).
    pos = tl.load(pos_ptr + b).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
    cos = tl.load(cs_ptr + pos * stride_cs + offs_d).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_d).to(tl.float32)

    row = qkv_ptr + b.to(tl.int64) * stride_qkv
    x_off = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    m2 = in_range[:, None]
    x1 = tl.load(row + x_off, mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(row + x_off + HALF, mask=m2, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]

    # q heads -> q_out
    is_q = (offs_h < NUM_Q_HEADS)[:, None]
    q_row = q_out_ptr + b.to(tl.int64) * stride_q_out
    tl.store(q_row + x_off, o1.to(q_out_ptr.dtype.element_ty), mask=is_q)
    tl.store(q_row + x_off + HALF, o2.to(q_out_ptr.dtype.element_ty), mask=is_q)

    # k heads (roped) and v heads (raw) -> cache slot; slot < 0 is padding: no cache write at all.
    slot = tl.load(slot_ptr + b).to(tl.int64)
    is_k = (in_range & (offs_h >= NUM_Q_HEADS) & (slot >= 0))[:, None]
    safe_slot = tl.maximum(slot, 0)
    blk = safe_slot // BLOCK_SIZE
    off = safe_slot % BLOCK_SIZE
    kv_head = offs_h - NUM_Q_HEADS  # negative on q rows, which are masked out
    c_off = (blk * stride_kv_blk + off * (NUM_KV_HEADS * HEAD_DIM)
             + kv_head[:, None] * HEAD_DIM + offs_d[None, :])
    el = kv_ptr.dtype.element_ty
    tl.store(kv_ptr + c_off, o1.to(el), mask=is_k)
    tl.store(kv_ptr + c_off + HALF, o2.to(el), mask=is_k)
    v_off = x_off + NUM_KV_HEADS * HEAD_DIM
    v1 = tl.load(row + v_off, mask=is_k, other=0.0)
    v2 = tl.load(row + v_off + HALF, mask=is_k, other=0.0)
    tl.store(kv_ptr + stride_kv_kind + c_off, v1.to(el), mask=is_k)
    tl.store(kv_ptr + stride_kv_kind + c_off + HALF, v2.to(el), mask=is_k)


def check_kv_cache(kv_cache: object, num_kv_heads: int, head_dim: int, dtype: torch.dtype | None,
                   device: torch.device | None) -> torch.Tensor:
    """kv_cache [num_blocks, 2, block_size, kv_heads, head_dim]; only the last three dims must be
    contiguous (dim 0 and 1 strides are taken as given: vLLM may view a larger buffer)."""
    t = check_tensor("kv_cache", kv_cache, ndim=5, dtypes=FLOAT_DTYPES, device=device, contiguous=False)
    _nb, two, bs, kvh, d = t.shape
    if two != 2:
        raise ValueError(f"kv_cache dim 1 must be 2 (K, V), got shape {tuple(t.shape)}")
    if bs not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"kv_cache block_size={bs} is not supported; use one of {SUPPORTED_BLOCK_SIZES}")
    if kvh != num_kv_heads or d != head_dim:
        raise ValueError(f"kv_cache has {kvh} kv heads of dim {d} (shape {tuple(t.shape)}), "
                         f"expected num_kv_heads={num_kv_heads}, head_dim={head_dim}")
    if t.stride(4) != 1 or t.stride(3) != d or t.stride(2) != kvh * d:
        raise ValueError(f"kv_cache's last three dims must be contiguous, got stride {t.stride()} "
                         f"for shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"kv_cache has dtype {t.dtype} but the activations are {dtype}")
    check_device(t)
    return t


def _check_heads(num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported; use one of {SUPPORTED_HEAD_DIMS}")
    if num_q_heads <= 0 or num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")


def rope_kv_append(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, num_q_heads: int,
                   num_kv_heads: int, head_dim: int, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE q and k of qkv [B, (qh + 2*kvh)*d] (q|k|v), append roped K and raw V to kv_cache at
    slot_mapping, and return roped q [B, qh*d] (written into q_out when given; no allocation then).

    positions [B] int64/int32; cos_sin_cache [max_pos, d] (cos | sin, any float dtype, used in fp32);
    kv_cache [num_blocks, 2, block_size, kvh, d] in qkv's dtype; slot_mapping [B] int64/int32,
    slot < 0 = padded token (no cache write). No host synchronisation: CUDA-graph capturable.
    """
    _check_heads(num_q_heads, num_kv_heads, head_dim)
    check_tensor("qkv", qkv, ndim=2, dtypes=FLOAT_DTYPES, contiguous=False)
    check_device(qkv)
    dev, dt = qkv.device, qkv.dtype
    b = qkv.shape[0]
    check_tokens("qkv", b)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(f"qkv has {qkv.shape[1]} columns, expected (num_q_heads={num_q_heads} + "
                         f"2*num_kv_heads={num_kv_heads}) * head_dim={head_dim} = {width}")
    if qkv.stride(1) != 1:
        raise ValueError(f"qkv rows must be contiguous, got stride {qkv.stride()}")
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_shape("positions", positions, (b,))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_shape("slot_mapping", slot_mapping, (b,))
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, device=dev, contiguous=False)
    if cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(1) != 1 or cos_sin_cache.shape[0] < 1:
        raise ValueError(f"cos_sin_cache must be [max_pos, head_dim={head_dim}] with contiguous rows, "
                         f"got shape {tuple(cos_sin_cache.shape)} stride {cos_sin_cache.stride()}")
    check_kv_cache(kv_cache, num_kv_heads, head_dim, dt, dev)
    q_size = num_q_heads * head_dim
    if q_out is None:
        q_out = torch.empty(b, q_size, dtype=dt, device=dev)
    else:
        check_tensor("q_out", q_out, dtypes=(dt,), device=dev)
        if q_out.shape not in ((b, q_size), (b, num_q_heads, head_dim)):
            raise ValueError(f"q_out has shape {tuple(q_out.shape)}, expected ({b}, {q_size}) "
                             f"or ({b}, {num_q_heads}, {head_dim})")

    heads = num_q_heads + num_kv_heads
    hpp = min(MAX_HEADS_PER_PROGRAM, triton.next_power_of_2(heads))
    grid = (b, triton.cdiv(heads, hpp))
    _rope_kv_append_kernel[grid](
        qkv, positions, cos_sin_cache, kv_cache, slot_mapping, q_out,
        qkv.stride(0), cos_sin_cache.stride(0), kv_cache.stride(0), kv_cache.stride(1), q_size,
        cos_sin_cache.shape[0],
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2], HEADS_PER_PROG=hpp, num_warps=4,
    )
    return q_out


def rope_kv_append_bytes(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype = torch.bfloat16, cos_sin_dtype: torch.dtype = torch.float32,
                         num_written: int | None = None) -> int:
    """Bytes one call moves: qkv rows, positions/slots (8 B each), one cos|sin row per token, the q
    output and K/V of the ``num_written`` tokens with a slot >= 0 (default: all)."""
    el = torch.tensor([], dtype=dtype).element_size()
    cs_el = torch.tensor([], dtype=cos_sin_dtype).element_size()
    nw = num_tokens if num_written is None else num_written
    reads = num_tokens * ((num_q_heads + 2 * num_kv_heads) * head_dim * el + 16 + head_dim * cs_el)
    writes = num_tokens * num_q_heads * head_dim * el + nw * 2 * num_kv_heads * head_dim * el
    return reads + writes
