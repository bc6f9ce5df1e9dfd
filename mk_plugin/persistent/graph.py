"""The decode step as a list of fused ops (names from mk_plugin.ops), with the buffers each reads
and writes. tasks.py splits each op into tasks; backend.py runs ops listed in `fallback` with the
Triton kernels, on the same buffers, between megakernel segments.

Per layer l (h = residual source: the caller's HIDDEN_IN for layer 0, RESID afterwards):
    qkv_rope   Q, KV[l]  <- rope(rms_norm(h) @ Wqkv^T); K, V appended at slot_mapping
    attention  ATTN_O    <- paged attention of Q over KV[l] (split-KV partials + combine)
    o_proj     RESID     <- h + ATTN_O @ Wo^T
    gate_up    ACT       <- silu(rms_norm(RESID) @ Wg^T) * (rms_norm(RESID) @ Wu^T)
    down       RESID     <- RESID + ACT @ Wd^T
then final_norm (OUT <- rms_norm(RESID)) and optionally lm_head (LOGITS <- OUT @ Wlm^T).
Reading layer 0's residual straight from the caller's tensor saves a copy and keeps the input
unmodified.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ops import LAYER_OPS, STEP_OPS
from ..spec import LlamaSpec
from .encoding import Buf


@dataclass(frozen=True)
class FusedOp:
    name: str                 # one of mk_plugin.ops.STEP_OPS
    layer: int                # -1 for final_norm / lm_head
    reads: tuple[str, ...]    # buffer names (Buf members) and "KV" for the layer's cache
    writes: tuple[str, ...]

    @property
    def key(self) -> str:
        return self.name if self.layer < 0 else f"L{self.layer}.{self.name}"


def residual_source(layer: int) -> Buf:
    """Where layer `layer` reads the residual stream: the caller's input for layer 0."""
    return Buf.HIDDEN_IN if layer == 0 else Buf.RESID


def decode_graph(spec: LlamaSpec, lm_head: bool = False) -> list[FusedOp]:
    """The fused ops of one decode step in execution order."""
    ops: list[FusedOp] = []
    for layer in range(spec.num_layers):
        h = residual_source(layer).name
        table = {
            "qkv_rope": ((h,), ("Q", "KV")),
            "attention": (("Q", "KV"), ("ATTN_O", "PART_O", "PART_ML")),
            "o_proj": (("ATTN_O", h), ("RESID", "PART_K")),   # PART_K: K-split partials (tuning.ksplit)
            "gate_up": (("RESID",), ("ACT",)),
            "down": (("ACT", "RESID"), ("RESID", "PART_K")),
        }
        for name in LAYER_OPS:
            r, w = table[name]
            ops.append(FusedOp(name, layer, r, w))
    ops.append(FusedOp("final_norm", -1, ("RESID",), ("OUT",)))
    if lm_head:
        ops.append(FusedOp("lm_head", -1, ("OUT",), ("LOGITS",)))
    assert all(op.name in STEP_OPS for op in ops)
    return ops


def split_segments(ops: list[FusedOp], fallback: frozenset[str]) -> list[list[FusedOp] | FusedOp]:
    """Cut the op list at fallback ops: maximal runs of megakernel ops become lists (one launch
    each); each fallback op stands alone (a FusedOp) between them."""
    unknown = set(fallback) - set(STEP_OPS)
    if unknown:
        raise ValueError(f"fallback names unknown op(s) {sorted(unknown)}; known: {', '.join(STEP_OPS)}")
    out: list[list[FusedOp] | FusedOp] = []
    run: list[FusedOp] = []
    for op in ops:
        if op.name in fallback:
            if run:
                out.append(run)
                run = []
            out.append(op)
        else:
            run.append(op)
    if run:
        out.append(run)
    return out
