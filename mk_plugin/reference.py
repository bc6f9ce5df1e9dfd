"""fp32 torch truth for every decode op and for one whole decode step over a paged KV cache.

Layouts follow vLLM 0.24 (FLASH_ATTN backend):
- KV cache per layer ``kv[num_blocks, 2, block_size, kv_heads, head_dim]``, K at ``[:, 0]``.
- ``slot = block_table[r, pos // block_size] * block_size + pos % block_size``; slot < 0 is padding.
- ``block_table[num_reqs, max_blocks]`` int32, ``seq_lens[num_reqs]`` int32 including the new token.
- Linear weights ``[out_features, in_features]``; qkv rows are q|k|v, gate_up rows are gate|up.
- RoPE is neox style; ``cos_sin_cache[max_pos, head_dim]`` holds cos in the first half, sin in the
  second, computed the way vLLM's ``get_rope`` does (llama3 frequency scaling included).
Every function upcasts to fp32 and returns fp32 (the cache functions write in the cache's dtype).
"""
from __future__ import annotations

import math

import torch

from .spec import LlamaSpec
from .weights import ModelWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (if given); out = h / sqrt(mean(h^2) + eps) * weight. Returns (out, h)."""
    h = x.float() if residual is None else x.float() + residual.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out, h


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x @ weight^T with weight [N, K]."""
    return x.float() @ weight.float().t()


def silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gu[:, :I]) * gu[:, I:] with I = gu.shape[-1] // 2."""
    g, u = gu.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def rope_inv_freq(spec: LlamaSpec) -> torch.Tensor:
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rs = spec.rope_scaling
    if rs is None:
        return inv
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    wave_len = 2 * math.pi / inv
    if rs.low_freq_factor != rs.high_freq_factor:
        smooth = (rs.original_max_position_embeddings / wave_len - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
    else:
        smooth = torch.zeros_like(inv)
    return torch.where(
        wave_len < high_wl, inv,
        torch.where(wave_len > low_wl, inv / rs.factor,
                    (1 - smooth) * inv / rs.factor + smooth * inv))


def rope_cos_sin_cache(spec: LlamaSpec, max_pos: int | None = None) -> torch.Tensor:
    """[max_pos, head_dim] fp32: cos(pos * inv_freq) | sin(pos * inv_freq), as vLLM builds it."""
    n = max_pos or spec.max_position_embeddings
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), rope_inv_freq(spec))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation of x[T, heads, d]: (x1*cos - x2*sin, x2*cos + x1*sin) with x1|x2 the halves."""
    d = x.shape[-1]
    cs = cos_sin[positions.long().clamp(min=0)].float()
    cos, sin = cs[:, None, : d // 2], cs[:, None, d // 2:]
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def kv_append(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, kv_heads, d] into kv_cache at slot_mapping[T]; slots < 0 are skipped."""
    bs = kv_cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        kv_cache[slot // bs, 0, slot % bs] = k[t].to(kv_cache.dtype)
        kv_cache[slot // bs, 1, slot % bs] = v[t].to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [seq_len, kv_heads, d] fp32 of one request, read through its block-table row."""
    bs = kv_cache.shape[2]
    pos = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_row.long()[pos // bs]
    offs = pos % bs
    return kv_cache[blocks, 0, offs].float(), kv_cache[blocks, 1, offs].float()


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention: q[B, qh, d] (one token per request) over its first seq_lens[b] cached
    positions; GQA maps q head h to kv head h // (qh / kvh). Requests with seq_len <= 0 give 0."""
    b, qh, d = q.shape
    kvh = kv_cache.shape[3]
    out = torch.zeros(b, qh, d, dtype=torch.float32, device=q.device)
    for r, L in enumerate(seq_lens.tolist()):
        if L <= 0:
            continue
        k, v = gather_kv(kv_cache, block_table[r], L)
        k = k.repeat_interleave(qh // kvh, dim=1)  # [L, qh, d]
        v = v.repeat_interleave(qh // kvh, dim=1)
        s = torch.einsum("hd,lhd->hl", q[r].float(), k) * scale
        out[r] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v)
    return out


def _rounder(dtype: torch.dtype | None):
    """Identity, or a round trip through `dtype` (the storage points of a half-precision kernel)."""
    return (lambda t: t) if dtype is None else (lambda t: t.to(dtype).float())


def decode_layer(spec: LlamaSpec, lw, h: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 slot_mapping: torch.Tensor, round_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One decoder layer on the residual stream h[B, H] (fp32); writes this step's K/V into kv_cache.

    round_dtype=None is pure fp32. With bf16/fp16 every tensor a fused kernel stores (normed input,
    qkv, roped q/k, attention output, activation, residual stream) is rounded there, while all
    arithmetic stays fp32: the truth for a kernel chain, free of its accumulation order only."""
    rd = _rounder(round_dtype)
    b = h.shape[0]
    a, _ = rms_norm(h, lw.input_norm, spec.rms_eps)
    qkv = rd(linear(rd(a), lw.qkv))
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    q = rd(apply_rope(q.view(b, spec.num_q_heads, spec.head_dim), positions, cos_sin))
    k = rd(apply_rope(k.view(b, spec.num_kv_heads, spec.head_dim), positions, cos_sin))
    kv_append(k, v.view(b, spec.num_kv_heads, spec.head_dim), kv_cache, slot_mapping)
    attn = rd(paged_attention(q, kv_cache, block_table, seq_lens, spec.head_dim ** -0.5))
    h = rd(h + linear(attn.reshape(b, spec.q_size), lw.o))
    m, _ = rms_norm(h, lw.post_norm, spec.rms_eps)
    return rd(h + linear(rd(silu_and_mul(linear(rd(m), lw.gate_up))), lw.down))


def decode_step(spec: LlamaSpec, w: ModelWeights, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], block_table: torch.Tensor, seq_lens: torch.Tensor,
                slot_mapping: torch.Tensor, cos_sin: torch.Tensor | None = None,
                round_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of B tokens (token b belongs to request b). Returns (final normed hidden
    [B, H], logits [B, vocab]), both fp32. kv_caches (one per layer) receive this step's K/V.
    round_dtype: see decode_layer (None = pure fp32)."""
    if cos_sin is None:
        cos_sin = rope_cos_sin_cache(spec, int(positions.max().item()) + 1).to(input_ids.device)
    h = w.embed[input_ids.long()].float()
    for i, lw in enumerate(w.layers):
        h = decode_layer(spec, lw, h, positions, cos_sin, kv_caches[i], block_table, seq_lens, slot_mapping,
                         round_dtype)
    hn, _ = rms_norm(h, w.final_norm, spec.rms_eps)
    hn = _rounder(round_dtype)(hn)
    return hn, linear(hn, w.lm_head)
