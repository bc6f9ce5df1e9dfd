"""MK_LM_HEAD=megakernel on the CPU: the megakernel (its VM executor) computes a decode step's logits inside
the step and compute_logits hands them to vLLM's sampler -- for an eager step and for a simulated FULL-graph
replay -- against the fp32 reference; vLLM's LM head everywhere else (stock and Triton steps, models whose
logits processor scales or caps, MK_MODE=triton, after a megakernel hang); the tuning lookup of a decoder with
the LM head; the auto path's decode and measurement with it."""
from __future__ import annotations

import pytest
import torch
from vllm_fakes import SPEC, bind_kv, fa_md, fwd_ctx, make_model, profile_run  # tests/vllm_fakes.py

from mk_plugin import reference as ref
from mk_plugin import vllm_adapter as va
from mk_plugin.config import ConfigError, MkConfig
from mk_plugin.decoding import DecodeInputs
from mk_plugin.testing import assert_matches, make_decode_batch


@pytest.fixture
def warned(monkeypatch):
    import vllm.logger  # noqa: F401 (vLLM's logging config first: see test_vllm_adapter.mk_log)

    got: list[str] = []
    # (the adapter's modules share this one logger, "vllm.mk_plugin")
    monkeypatch.setattr(va.logger, "warning", lambda fmt, *a: got.append(fmt % a))
    return got


def _reference(w, b):
    cs = ref.rope_cos_sin_cache(SPEC, 4096).to(SPEC.torch_dtype)
    return ref.decode_step(SPEC, w, b.input_ids, b.positions, b.clone_caches(), b.block_table, b.seq_lens,
                           b.slot_mapping, cs)


def _step(model, b):
    bind_kv(model, b.kv_caches)
    with fwd_ctx(fa_md(b)):
        return model(b.input_ids, b.positions)


def test_config_mk_lm_head():
    assert MkConfig.from_env({}).lm_head == "vllm"
    assert MkConfig.from_env({"MK_LM_HEAD": " Megakernel "}).lm_head == "megakernel"
    with pytest.raises(ConfigError, match=r"MK_LM_HEAD='fused' is not supported; choose one of vllm, megakernel"):
        MkConfig.from_env({"MK_LM_HEAD": "fused"})


def test_megakernel_logits_eager_step_and_replay(monkeypatch, warned):
    monkeypatch.setenv("MK_LM_HEAD", "megakernel")
    model, w = make_model(monkeypatch, "megakernel")
    profile_run(model)
    st = model._mk_state
    assert st.decoder.lm_head and st.logits_buf.shape == (8, SPEC.vocab_size) and st.logits_buf.dtype == torch.float32
    assert model.mk_status()["lm_head"] == "megakernel" and warned == []

    # an eager step: the megakernel writes out and the logits; compute_logits returns those rows (not vLLM's)
    b = make_decode_batch(SPEC, [37, 5, 0], block_size=16, seed=1)
    exp_out, exp_logits = _reference(w, b)
    st.logits_buf.fill_(float("nan"))
    out = _step(model, b)
    assert_matches(out[:2], exp_out[:2], SPEC.torch_dtype, "step")
    poisoned = torch.full_like(out[:3], float("nan"))   # vLLM's LM head on these would give NaN
    logits = model.compute_logits(poisoned)
    assert logits.data_ptr() == st.logits_buf.data_ptr() and logits.shape == (3, SPEC.vocab_size)
    assert_matches(logits[:2], exp_logits[:2], SPEC.torch_dtype, "step")
    assert model.mk_status()["counts"]["logits:megakernel"] == 1

    # a second compute_logits without a forward is a FULL-graph replay: the captured call of the smallest
    # size >= rows; a size captured stock (None) and one larger than any capture get vLLM's LM head
    b2 = make_decode_batch(SPEC, [9, 70], block_size=16, seed=4)
    _, exp2 = _reference(w, b2)
    lg = st.logits_buf[:2]
    st.decoder.decode(DecodeInputs(w.embed[b2.input_ids], b2.positions, b2.kv_caches, b2.block_table, b2.seq_lens,
                                   b2.slot_mapping, st.cos_sin), st.out_buf[:2], lg)   # what a replay writes
    model._mk_graph_calls[2] = va._DecodeCall(None, st.out_buf[:2], "megakernel", lg)
    model._mk_graph_calls[4] = None
    assert_matches(model.compute_logits(poisoned[:2]), exp2, SPEC.torch_dtype, "step")
    for rows in (3, 6):   # size 4 was captured stock; nothing was captured for 6
        hidden = torch.ones(rows, SPEC.hidden_size, dtype=SPEC.torch_dtype)
        assert torch.equal(model.compute_logits(hidden), hidden.float() @ w.lm_head.float().t())
    assert model.mk_status()["counts"]["logits:megakernel"] == 2


