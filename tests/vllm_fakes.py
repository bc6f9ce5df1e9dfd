"""Fakes of vLLM's side for the adapter tests (not a test module: test modules import this one, never
each other): a vLLM config namespace, a fake LlamaForCausalLM with vLLM's parameter and Attention layout,
forward-context and attention-metadata helpers, and the fp32 reference of one decode step."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from mk_plugin import reference as ref
from mk_plugin import vllm_adapter as va
from mk_plugin.spec import LlamaSpec
from mk_plugin.weights import random_weights


def _fake_vllm_config(**over) -> SimpleNamespace:
    from vllm.config.compilation import CUDAGraphMode

    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        decode_context_parallel_size=1, prefill_context_parallel_size=1,
                                        use_ubatching=False),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
        quant_config=None, lora_config=None, speculative_config=None)
    for path, v in over.items():
        obj = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, v)
    return cfg


SPEC = LlamaSpec(hidden_size=320, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64,
                 intermediate_size=688, vocab_size=1000, rope_theta=10000.0, max_position_embeddings=4096)
HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 320, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 688,
      "vocab_size": 1000, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "dtype": "bfloat16"}
STOCK = 7.0  # the fake stock forward returns this value everywhere


def _ns(**kw) -> SimpleNamespace:
    return SimpleNamespace(**kw)


class FakeStockLlama(torch.nn.Module):
    """vLLM's LlamaForCausalLM as far as the adapter looks at it: the attribute paths of its
    parameters, Attention modules (layer_name, kv_cache, attn_backend) and rotary_emb."""

    def __init__(self, *, vllm_config, prefix: str = "", weights=None, backend: str = "FLASH_ATTN"):
        super().__init__()
        w = weights
        cs = ref.rope_cos_sin_cache(SPEC, 4096).to(SPEC.torch_dtype)
        be = _ns(get_name=lambda: backend)
        layers = []
        for i, lw in enumerate(w.layers):
            attn = _ns(layer_name=f"model.layers.{i}.self_attn.attn", kv_cache=torch.tensor([]), attn_backend=be)
            layers.append(_ns(
                input_layernorm=_ns(weight=lw.input_norm), post_attention_layernorm=_ns(weight=lw.post_norm),
                self_attn=_ns(qkv_proj=_ns(weight=lw.qkv), o_proj=_ns(weight=lw.o), attn=attn,
                              rotary_emb=_ns(is_neox_style=True, rotary_dim=64, cos_sin_cache=cs)),
                mlp=_ns(gate_up_proj=_ns(weight=lw.gate_up), down_proj=_ns(weight=lw.down))))
        self.model = _ns(layers=layers, embed_tokens=_ns(weight=w.embed), norm=_ns(weight=w.final_norm))
        self.lm_head = _ns(weight=w.lm_head, bias=None)
        # vLLM's LogitsProcessor as the adapter reads it (MK_LM_HEAD=megakernel needs exactly this)
        self.logits_processor = _ns(scale=1.0, soft_cap=None, logits_as_input=False, org_vocab_size=SPEC.vocab_size)
        self.stock_calls = 0

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        self.stock_calls += 1
        return torch.full((positions.shape[0], SPEC.hidden_size), STOCK, dtype=SPEC.torch_dtype)

    def compute_logits(self, hidden_states):
        return hidden_states.float() @ self.lm_head.weight.float().t()


class FakeMk(va.MkDecodeMixin, FakeStockLlama):
    pass


def make_model(monkeypatch, mode: str = "triton", backend: str = "FLASH_ATTN", **over):
    monkeypatch.setenv("MK_MODE", mode)
    cfg = _fake_vllm_config(**over)
    cfg.model_config = _ns(hf_config=_ns(to_dict=lambda: dict(HF)), dtype=torch.bfloat16, max_model_len=512,
                           enforce_eager=True, model="fake")
    w = random_weights(SPEC, seed=3)
    return FakeMk(vllm_config=cfg, weights=w, backend=backend), w


def fwd_ctx(md, slot=None, layers: int = 2):
    from vllm.forward_context import ForwardContext, override_forward_context

    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    sm = {} if slot is None else {n: slot for n in names}
    return override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={n: md for n in names},
                                                   slot_mapping=sm))


def fa_md(batch, max_query_len: int = 1) -> SimpleNamespace:
    """FlashAttentionMetadata-shaped object for a DecodeBatch."""
    return _ns(max_query_len=max_query_len, max_seq_len=int(batch.seq_lens.max()), seq_lens=batch.seq_lens,
               block_table=batch.block_table, slot_mapping=batch.slot_mapping, causal=True,
               dcp_context_kv_lens=None, mm_prefix_range_tensor=None, query_start_loc=None)


def bind_kv(model, caches) -> None:
    for layer, c in zip(model.model.layers, caches):
        layer.self_attn.attn.kv_cache = c


def reference_out(w, b, caches: list[torch.Tensor]) -> torch.Tensor:
    """The fp32 reference's final hidden state for decode batch b over `caches` (a copy of b's)."""
    exp, _ = ref.decode_step(SPEC, w, b.input_ids, b.positions, caches, b.block_table, b.seq_lens,
                             b.slot_mapping, ref.rope_cos_sin_cache(SPEC, 4096).to(SPEC.torch_dtype))
    return exp


def decode_once(model, w, b) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of batch b through the model (its KV caches bound), and the reference's."""
    caches_ref = b.clone_caches()
    bind_kv(model, b.kv_caches)
    with fwd_ctx(fa_md(b)):
        out = model(b.input_ids, b.positions)
    return out, reference_out(w, b, caches_ref)


def profile_run(model) -> torch.Tensor:
    """vLLM's profile run: a forward call with no forward context (or no metadata): stock."""
    return model(torch.zeros(16, dtype=torch.int64), torch.arange(16))
