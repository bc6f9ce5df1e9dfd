"""The decode state of one model instance: vLLM's parameters viewed as ModelWeights (every shape and
dtype checked), its rotary table, the workspace and the decoder (Triton step or MegakernelDecoder),
built once on the first forward call; plus the KV-cache layout check and the once-per-key log."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..config import MkConfig
from ..decoding import DecodeInputs, Decoder
from .decide import MAX_DECODE_TOKENS, config_unsupported_reason, hf_dict_for_spec, sizes_to_prepare

logger = logging.getLogger("vllm.mk_plugin")  # the adapter's logger (a child of vLLM's)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False on a machine without CUDA)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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
    embed_buf: Any                 # [max_tokens, H]: the embedded input of a step
    out_buf: Any                   # [max_tokens, H]: the final-normed hidden states returned
    decoder: Decoder               # TritonDecoder or MegakernelDecoder (mk_plugin.decoding)
    kv_key: tuple | None = None    # identity of the last validated KV cache list
    # MK_LM_HEAD=megakernel: [max_tokens, V] fp32, the logits of the megakernel's steps (its lm_head tasks);
    # None: vLLM's own LM head computes every step's logits
    logits_buf: Any = None

    @property
    def backend(self) -> str:
        """"triton" | "megakernel" | "auto": the decode path in use."""
        return self.decoder.backend

    @property
    def workspace(self) -> Any:
        """The Triton path's DecodeWorkspace (its decoder's, or auto's Triton decoder's); None when the
        decode path is the megakernel alone."""
        dec = getattr(self.decoder, "triton", self.decoder)
        return getattr(dec, "workspace", None)


@dataclass
class _DecodeCall:
    """One call of the decode path: its inputs, its output rows and the backend that ran it."""
    inputs: DecodeInputs
    out: Any
    backend: str
    logits: Any = None   # the step's fp32 logits rows when the megakernel computed them (MK_LM_HEAD=megakernel)


def _weights_from_model(model: Any, spec: Any) -> Any:
    """ModelWeights viewing vLLM's parameters in their own layouts; checks every shape and dtype."""
    import torch

    from ..weights import LayerWeights, ModelWeights

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
    from ..spec import LlamaSpec

    mc = vllm_config.model_config
    return LlamaSpec.from_hf_config(hf_dict_for_spec(mc.hf_config.to_dict(), mc.dtype),
                                    name=str(getattr(mc, "model", "vllm")))


def _build_decode_state(model: Any, vllm_config: Any, cfg: MkConfig, once: _OnceLog) -> DecodeState:
    """Validate the engine config and the model, then allocate the workspace; raises _Unsupported."""
    import torch

    from ..spec import UnsupportedModel

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
    from ..triton_ops._device import interpreting

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

    decoder: Decoder | None = None
    mk = None
    fuse_lm_head = _fuse_lm_head(model, spec, cfg, once)
    # Programs of the sizes vLLM captures (all of them when it captures none) now, never during capture; any
    # other size on its first (eager) step
    sizes = sizes_to_prepare(getattr(vllm_config, "compilation_config", None), max_tokens)
    if cfg.mode in ("megakernel", "auto"):
        try:
            from ..persistent.backend import MegakernelDecoder
            from ..persistent.encoding import Rounding
            from ..persistent.variant import KernelVariant

            mk = MegakernelDecoder(spec, weights, max_tokens, device, fallback=cfg.fallback, lm_head=fuse_lm_head,
                                   watchdog_ms=cfg.watchdog_ms, tuning=cfg.tuning,
                                   variant=KernelVariant(rounding=Rounding[cfg.rounding.upper()]),
                                   trace=cfg.trace, verbose=cfg.verbose)
            if cfg.mode == "megakernel":
                mk.prepare(sizes)
                decoder = mk
        except Exception as e:  # noqa: BLE001 - any failure to build it means: use the Triton path
            mk = None
            _megakernel_unavailable(cfg, once, e)
    if decoder is None:
        from ..triton_ops import DecodeWorkspace, TritonDecoder

        try:
            workspace = DecodeWorkspace.allocate(spec, max_tokens, max_blocks, block_size, device)
        except ValueError as e:  # its input checks: a shape/size the kernels do not cover
            raise _Unsupported(f"decode workspace: {e}") from e
        decoder = TritonDecoder(spec, weights, workspace)
        if mk is not None:  # MK_MODE=auto: per batch size, the path measured faster here
            try:
                decoder = _auto_decoder(decoder, mk, spec, weights, cos_sin, block_size, max_tokens, device, sizes)
            except Exception as e:  # noqa: BLE001 - the megakernel failed in its measurement or its build
                _megakernel_unavailable(cfg, once, e)
    if (cfg.dump_logits or cfg.force_tokens) and not getattr(vllm_config.model_config, "enforce_eager", False):
        once.warn("debug_eager", "MK_DUMP_LOGITS/MK_FORCE_TOKENS only see steps that run in Python; "
                  "use enforce_eager=True (CUDA-graph replays are skipped)")
    logits_buf = None
    if megakernel_of(decoder) is not None and fuse_lm_head:
        logits_buf = torch.zeros(max_tokens, spec.vocab_size, dtype=torch.float32, device=device)
    return DecodeState(spec=spec, weights=weights, cos_sin=cos_sin, attn_layers=attn_layers,
                       layer_name=attn_layers[0].layer_name, max_tokens=max_tokens, block_size=block_size,
                       capacity_tokens=max_blocks * block_size, embed_buf=embed_buf,
                       out_buf=out_buf, decoder=decoder, logits_buf=logits_buf)


