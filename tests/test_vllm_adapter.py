"""The vLLM 0.24 adapter on CPU: entry point, registration, dispatch decisions, unsupported configs,
and the decode path of MkDecodeMixin driven through vLLM's real forward context on a small fake
model (vLLM's own module layout, Triton in the CPU interpreter) against mk_plugin.reference."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm_fakes import (  # tests/vllm_fakes.py
    SPEC,
    STOCK,
    _fake_vllm_config,
    bind_kv,
    decode_once,
    fa_md,
    fwd_ctx,
    make_model,
    profile_run,
    reference_out,
)

from mk_plugin import vllm_adapter as va
from mk_plugin.config import ConfigError
from mk_plugin.spec import LlamaSpec, UnsupportedModel
from mk_plugin.testing import assert_matches, make_decode_batch, poison_

ROOT = Path(__file__).resolve().parents[1]
LAYER0 = "model.layers.0.self_attn.attn"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MK_") and k != "VLLM_PLUGINS"}
    env.update(extra)
    return env


def _run_py(code: str, **env: str) -> dict:
    """Run code in a fresh interpreter; its last stdout line is JSON."""
    p = subprocess.run([sys.executable, "-c", code], env=_clean_env(**env), capture_output=True, text=True,
                       timeout=180, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


class _Capture(logging.Handler):
    """Collects the adapter's log records (vLLM's 'vllm' logger does not propagate to root)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.WARNING]


@pytest.fixture
def mk_log():
    # vLLM configures logging (dictConfig) on its first import, which strips the handlers of existing
    # "vllm.*" loggers: import it first, or a test run on its own loses the capture handler.
    import vllm.logger  # noqa: F401

    h = _Capture()
    va.logger.addHandler(h)
    old = va.logger.level
    va.logger.setLevel(logging.DEBUG)
    yield h
    va.logger.removeHandler(h)
    va.logger.setLevel(old)


# ---- entry point and registration -------------------------------------------------------------------
def test_entry_point_is_installed():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "mk_plugin"]
    assert eps, "mk_plugin entry point not found: pip install -e . (discovery uses importlib.metadata)"
    assert eps[0].value == "mk_plugin.vllm_adapter:register"
    assert eps[0].load() is va.register


def test_vllm_loads_plugin_without_cuda_and_lazily():
    # vLLM's own loader in a fresh process, twice (idempotent); no CUDA, no Llama model code imported.
    code = """
import json, sys, torch
from vllm.plugins import load_general_plugins
import mk_plugin.vllm_adapter as va
load_general_plugins(); va.register(); va.register()
from vllm import ModelRegistry
m = ModelRegistry.models["LlamaForCausalLM"]
print(json.dumps({"mod": m.module_name, "cls": m.class_name, "cuda": torch.cuda.is_initialized(),
                  "llama": "vllm.model_executor.models.llama" in sys.modules}))
"""
    r = _run_py(code)
    assert (r["mod"], r["cls"]) == ("mk_plugin.vllm_adapter", "MkLlamaForCausalLM")
    assert r["cuda"] is False and r["llama"] is False


def test_vllm_plugins_empty_gives_stock_registry():
    code = """
import json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm import ModelRegistry
m = ModelRegistry.models["LlamaForCausalLM"]
print(json.dumps({"mod": m.module_name, "cls": m.class_name}))
"""
    r = _run_py(code, VLLM_PLUGINS="")
    assert (r["mod"], r["cls"]) == ("vllm.model_executor.models.llama", "LlamaForCausalLM")


def test_registry_resolves_to_our_class(monkeypatch):
    monkeypatch.delenv("MK_MODE", raising=False)
    from vllm import ModelRegistry
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.registry import _ModelInfo

    va.register()
    before = dict(ModelRegistry.models)
    va.register()
    assert ModelRegistry.models == before
    cls = ModelRegistry.models["LlamaForCausalLM"].load_model_cls()
    assert cls is va.MkLlamaForCausalLM and issubclass(cls, LlamaForCausalLM)
    assert issubclass(cls, va.MkDecodeMixin) and cls.__module__ == "mk_plugin.vllm_adapter"
    info = _ModelInfo.from_model_cls(cls)  # what vLLM inspects in a subprocess at startup
    assert info.is_text_generation_model and not info.is_pooling_model


