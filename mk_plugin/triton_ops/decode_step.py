"""The Triton decode path: one decode step of B tokens through every layer, op by op.

This is the verified fallback of the megakernel and the reference for its speed. The ops are the
TRITON_OPS table of step_ops.py (mk_plugin.ops names: qkv_rope, attention, o_proj, gate_up, down,
final_norm), the same calls the megakernel's fallback segments make. All intermediates live in a
DecodeWorkspace allocated once, so a step allocates nothing and can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..decoding import DecodeInputs
from ..ops import LAYER_OPS
from ..spec import LlamaSpec
from ..weights import ModelWeights
from ._checks import check_device, check_shape, check_tensor, check_tokens
from ._device import device_sms
from .paged_attention import choose_num_splits, paged_attention_workspace_size
from .step_ops import TRITON_OPS, OpBuffers


@dataclass
class DecodeWorkspace:
    """Every intermediate of a step for up to max_tokens tokens. h/h2 ping-pong the residual stream
    so no kernel reads and writes the same buffer."""
    max_tokens: int
    # KV splits of the attention per batch size (index b - 1): chosen for the step's own batch, so that a small batch
    # still spreads over the SMs (one count for max_tokens gave batch 2 of Llama-3.1-8B 32 programs on 132 SMs: its
    # attention at 8K tokens of context ran ~8x vLLM's, bench/NOTES.md session 25)
    splits_by_batch: tuple[int, ...]
    h: torch.Tensor
    h2: torch.Tensor
    qkv: torch.Tensor
    q: torch.Tensor
    attn: torch.Tensor
    act: torch.Tensor
    attn_ws: torch.Tensor

    @classmethod
    def allocate(cls, spec: LlamaSpec, max_tokens: int, max_blocks_per_seq: int, block_size: int,
                 device: str | torch.device) -> DecodeWorkspace:
        if not 1 <= max_tokens <= 16:
            raise ValueError(f"max_tokens={max_tokens}; the decode path supports 1..16 tokens")
        dt = spec.torch_dtype
        sms = device_sms(torch.device(device))
        splits = tuple(choose_num_splits(b, spec.num_kv_heads, max_blocks_per_seq * block_size, block_size, sms)
                       for b in range(1, max_tokens + 1))

        def buf(n: int) -> torch.Tensor:
            return torch.empty(max_tokens, n, dtype=dt, device=device)

        # one buffer serves every batch size: a (b, S) call uses its first b * S rows of partials
        rows = max(b * sp for b, sp in enumerate(splits, start=1))
        ws_elems = paged_attention_workspace_size(rows, spec.num_q_heads, spec.head_dim, 1)
        return cls(max_tokens, splits, buf(spec.hidden_size), buf(spec.hidden_size), buf(spec.qkv_size),
                   buf(spec.q_size), buf(spec.q_size), buf(spec.intermediate_size),
                   torch.empty(ws_elems, dtype=torch.float32, device=device))


def _check_step_inputs(spec: LlamaSpec, weights: ModelWeights, hidden: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[torch.Tensor], block_table: torch.Tensor, seq_lens: torch.Tensor,
                       slot_mapping: torch.Tensor, out: torch.Tensor | None) -> None:
    """Everything a step's kernels will check, checked before the first one launches: a refused
    step must not have written this token's K/V already."""
    if len(kv_caches) != spec.num_layers or len(weights.layers) != spec.num_layers:
        raise ValueError(f"got {len(kv_caches)} kv caches and {len(weights.layers)} layers of weights; "
                         f"the spec has num_layers={spec.num_layers}")
    check_tensor("hidden", hidden, ndim=2, dtypes=(spec.torch_dtype,))
    check_device(hidden)
    b, dev = hidden.shape[0], hidden.device
    check_tokens("hidden", b)
    check_shape("hidden", hidden, (b, spec.hidden_size))
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(spec.torch_dtype,), device=dev)
        check_shape("out", out, (b, spec.hidden_size))
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64, torch.int32), device=dev)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), device=dev)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev, contiguous=False)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=dev)
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_shape(name, t, (b,))
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.shape[0] < b:
            raise ValueError(f"{name} has {t.shape[0]} rows for a batch of {b} tokens (one request per token)")
    shape = (spec.num_kv_heads, spec.head_dim)
    for i, c in enumerate(kv_caches):
        check_tensor(f"kv_caches[{i}]", c, ndim=5, dtypes=(spec.torch_dtype,), device=dev, contiguous=False)
        if c.shape[1] != 2 or tuple(c.shape[3:]) != shape:
            raise ValueError(f"kv_caches[{i}] has shape {tuple(c.shape)}; expected (num_blocks, 2, block_size, "
                             f"{shape[0]}, {shape[1]}) (vLLM FLASH_ATTN layout)")


def decode_step(spec: LlamaSpec, weights: ModelWeights, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], block_table: torch.Tensor, seq_lens: torch.Tensor,
                slot_mapping: torch.Tensor, cos_sin_cache: torch.Tensor, *,
                workspace: DecodeWorkspace | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run all layers for B decode tokens (token b is request b) and return the final-normed hidden
    states [B, H] (what LlamaModel.forward returns). hidden is the embedded input [B, H]; this step's
    K/V are written into kv_caches (one per layer, vLLM FLASH_ATTN layout) at slot_mapping."""
    _check_step_inputs(spec, weights, hidden, positions, kv_caches, block_table, seq_lens, slot_mapping, out)
    b = hidden.shape[0]
    ws = workspace or DecodeWorkspace.allocate(spec, b, block_table.shape[1], kv_caches[0].shape[2], hidden.device)
    if b > ws.max_tokens:
        raise ValueError(f"batch of {b} tokens exceeds the workspace's max_tokens={ws.max_tokens}")
    h, h2 = ws.h[:b], ws.h2[:b]
    h.copy_(hidden)
    o = out if out is not None else torch.empty_like(hidden)
    # The residual stream ping-pongs: layer input h, after o_proj h2, after down h again.
    bufs = OpBuffers(DecodeInputs(hidden, positions, kv_caches, block_table, seq_lens, slot_mapping, cos_sin_cache),
                     h_src=lambda _layer: h, h_mid=h2, h_out=h, qkv=ws.qkv[:b], q=ws.q[:b], attn=ws.attn[:b],
                     act=ws.act[:b], attn_ws=ws.attn_ws, out=o, num_splits=ws.splits_by_batch[b - 1])
    for i in range(spec.num_layers):
        for op in LAYER_OPS:
            TRITON_OPS[op](spec, weights, i, bufs)
    TRITON_OPS["final_norm"](spec, weights, -1, bufs)
    return o


@dataclass
class TritonDecoder:
    """The Triton decode path as a Decoder (mk_plugin.decoding): decode_step over a preallocated
    workspace, so a step allocates nothing and can be captured in a CUDA graph."""
    spec: LlamaSpec
    weights: ModelWeights
    workspace: DecodeWorkspace
    backend: ClassVar[str] = "triton"

    def decode(self, inputs: DecodeInputs, out: torch.Tensor) -> torch.Tensor:
        return decode_step(self.spec, self.weights, *inputs.args(), workspace=self.workspace, out=out)
