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

Backends of the decode path: MK_MODE=triton runs ``triton_ops.decode_step``;
MK_MODE=megakernel runs ``persistent.backend.MegakernelDecoder`` (built on the first forward call with MK_FALLBACK's ops
on the Triton kernels, its programs prepared before any capture); if that import or construction fails, ONE
warning names the reason and the Triton path is used. MK_MODE=auto (the default) holds both and runs, per padded
batch size, the one measured faster here (adapter/auto.py), or stock vLLM's forward where that was measured no
slower inside vLLM.

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

The LM head (MK_LM_HEAD, adapter/state.py and hangs.py): by default vLLM's own ``compute_logits`` computes every
step's logits from the hidden states returned. With MK_LM_HEAD=megakernel a megakernel step (MK_MODE=megakernel,
or auto's megakernel sizes) also runs its lm_head tasks into a preallocated fp32 buffer [max_tokens, V], and
``compute_logits`` returns those rows instead of computing them: the step it belongs to is found as a hang's is
(the forward call that ran in Python, else the FULL graph replayed: every stock capture is marked so that a
replay is never matched with a larger size's megakernel call). Models whose LogitsProcessor scales, soft-caps or
cuts the logits, or whose LM head has a bias, keep vLLM's LM head (one warning).

V1 vs V2 runners: both build ``FlashAttentionMetadata`` per layer (V2 through
``v1/worker/gpu/attn_utils.build_attn_metadata``); in non-FULL modes their ``seq_lens`` may have
fewer rows than the (padded) input, so the decode runs on the first ``len(seq_lens)`` tokens and the
padded output rows are left as they are (nothing reads them). The slot mapping is taken from the
forward context (what stock's KV write uses), falling back to the metadata's.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

from .adapter.auto import STOCK, describe
from .adapter.debug import DebugHooksMixin
from .adapter.decide import (  # noqa: F401 (public names of this module)
    MAX_DECODE_TOKENS,
    METADATA_FIELDS,
    SUPPORTED_ATTN_BACKEND,
    Decision,
    _forward_context_metadata,
    config_unsupported_reason,
    decide,
    full_graph_replays_on_mixed,
    hf_dict_for_spec,
)
from .adapter.hangs import HangMixin
from .adapter.state import (
    DecodeState,
    _build_decode_state,
    _DecodeCall,
    _kv_unsupported_reason,
    _OnceLog,
    _Unsupported,
    capturing,
    megakernel_of,
    spec_from_vllm_config,
)
from .config import MkConfig, get_config
from .decoding import DecodeInputs

logger = logging.getLogger("vllm.mk_plugin")  # a child of vLLM's logger: same format and level

ARCHITECTURE = "LlamaForCausalLM"
MODULE_NAME = "mk_plugin.vllm_adapter"
CLASS_NAME = "MkLlamaForCausalLM"
MODEL_CLASS_PATH = f"{MODULE_NAME}:{CLASS_NAME}"


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


# ---- the model class -----------------------------------------------------------------------------
class MkDecodeMixin(HangMixin, DebugHooksMixin):
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
        self._mk_graph_calls: dict[int, _DecodeCall | None] = {}   # None: a FULL graph captured stock
        self._mk_graph_sizes: list[int] = []   # sorted keys of _mk_graph_calls (hangs.py _mk_graph_call)
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
            if capturing():
                # A FULL graph captured stock (MK_MODE=auto's choice, or any refusal): compute_logits must never take
                # a replay of it for a decode call of a larger captured size (hangs.py _mk_graph_call).
                self._mk_graph_calls[positions.shape[-1]] = None
                self._mk_py_step = False   # the next compute_logits follows a replay, not this capture
        elif self._mk_cfg.dump_logits or self._mk_cfg.force_tokens:
            self._mk_record_seq_lens()
        self._mk_counts["stock"] += 1
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)

    def compute_logits(self, hidden_states: Any) -> Any:
        hidden_states, fused = self._mk_after_step(hidden_states)
        logits = fused if fused is not None else super().compute_logits(hidden_states)
        if logits is not None and (self._mk_cfg.dump_logits or self._mk_cfg.force_tokens):
            logits = self._mk_debug_logits(logits)
        return logits

    def mk_status(self) -> dict[str, Any]:
        """What this worker's model did (for bench scripts, through LLM.apply_model)."""
        st = self._mk_state
        mk = None if st is None else megakernel_of(st.decoder)
        return {
            "class": type(self).__name__, "mode": self._mk_cfg.mode,
            "backend": None if st is None else st.backend,
            "unsupported": self._mk_unsupported,
            "hang": None if self._mk_hang is None else str(self._mk_hang),
            "max_tokens": None if st is None else st.max_tokens,
            # the megakernel's rounding points as built (MK_ROUNDING), so records show what ran
            "rounding": None if mk is None else mk.rounding.name.lower(),
            # who computes the logits of the megakernel's steps (MK_LM_HEAD, where the model allows it)
            "lm_head": None if st is None else ("megakernel" if st.logits_buf is not None else "vllm"),
            # per padded batch size: the task split used (MK_TUNING) and where it came from
            "tuning": None if mk is None else dict(mk.tuning_source),
            # MK_MODE=auto: per batch size, the path chosen and why
            "auto": None if st is None or st.backend != "auto" else describe(st.decoder, range(1, st.max_tokens + 1)),
            "counts": dict(self._mk_counts), "logged": dict(self._mk_log.seen),
        }

    # -- decode path --
    def _mk_ensure_state(self) -> DecodeState | None:
        if self._mk_state is not None or self._mk_unsupported is not None:
            return self._mk_state
        if capturing():
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
        if st.backend == "auto" and st.decoder.path_for(md.seq_lens.shape[0]) == STOCK:
            return self._mk_auto_stock(num_tokens)
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

    def _mk_auto_stock(self, num_tokens: int) -> None:
        """MK_MODE=auto chose stock vLLM for this batch size (adapter/auto.py pick): the step runs the inherited
        forward (which marks a FULL-graph capture of it as stock)."""
        if self._mk_cfg.verbose:
            self._mk_log.note(f"auto_stock:{num_tokens}", f"MK_MODE=auto: stock path for {num_tokens} token rows "
                              "(measured no slower than the plugin's paths at this batch size)")

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
        inputs = DecodeInputs(hidden, positions[:reqs], kv, md.block_table[:reqs], md.seq_lens, slot[:reqs],
                              st.cos_sin)
        ran = st.decoder.path_for(reqs) if st.backend == "auto" else st.backend
        # MK_LM_HEAD=megakernel: a megakernel step also writes its logits; compute_logits hands them out
        logits = st.logits_buf[:reqs] if st.logits_buf is not None and ran == "megakernel" else None
        call = _DecodeCall(inputs, st.out_buf[:reqs], ran, logits)
        if capturing():
            # A FULL-graph capture: replays of this graph do not run forward; compute_logits finds
            # the graph's static tensors here if it has to recompute a replayed step.
            self._mk_graph_calls[num_tokens] = call
            self._mk_py_step, self._mk_last_call = False, None
        else:
            self._mk_last_call = call
        try:
            if logits is None:
                st.decoder.decode(inputs, st.out_buf[:reqs])
            else:
                st.decoder.decode(inputs, st.out_buf[:reqs], logits)
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
