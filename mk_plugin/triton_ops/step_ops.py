"""The Triton calls of each op of a decode step (mk_plugin.ops names), written once: the Triton decode
step chains them (decode_step.py), the megakernel runs the ones named in MK_FALLBACK between its
segments and recomputes a hung step with the whole chain (persistent/backend.py). Only the buffers
differ: the Triton step ping-pongs the residual stream between two buffers, the megakernel keeps
its own (the layer's residual source, then RESID, added to in place)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..decoding import DecodeInputs
from ..spec import LlamaSpec
from ..weights import ModelWeights
from .linear import linear
from .lm_head import lm_head
from .paged_attention import paged_attention
from .rms_norm import rms_norm
from .rope_kv_append import rope_kv_append


@dataclass
class OpBuffers:
    """Where one step's ops read and write ([B, ...] views). Layer L reads its residual stream from
    h_src(L); o_proj writes h_mid (= h_src(L) + attention projection); down writes h_out (= h_mid +
    MLP), which the next layer's h_src and final_norm read. num_splits None: paged_attention picks."""
    inputs: DecodeInputs
    h_src: Callable[[int], torch.Tensor]
    h_mid: torch.Tensor
    h_out: torch.Tensor
    qkv: torch.Tensor
    q: torch.Tensor
    attn: torch.Tensor
    act: torch.Tensor
    attn_ws: torch.Tensor
    out: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    num_splits: int | None = None


def _qkv_rope(s: LlamaSpec, w: ModelWeights, n: int, b: OpBuffers) -> None:
    lw, i = w.layers[n], b.inputs
    qkv = linear(b.h_src(n), lw.qkv, norm_weight=lw.input_norm, eps=s.rms_eps, out=b.qkv)
    rope_kv_append(qkv, i.positions, i.cos_sin, i.kv_caches[n], i.slot_mapping, num_q_heads=s.num_q_heads,
                   num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, q_out=b.q)


def _attention(s: LlamaSpec, w: ModelWeights, n: int, b: OpBuffers) -> None:
    i = b.inputs
    paged_attention(b.q, i.kv_caches[n], i.block_table, i.seq_lens, s.head_dim ** -0.5, num_splits=b.num_splits,
                    out=b.attn, workspace=b.attn_ws)


def _o_proj(s: LlamaSpec, w: ModelWeights, n: int, b: OpBuffers) -> None:
    linear(b.attn, w.layers[n].o, residual=b.h_src(n), out=b.h_mid)


def _gate_up(s: LlamaSpec, w: ModelWeights, n: int, b: OpBuffers) -> None:
    lw = w.layers[n]
    linear(b.h_mid, lw.gate_up, norm_weight=lw.post_norm, eps=s.rms_eps, activation="silu_and_mul", out=b.act)


def _down(s: LlamaSpec, w: ModelWeights, n: int, b: OpBuffers) -> None:
    linear(b.act, w.layers[n].down, residual=b.h_mid, out=b.h_out)


def _final_norm(s: LlamaSpec, w: ModelWeights, n: int, b: OpBuffers) -> None:
    assert b.out is not None
    rms_norm(b.h_out, w.final_norm, s.rms_eps, out=b.out)


def _lm_head(s: LlamaSpec, w: ModelWeights, n: int, b: OpBuffers) -> None:
    assert b.out is not None and b.logits is not None
    lm_head(b.out, w.lm_head, out=b.logits)


# op name (mk_plugin.ops.STEP_OPS) -> fn(spec, weights, layer, buffers); layer is -1 after the last layer
TRITON_OPS: dict[str, Callable[[LlamaSpec, ModelWeights, int, OpBuffers], None]] = {
    "qkv_rope": _qkv_rope, "attention": _attention, "o_proj": _o_proj, "gate_up": _gate_up, "down": _down,
    "final_norm": _final_norm, "lm_head": _lm_head,
}
