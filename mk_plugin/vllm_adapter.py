"""vLLM 0.24 integration: the `vllm.general_plugins` entry point and the Llama model class.

How it plugs in
- ``register()`` (entry point ``mk_plugin = "mk_plugin.vllm_adapter:register"``) runs once in every
  vLLM process (front end, engine core, workers). It validates the MK_* switches (a bad value stops
  vLLM with a ConfigError naming it) and registers architecture ``LlamaForCausalLM`` with the lazy
  string ``"mk_plugin.vllm_adapter:MkLlamaForCausalLM"``. It imports vLLM's model registry only: no
  model code, nothing that touches CUDA. Calling it again changes nothing.
- ``MkLlamaForCausalLM`` is built on first attribute access (PEP 562 ``__getattr__``), so importing
  this module for ``register()`` does not import vLLM's Llama code. It is ``MkDecodeMixin`` in front
  of vLLM's own ``LlamaForCausalLM``: same parameters, weight loading, prefill, ``Attention`` layers
  (the KV cache is sized from them) and LM head.

Backends of the decode path: MK_MODE=triton (default) runs ``triton_ops.decode_step``;
MK_MODE=megakernel runs ``persistent.backend.MegakernelDecoder`` (built on the first forward call with MK_FALLBACK's ops
on the Triton kernels, its programs prepared for every batch size before any capture); if that import
or construction fails, ONE warning names the reason and the Triton path is used.

Which path a step takes (``decide``; stock = ``LlamaForCausalLM.forward``)
- MK_MODE=stock: the class is still registered (so MK_DUMP_LOGITS works) but every step is stock.
  For vLLM without the plugin at all use ``VLLM_PLUGINS=""`` (or uninstall the package).
- A step runs mk_plugin's decode path only when the forward context holds FLASH_ATTN metadata with
  ``max_query_len == 1`` (every request has one new token; token b is request b) and at most
  ``min(max_num_seqs, 16)`` tokens. Prefill, mixed batches and the profile run (no metadata) are
  stock, silently. Anything unsupported (see ``config_unsupported_reason``, the metadata checks in
  ``decide``, the weight/KV checks) logs ONE warning naming the reason and runs stock.

Why the branch is in the top-level ``forward``
- ``LlamaModel`` (``self.model``) is wrapped by ``@support_torch_compile``; branching here keeps the
  decode path out of torch.compile, while stock steps still call the compiled ``self.model``.
- CUDA graphs: with FULL_AND_PIECEWISE (default) vLLM captures uniform-decode batches as FULL graphs
  by calling this forward with real decode metadata, so our kernels are what gets captured (V1:
  ``CUDAGraphWrapper`` around the model; V2: ``torch.cuda.graph`` around ``model(**inputs)``).
  Piecewise captures pass no metadata and therefore capture stock. Plain ``cudagraph_mode=FULL`` is
  refused: there a graph captured on a decode-shaped dummy batch is replayed for mixed batches.
- During a step nothing is allocated: the decode workspace, the embedding and output buffers are
  allocated on the first forward call (vLLM's profile run, before the KV cache is sized) and kept
  as plain attributes (never parameters or buffers: dummy loading and the weight loader never see
  them). Kernels run on ``torch.cuda.current_stream()``; per-step values are read on the device from
  the metadata tensors (block_table, seq_lens, slot_mapping); padded entries have seq_len 0, slot -1.

Megakernel hangs (MK_MODE=megakernel; see persistent/errors.MegakernelHang and the README)
- Every wait inside the megakernel is bounded (MK_WATCHDOG_MS); a stuck launch records the failure
  in the decoder's error record (mirrored to pinned host memory) and ends. The record is sticky:
  later launches, including CUDA-graph replays, exit at once until it is cleared.
- ``compute_logits`` runs in Python after every step in both runners (V2: ``GPUModelRunner.sample``
  after ``cudagraph_manager.run_fullgraph``; V1: after the CUDAGraphWrapper), so it is where the
  adapter looks: it reads the pinned mirror (no host synchronisation; the GPU may still be behind,
  so a hang is seen 0-2 steps late). On a hang it logs the MegakernelHang once and switches the
  decode path to Triton for the rest of the run: eager decode steps call the Triton decoder; a
  FULL-graph replay (a step whose forward did not run in Python) still launches the captured
  megakernel, which exits at once, and compute_logits recomputes that step with Triton from the
  graph's static input tensors (recorded at capture) before computing the logits.
- Not guaranteed: the steps that ran between the hang and the step at which the host saw it
  returned invalid hidden states (their sampled tokens are wrong), and the K/V those steps should
  have written are invalid too, so the requests in flight at that moment may keep producing wrong
  tokens. Requests admitted after the switch are computed by the Triton path. Recomputing a
  replayed step assumes the replayed graph is the smallest captured size >= the number of logits
  rows and that logits rows are the first rows of the output (true for pure decode steps).

V1 vs V2 runners: both build ``FlashAttentionMetadata`` per layer (V2 through
``v1/worker/gpu/attn_utils.build_attn_metadata``); in non-FULL modes their ``seq_lens`` may have
fewer rows than the (padded) input, so the decode runs on the first ``len(seq_lens)`` tokens and the
padded output rows are left as they are (nothing reads them). The slot mapping is taken from the
forward context (what stock's KV write uses), falling back to the metadata's.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .config import MkConfig, get_config

logger = logging.getLogger("vllm.mk_plugin")  # a child of vLLM's logger: same format and level

ARCHITECTURE = "LlamaForCausalLM"
MODULE_NAME = "mk_plugin.vllm_adapter"
CLASS_NAME = "MkLlamaForCausalLM"
MODEL_CLASS_PATH = f"{MODULE_NAME}:{CLASS_NAME}"
MAX_DECODE_TOKENS = 16
SUPPORTED_ATTN_BACKEND = "FLASH_ATTN"
# Attributes of vLLM's FlashAttentionMetadata the decode path reads.
METADATA_FIELDS = ("max_query_len", "max_seq_len", "seq_lens", "block_table", "slot_mapping")


# ---- registration ------------------------------------------------------------------------------
def register() -> None:
    """Entry point of `vllm.general_plugins`: register our Llama class with vLLM (lazily, by name).

    Idempotent and CUDA-free. Raises ConfigError on a bad MK_* value so vLLM stops at startup."""
    cfg = get_config()
    from vllm import ModelRegistry  # the registry only; no model module is imported here

    existing = ModelRegistry.models.get(ARCHITECTURE)
    if (getattr(existing, "module_name", None), getattr(existing, "class_name", None)) == (MODULE_NAME, CLASS_NAME):
        return
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS_PATH)
    logger.debug("mk_plugin: %s -> %s (MK_MODE=%s)", ARCHITECTURE, MODEL_CLASS_PATH, cfg.mode)


# ---- decisions (pure functions: no vLLM import, unit-tested with fake objects) -------------------
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


# ---- per-model state -----------------------------------------------------------------------------
class _Unsupported(Exception):
    """Raised while building the decode state; the message is the reason logged once."""


class _OnceLog:
    """Warnings (and verbose infos) logged once per key for one model instance."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}  # key -> the message logged

    def warn(self, key: str, msg: str) -> None:
        if key not in self.seen:
            self.seen[key] = msg
            logger.warning("mk_plugin: %s", msg)

    def note(self, key: str, msg: str) -> None:
        if key not in self.seen:
            self.seen[key] = msg
            logger.info("mk_plugin: %s", msg)


