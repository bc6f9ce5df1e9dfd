"""The Triton path's and the stock-like scheme's rounding points, emulated in torch for
bench/accuracy_cpu.py (see its docstring): bf16 rounding, the split-KV online-softmax attention of
triton_ops/paged_attention.py (or FlashAttention's, for the stock-like scheme), and one decode step of
either scheme."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mk_plugin import reference as ref
from mk_plugin.spec import LlamaSpec
from mk_plugin.triton_ops.paged_attention import choose_num_splits, tile_tokens
from mk_plugin.weights import ModelWeights

BF16 = torch.bfloat16
LOG2E = 1.4426950408889634
NUM_SMS = 132   # the H200's SMs: the Triton kernel's split count depends on it


def rd(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 to bf16 (nearest even) and back."""
    return t.to(BF16).float()


# ---- attention emulations --------------------------------------------------------------------------
def tiled_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, *, tile: int, num_splits: int, l_from_rounded: bool) -> torch.Tensor:
    """Online-softmax decode attention in exp2 units over `tile`-token tiles, the tiles of a request
    cut into num_splits equal shares, p rounded to bf16 before P@V (l summed from the rounded p when
    l_from_rounded, as triton_ops/paged_attention.py does; from the fp32 p as FlashAttention does),
    then the split combine. q [B, qh, d]; returns fp32 [B, qh, d] (the caller rounds)."""
    b, qh, d = q.shape
    kvh = kv_cache.shape[3]
    out = torch.zeros(b, qh, d)
    for r, L in enumerate(seq_lens.tolist()):
        if L <= 0:
            continue
        k, v = ref.gather_kv(kv_cache, block_table[r], L)
        k = k.repeat_interleave(qh // kvh, dim=1)
        v = v.repeat_interleave(qh // kvh, dim=1)
        s = torch.einsum("hd,lhd->hl", q[r].float(), k) * (scale * LOG2E)
        n_tiles = -(-L // tile)
        per = -(-n_tiles // num_splits)
        ms, ls, accs = [], [], []
        for sp in range(num_splits):
            lo, hi = sp * per, min(sp * per + per, n_tiles)
            if lo >= hi:
                continue
            m = torch.full((qh,), float("-inf"))
            l_ = torch.zeros(qh)
            acc = torch.zeros(qh, d)
            for t in range(lo, hi):
                a, z = t * tile, min(L, (t + 1) * tile)
                sc = s[:, a:z]
                m_new = torch.maximum(m, sc.max(-1).values)
                alpha = torch.exp2(m - m_new)
                p32 = torch.exp2(sc - m_new[:, None])
                p = rd(p32)
                l_ = l_ * alpha + (p if l_from_rounded else p32).sum(-1)
                acc = acc * alpha[:, None] + torch.einsum("hl,lhd->hd", p, v[a:z])
                m = m_new
            ms.append(m)
            ls.append(l_)
            accs.append(acc)
        m = torch.stack(ms)
        w = torch.exp2(m - m.max(0).values)
        out[r] = (w[:, :, None] * torch.stack(accs)).sum(0) / (w * torch.stack(ls)).sum(0)[:, None]
    return out


def norm_f32(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return ref.rms_norm(h, w, eps)[0]


# ---- emulated decode steps ----------------------------------------------------------------------
def step_emulated(kind: str, spec: LlamaSpec, w: ModelWeights, ids: torch.Tensor, positions: torch.Tensor,
                  caches: list[torch.Tensor], block_table: torch.Tensor, seq_lens: torch.Tensor,
                  slots: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """kind 'triton' or 'stock' (see the module docstring); returns the final normed hidden [B, H]
    (bf16 values in fp32). caches (bf16) receive this step's K/V."""
    b, eps, d = ids.shape[0], spec.rms_eps, spec.head_dim
    scale = d ** -0.5
    bs = caches[0].shape[2]
    splits = choose_num_splits(b, spec.num_kv_heads, block_table.shape[1] * bs, bs, NUM_SMS)
    h = w.embed[ids.long()].float()
    res = None
    for i, lw in enumerate(w.layers):
        if kind == "triton":
            a = rd(norm_f32(h, lw.input_norm, eps))
        else:  # stock: fused_add_rms_norm: residual rounded, normed output rounded twice
            z = h if res is None else rd(h + res)
            res = z
            a = rd(rd(z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)) * lw.input_norm.float())
        qkv = rd(ref.linear(a, lw.qkv))
        q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        q = rd(ref.apply_rope(q.view(b, spec.num_q_heads, d), positions, cs))
        k = rd(ref.apply_rope(k.view(b, spec.num_kv_heads, d), positions, cs))
        ref.kv_append(k, v.view(b, spec.num_kv_heads, d), caches[i], slots)
        if kind == "triton":
            attn = rd(tiled_attention(q, caches[i], block_table, seq_lens, scale, tile=tile_tokens(bs),
                                      num_splits=splits, l_from_rounded=True))
            h = rd(h + ref.linear(attn.reshape(b, -1), lw.o))
            m = rd(norm_f32(h, lw.post_norm, eps))
            act = rd(ref.silu_and_mul(ref.linear(m, lw.gate_up)))
            h = rd(h + ref.linear(act, lw.down))
        else:
            attn = rd(tiled_attention(q, caches[i], block_table, seq_lens, scale, tile=128, num_splits=1,
                                      l_from_rounded=False))
            o = rd(ref.linear(attn.reshape(b, -1), lw.o))
            z = rd(o + res)
            res = z
            m = rd(rd(z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)) * lw.post_norm.float())
            act = rd(ref.silu_and_mul(rd(ref.linear(m, lw.gate_up))))
            h = rd(ref.linear(act, lw.down))
    if kind == "triton":
        return rd(norm_f32(h, w.final_norm, eps))
    z = rd(h + res)
    return rd(rd(z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)) * w.final_norm.float())
