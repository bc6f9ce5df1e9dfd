"""LM head: fp32 logits[M, V] = f(hidden) @ weight^T, f = optional fused final rms-norm.

A thin wrapper over `linear` with out_dtype=float32 (logits feed the sampler in fp32, and the
vocab dimension of 128256 rows fills the GPU without split-K).
"""
from __future__ import annotations

import torch

from .linear import linear


def lm_head(hidden: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
            eps: float = 1e-5, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits = f(hidden) @ weight^T in fp32; hidden [M, H] (M = 1..16), weight [V, H].

    norm_weight [H] given: f(h) = round_to_hidden_dtype(h * rsqrt(mean(h^2) + eps) * norm_weight),
    else f(h) = h. out [M, V] fp32: written in place.
    """
    return linear(hidden, weight, norm_weight=norm_weight, eps=eps, out=out, out_dtype=torch.float32)