@dataclass
class DecodeState:
    """Everything the decode path needs, built once on the first forward call (vLLM's profile run,
    before the KV cache is sized). Plain attributes: never parameters or registered buffers."""
    spec: Any                      # LlamaSpec
    weights: Any                   # ModelWeights, views of vLLM's own parameters (no copies)
    cos_sin: Any                   # [max_pos, head_dim] rotary table of layer 0, model dtype
    attn_layers: list[Any]         # vLLM Attention modules; .kv_cache is (re)bound by the runner
    layer_name: str                # key of layer 0 in ForwardContext.attn_metadata / slot_mapping
    max_tokens: int
    block_size: int
    capacity_tokens: int           # max_blocks_per_seq * block_size the workspace was sized for
    workspace: Any                 # triton_ops.DecodeWorkspace (None on the megakernel path)
    embed_buf: Any                 # [max_tokens, H]: the embedded input of a step
    out_buf: Any                   # [max_tokens, H]: the final-normed hidden states returned
    decoder: Callable[..., Any]    # partial(decode_step, spec, weights, workspace=...) or MegakernelDecoder
    backend: str                   # "triton" | "megakernel"
    kv_key: tuple | None = None    # identity of the last validated KV cache list


@dataclass
class _DecodeCall:
    """One call of the decode path: its decoder arguments (hidden, positions, kv caches,
    block_table, seq_lens, slot_mapping, cos_sin), its output rows and the backend that ran it."""
    args: tuple
    out: Any
    backend: str