def lm_head_unsupported_reason(model: Any, spec: Any) -> str | None:
    """Why the megakernel's LM head cannot stand in for vLLM's compute_logits on this model (None: it can). The
    megakernel computes LOGITS = OUT @ lm_head.weight[:V]^T in fp32; vLLM's LogitsProcessor may also scale,
    soft-cap or cut the vocabulary, which the megakernel does not."""
    lp = getattr(model, "logits_processor", None)
    if lp is None:
        return "the model has no logits_processor to compare with"
    if getattr(lp, "logits_as_input", False):
        return "the logits processor takes logits as input"
    if getattr(lp, "soft_cap", None) is not None:
        return f"logits soft cap {lp.soft_cap}"
    if float(getattr(lp, "scale", 1.0)) != 1.0:
        return f"logit scale {lp.scale}"
    org = getattr(lp, "org_vocab_size", spec.vocab_size)
    if org != spec.vocab_size:
        return f"the logits processor keeps {org} vocabulary rows, the model has {spec.vocab_size}"
    if getattr(getattr(model, "lm_head", None), "bias", None) is not None:
        return "the LM head has a bias"
    return None


def _fuse_lm_head(model: Any, spec: Any, cfg: MkConfig, once: _OnceLog) -> bool:
    """Whether the megakernel computes the logits (MK_LM_HEAD=megakernel and the model allows it); one warning
    says why not where it was asked for and cannot be."""
    if cfg.lm_head != "megakernel":
        return False
    if cfg.mode not in ("megakernel", "auto"):
        once.warn("lm_head", f"MK_LM_HEAD=megakernel has no effect with MK_MODE={cfg.mode}: vLLM's LM head computes "
                  "the logits")
        return False
    why = lm_head_unsupported_reason(model, spec)
    if why:
        once.warn("lm_head", f"MK_LM_HEAD=megakernel: {why}; vLLM's LM head computes the logits")
        return False
    return True


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


def megakernel_of(decoder: Any) -> Any:
    """The MegakernelDecoder a decode path may launch (itself, auto's megakernel), or None."""
    return decoder if decoder.backend == "megakernel" else getattr(decoder, "megakernel", None)


def _megakernel_unavailable(cfg: MkConfig, once: _OnceLog, e: Exception) -> None:
    what = "MK_MODE=megakernel is unavailable" if cfg.mode == "megakernel" else \
        "MK_MODE=auto: the megakernel is unavailable"
    once.warn("megakernel", f"{what} ({type(e).__name__}: {e}); using the Triton decode path")


def _auto_decoder(triton: Any, mk: Any, spec: Any, weights: Any, cos_sin: Any, block_size: int, max_tokens: int,
                  device: Any, sizes: list[int]) -> Any:
    """MK_MODE=auto's decoder: the packaged table of measured steps for this GPU and model, else a
    short measurement of both paths here (CUDA only), else Triton (adapter/auto.py). The megakernel's
    programs of `sizes` are built where it was chosen (a measured size was built by its measurement);
    the sizes given to Triton never launch it."""
    from ..persistent.encoding import spec_hash
    from ..triton_ops._device import device_name, gpu_slug
    from .auto import AutoDecoder, choose, load_paths, measure_both, paths_file

    name = device_name(device) or "cpu"
    path = paths_file(gpu_slug(name))
    table = load_paths(path, spec_hash(spec), mk.num_sms)
    measure = measure_both(triton, mk, spec, weights, cos_sin, block_size) if device.type == "cuda" else None
    choice, source = choose(max_tokens, table, path.name, measure)
    mk.prepare([b for b in sizes if choice[b] == "megakernel"])
    return AutoDecoder(triton, mk, choice, source)
