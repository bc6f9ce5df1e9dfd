"""The op names of one decode step, in order. The same names are used by the Triton decode path
(`triton_ops.decode_step`), MK_FALLBACK, the megakernel's graph and task types, tests and bench."""
from __future__ import annotations

# Per layer: qkv_rope = rms_norm(h) -> qkv linear -> RoPE -> K/V append into the paged cache;
# attention = paged decode attention (split-KV partials + combine); o_proj = linear + residual;
# gate_up = rms_norm(h) -> gate_up linear -> silu_and_mul; down = linear + residual.
# After the last layer: final_norm, then lm_head (logits).
LAYER_OPS: tuple[str, ...] = ("qkv_rope", "attention", "o_proj", "gate_up", "down")
STEP_OPS: tuple[str, ...] = LAYER_OPS + ("final_norm", "lm_head")