def _weights_from_model(model: Any, spec: Any) -> Any:
    """ModelWeights viewing vLLM's parameters in their own layouts; checks every shape and dtype."""
    import torch

    from .weights import LayerWeights, ModelWeights

    inner = model.model
    h, i = spec.hidden_size, spec.intermediate_size
    dt = spec.torch_dtype
    layers = list(inner.layers)
    if len(layers) != spec.num_layers:
        raise _Unsupported(f"model has {len(layers)} layers here, config says {spec.num_layers}")
    emb = inner.embed_tokens.weight
    if emb.dim() != 2 or emb.shape[0] < spec.vocab_size or emb.shape[1] != h:
        raise _Unsupported(f"embed_tokens.weight has shape {tuple(emb.shape)}; expected [>={spec.vocab_size}, {h}]")
    device = emb.device

    def take(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(t.shape) != shape or t.dtype != dt or t.device != device or not t.is_contiguous():
            raise _Unsupported(f"{name} is {tuple(t.shape)} {t.dtype} on {t.device} (contiguous={t.is_contiguous()}); "
                               f"the decode path needs {shape} {dt} on {device}")
        return t

    lws = []
    for n, layer in enumerate(layers):
        at, mlp = layer.self_attn, layer.mlp
        p = f"model.layers.{n}."
        lws.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight", layer.input_layernorm.weight.data, (h,)),
            qkv=take(p + "self_attn.qkv_proj.weight", at.qkv_proj.weight.data, (spec.qkv_size, h)),
            o=take(p + "self_attn.o_proj.weight", at.o_proj.weight.data, (h, spec.q_size)),
            post_norm=take(p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight.data, (h,)),
            gate_up=take(p + "mlp.gate_up_proj.weight", mlp.gate_up_proj.weight.data, (2 * i, h)),
            down=take(p + "mlp.down_proj.weight", mlp.down_proj.weight.data, (h, i)),
        ))
    # vLLM pads the vocabulary rows to a multiple of 64; the first vocab_size rows are the real ones.
    embed = take("model.embed_tokens.weight[:vocab]", emb.data[: spec.vocab_size], (spec.vocab_size, h))
    lm_w = getattr(getattr(model, "lm_head", None), "weight", None)
    if lm_w is None or lm_w.data_ptr() == emb.data_ptr():
        lm_head = embed
    else:
        lm_head = take("lm_head.weight[:vocab]", lm_w.data[: spec.vocab_size], (spec.vocab_size, h))
    final_norm = take("model.norm.weight", inner.norm.weight.data, (h,))
    return ModelWeights(embed=embed, layers=lws, final_norm=final_norm, lm_head=lm_head)


def _rotary_table(model: Any, spec: Any, device: Any) -> Any:
    """vLLM's own cos|sin cache of layer 0 (so our rotation equals stock's), in the model dtype."""
    rot = model.model.layers[0].self_attn.rotary_emb
    if not getattr(rot, "is_neox_style", True):
        raise _Unsupported("rotary embedding is not neox style")
    if getattr(rot, "rotary_dim", spec.head_dim) != spec.head_dim:
        raise _Unsupported(f"partial rotary (rotary_dim={rot.rotary_dim}, head_dim={spec.head_dim})")
    cs = getattr(rot, "cos_sin_cache", None)
    if cs is None or cs.dim() != 2 or cs.shape[1] != spec.head_dim:
        raise _Unsupported(f"rotary_emb.cos_sin_cache missing or not [max_pos, {spec.head_dim}] "
                           f"({None if cs is None else tuple(cs.shape)}; {type(rot).__name__})")
    # Stock converts the cache the same way (RotaryEmbeddingBase._match_cos_sin_cache_dtype); a
    # copy is made at most once, here, outside any graph capture.
    return cs.to(device=device, dtype=spec.torch_dtype).contiguous()