def test_stock_and_triton_steps_keep_vllms_lm_head(monkeypatch, warned):
    monkeypatch.setenv("MK_LM_HEAD", "megakernel")
    model, w = make_model(monkeypatch, "megakernel")
    profile_run(model)
    # the profile run was stock: its compute_logits is vLLM's
    h = torch.ones(2, SPEC.hidden_size, dtype=SPEC.torch_dtype)
    model._mk_py_step = True
    assert torch.equal(model.compute_logits(h), h.float() @ w.lm_head.float().t())
    # a mixed batch (max_query_len > 1) runs stock in Python: vLLM's LM head
    b = make_decode_batch(SPEC, [20, 9], block_size=16, seed=2)
    bind_kv(model, b.kv_caches)
    with fwd_ctx(fa_md(b, max_query_len=3)):
        out = model(b.input_ids, b.positions)
    assert torch.equal(model.compute_logits(out[:2]), out[:2].float() @ w.lm_head.float().t())
    assert "logits:megakernel" not in model.mk_status()["counts"]


@pytest.mark.parametrize("attr,value,needle", [("scale", 0.5, "logit scale 0.5"),
                                                ("soft_cap", 30.0, "logits soft cap 30.0"),
                                                ("org_vocab_size", 999, "keeps 999 vocabulary rows")])
def test_logits_processors_the_megakernel_does_not_model(monkeypatch, warned, attr, value, needle):
    monkeypatch.setenv("MK_LM_HEAD", "megakernel")
    model, _ = make_model(monkeypatch, "megakernel")
    setattr(model.logits_processor, attr, value)
    profile_run(model)
    assert model._mk_state.logits_buf is None and not model._mk_state.decoder.lm_head
    assert model.mk_status()["lm_head"] == "vllm"
    assert len(warned) == 1 and needle in warned[0] and "vLLM's LM head computes the logits" in warned[0]


def test_triton_mode_ignores_mk_lm_head_with_one_warning(monkeypatch, warned):
    monkeypatch.setenv("MK_LM_HEAD", "megakernel")
    model, _ = make_model(monkeypatch, "triton")
    profile_run(model)
    assert model._mk_state.logits_buf is None and model.mk_status()["lm_head"] == "vllm"
    assert len(warned) == 1 and "no effect with MK_MODE=triton" in warned[0]


def test_after_a_hang_vllms_lm_head_computes_the_logits(monkeypatch, warned, unsatisfiable_wait):
    pytest.importorskip("mk_plugin.triton_ops")
    monkeypatch.setenv("MK_LM_HEAD", "megakernel")
    model, w = make_model(monkeypatch, "megakernel")
    profile_run(model)
    st = model._mk_state
    mk = st.decoder
    mk.install_program(unsatisfiable_wait(mk.program(3)))
    b = make_decode_batch(SPEC, [37, 5, 0], block_size=16, seed=1)
    _, exp_logits = _reference(w, b)
    st.logits_buf.fill_(float("nan"))
    out = _step(model, b)
    assert mk.pending_error()
    logits = model.compute_logits(out[:3])   # recomputed with Triton, then vLLM's LM head (the fake's fp32 one)
    assert logits.data_ptr() != st.logits_buf.data_ptr() and torch.isfinite(logits).all()
    assert_matches(logits[:2], exp_logits[:2], SPEC.torch_dtype, "step")
    assert st.backend == "triton" and model.mk_status()["counts"]["recomputed"] == 1
    assert "logits:megakernel" not in model.mk_status()["counts"]


def test_tuning_of_a_decoder_with_the_lm_head_takes_the_layers_entry(tmp_path):
    from mk_plugin.persistent import tuning as tn
    from mk_plugin.persistent import tuning_table as tt

    t = tn.ScheduleTuning((("gate_up", 2.0),), attn_chunks=3)
    with_lm = tn.ScheduleTuning((("lm_head", 0.5),))
    plain = tt.TuningTable("cpu", [tt.TuningEntry(tt.spec_tuning_key(SPEC, 3, 132, False), t, 80.0, 100.0)])
    path = plain.save(tmp_path / "plain.json")
    (got, why), = tt.resolve(str(path), "cpu", [tt.spec_tuning_key(SPEC, 3, 132, True)])
    assert got == t and "80.0 vs 100.0 us" in why and "the layers' entry" in why
    # a table that measured the model with its LM head is used as it is
    plain.put(tt.TuningEntry(tt.spec_tuning_key(SPEC, 3, 132, True), with_lm, 70.0, 100.0))
    path = plain.save(tmp_path / "both.json")
    (got, why), = tt.resolve(str(path), "cpu", [tt.spec_tuning_key(SPEC, 3, 132, True)])
    assert got == with_lm and "layers' entry" not in why
    (got, _), = tt.resolve(str(path), "cpu", [tt.spec_tuning_key(SPEC, 3, 132, False)])
    assert got == t


def test_auto_decoder_passes_logits_to_the_megakernel_only():
    from mk_plugin.adapter.auto import AutoDecoder

    calls = []

    class Rec:
        def __init__(self, name):
            self.name = name

        def decode(self, inputs, out, *logits):
            calls.append((self.name, logits))
            return out

    dec = AutoDecoder(Rec("triton"), Rec("megakernel"), {1: "megakernel", 2: "triton"})
    lg = torch.zeros(1)
    for batch in (1, 2):
        dec.decode(DecodeInputs(torch.zeros(batch, 4), *[None] * 6), torch.zeros(batch, 4), lg)
    assert calls == [("megakernel", (lg,)), ("triton", ())]