def test_register_rejects_bad_switch(monkeypatch):
    monkeypatch.setenv("MK_MODE", "fastest")
    with pytest.raises(ConfigError, match="MK_MODE='fastest'"):
        va.register()


# ---- decide(): pure dispatch logic on fake metadata ---------------------------------------------------
def fake_md(reqs: int = 3, max_query_len: int = 1, max_seq_len: int = 100, blocks: int = 7, **kw) -> SimpleNamespace:
    md = SimpleNamespace(max_query_len=max_query_len, max_seq_len=max_seq_len,
                         seq_lens=torch.ones(reqs, dtype=torch.int32),
                         block_table=torch.zeros(reqs, blocks, dtype=torch.int32),
                         slot_mapping=torch.zeros(reqs, dtype=torch.int64), causal=True)
    for k, v in kw.items():
        setattr(md, k, v)
    return md


def dec(raw, num_tokens: int = 3, **kw) -> va.Decision:
    args = {"max_tokens": 16, "capacity_tokens": 4096}
    args.update(kw)
    return va.decide(raw, LAYER0, num_tokens, **args)


def test_decide_decode_step():
    d = dec({LAYER0: fake_md(3)}, 3)
    assert d.decode and d.warn_key is None
    # V2 piecewise/eager: padded token rows beyond the requests are allowed (output rows unused)
    assert dec({LAYER0: fake_md(3)}, 4).decode


@pytest.mark.parametrize("raw,num_tokens,kw,key", [
    (None, 8, {}, None),                                            # profile run / piecewise capture
    ({LAYER0: fake_md(2, max_query_len=7)}, 9, {}, None),          # prefill / mixed batch
    ({LAYER0: fake_md(3)}, 3, {"mode": "stock"}, None),             # MK_MODE=stock
    ({LAYER0: fake_md(3)}, 3, {"static_reason": "tensor parallel size 2"}, "config"),
    ([{LAYER0: fake_md(3)}], 3, {}, "ubatch"),                      # DBO micro-batches
    ({"other.layer": fake_md(3)}, 3, {}, "metadata"),
    ({LAYER0: SimpleNamespace(max_query_len=1)}, 3, {}, "metadata"),  # not FLASH_ATTN metadata
    ({LAYER0: fake_md(17)}, 17, {}, "batch"),                       # > 16 decode tokens
    ({LAYER0: fake_md(9)}, 9, {"max_tokens": 8}, "batch"),          # > min(max_num_seqs, 16)
    ({LAYER0: fake_md(5)}, 4, {}, "layout"),                        # more requests than token rows
    ({LAYER0: fake_md(3, max_seq_len=5000)}, 3, {}, "context"),     # workspace too small
    ({LAYER0: fake_md(3, dcp_context_kv_lens=torch.ones(3))}, 3, {}, "dcp"),
    ({LAYER0: fake_md(3, causal=False)}, 3, {}, "causal"),
])
def test_decide_stock(raw, num_tokens, kw, key):
    d = dec(raw, num_tokens, **kw)
    assert not d.decode and d.warn_key == key and d.reason


def test_config_supported():
    from vllm.config.compilation import CUDAGraphMode

    assert va.config_unsupported_reason(_fake_vllm_config(), {"FLASH_ATTN"}) is None
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY):
        assert va.config_unsupported_reason(_fake_vllm_config(**{"compilation_config.cudagraph_mode": mode}),
                                            {"FLASH_ATTN"}) is None


@pytest.mark.parametrize("over,backends,needle", [
    ({"parallel_config.tensor_parallel_size": 2}, {"FLASH_ATTN"}, "tensor parallel size 2"),
    ({"parallel_config.pipeline_parallel_size": 2}, {"FLASH_ATTN"}, "pipeline parallel size 2"),
    ({"parallel_config.decode_context_parallel_size": 2}, {"FLASH_ATTN"}, "decode context parallel"),
    ({"parallel_config.use_ubatching": True}, {"FLASH_ATTN"}, "micro-batching"),
    ({"cache_config.cache_dtype": "fp8"}, {"FLASH_ATTN"}, "kv cache dtype 'fp8'"),
    ({"quant_config": object()}, {"FLASH_ATTN"}, "quantization"),
    ({"lora_config": object()}, {"FLASH_ATTN"}, "LoRA"),
    ({"speculative_config": object()}, {"FLASH_ATTN"}, "speculative"),
    ({}, {"FLASHINFER"}, "FLASHINFER"),
    ({}, {"FLASH_ATTN", "TRITON_ATTN"}, "TRITON_ATTN"),
])
def test_config_unsupported(over, backends, needle):
    r = va.config_unsupported_reason(_fake_vllm_config(**over), backends)
    assert r is not None and needle in r