def spec_from_vllm_config(vllm_config: Any) -> Any:
    """LlamaSpec of the served model at the dtype vLLM runs; raises UnsupportedModel."""
    from .spec import LlamaSpec

    mc = vllm_config.model_config
    return LlamaSpec.from_hf_config(hf_dict_for_spec(mc.hf_config.to_dict(), mc.dtype),
                                    name=str(getattr(mc, "model", "vllm")))


def _build_decode_state(model: Any, vllm_config: Any, cfg: MkConfig, once: _OnceLog) -> DecodeState:
    """Validate the engine config and the model, then allocate the workspace; raises _Unsupported."""
    import torch

    from .spec import UnsupportedModel

    layers = list(model.model.layers)
    attn_layers = [layer.self_attn.attn for layer in layers]
    backends = {a.attn_backend.get_name() for a in attn_layers}
    reason = config_unsupported_reason(vllm_config, backends)
    if reason:
        raise _Unsupported(reason)
    try:
        spec = spec_from_vllm_config(vllm_config)
    except UnsupportedModel as e:
        raise _Unsupported(str(e)) from e
    weights = _weights_from_model(model, spec)
    device = weights.embed.device
    from .triton_ops._device import interpreting

    if device.type != "cuda" and not interpreting():
        raise _Unsupported(f"weights are on {device}; the decode path runs on CUDA")
    cos_sin = _rotary_table(model, spec, device)

    max_tokens = max(1, min(int(vllm_config.scheduler_config.max_num_seqs), MAX_DECODE_TOKENS))
    block_size = int(vllm_config.cache_config.block_size)
    max_model_len = int(vllm_config.model_config.max_model_len or 0)
    if max_model_len <= 0:  # -1 = auto-fit, decided after this point and only ever smaller
        max_model_len = spec.max_position_embeddings
    max_blocks = -(-max_model_len // block_size)
    # Zeroed, not empty: output rows past a step's requests (padding) are returned as they are, so
    # they must never hold uninitialised bits (NaN/Inf) that a later whole-tensor op could trip on.
    embed_buf = torch.zeros(max_tokens, spec.hidden_size, dtype=spec.torch_dtype, device=device)
    out_buf = torch.zeros(max_tokens, spec.hidden_size, dtype=spec.torch_dtype, device=device)

    # decoder(hidden, positions, kv_caches, block_table, seq_lens, slot_mapping, cos_sin, out=...)
    decoder: Callable[..., Any] | None = None
    workspace = None
    backend = "triton"
    if cfg.mode == "megakernel":
        try:
            from .persistent.backend import MegakernelDecoder
            from .persistent.encoding import Rounding, rounding_define

            mk = MegakernelDecoder(spec, weights, max_tokens, device, fallback=cfg.fallback,
                                   watchdog_ms=cfg.watchdog_ms, tuning=cfg.tuning,
                                   defines=(rounding_define(Rounding[cfg.rounding.upper()]),))
            mk.prepare()  # build and upload the programs of every batch size now, never during capture
            decoder, backend = mk, "megakernel"
        except Exception as e:  # noqa: BLE001 - any failure to build it means: use the Triton path
            once.warn("megakernel", f"MK_MODE=megakernel is unavailable ({type(e).__name__}: {e}); "
                      "using the Triton decode path")
    if decoder is None:
        from .triton_ops import DecodeWorkspace, decode_step

        try:
            workspace = DecodeWorkspace.allocate(spec, max_tokens, max_blocks, block_size, device)
        except ValueError as e:  # its input checks: a shape/size the kernels do not cover
            raise _Unsupported(f"decode workspace: {e}") from e
        decoder = functools.partial(decode_step, spec, weights, workspace=workspace)
    if (cfg.dump_logits or cfg.force_tokens) and not getattr(vllm_config.model_config, "enforce_eager", False):
        once.warn("debug_eager", "MK_DUMP_LOGITS/MK_FORCE_TOKENS only see steps that run in Python; "
                  "use enforce_eager=True (CUDA-graph replays are skipped)")
    return DecodeState(spec=spec, weights=weights, cos_sin=cos_sin, attn_layers=attn_layers,
                       layer_name=attn_layers[0].layer_name, max_tokens=max_tokens, block_size=block_size,
                       capacity_tokens=max_blocks * block_size, workspace=workspace, embed_buf=embed_buf,
                       out_buf=out_buf, decoder=decoder, backend=backend)


def _kv_unsupported_reason(st: DecodeState, kv: list[Any]) -> str | None:
    """The KV caches must be vLLM's FLASH_ATTN NHD layout, contiguous, in the model dtype."""
    s = st.spec
    want = (2, st.block_size, s.num_kv_heads, s.head_dim)
    for n, t in enumerate(kv):
        if t is None or t.dim() != 5 or tuple(t.shape[1:]) != want or t.dtype != s.torch_dtype \
                or not t.is_contiguous():
            desc = "None" if t is None else f"{tuple(t.shape)} {t.dtype} contiguous={t.is_contiguous()}"
            return (f"KV cache of layer {n} is {desc}; the decode path needs [num_blocks, {', '.join(map(str, want))}] "
                    f"{s.torch_dtype}, contiguous (FLASH_ATTN, NHD layout)")
    return None


# ---- the model class -----------------------------------------------------------------------------
class MkDecodeMixin:
    """Put in front of vLLM's LlamaForCausalLM: decode steps run mk_plugin's decode path, every
    other step (and anything unsupported) runs the inherited stock forward."""

    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._mk_vllm_config = vllm_config
        self._mk_cfg: MkConfig = get_config()
        self._mk_state: DecodeState | None = None
        self._mk_unsupported: str | None = None       # set once: the whole run is stock
        self._mk_log = _OnceLog()
        self._mk_counts: Counter[str] = Counter()     # Python-visible calls per path (graph replays are not seen)
        self._mk_dbg_seq_lens: list[int] | None = None
        self._mk_dbg_calls = 0
        self._mk_force: list[int] | None = None
        # Hang handling (compute_logits): whether forward ran in Python for the current step, the
        # decode call it made, the calls captured into CUDA graphs (by token count), the hang seen.
        self._mk_py_step = False
        self._mk_last_call: _DecodeCall | None = None
        self._mk_graph_calls: dict[int, _DecodeCall] = {}
        self._mk_hang: Any = None        # the MegakernelHang that switched the run to Triton
        self._mk_megakernel: Any = None  # the MegakernelDecoder it came from (its record stays set)

    # -- vLLM entry points --
    def forward(self, input_ids: Any, positions: Any, intermediate_tensors: Any = None,
                inputs_embeds: Any = None, **kwargs: Any) -> Any:
        self._mk_py_step, self._mk_last_call = True, None  # (a capture resets it in _mk_run)
        if intermediate_tensors is None and not kwargs and self._mk_cfg.mode != "stock":
            out = self._mk_maybe_decode(input_ids, positions, inputs_embeds)
            if out is not None:
                return out
        elif self._mk_cfg.dump_logits or self._mk_cfg.force_tokens:
            self._mk_record_seq_lens()
        self._mk_counts["stock"] += 1
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)

    def compute_logits(self, hidden_states: Any) -> Any:
        hidden_states = self._mk_after_step(hidden_states)
        logits = super().compute_logits(hidden_states)
        if logits is not None and (self._mk_cfg.dump_logits or self._mk_cfg.force_tokens):
            logits = self._mk_debug_logits(logits)
        return logits

    def mk_status(self) -> dict[str, Any]:
        """What this worker's model did (for bench scripts, through LLM.apply_model)."""
        st = self._mk_state
        return {
            "class": type(self).__name__, "mode": self._mk_cfg.mode,
            "backend": None if st is None else st.backend,
            "unsupported": self._mk_unsupported,
            "hang": None if self._mk_hang is None else str(self._mk_hang),
            "max_tokens": None if st is None else st.max_tokens,
            # the megakernel's rounding points as built (MK_ROUNDING), so records show what ran
            "rounding": None if st is None or st.backend != "megakernel" else st.decoder.rounding.name.lower(),
            # per padded batch size: the task split used (MK_TUNING) and where it came from
            "tuning": None if st is None or st.backend != "megakernel" else dict(st.decoder.tuning_source),
            "counts": dict(self._mk_counts), "logged": dict(self._mk_log.seen),
        }

    # -- decode path --
    def _mk_ensure_state(self) -> DecodeState | None:
        if self._mk_state is not None or self._mk_unsupported is not None:
            return self._mk_state
        import torch

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Never allocate inside a capture; vLLM's profile run always comes first, so this is
            # only reached by an unusual startup order: stay stock for this call.
            self._mk_log.warn("capture_build", "first forward call is inside a CUDA-graph capture; "
                              "the decode state is built on the next eager call")
            return None
        try:
            self._mk_state = _build_decode_state(self, self._mk_vllm_config, self._mk_cfg, self._mk_log)
        except _Unsupported as e:
            self._mk_unsupported = str(e)
            self._mk_log.warn("config", f"every step runs stock vLLM: {e}")
            return None
        self._mk_log.note("ready", f"decode path ready: backend={self._mk_state.backend}, "
                          f"up to {self._mk_state.max_tokens} tokens per decode step")
        return self._mk_state

    def _mk_maybe_decode(self, input_ids: Any, positions: Any, inputs_embeds: Any) -> Any:
        """The decode path's output [num_tokens, H], or None for the stock path."""
        st = self._mk_ensure_state()
        raw, slot_by_layer = _forward_context_metadata()
        if self._mk_cfg.dump_logits or self._mk_cfg.force_tokens:
            self._mk_record_seq_lens(raw, st)
        if st is None:
            return None
        if positions.dim() != 1 or (input_ids is None and inputs_embeds is None):
            self._mk_log.warn("inputs", f"positions of shape {tuple(positions.shape)} / no input ids "
                              "are not supported")
            return None
        num_tokens = positions.shape[0]
        d = decide(raw, st.layer_name, num_tokens, max_tokens=st.max_tokens, capacity_tokens=st.capacity_tokens,
                   mode=self._mk_cfg.mode, static_reason=self._mk_unsupported)
        if d.decode and full_graph_replays_on_mixed(
                getattr(self._mk_vllm_config.compilation_config, "cudagraph_mode", None)):
            d = Decision(False, "cudagraph_mode=FULL replays decode graphs on mixed batches", "cudagraph_mode")
        if not d.decode:
            if d.warn_key:
                self._mk_log.warn(d.warn_key, d.reason)
            elif self._mk_cfg.verbose:
                self._mk_log.note("stock:" + d.reason.split(" (")[0], f"stock path: {d.reason}")
            return None
        md = raw[st.layer_name] if isinstance(raw, Mapping) else raw
        kv = [a.kv_cache for a in st.attn_layers]
        key = tuple(t.data_ptr() if hasattr(t, "data_ptr") else id(t) for t in kv)
        if key != st.kv_key:
            why = _kv_unsupported_reason(st, kv)
            if why:
                self._mk_log.warn("kv_cache", why)
                return None
            st.kv_key = key
        slot = slot_by_layer.get(st.layer_name) if isinstance(slot_by_layer, Mapping) else None
        if slot is None:
            slot = md.slot_mapping
        return self._mk_run(st, md, kv, slot, input_ids, positions, inputs_embeds, num_tokens)

    def _mk_run(self, st: DecodeState, md: Any, kv: list[Any], slot: Any, input_ids: Any, positions: Any,
                inputs_embeds: Any, num_tokens: int) -> Any:
        """Embed the first len(seq_lens) tokens into a preallocated buffer, run the decoder into
        out_buf and return out_buf[:num_tokens] (rows past the requests are padding nobody reads)."""
        import torch

        reqs = md.seq_lens.shape[0]

        hidden = st.embed_buf[:reqs]
        if inputs_embeds is not None:
            hidden.copy_(inputs_embeds[:reqs])
        else:  # == VocabParallelEmbedding at TP 1 (F.embedding), into a preallocated buffer
            torch.index_select(st.weights.embed, 0, input_ids[:reqs], out=hidden)
        call = _DecodeCall((hidden, positions[:reqs], kv, md.block_table[:reqs], md.seq_lens, slot[:reqs],
                            st.cos_sin), st.out_buf[:reqs], st.backend)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # A FULL-graph capture: replays of this graph do not run forward; compute_logits finds
            # the graph's static tensors here if it has to recompute a replayed step.
            self._mk_graph_calls[num_tokens] = call
            self._mk_py_step, self._mk_last_call = False, None
        else:
            self._mk_last_call = call
        try:
            st.decoder(hidden, positions[:reqs], kv, md.block_table[:reqs], md.seq_lens, slot[:reqs], st.cos_sin,
                       out=st.out_buf[:reqs])
        except ValueError as e:
            # An input check of the kernels refused this step before computing it; whatever was
            # launched only wrote this token's K/V slots, which the stock path rewrites.
            self._mk_unsupported = f"decode kernels refused a step: {e}"
            self._mk_log.warn("kernel_check", f"{self._mk_unsupported}; every later step runs stock vLLM")
            return None
        self._mk_counts[f"decode:{num_tokens}"] += 1
        if self._mk_cfg.verbose:
            self._mk_log.note(f"decode:{num_tokens}", f"decode path ({st.backend}) for {num_tokens} token rows")
        return st.out_buf[:num_tokens]

    # -- megakernel hangs (see the module docstring) --
    def _mk_after_step(self, hidden_states: Any) -> Any:
        """Called by compute_logits once per step: notice a recorded megakernel hang (no host
        synchronisation unless one is pending), switch to Triton, and return the hidden states to
        compute logits from -- recomputed with Triton when this step's came from the megakernel
        after the switch."""
        py_step, call = self._mk_py_step, self._mk_last_call
        self._mk_py_step, self._mk_last_call = False, None
        st = self._mk_state
        if st is None:
            return hidden_states
        if self._mk_hang is None:
            if st.backend != "megakernel" or not st.decoder.pending_error():
                return hidden_states
            if not self._mk_switch_to_triton(st):
                return hidden_states
        if not py_step:  # a FULL-graph replay: it ran the captured megakernel, which exited at once
            call = self._mk_graph_call(hidden_states.shape[0])
        if call is None or call.backend != "megakernel":
            return hidden_states  # stock or Triton produced this step
        rows = hidden_states.shape[0]
        if rows > call.out.shape[0]:
            raise RuntimeError(f"mk_plugin: cannot recompute a megakernel step of {call.out.shape[0]} rows for "
                               f"{rows} logits rows after {self._mk_hang}")
        st.decoder(*call.args, out=call.out)
        self._mk_counts["recomputed"] += 1
        return call.out[:rows]

    def _mk_graph_call(self, rows: int) -> _DecodeCall | None:
        """The decode call captured for the graph vLLM replays for `rows` requests: the smallest
        captured token count >= rows (vLLM pads a batch up to the next capture size)."""
        sizes = sorted(n for n in self._mk_graph_calls if n >= rows)
        return self._mk_graph_calls[sizes[0]] if sizes else None

    def _mk_switch_to_triton(self, st: DecodeState) -> bool:
        """Read the pending hang (synchronises: rare), log it once and make the Triton decoder the
        decode path for the rest of the run. The megakernel's record is left set on purpose: the
        captured graphs keep launching it and it must keep exiting at once."""
        import torch

        from .persistent.errors import MegakernelHang
        from .triton_ops import DecodeWorkspace, decode_step

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False
        mk = st.decoder
        try:
            mk.check_errors(clear=False)
            return False  # the mirror and the record disagree: nothing to report (yet)
        except MegakernelHang as e:
            hang = e
        try:
            ws = DecodeWorkspace.allocate(st.spec, st.max_tokens, st.capacity_tokens // st.block_size, st.block_size,
                                          st.embed_buf.device)
        except ValueError as e:
            raise RuntimeError(f"mk_plugin: {hang}; the Triton decode path cannot take over ({e})") from hang
        self._mk_hang, self._mk_megakernel = hang, mk
        st.decoder = functools.partial(decode_step, st.spec, st.weights, workspace=ws)
        st.workspace, st.backend = ws, "triton"
        self._mk_log.warn("megakernel_hang", f"{hang}. The megakernel is disabled for the rest of this run: decode "
                          "steps use the Triton path (replays of captured graphs are recomputed with it in "
                          "compute_logits). Steps computed between the hang and now returned invalid results.")
        return True

    # -- debug hooks (MK_DUMP_LOGITS / MK_FORCE_TOKENS; eager only, they sync the host) --
    def _mk_record_seq_lens(self, raw: Any = None, st: DecodeState | None = None) -> None:
        import torch

        self._mk_dbg_seq_lens = None
        if raw is None:
            raw, _ = _forward_context_metadata()
        if raw is None or isinstance(raw, list):
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # .tolist() would sync the host inside a capture
        name = st.layer_name if st is not None else self.model.layers[0].self_attn.attn.layer_name
        md = raw.get(name) if isinstance(raw, Mapping) else raw
        if md is not None and hasattr(md, "seq_lens"):
            self._mk_dbg_seq_lens = [int(x) for x in md.seq_lens.tolist()]

    def _mk_debug_logits(self, logits: Any) -> Any:
        import torch

        lens, self._mk_dbg_seq_lens = self._mk_dbg_seq_lens, None
        if lens is None:
            return logits
        if len(lens) != logits.shape[0]:
            self._mk_log.warn("debug_rows", f"MK_DUMP_LOGITS/MK_FORCE_TOKENS: {logits.shape[0]} logit rows for "
                              f"{len(lens)} requests (spec decode or chunked prefill?); step skipped")
            return logits
        if self._mk_cfg.dump_logits:
            os.makedirs(self._mk_cfg.dump_logits, exist_ok=True)
            path = os.path.join(self._mk_cfg.dump_logits, f"logits_{os.getpid()}_{self._mk_dbg_calls:06d}.pt")
            torch.save({"seq_lens": lens, "logits": logits.float().cpu(), "mode": self._mk_cfg.mode}, path)
            self._mk_dbg_calls += 1
        if self._mk_cfg.force_tokens:
            if self._mk_force is None:
                with open(self._mk_cfg.force_tokens) as f:
                    self._mk_force = [int(t) for t in json.load(f)]
            for r, n in enumerate(lens):
                if 0 < n < len(self._mk_force):
                    logits[r].fill_(float("-inf"))
                    logits[r, self._mk_force[n]] = 0.0
        return logits


