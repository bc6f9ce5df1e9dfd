import dataclasses
import json
from pathlib import Path

import pytest

from mk_plugin.spec import LlamaSpec, UnsupportedModel

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"


def load(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


def test_tiny_default():
    s = LlamaSpec.tiny()
    assert (s.hidden_size, s.num_layers, s.num_q_heads, s.num_kv_heads, s.head_dim) == (256, 2, 4, 2, 64)
    assert (s.intermediate_size, s.vocab_size) == (688, 1000)
    assert s.qkv_size == 256 + 2 * 128


def test_llama_1b_and_8b_configs():
    s1 = LlamaSpec.from_hf_config(load("llama-3.2-1b"))
    assert s1.tie_word_embeddings and s1.rope_scaling.factor == 32.0 and s1.head_dim == 64
    # 2.47 GB of weights per step is the figure the bandwidth floor is quoted against
    assert abs(s1.weight_bytes_per_step() / 1e9 - 2.47) < 0.01
    s8 = LlamaSpec.from_hf_config(load("llama-3.1-8b"))
    assert s8.head_dim == 128 and not s8.tie_word_embeddings and s8.gqa_group == 4


@pytest.mark.parametrize("field,value,match", [
    ("attention_bias", True, "attention_bias=True"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("sliding_window", 4096, "sliding_window=4096"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'"),
    ("head_dim", 96, "head_dim=96"),
    ("torch_dtype", "float32", "torch_dtype='float32'"),
    ("hidden_size", 2050, "hidden_size=2050"),
    ("num_key_value_heads", 5, "num_key_value_heads=5"),
    ("architectures", ["MistralForCausalLM"], "architectures"),
])
def test_unsupported_fields_are_named(field, value, match):
    cfg = load("llama-3.2-1b")
    cfg[field] = value
    with pytest.raises(UnsupportedModel, match=match) as ei:
        LlamaSpec.from_hf_config(cfg)
    assert "supported:" in str(ei.value)


def test_llama3_rope_scaling_missing_key():
    cfg = load("llama-3.2-1b")
    del cfg["rope_scaling"]["low_freq_factor"]
    with pytest.raises(UnsupportedModel, match="low_freq_factor"):
        LlamaSpec.from_hf_config(cfg)


def test_spec_is_frozen():
    s = LlamaSpec.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.hidden_size = 512  # type: ignore[misc]
