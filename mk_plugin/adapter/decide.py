"""Which path one forward call takes, and which engine settings the decode path cannot serve: pure
functions over duck-typed vLLM objects (no vLLM import at module level; unit-tested with fakes)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_DECODE_TOKENS = 16
SUPPORTED_ATTN_BACKEND = "FLASH_ATTN"
# Attributes of vLLM's FlashAttentionMetadata the decode path reads.
METADATA_FIELDS = ("max_query_len", "max_seq_len", "seq_lens", "block_table", "slot_mapping")


@dataclass(frozen=True)
class Decision:
    """Which path one forward call takes. warn_key is set when the reason is something unsupported
    (worth one warning per key); None for the expected stock steps (prefill, profile run)."""
    decode: bool
    reason: str
    warn_key: str | None = None


def decide(attn_metadata: Any, layer_name: str, num_tokens: int, *, max_tokens: int, capacity_tokens: int,
           mode: str = "triton", static_reason: str | None = None) -> Decision:
    """Decode path iff: mode != stock, the config is supported, the forward context's metadata for
    `layer_name` is FLASH_ATTN-like with max_query_len == 1, num_tokens <= max_tokens, the metadata's
    rows cover the requests, and its max_seq_len fits the workspace (capacity_tokens).

    attn_metadata is ForwardContext.attn_metadata: None (profile run), a dict keyed by layer name,
    or a list of dicts (micro-batching). Reads host-side attributes and tensor shapes only."""
    if mode == "stock":
        return Decision(False, "MK_MODE=stock")
    if static_reason is not None:
        return Decision(False, static_reason, "config")
    if attn_metadata is None:
        return Decision(False, "no attention metadata (profile run, dummy run or piecewise capture)")
    if isinstance(attn_metadata, list):
        return Decision(False, "attention metadata is a list (micro-batching/DBO is not supported)", "ubatch")
    md = attn_metadata.get(layer_name) if isinstance(attn_metadata, Mapping) else attn_metadata
    if md is None:
        return Decision(False, f"no attention metadata for layer {layer_name!r}", "metadata")
    missing = [f for f in METADATA_FIELDS if not hasattr(md, f)]
    if missing:
        return Decision(False, f"attention metadata {type(md).__name__} lacks {missing}; only "
                        f"{SUPPORTED_ATTN_BACKEND} metadata is supported", "metadata")
    if md.max_query_len != 1:
        return Decision(False, f"prefill or mixed batch (max_query_len={md.max_query_len})")
    if num_tokens > max_tokens:
        return Decision(False, f"decode batch of {num_tokens} tokens is larger than the decode path's "
                        f"{max_tokens} (min(max_num_seqs, {MAX_DECODE_TOKENS})); such batches run stock", "batch")
    reqs = md.seq_lens.shape[0]
    if not 1 <= reqs <= num_tokens or md.block_table.dim() != 2 or md.block_table.shape[0] < reqs \
            or md.slot_mapping.shape[0] < reqs:
        return Decision(False, f"unexpected metadata layout: {num_tokens} tokens, seq_lens {tuple(md.seq_lens.shape)}, "
                        f"block_table {tuple(md.block_table.shape)}, slot_mapping {tuple(md.slot_mapping.shape)}",
                        "layout")
    if md.max_seq_len > capacity_tokens:
        return Decision(False, f"max_seq_len={md.max_seq_len} exceeds the workspace's {capacity_tokens} tokens",
                        "context")
    if getattr(md, "dcp_context_kv_lens", None) is not None:
        return Decision(False, "decode context parallelism is not supported", "dcp")
    if getattr(md, "causal", True) is not True or getattr(md, "mm_prefix_range_tensor", None) is not None:
        return Decision(False, "non-causal or prefix-LM attention is not supported", "causal")
    return Decision(True, f"decode of {reqs} request(s) in {num_tokens} token rows")


def full_graph_replays_on_mixed(cudagraph_mode: Any) -> bool:
    """True for cudagraph modes whose FULL graphs also serve mixed batches (plain FULL): a graph
    captured on a decode-shaped dummy batch would then replay our decode kernels on a prefill."""
    if cudagraph_mode is None or not hasattr(cudagraph_mode, "has_full_cudagraphs"):
        return False
    return bool(cudagraph_mode.has_full_cudagraphs() and not cudagraph_mode.separate_routine())


def full_decode_graphs(cudagraph_mode: Any) -> bool:
    """True for cudagraph modes that capture uniform decode batches as FULL graphs (FULL_AND_PIECEWISE,
    FULL_DECODE_ONLY; plain FULL is refused by config_unsupported_reason)."""
    if cudagraph_mode is None or not hasattr(cudagraph_mode, "decode_mode"):
        return False
    return getattr(cudagraph_mode.decode_mode(), "name", None) == "FULL"


def sizes_to_prepare(compilation_config: Any, max_tokens: int) -> list[int]:
    """The decode batch sizes whose megakernel programs are built before vLLM captures its graphs.

    With FULL decode graphs both runners (V1 CudagraphDispatcher, V2 CudaGraphManager) capture a FULL graph
    of every capture size s <= max_num_seqs with s requests, after an eager warm-up of the same s, and pad a
    uniform decode batch of n requests to the smallest capture size >= n: in a graph the decode path only
    sees capture sizes (those <= max_tokens; a larger padded batch runs stock). A batch above the largest
    capture size runs without a graph at its own size, so those sizes are built too, and max_tokens. Any
    other size reaches the decoder only in an eager step (e.g. cascade attention), where it is built on
    first use. Without FULL decode graphs (enforce_eager, NONE, PIECEWISE) every decode step runs eagerly at
    its own size: all of 1..max_tokens, so that no first step of a size waits for its build."""
    every = list(range(1, max_tokens + 1))
    sizes = sorted({int(s) for s in getattr(compilation_config, "cudagraph_capture_sizes", None) or ()})
    if not sizes or not full_decode_graphs(getattr(compilation_config, "cudagraph_mode", None)):
        return every
    return [n for n in every if n in sizes or n > sizes[-1] or n == max_tokens]


def config_unsupported_reason(vllm_config: Any, attn_backends: set[str]) -> str | None:
    """The first engine setting the decode path cannot serve exactly, or None. Duck-typed on
    VllmConfig (parallel_config, cache_config, quant_config, lora_config, speculative_config,
    compilation_config); attn_backends are the names of the attention layers' backends."""
    pc = vllm_config.parallel_config
    for name, what in (("tensor_parallel_size", "tensor parallel"), ("pipeline_parallel_size", "pipeline parallel"),
                       ("decode_context_parallel_size", "decode context parallel"),
                       ("prefill_context_parallel_size", "prefill context parallel")):
        n = getattr(pc, name, 1) or 1
        if n > 1:
            return f"{what} size {n} (only 1 is supported)"
    if getattr(pc, "use_ubatching", False):
        return "micro-batching (DBO/ubatching) is not supported"
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype != "auto":
        return f"kv cache dtype {cache_dtype!r} (only 'auto', the model dtype, is supported)"
    if getattr(vllm_config, "quant_config", None) is not None:
        return f"quantization {type(vllm_config.quant_config).__name__} (only unquantized bf16/fp16 weights)"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA is enabled (the decode path has no LoRA)"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding is enabled"
    if attn_backends != {SUPPORTED_ATTN_BACKEND}:
        return f"attention backend(s) {sorted(attn_backends)} (only {SUPPORTED_ATTN_BACKEND} is supported)"
    cc = getattr(vllm_config, "compilation_config", None)
    if full_graph_replays_on_mixed(getattr(cc, "cudagraph_mode", None)):
        return (f"cudagraph_mode={cc.cudagraph_mode} replays FULL graphs on mixed batches; use "
                "FULL_AND_PIECEWISE (default), FULL_DECODE_ONLY, PIECEWISE or enforce_eager")
    return None


def hf_dict_for_spec(hf: Mapping[str, Any], model_dtype: Any) -> dict[str, Any]:
    """A HF config dict as LlamaSpec.from_hf_config reads it: transformers >= 5 moves rope_theta and
    rope_scaling into `rope_parameters`; the dtype is the one vLLM actually runs (model_config.dtype)."""
    d = dict(hf)
    rp = d.get("rope_parameters")
    if isinstance(rp, Mapping) and ("rope_type" in rp or "rope_theta" in rp):
        if "rope_theta" in rp and d.get("rope_theta") is None:
            d["rope_theta"] = rp["rope_theta"]
        if d.get("rope_scaling") is None:
            d["rope_scaling"] = {k: v for k, v in rp.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if "partial_rotary_factor" in rp and "partial_rotary_factor" not in d:
            d["partial_rotary_factor"] = rp["partial_rotary_factor"]
    if model_dtype is not None:
        d["torch_dtype"] = str(model_dtype).replace("torch.", "")
    return d


def _forward_context_metadata() -> tuple[Any, Any]:
    """(attn_metadata, slot_mapping) of vLLM's current forward context, (None, None) outside one."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None, None
    fc = get_forward_context()
    return fc.attn_metadata, fc.slot_mapping