def test_auto_mode_fuses_on_the_megakernels_batch_sizes_only(monkeypatch, warned):
    monkeypatch.setenv("MK_LM_HEAD", "megakernel")
    model, w = make_model(monkeypatch, "auto")
    profile_run(model)
    st = model._mk_state
    assert st.backend == "auto" and st.logits_buf is not None and st.decoder.megakernel.lm_head
    st.decoder.choice = {b: "triton" if b == 2 else "megakernel" for b in range(1, 9)}   # as a table could say
    for lens, fused in (([37, 5, 0], True), ([20, 9], False)):
        b = make_decode_batch(SPEC, lens, block_size=16, seed=len(lens))
        _, exp_logits = _reference(w, b)
        out = _step(model, b)
        logits = model.compute_logits(out[:len(lens)])
        assert (logits.data_ptr() == st.logits_buf.data_ptr()) == fused
        n = sum(x > 0 for x in lens)
        assert_matches(logits[:n], exp_logits[:n], SPEC.torch_dtype, "step")
    assert model.mk_status()["counts"]["logits:megakernel"] == 1


def test_auto_measurement_times_the_same_work_on_both_paths(monkeypatch):
    """With the megakernel's LM head, the in-worker measurement adds vLLM's LM head to the Triton step."""
    from mk_plugin import timing
    from mk_plugin.adapter.auto import measure_both
    from mk_plugin.weights import random_weights

    w = random_weights(SPEC, seed=5)
    seen = []

    class Dec:
        def __init__(self, name, lm_head):
            self.name, self.lm_head = name, lm_head

        def decode(self, inputs, out, *logits):
            seen.append((self.name, tuple(x.shape for x in logits)))
            return out

    def one_call(fn, replays):
        r = fn()
        seen.append(("result", None if r is None else tuple(r.shape)))
        return 0.001

    monkeypatch.setattr(timing, "graph_median_ms", one_call)
    cs = ref.rope_cos_sin_cache(SPEC, 4096).to(SPEC.torch_dtype)
    for lm in (True, False):
        seen.clear()
        assert measure_both(Dec("triton", False), Dec("megakernel", lm), SPEC, w, cs, 16)(3) == (1.0, 1.0)
        if lm:
            assert seen == [("triton", ()), ("result", (3, SPEC.vocab_size)),
                            ("megakernel", ((3, SPEC.vocab_size),)), ("result", (3, SPEC.hidden_size))]
        else:
            assert seen == [("triton", ()), ("result", (3, SPEC.hidden_size)),
                            ("megakernel", ()), ("result", (3, SPEC.hidden_size))]


def test_replays_find_the_graph_captured_for_their_size(monkeypatch, warned):
    """Captures record what each FULL graph holds: a megakernel call (its logits rows) or stock (None: any stock
    capture, so a replay padded to a stock graph never takes a larger size's megakernel logits)."""
    monkeypatch.setenv("MK_LM_HEAD", "megakernel")
    model, w = make_model(monkeypatch, "megakernel")
    profile_run(model)
    st = model._mk_state
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    b4 = make_decode_batch(SPEC, [37, 5, 11, 60], block_size=16, seed=6)
    _step(model, b4)                                    # captured: the megakernel for 4 tokens
    b8 = make_decode_batch(SPEC, [9] * 8, block_size=16, seed=7)
    bind_kv(model, b8.kv_caches)
    with fwd_ctx(fa_md(b8, max_query_len=2)):          # a capture for 8 tokens that decide() leaves stock
        model(b8.input_ids, b8.positions)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert model._mk_graph_calls[8] is None and model._mk_graph_calls[4].logits.shape == (4, SPEC.vocab_size)
    _, exp4 = _reference(w, b4)
    h = torch.ones(3, SPEC.hidden_size, dtype=SPEC.torch_dtype)
    assert_matches(model.compute_logits(h), exp4[:3], SPEC.torch_dtype, "step")       # replay of the 4-graph, 3 rows
    h6 = torch.ones(6, SPEC.hidden_size, dtype=SPEC.torch_dtype)
    assert torch.equal(model.compute_logits(h6), h6.float() @ w.lm_head.float().t())  # replay of the stock 8-graph
    assert st.logits_buf.shape[0] == 8


def test_a_capture_before_the_decode_state_exists_is_marked_stock(monkeypatch, warned):
    """An unusual start-up order (the first forward inside a capture) runs stock and builds nothing: that graph is
    stock, and a replay padded to it must not take a larger size's megakernel logits later."""
    monkeypatch.setenv("MK_LM_HEAD", "megakernel")
    model, _ = make_model(monkeypatch, "megakernel")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _step(model, make_decode_batch(SPEC, [37, 5], block_size=16, seed=8))
    assert model._mk_state is None and model._mk_graph_calls == {2: None} and not model._mk_py_step
    assert len(warned) == 1 and "inside a CUDA-graph capture" in warned[0]
