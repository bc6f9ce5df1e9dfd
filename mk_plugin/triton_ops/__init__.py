"""Per-op Triton decode kernels: the verified references for speed and the per-op fallbacks.
Each wrapper checks its inputs and documents its formula; see the op files."""
from .decode_step import DecodeWorkspace, TritonDecoder, decode_step
from .linear import linear
from .lm_head import lm_head
from .paged_attention import paged_attention
from .rms_norm import rms_norm
from .rope_kv_append import rope_kv_append

__all__ = ["DecodeWorkspace", "TritonDecoder", "decode_step", "linear", "lm_head", "paged_attention", "rms_norm", "rope_kv_append"]
