"""One interface for every decode path: the inputs of a decode step (DecodeInputs: the seven tensors
every decode call takes) and the Decoder protocol that the Triton step (triton_ops.TritonDecoder),
the megakernel (persistent.backend.MegakernelDecoder, on the GPU or on its CPU interpreter) and the
vLLM adapter share. Framework-free apart from torch: nothing here imports Triton, CuPy or vLLM."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class DecodeInputs:
    """One decode step of B tokens, token b being the new token of request b.

    hidden [B, H] embedded input (model dtype); positions [B]; kv_caches one per layer in vLLM's
    FLASH_ATTN layout [num_blocks, 2, block_size, kv_heads, head_dim]; block_table [>= B, blocks]
    int32; seq_lens [>= B] int32 (0 = padded entry); slot_mapping [B] (-1 = no K/V write);
    cos_sin [max_pos, head_dim] rotary table (fp32 or model dtype)."""
    hidden: torch.Tensor
    positions: torch.Tensor
    kv_caches: list[torch.Tensor]
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin: torch.Tensor

    @property
    def batch(self) -> int:
        return int(self.hidden.shape[0])

    def args(self) -> tuple:
        """The positional arguments of decode_step / MegakernelDecoder.__call__, in their order."""
        return (self.hidden, self.positions, self.kv_caches, self.block_table, self.seq_lens, self.slot_mapping,
                self.cos_sin)


@runtime_checkable
class Decoder(Protocol):
    """A decode path: decode(inputs, out) writes the final-normed hidden states [B, H] into `out`
    (and returns it) and appends this step's K/V to inputs.kv_caches; it allocates nothing once
    prepared, so it can be captured in a CUDA graph. `backend` names the path ("triton" or
    "megakernel") for logs and mk_status."""
    backend: str

    def decode(self, inputs: DecodeInputs, out: torch.Tensor) -> torch.Tensor: ...