def test_plain_full_cudagraph_mode_is_refused():
    from vllm.config.compilation import CUDAGraphMode

    assert va.full_graph_replays_on_mixed(CUDAGraphMode.FULL)
    assert not va.full_graph_replays_on_mixed(CUDAGraphMode.FULL_AND_PIECEWISE)
    r = va.config_unsupported_reason(_fake_vllm_config(**{"compilation_config.cudagraph_mode": CUDAGraphMode.FULL}),
                                     {"FLASH_ATTN"})
    assert r is not None and "FULL" in r


def test_spec_from_transformers5_config_dict():
    # transformers >= 5 folds rope_theta/rope_scaling into rope_parameters and writes 'dtype'
    from transformers import AutoConfig

    d = AutoConfig.from_pretrained(ROOT / "bench/models/llama-3.2-1b").to_dict()
    s = LlamaSpec.from_hf_config(va.hf_dict_for_spec(d, torch.bfloat16))
    assert s.rope_theta == 500000.0 and s.rope_scaling is not None and s.rope_scaling.factor == 32.0
    assert s.dtype == "bfloat16" and s.tie_word_embeddings and s.num_layers == 16
    assert LlamaSpec.from_hf_config(va.hf_dict_for_spec(d, torch.float16)).dtype == "float16"
    with pytest.raises(UnsupportedModel, match="torch_dtype"):
        LlamaSpec.from_hf_config(va.hf_dict_for_spec(d, torch.float32))
    yarn = dict(d, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(UnsupportedModel, match="rope_type"):
        LlamaSpec.from_hf_config(va.hf_dict_for_spec(yarn, torch.bfloat16))


# ---- MkDecodeMixin on a fake model with vLLM's layout (tests/vllm_fakes.py), through vLLM's forward context
@pytest.fixture(scope="module")
def triton_ops():
    return pytest.importorskip("mk_plugin.triton_ops")


def test_decode_path_matches_reference(monkeypatch, mk_log, triton_ops):
    model, w = make_model(monkeypatch)
    assert (profile_run(model) == STOCK).all() and model.stock_calls == 1
    st = model._mk_state
    assert st is not None and st.backend == "triton" and st.max_tokens == 8  # min(max_num_seqs=8, 16)
    assert list(model.parameters()) == [] and list(model.buffers()) == []  # nothing registered
    ws_ptr = st.workspace.h.data_ptr()

    # 3 requests (one padded: seq_len 0, slot -1) in 4 token rows (V2 pads rows past the requests)
    b = make_decode_batch(SPEC, [37, 5, 0], block_size=16, seed=1)
    bind_kv(model, b.kv_caches)
    caches_ref = b.clone_caches()
    ids = torch.cat([b.input_ids, torch.tensor([11])])
    pos = torch.cat([b.positions, torch.tensor([0])])
    poison_(st.out_buf)
    with fwd_ctx(fa_md(b), slot=torch.cat([b.slot_mapping, torch.tensor([-1])])):
        out = model(ids, pos)
    assert out.shape == (4, SPEC.hidden_size) and model.stock_calls == 1
    assert out.data_ptr() == st.out_buf.data_ptr() and st.workspace.h.data_ptr() == ws_ptr  # no reallocation
    exp = reference_out(w, b, caches_ref)
    assert_matches(out[:2], exp[:2], SPEC.torch_dtype, "step")
    for got, want in zip(b.kv_caches, caches_ref):  # this step's K/V written where stock would
        for slot in b.slot_mapping[:2].tolist():
            assert_matches(got[slot // 16, :, slot % 16], want[slot // 16, :, slot % 16], SPEC.torch_dtype, "op")

    # same step fed as inputs_embeds (input_ids None), as V1/V2 do for prompt embeddings
    b2 = make_decode_batch(SPEC, [37, 5, 0], block_size=16, seed=1)
    bind_kv(model, b2.kv_caches)
    with fwd_ctx(fa_md(b2)):
        out2 = model(None, b2.positions, inputs_embeds=w.embed[b2.input_ids])
    assert_matches(out2[:2], exp[:2], SPEC.torch_dtype, "step")
    assert mk_log.warnings() == []
    assert model.mk_status()["counts"] == {"stock": 1, "decode:4": 1, "decode:3": 1}


def test_stock_steps_and_one_warning_per_reason(monkeypatch, mk_log, triton_ops):
    model, _ = make_model(monkeypatch)
    profile_run(model)
    b = make_decode_batch(SPEC, [20, 9], block_size=16, seed=2)
    bind_kv(model, b.kv_caches)
    with fwd_ctx(fa_md(b, max_query_len=5)):  # prefill/mixed: stock, silent
        assert (model(b.input_ids, b.positions) == STOCK).all()
    big = make_decode_batch(SPEC, [3] * 9, block_size=16, seed=2)  # 9 > max_tokens 8
    bind_kv(model, big.kv_caches)
    for _ in range(3):
        with fwd_ctx(fa_md(big)):
            assert (model(big.input_ids, big.positions) == STOCK).all()
    assert len(mk_log.warnings()) == 1 and "9 tokens" in mk_log.warnings()[0]
    # PP intermediate tensors always go to stock
    with fwd_ctx(fa_md(b)):
        assert (model(b.input_ids, b.positions, intermediate_tensors=object()) == STOCK).all()


@pytest.mark.parametrize("mode,over,backend,needle", [
    ("triton", {"parallel_config.tensor_parallel_size": 2}, "FLASH_ATTN", "tensor parallel"),
    ("triton", {"cache_config.cache_dtype": "fp8_e4m3"}, "FLASH_ATTN", "fp8_e4m3"),
    ("triton", {}, "FLASHINFER", "FLASHINFER"),
])
def test_unsupported_config_is_stock_with_one_warning(monkeypatch, mk_log, mode, over, backend, needle):
    model, _ = make_model(monkeypatch, mode, backend, **over)
    b = make_decode_batch(SPEC, [20, 9], block_size=16, seed=2)
    bind_kv(model, b.kv_caches)
    profile_run(model)
    for _ in range(3):
        with fwd_ctx(fa_md(b)):
            assert (model(b.input_ids, b.positions) == STOCK).all()
    assert model._mk_state is None and model.stock_calls == 4  # nothing allocated
    assert len(mk_log.warnings()) == 1 and needle in mk_log.warnings()[0]
    assert model.mk_status()["unsupported"] is not None


def test_unsupported_kv_cache_layout(monkeypatch, mk_log, triton_ops):
    model, _ = make_model(monkeypatch)
    profile_run(model)
    b = make_decode_batch(SPEC, [20, 9], block_size=16, seed=2)
    bind_kv(model, [c.transpose(2, 3).contiguous().transpose(2, 3) for c in b.kv_caches])  # HND strides
    for _ in range(2):
        with fwd_ctx(fa_md(b)):
            assert (model(b.input_ids, b.positions) == STOCK).all()
    assert len(mk_log.warnings()) == 1 and "contiguous" in mk_log.warnings()[0]


def test_stock_mode_never_builds_state(monkeypatch, mk_log):
    model, _ = make_model(monkeypatch, "stock")
    b = make_decode_batch(SPEC, [20, 9], block_size=16, seed=2)
    bind_kv(model, b.kv_caches)
    profile_run(model)
    with fwd_ctx(fa_md(b)):
        assert (model(b.input_ids, b.positions) == STOCK).all()
    assert model._mk_state is None and mk_log.warnings() == []
    assert va.mk_status(model)["mode"] == "stock"


def test_megakernel_unavailable_falls_back_to_triton(monkeypatch, mk_log, triton_ops):
    monkeypatch.setitem(sys.modules, "mk_plugin.persistent.backend", None)  # the import now fails
    model, _ = make_model(monkeypatch, "megakernel")
    profile_run(model)
    assert model._mk_state.backend == "triton" and model._mk_state.workspace is not None
    assert len(mk_log.warnings()) == 1 and "MK_MODE=megakernel is unavailable" in mk_log.warnings()[0]


@pytest.mark.parametrize("rounding", ["fused", "stock"])
def test_megakernel_path_matches_reference(monkeypatch, mk_log, rounding):
    # MegakernelDecoder on a CPU device runs its encoded programs in the VM: the same programs and
    # fallback glue as the GPU; here driven through the adapter exactly like the Triton path.
    from mk_plugin.persistent.backend import MegakernelDecoder  # CI installs it: a failure must show
    from mk_plugin.persistent.encoding import Rounding

    monkeypatch.setenv("MK_ROUNDING", rounding)
    model, w = make_model(monkeypatch, "megakernel")
    profile_run(model)
    assert model._mk_state.backend == "megakernel" and model._mk_state.workspace is None
    dec = model._mk_state.decoder
    assert isinstance(dec, MegakernelDecoder) and dec.rounding == Rounding[rounding.upper()]
    assert model.mk_status()["rounding"] == rounding
    out, exp = decode_once(model, w, make_decode_batch(SPEC, [37, 5, 0], block_size=16, seed=1))
    assert_matches(out[:2], exp[:2], SPEC.torch_dtype, "step")
    assert mk_log.warnings() == [] and model.mk_status()["counts"].get("decode:3") == 1


def test_megakernel_uses_the_tuning_table_mk_tuning_names(monkeypatch, mk_log, tmp_path):
    from mk_plugin.persistent import tuning as tn
    from mk_plugin.persistent import tuning_table as tt

    t = tn.ScheduleTuning((("gate_up", 2.0), ("o_proj", 0.5)), attn_chunks=3)
    key = tt.spec_tuning_key(SPEC, 3, 132, False)   # a CPU decoder models 132 SMs; vLLM's LM head
    table = tt.TuningTable("cpu", [tt.TuningEntry(key, t, 80.0, 100.0)]).save(tmp_path / "tuned.json")
    monkeypatch.setenv("MK_TUNING", str(table))
    model, w = make_model(monkeypatch, "megakernel")
    profile_run(model)
    dec = model._mk_state.decoder
    src = model.mk_status()["tuning"]
    assert dec.tunings[3] == t and str(table) in src[3] and "80.0 vs 100.0 us" in src[3]
    assert dec.tunings[2] == tn.ScheduleTuning((("gate_up", 2.0), ("o_proj", 0.5))) and "batch 3's" in src[2]
    out, exp = decode_once(model, w, make_decode_batch(SPEC, [37, 5, 19], block_size=16, seed=4))
    assert dec.program(3).tuning == t and dec.program(3).attn_chunks == 3
    assert_matches(out, exp, SPEC.torch_dtype, "step")
    assert mk_log.warnings() == []


def test_debug_dump_and_force_tokens(monkeypatch, tmp_path):
    seq = list(range(100, 160))
    (tmp_path / "force.json").write_text(json.dumps(seq))
    monkeypatch.setenv("MK_DUMP_LOGITS", str(tmp_path / "dump"))
    monkeypatch.setenv("MK_FORCE_TOKENS", str(tmp_path / "force.json"))
    model, _ = make_model(monkeypatch, "stock")
    b = make_decode_batch(SPEC, [20, 9], block_size=16, seed=2)
    bind_kv(model, b.kv_caches)
    with fwd_ctx(fa_md(b)):
        h = model(b.input_ids, b.positions)
    logits = model.compute_logits(h[:2])
    assert logits.argmax(-1).tolist() == [seq[20], seq[9]]  # the token after a seq_len-L request is seq[L]
    dumps = sorted((tmp_path / "dump").glob("logits_*.pt"))
    assert len(dumps) == 1
    d = torch.load(dumps[0])
    assert d["seq_lens"] == [20, 9] and d["logits"].shape == (2, SPEC.vocab_size)
    assert torch.isfinite(d["logits"]).all()  # saved before forcing
    # a compute_logits call without a preceding forward (vLLM's dummy sampler run) is left alone
    assert torch.isfinite(model.compute_logits(h[:2])).all()
