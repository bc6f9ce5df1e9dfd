"""What model we run: one frozen, validated description of a Llama-family decoder.

Built from a Hugging Face ``config.json`` dict with :meth:`LlamaSpec.from_hf_config`. Anything the
kernels cannot compute exactly raises :class:`UnsupportedModel` naming the field, its value and what
is supported, so the vLLM adapter can fall back to stock vLLM instead of returning a wrong answer.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# 16 elements = 32 bytes of bf16: every row of every weight starts 16-byte aligned for vector
# loads and bulk copies, and tiles of 16 columns cover a matrix exactly.
SIZE_MULTIPLE = 16
MAX_GQA_GROUP = 16


class UnsupportedModel(ValueError):
    """A model config mk_plugin cannot run exactly. The message names field, value and what is supported."""

    def __init__(self, field_name: str, value: Any, supported: str):
        self.field = field_name
        self.value = value
        self.supported = supported
        super().__init__(f"unsupported model config: {field_name}={value!r}; supported: {supported}")


@dataclass(frozen=True)
class Llama3RopeScaling:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaSpec:
    hidden_size: int = 256
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 688
    vocab_size: int = 1000
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    name: str = field(default="tiny", compare=False)

    def __post_init__(self) -> None:
        positive = ("hidden_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "vocab_size", "max_position_embeddings")
        for f in positive:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UnsupportedModel(f, v, "a positive integer")
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise UnsupportedModel("head_dim", self.head_dim, f"one of {SUPPORTED_HEAD_DIMS}")
        if self.num_q_heads % self.num_kv_heads:
            raise UnsupportedModel("num_key_value_heads", self.num_kv_heads,
                                   f"a divisor of num_attention_heads={self.num_q_heads}")
        if self.gqa_group > MAX_GQA_GROUP:
            raise UnsupportedModel("num_attention_heads/num_key_value_heads", self.gqa_group,
                                   f"at most {MAX_GQA_GROUP} query heads per kv head")
        for f in ("hidden_size", "intermediate_size"):
            v = getattr(self, f)
            if v % SIZE_MULTIPLE:
                raise UnsupportedModel(f, v, f"a multiple of {SIZE_MULTIPLE}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedModel("torch_dtype", self.dtype, f"one of {sorted(SUPPORTED_DTYPES)}")
        if not (self.rms_eps > 0 and math.isfinite(self.rms_eps)):
            raise UnsupportedModel("rms_norm_eps", self.rms_eps, "a positive finite float")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise UnsupportedModel("rope_theta", self.rope_theta, "a positive finite float")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def gqa_group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return SUPPORTED_DTYPES[self.dtype]

    def weight_bytes_per_step(self, include_lm_head: bool = True) -> int:
        """Bytes of weights one decode step must read (each matrix once, norms included)."""
        h, i = self.hidden_size, self.intermediate_size
        per_layer = h * self.qkv_size + self.q_size * h + h * 2 * i + i * h + 2 * h
        total = self.num_layers * per_layer + h
        if include_lm_head:
            total += self.vocab_size * h
        return total * torch.tensor([], dtype=self.torch_dtype).element_size()

    def kv_bytes_per_step(self, seq_lens: list[int]) -> int:
        """Bytes of K and V one decode step reads for the given context lengths (all layers)."""
        el = torch.tensor([], dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * self.kv_size * el * sum(max(0, s) for s in seq_lens)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def tiny(cls) -> LlamaSpec:
        """The built-in default: 2 layers, hidden 256, 4 q heads, 2 kv heads, head_dim 64."""
        return cls()

    @classmethod
    def from_json_file(cls, path: str | Path) -> LlamaSpec:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        with open(p) as f:
            cfg = json.load(f)
        return cls.from_hf_config(cfg, name=p.parent.name or p.stem)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "hf") -> LlamaSpec:
        """Validate a Hugging Face Llama config dict; raise UnsupportedModel on anything we can't run."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        if archs != ["LlamaForCausalLM"]:
            raise UnsupportedModel("architectures", archs, "['LlamaForCausalLM']")
        mt = cfg.get("model_type", "llama")
        if mt != "llama":
            raise UnsupportedModel("model_type", mt, "'llama'")
        for f in ("attention_bias", "mlp_bias"):
            if cfg.get(f, False):
                raise UnsupportedModel(f, cfg[f], "false (no bias terms)")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel("hidden_act", act, "'silu'")
        sw = cfg.get("sliding_window")
        if sw is not None:
            raise UnsupportedModel("sliding_window", sw, "null (full attention)")
        prf = cfg.get("partial_rotary_factor", 1.0)
        if prf != 1.0:
            raise UnsupportedModel("partial_rotary_factor", prf, "1.0")
        if cfg.get("quantization_config") is not None:
            raise UnsupportedModel("quantization_config", cfg["quantization_config"], "null (bf16/fp16 weights)")
        hidden = cfg.get("hidden_size")
        nq = cfg.get("num_attention_heads")
        if not isinstance(hidden, int) or not isinstance(nq, int) or nq <= 0:
            raise UnsupportedModel("hidden_size/num_attention_heads", (hidden, nq), "positive integers")
        head_dim = cfg.get("head_dim") or hidden // nq
        return cls(
            hidden_size=hidden,
            num_layers=cfg.get("num_hidden_layers"),
            num_q_heads=nq,
            num_kv_heads=cfg.get("num_key_value_heads") or nq,
            head_dim=head_dim,
            intermediate_size=cfg.get("intermediate_size"),
            vocab_size=cfg.get("vocab_size"),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=_parse_rope_scaling(cfg.get("rope_scaling")),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=_parse_dtype(cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))),
            name=name,
        )


def _parse_dtype(v: Any) -> str:
    s = str(v).replace("torch.", "")
    if s not in SUPPORTED_DTYPES:
        raise UnsupportedModel("torch_dtype", v, f"one of {sorted(SUPPORTED_DTYPES)}")
    return s


def _parse_rope_scaling(rs: dict[str, Any] | None) -> Llama3RopeScaling | None:
    if rs is None:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise UnsupportedModel("rope_scaling.rope_type", kind, "'llama3', 'default' or no rope_scaling")
    try:
        return Llama3RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise UnsupportedModel(f"rope_scaling.{e.args[0]}", None, "present for rope_type 'llama3'") from e
