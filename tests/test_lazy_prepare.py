"""Which megakernel programs the adapter builds before vLLM captures its CUDA graphs (adapter/decide.py
sizes_to_prepare): the capture sizes a FULL decode graph can hold, every size without graphs; the rest on
first eager use, never inside a capture. On CPU: the decoder runs its programs in the VM."""
from __future__ import annotations

import json

import pytest
import torch
from vllm_fakes import SPEC, decode_once, make_model, profile_run  # tests/vllm_fakes.py

from mk_plugin.adapter import auto
from mk_plugin.adapter.decide import sizes_to_prepare
from mk_plugin.persistent.encoding import spec_hash
from mk_plugin.testing import assert_matches, make_decode_batch


def _cc(mode_name: str | None, sizes):
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    return SimpleNamespace(cudagraph_mode=None if mode_name is None else CUDAGraphMode[mode_name],
                           cudagraph_capture_sizes=sizes)


@pytest.mark.parametrize("mode,sizes,max_tokens,want", [
    ("FULL_AND_PIECEWISE", [1, 2, 4, 8, 16, 24, 32], 16, [1, 2, 4, 8, 16]),
    ("FULL_DECODE_ONLY", [1, 2, 4, 8, 16], 8, [1, 2, 4, 8]),
    ("FULL_AND_PIECEWISE", [1, 2, 4, 8, 16, 24], 12, [1, 2, 4, 8, 12]),   # max_tokens itself
    ("FULL_AND_PIECEWISE", [4, 1, 2, 2], 6, [1, 2, 4, 5, 6]),             # above the largest: no graph
    ("PIECEWISE", [1, 2, 4, 8], 8, list(range(1, 9))),                     # every decode step eager
    ("NONE", [], 8, list(range(1, 9))),
    ("FULL_AND_PIECEWISE", [], 4, [1, 2, 3, 4]),                           # enforce_eager: no sizes
    ("FULL_AND_PIECEWISE", None, 4, [1, 2, 3, 4]),
    (None, [1, 2], 4, [1, 2, 3, 4]),
])
def test_sizes_to_prepare(mode, sizes, max_tokens, want):
    assert sizes_to_prepare(_cc(mode, sizes), max_tokens) == want


def test_graph_mode_prepares_the_capture_sizes_and_builds_others_on_first_eager_use(monkeypatch):
    model, w = make_model(monkeypatch, "megakernel", **{"compilation_config.cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
    profile_run(model)
    dec = model._mk_state.decoder
    assert dec.backend == "megakernel" and sorted(dec._entries) == [1, 2, 4, 8]   # max_num_seqs 8
    out, exp = decode_once(model, w, make_decode_batch(SPEC, [37, 5, 19], block_size=16, seed=2))
    assert sorted(dec._entries) == [1, 2, 3, 4, 8]   # an eager step of 3 (no graph pads it here) built 3
    assert_matches(out, exp, SPEC.torch_dtype, "step")


def test_eager_mode_prepares_every_size(monkeypatch):
    model, _ = make_model(monkeypatch, "megakernel")   # enforce_eager: no capture sizes
    profile_run(model)
    assert sorted(model._mk_state.decoder._entries) == list(range(1, 9))


def test_an_unbuilt_size_inside_a_capture_raises(monkeypatch):
    model, _ = make_model(monkeypatch, "megakernel", **{"compilation_config.cudagraph_capture_sizes": [1, 2, 4, 8]})
    profile_run(model)
    dec = model._mk_state.decoder
    # as on the GPU inside torch.cuda.graph (the check reads only these two)
    monkeypatch.setattr(dec, "device", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert dec.program(4).batch == 4   # prepared: served from the decoder's entries
    with pytest.raises(RuntimeError, match=r"batch 3 is not built; call MegakernelDecoder.prepare\(\) before"):
        dec.program(3)
    assert 3 not in dec._entries


def test_auto_prepares_only_the_sizes_it_gives_the_megakernel(monkeypatch, tmp_path):
    pytest.importorskip("mk_plugin.triton_ops")
    path = tmp_path / "paths_cpu.json"   # batch <= 2: the megakernel; 3..8 (the entry of 8): Triton
    path.write_text(json.dumps({"format": 1, "entries": [
        {"spec_hash": spec_hash(SPEC), "num_sms": 132, "batch": 2, "triton_us": 1000.0, "megakernel_us": 500.0},
        {"spec_hash": spec_hash(SPEC), "num_sms": 132, "batch": 8, "triton_us": 1000.0, "megakernel_us": 1500.0}]}))
    monkeypatch.setattr(auto, "paths_file", lambda slug: path)
    # [4, 8]: a batch of 1 or 2 is padded to 4, where auto runs Triton: no megakernel program is needed
    for sizes, want in (([1, 2, 4, 8], [1, 2]), ([4, 8], []), (None, [1, 2])):
        model, _ = make_model(monkeypatch, "auto", **{"compilation_config.cudagraph_capture_sizes": sizes})
        profile_run(model)
        st = model._mk_state
        assert st.backend == "auto" and [st.decoder.path_for(b) for b in (1, 2, 3, 8)] == ["megakernel"] * 2 + ["triton"] * 2
        assert sorted(st.decoder.megakernel._entries) == want
