"""Weights of a Llama decoder in the layouts vLLM holds them ([out, in], qkv fused q|k|v, gate_up
fused gate|up). The Triton path reads vLLM's own parameters through this view; no repacking."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import LlamaSpec


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor         # [q_size + 2*kv_size, H]
    o: torch.Tensor           # [H, q_size]
    post_norm: torch.Tensor   # [H]
    gate_up: torch.Tensor     # [2*I, H]
    down: torch.Tensor        # [H, I]


@dataclass
class ModelWeights:
    embed: torch.Tensor       # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor     # [V, H] (the same tensor as embed when embeddings are tied)

    def to(self, device=None, dtype=None) -> ModelWeights:
        def cv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype)
        embed = cv(self.embed)
        lm = embed if self.lm_head is self.embed else cv(self.lm_head)
        layers = [LayerWeights(*(cv(getattr(lw, f)) for f in LayerWeights.__dataclass_fields__))
                  for lw in self.layers]
        return ModelWeights(embed, layers, cv(self.final_norm), lm)


def random_weights(spec: LlamaSpec, seed: int = 0, std: float = 0.02, device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None, draw_on_device: bool = False) -> ModelWeights:
    """Seeded N(0, std) matrices and N(1, 0.1) norm weights (never zeros, never all-ones).
    draw_on_device: the generator lives on `device` (seconds instead of minutes for 8B-sized
    weights on a GPU; other values than the CPU draw of the same seed)."""
    gdev = device if draw_on_device else "cpu"
    g = torch.Generator(gdev).manual_seed(seed)
    dt = dtype or spec.torch_dtype
    h, i = spec.hidden_size, spec.intermediate_size

    def mat(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g, device=gdev) * std).to(device=device, dtype=dt)

    def norm() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(h, generator=g, device=gdev)).to(device=device, dtype=dt)

    layers = [LayerWeights(norm(), mat(spec.qkv_size, h), mat(h, spec.q_size), norm(),
                           mat(2 * i, h), mat(h, i)) for _ in range(spec.num_layers)]
    embed = mat(spec.vocab_size, h)
    lm = embed if spec.tie_word_embeddings else mat(spec.vocab_size, h)
    return ModelWeights(embed, layers, norm(), lm)
