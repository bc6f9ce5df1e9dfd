"""Shared by tests, `python -m mk_plugin check` and bench: the tolerance table and batch builders."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .spec import LlamaSpec


@dataclass(frozen=True)
class Tol:
    atol: float      # element-wise, with rtol, for torch.testing.assert_close
    rtol: float
    rel_fro: float   # ||actual - expected||_F / ||expected||_F


# The one tolerance table, keyed by the dtype of the kernel's inputs and outputs. "op" covers one
# kernel against its fp32 reference (output rounding + accumulation order); "step" a whole decode
# step, where bf16 rounding of every intermediate (residual stream, KV cache) compounds per layer.
# "drift" compares a whole half-precision step with the PURE fp32 reference: rounding of the
# residual stream compounds over depth (seen on the H200 with seeded std-0.02 weights: rel 2.7e-2
# at 16 layers (1B), 3.6e-2 at 32 (8B)); "step" compares with the reference that rounds at the
# kernels' storage points (reference.decode_step(round_dtype=...)), which does not drift.
TOLERANCES: dict[torch.dtype, dict[str, Tol]] = {
    torch.bfloat16: {"op": Tol(atol=2e-2, rtol=2e-2, rel_fro=1e-2), "step": Tol(atol=1e-1, rtol=1e-1, rel_fro=3e-2),
                     "drift": Tol(atol=0.5, rtol=0.5, rel_fro=8e-2)},
    torch.float16: {"op": Tol(atol=5e-3, rtol=5e-3, rel_fro=2e-3), "step": Tol(atol=3e-2, rtol=3e-2, rel_fro=8e-3),
                    "drift": Tol(atol=0.1, rtol=0.1, rel_fro=2e-2)},
    torch.float32: {"op": Tol(atol=1e-4, rtol=1e-4, rel_fro=1e-5), "step": Tol(atol=1e-3, rtol=1e-3, rel_fro=1e-4),
                    "drift": Tol(atol=1e-3, rtol=1e-3, rel_fro=1e-4)},
}


def tolerance(dtype: torch.dtype, kind: str = "op") -> Tol:
    return TOLERANCES[dtype][kind]


def bf16_ulp(x: float) -> float:
    """One unit in the last place of bf16 at x (8 significant bits): the resolution below which two
    bf16 logits are a tie."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x != 0 else 2.0 ** -133


def rel_fro(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    return float(torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e).clamp_min(1e-30))


def compare(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, kind: str = "op") -> dict:
    """Errors of actual vs expected and whether they pass the table's tolerance for (dtype, kind)."""
    t = tolerance(dtype, kind)
    a, e = actual.float().cpu(), expected.float().cpu()
    finite = bool(torch.isfinite(a).all())
    max_abs = float((a - e).abs().max()) if a.numel() else 0.0
    rf = rel_fro(a, e) if a.numel() else 0.0
    ok = finite and a.shape == e.shape and rf <= t.rel_fro and bool(
        torch.isclose(a, e, atol=t.atol, rtol=t.rtol).all())
    return {"max_abs": max_abs, "rel_fro": rf, "pass": ok}


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, kind: str = "op") -> None:
    """assert_close with the table's atol/rtol, then the relative Frobenius bound."""
    t = tolerance(dtype, kind)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.isfinite(actual.float()).all(), "non-finite values (unwritten poison?)"
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=t.atol, rtol=t.rtol)
    rf = rel_fro(actual, expected)
    assert rf <= t.rel_fro, f"relative Frobenius error {rf:.3e} > {t.rel_fro:.1e} ({dtype}, {kind})"


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with NaN (float) so any element a kernel fails to write is caught."""
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-12345)


@dataclass
class DecodeBatch:
    """Per-step inputs of a decode step, laid out as vLLM's FLASH_ATTN metadata."""
    input_ids: torch.Tensor     # [B] int64
    positions: torch.Tensor     # [B] int64 (seq_len - 1; 0 for padded entries)
    seq_lens: torch.Tensor      # [B] int32, 0 for padded entries
    block_table: torch.Tensor   # [B, max_blocks] int32 (width padded past what is needed)
    slot_mapping: torch.Tensor  # [B] int64, -1 for padded entries
    kv_caches: list[torch.Tensor]  # per layer [num_blocks, 2, block_size, kv_heads, head_dim]

    @property
    def block_size(self) -> int:
        return self.kv_caches[0].shape[2]

    def clone_caches(self) -> list[torch.Tensor]:
        return [c.clone() for c in self.kv_caches]


def make_decode_batch(spec: LlamaSpec, seq_lens: list[int], block_size: int = 16, seed: int = 0,
                      device: str | torch.device = "cpu", num_layers: int | None = None,
                      extra_blocks: int = 3, dtype: torch.dtype | None = None) -> DecodeBatch:
    """A batch whose requests own random, non-contiguous cache blocks (a shuffled pool), with the
    cache pre-filled with N(0, 1) values so past K/V matter. seq_len 0 makes a padded entry."""
    g = torch.Generator().manual_seed(seed)
    dt = dtype or spec.torch_dtype
    nl = spec.num_layers if num_layers is None else num_layers
    need = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(need + [1]) + extra_blocks
    num_blocks = sum(need) + extra_blocks + 1
    pool = torch.randperm(num_blocks, generator=g).tolist()
    b = len(seq_lens)
    bt = torch.randint(0, num_blocks, (b, max_blocks), generator=g, dtype=torch.int32)
    slots, positions = [], []
    for r, s in enumerate(seq_lens):
        for j in range(need[r]):
            bt[r, j] = pool.pop()
        if s > 0:
            pos = s - 1
            slots.append(int(bt[r, pos // block_size]) * block_size + pos % block_size)
            positions.append(pos)
        else:
            slots.append(-1)
            positions.append(0)
    shape = (num_blocks, 2, block_size, spec.num_kv_heads, spec.head_dim)
    caches = [torch.randn(shape, generator=g).to(device=device, dtype=dt) for _ in range(nl)]
    ids = torch.randint(0, spec.vocab_size, (b,), generator=g)
    return DecodeBatch(
        input_ids=ids.to(device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=bt.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        kv_caches=caches,
    )
