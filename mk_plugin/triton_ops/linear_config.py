"""Launch configurations of triton_ops.linear: the LinearConfig of one call, chosen by a small
heuristic table (select_config) or, on a GPU model with a measured table (bench/sweep_linear.py
--write-tuned: tuned/linear_<gpu>.json), by the measured winner of the nearest token count."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from ._device import H200_SMS, gpu_slug

DEFAULT_NUM_SMS = H200_SMS
MAX_SPLIT_K = 8
# Split-K partials are at most this many bytes ([split_k, M, N_w] fp32); beyond it N is large
# enough to fill the GPU with N tiles alone.
MAX_WORKSPACE_BYTES = 4 << 20



@dataclass(frozen=True)
class LinearConfig:
    block_n: int      # output columns per program (W rows; twice that with silu_and_mul)
    block_k: int      # K chunk per loop iteration
    split_k: int      # programs along K (1: no split, no workspace, one launch)
    use_dot: bool     # tensor-core dot with tokens padded to 16, else FMA GEMV (M == 1 only)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for f in ("block_n", "block_k"):
            v = getattr(self, f)
            if v < 1 or v & (v - 1):
                raise ValueError(f"LinearConfig.{f}={v} must be a power of two")
        if self.use_dot and self.block_n < 16:
            raise ValueError(f"LinearConfig.block_n={self.block_n} must be >= 16 with use_dot")
        if self.use_dot and self.block_k < 16:
            raise ValueError(f"LinearConfig.block_k={self.block_k} must be >= 16 with use_dot")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"LinearConfig.split_k={self.split_k} must be in 1..{MAX_SPLIT_K}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _floor_pow2(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


MIN_TILES_BEFORE_SPLIT = 16
TUNED_DIR = Path(__file__).resolve().parent / "tuned"
# A measured winner replaces the heuristic only when it beat it by more than this (replay noise).
TUNED_MIN_GAIN = 0.03


def tuned_file(device_name: str) -> Path:
    """Where bench/sweep_linear.py --write-tuned stores the measured winners of one GPU model."""
    return TUNED_DIR / f"linear_{gpu_slug(device_name)}.json"


@functools.cache
def tuned_table(device_name: str) -> dict[tuple[int, int, int, bool], LinearConfig]:
    """(m, n_out, k, silu) -> LinearConfig measured on this GPU model, for the shapes swept there."""
    p = tuned_file(device_name)
    if not p.exists():
        return {}
    table = {}
    for e in json.loads(p.read_text())["entries"]:
        if e["default_us"] > e["best_us"] * (1 + TUNED_MIN_GAIN):
            table[(e["m"], e["n_out"], e["k"], e["silu"])] = LinearConfig(**e["config"])
    return table


def _tuned(m: int, n_out: int, k: int, silu: bool, device_name: str | None) -> LinearConfig | None:
    """The measured config for this shape at the nearest swept M of the same kind (M == 1 is
    the FMA GEMV, M > 1 the tensor-core path: a winner never crosses between the two)."""
    if device_name is None:
        return None
    ms = [tm for (tm, tn, tk, ts) in tuned_table(device_name) if (tn, tk, ts) == (n_out, k, silu)
          and (tm == 1) == (m == 1)]
    if not ms:
        return None
    return tuned_table(device_name)[(min(ms, key=lambda tm: abs(tm - m)), n_out, k, silu)]


def select_config(m: int, n_out: int, k: int, *, silu: bool = False,
                  num_sms: int = DEFAULT_NUM_SMS, device_name: str | None = None) -> LinearConfig:
    """The heuristic table. Chosen from bandwidth reasoning and ptxas register/shared-memory
    reports for sm_90 (no GPU timing yet): re-tune with measurements through `_linear(config=)`.

    M == 1, FMA GEMV: BLOCK_K = 1024 = 8 elements (16 bytes) x 32 lanes x 4 warps, so each thread
      owns one vector of each W row per chunk and x shares W's layout (no shared-memory round
      trip in the loop). BLOCK_N = the largest of (4, 2, 1) (silu_and_mul: (2, 1), i.e. 4 W rows)
      leaving >= 3*num_sms programs: ~64-84 registers, so up to 8 programs per SM, each with two
      W tiles (2 x 8 KiB at BLOCK_N=4) in flight through the register double buffer.
    M >= 2, tensor-core dot (tokens padded to 16): BLOCK_N = the largest of (64, 32, 16) leaving
      >= num_sms programs (bigger tiles amortise the x^T tile every program re-reads from L2);
      BLOCK_K = 4096 / BLOCK_N (8 KiB of bf16 W per stage and per gate/up set), 4 stages, which
      keeps the rms-norm prologue variants under ~130 registers (silu+norm: ~160-220).
    Split-K when fewer than MIN_TILES_BEFORE_SPLIT tiles: splits up to
    2*num_sms programs, each split at least 2 BLOCK_K chunks long.
    Llama-3.2-1B / 3.1-8B shapes (qkv, o, gate_up, down, lm_head) never split on a 132-SM GPU.
    """
    tuned = _tuned(m, n_out, k, silu, device_name)
    if tuned is not None:
        return tuned
    k_cap = max(16, 1 << max(k - 1, 0).bit_length())  # next power of two (triton.next_power_of_2)
    if m == 1:
        choices, target = ((2, 1) if silu else (4, 2, 1)), 3 * num_sms
        block_n = next((bn for bn in choices if _cdiv(n_out, bn) >= target), choices[-1])
        block_k, use_dot, stages = min(1024, k_cap), False, 1
    else:
        # Measured on the H200 (bench/sweep_linear.py, bench/results/sweep_linear_2026-11-30_h200.json):
        # 64-row tiles with 256-wide K chunks won or came within 10% for every 1B/8B shape at M=8,
        # even when that leaves fewer programs than SMs (8B qkv: 39.0 -> 20.5 us); 6 stages do not fit.
        block_n, block_k, use_dot, stages = 64, min(256, k_cap), True, (3 if silu else 4)
    tiles = _cdiv(n_out, block_n)
    split_k = 1
    if tiles < MIN_TILES_BEFORE_SPLIT:  # measured: 32-48 tiles of 64 rows beat split-K at Llama sizes
        split_k = min(MAX_SPLIT_K, _floor_pow2(2 * num_sms // tiles), _floor_pow2(k // (2 * block_k)))
        split_k = max(1, split_k)
        if split_k * 16 * n_out * (2 if silu else 1) * 4 > MAX_WORKSPACE_BYTES:
            split_k = 1
    return LinearConfig(block_n=block_n, block_k=block_k, split_k=split_k, use_dot=use_dot,
                        num_warps=4, num_stages=stages)