def _forward_context_metadata() -> tuple[Any, Any]:
    """(attn_metadata, slot_mapping) of vLLM's current forward context, (None, None) outside one."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None, None
    fc = get_forward_context()
    return fc.attn_metadata, fc.slot_mapping


def mk_status(model: Any) -> dict[str, Any]:
    """For LLM.apply_model(mk_status): the worker's model class and what its decode path did."""
    if hasattr(model, "mk_status"):
        return model.mk_status()
    return {"class": type(model).__name__, "mode": None, "backend": None}


# ---- lazy class construction (PEP 562) -------------------------------------------------------------
_MODEL_CLASS: type | None = None


def model_class() -> type:
    """MkLlamaForCausalLM = MkDecodeMixin + vLLM's LlamaForCausalLM (imports vLLM's Llama code)."""
    global _MODEL_CLASS
    if _MODEL_CLASS is None:
        from vllm.model_executor.models.llama import LlamaForCausalLM

        cls = type(CLASS_NAME, (MkDecodeMixin, LlamaForCausalLM), {
            "__module__": MODULE_NAME, "__qualname__": CLASS_NAME,
            "__doc__": "vLLM's LlamaForCausalLM whose decode steps run mk_plugin's decode path.",
        })
        _MODEL_CLASS = cls
    return _MODEL_CLASS


def __getattr__(name: str) -> Any:
    if name == CLASS_NAME:
        cls = model_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Decision", "DecodeState", "MkDecodeMixin", "config_unsupported_reason", "decide",
           "full_graph_replays_on_mixed", "hf_dict_for_spec", "mk_status", "model_class", "register",
           "spec_from_vllm_config"]  # + MkLlamaForCausalLM, provided lazily by __getattr__
