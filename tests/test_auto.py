"""MK_MODE=auto (mk_plugin/adapter/auto.py): the per-batch choice of decode path from a table of measured
steps or a measurement, and the adapter running it on a CPU (Triton interpreter + the megakernel's VM)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_fakes import SPEC, decode_once, make_model, profile_run  # tests/vllm_fakes.py

from mk_plugin.adapter import auto
from mk_plugin.persistent.encoding import spec_hash
from mk_plugin.testing import assert_matches, make_decode_batch


def test_pick_needs_a_gain_above_noise():
    assert auto.pick((1000.0, 950.0)) == "megakernel"
    assert auto.pick((1000.0, 980.0)) == "triton" and auto.pick((1000.0, 1200.0)) == "triton"


def test_pick_takes_stock_unless_a_plugin_path_beat_it():
    """Issue 12: with stock vLLM's TBT measured alongside, a plugin path must beat it by more than the noise."""
    t = lambda tr, mk, st: auto.PathTimes(tr, mk, "TBT in vLLM", st)
    assert auto.pick(t(1000.0, 800.0, 1000.0)) == "megakernel" and auto.pick(t(900.0, 1200.0, 1000.0)) == "triton"
    assert auto.pick(t(1000.0, 985.0, 1000.0)) == "stock"   # the megakernel only 1.5% faster than stock
    assert auto.pick(t(1010.0, 1300.0, 1000.0)) == "stock" and auto.pick(t(1000.0, 800.0, None)) == "megakernel"
    choice, source = auto.choose(2, {2: t(14579.0, 18207.0, 14056.0)}, "paths_x.json", None)
    assert choice == {1: "stock", 2: "stock"}
    assert source[2] == "table paths_x.json, TBT in vLLM: triton 14579 us, megakernel 18207 us, stock 14056 us"


def test_choose_from_table_then_measurement_then_default():
    table = {4: (1000.0, 800.0), 16: (1100.0, 1500.0)}
    choice, source = auto.choose(16, table, "paths_x.json", None)
    assert [choice[b] for b in (1, 3, 4, 5, 8, 16)] == ["megakernel"] * 3 + ["triton"] * 3  # 5: next size is 16
    assert "table paths_x.json" in source[3] and "(batch 4)" in source[3] and "(batch" not in source[4]
    seen = []

    def measure(b):
        seen.append(b)
        return (100.0, 90.0) if b == 1 else (100.0, 110.0)
    choice, source = auto.choose(8, {4: (1000.0, 800.0)}, "t", measure)
    assert seen == [1, 2, 8] and choice[1] == "megakernel" and choice[2] == "triton" and choice[3] == "megakernel"
    assert "measured here" in source[1]
    choice, source = auto.choose(2, {}, "t", None)
    assert choice == {1: "triton", 2: "triton"} and "verified default" in source[1]


def test_packaged_h200_table_is_read_for_its_model():
    from mk_plugin.spec import LlamaSpec
    spec = LlamaSpec.from_json_file(Path(__file__).resolve().parents[1] / "bench" / "models" / "llama-3.2-1b")
    t = auto.load_paths(auto.paths_file("nvidia_h200"), spec_hash(spec), 132)
    assert set(t) >= {1, 8, 16} and all(v[0] > 0 and v[1] > 0 for v in t.values())
    assert auto.load_paths(auto.paths_file("nvidia_h200"), spec_hash(spec), 114) == {}   # another SM count


def test_an_h100_reads_its_own_packaged_tables():
    """Session 40: an H100 SXM found no table of its own and ran the untuned megakernel program at every batch size.
    Its device name reaches both of its tables (paths and megakernel), and the megakernel table serves measured
    programs at 1B batch 1 and 16 and 8B batch 16, and at 1B batch 4 (the untuned base until session 48, where the H200
    entry did not win; since then the H200 batch-4 program with x_groups, measured -8% on the H100)."""
    from mk_plugin.persistent import tuning_table as tt
    from mk_plugin.persistent.tuning import UNTUNED_TUNING
    from mk_plugin.spec import LlamaSpec
    from mk_plugin.triton_ops._device import gpu_slug

    name = "NVIDIA H100 80GB HBM3"
    models = Path(__file__).resolve().parents[1] / "bench" / "models"
    assert auto.paths_file(gpu_slug(name)).is_file() and tt.tuned_file(name).is_file()
    one, eight = (LlamaSpec.from_json_file(models / m) for m in ("llama-3.2-1b", "llama-3.1-8b"))
    t = auto.load_paths(auto.paths_file(gpu_slug(name)), spec_hash(one), 132)
    assert set(t) >= {1, 4, 8, 16} and all(v[0] > 0 and v[1] > 0 for v in t.values())
    keys = [tt.spec_tuning_key(one, 1, 132, False), tt.spec_tuning_key(one, 16, 132, False),
            tt.spec_tuning_key(eight, 16, 132, False), tt.spec_tuning_key(one, 4, 132, False)]
    got = tt.resolve("auto", name, keys)
    assert all("megakernel_nvidia_h100_80gb_hbm3.json" in why for _, why in got), got
    assert got[3][0] != UNTUNED_TUNING and got[3][0].x_groups and "winner" in got[3][1]


@pytest.mark.parametrize("winner", ["triton", "megakernel"])
def test_adapter_auto_mode_runs_the_chosen_path(monkeypatch, tmp_path, winner):
    pytest.importorskip("mk_plugin.triton_ops")
    times = (1000.0, 500.0) if winner == "megakernel" else (1000.0, 1500.0)
    path = tmp_path / "paths_cpu.json"
    path.write_text(json.dumps({"format": 1, "entries": [
        {"spec_hash": spec_hash(SPEC), "num_sms": 132, "batch": 4, "triton_us": times[0], "megakernel_us": times[1]}]}))
    monkeypatch.setattr(auto, "paths_file", lambda slug: path)
    model, w = make_model(monkeypatch, "auto")
    profile_run(model)
    st = model._mk_state
    assert st.backend == "auto" and st.decoder.path_for(3) == winner
    assert model.mk_status()["auto"][3].startswith(f"{winner} (table paths_cpu.json")
    out, exp = decode_once(model, w, make_decode_batch(SPEC, [37, 5, 0], block_size=16, seed=1))
    assert_matches(out[:2], exp[:2], SPEC.torch_dtype, "step")
    assert model._mk_last_call.backend == winner   # what compute_logits would recompute after a hang


def test_adapter_auto_mode_runs_stock_where_stock_was_faster(monkeypatch, tmp_path):
    pytest.importorskip("mk_plugin.triton_ops")
    from vllm_fakes import STOCK
    path = tmp_path / "paths_cpu.json"
    path.write_text(json.dumps({"format": 1, "entries": [
        {"spec_hash": spec_hash(SPEC), "num_sms": 132, "batch": 2, "triton_us": 1000.0, "megakernel_us": 500.0},
        {"spec_hash": spec_hash(SPEC), "num_sms": 132, "batch": 4, "triton_us": 1000.0, "megakernel_us": 1500.0,
         "vllm_tbt": {"triton_ms": 1.0, "megakernel_ms": 1.5, "stock_ms": 1.0}}]}))
    monkeypatch.setattr(auto, "paths_file", lambda slug: path)
    model, w = make_model(monkeypatch, "auto")
    profile_run(model)
    st = model._mk_state
    assert [st.decoder.path_for(b) for b in (1, 2, 3, 4)] == ["megakernel", "megakernel", "stock", "stock"]
    assert model.mk_status()["auto"][3].startswith("stock (table paths_cpu.json, TBT in vLLM")
    calls = model.stock_calls
    out, _ = decode_once(model, w, make_decode_batch(SPEC, [37, 5, 0], block_size=16, seed=1))
    assert model.stock_calls == calls + 1 and bool((out == STOCK).all())   # vLLM's own forward ran the step
    assert model._mk_last_call is None   # nothing of the plugin's for compute_logits to recompute
    out, exp = decode_once(model, w, make_decode_batch(SPEC, [37, 5], block_size=16, seed=2))
    assert_matches(out, exp, SPEC.torch_dtype, "step")
    assert model._mk_last_call.backend == "megakernel"


def test_auto_is_the_default_mode(monkeypatch, tmp_path):
    """Issue 12: with MK_MODE unset the adapter runs auto (measured at or below stock, NOTES session 23)."""
    pytest.importorskip("mk_plugin.triton_ops")
    path = tmp_path / "paths_cpu.json"
    path.write_text(json.dumps({"format": 1, "entries": [
        {"spec_hash": spec_hash(SPEC), "num_sms": 132, "batch": 4, "triton_us": 1000.0, "megakernel_us": 1500.0}]}))
    monkeypatch.setattr(auto, "paths_file", lambda slug: path)
    model, _w = make_model(monkeypatch, "")   # MK_MODE set to "" = unset (config.get_config strips it)
    profile_run(model)
    assert model.mk_status()["mode"] == "auto" and model._mk_state.backend == "auto"


def test_in_vllm_tbt_decides_over_the_kernel_only_step(tmp_path):
    path = tmp_path / "paths_x.json"
    path.write_text(json.dumps({"format": 1, "entries": [
        {"spec_hash": 7, "num_sms": 132, "batch": 1, "triton_us": 1000.0, "megakernel_us": 990.0,
         "vllm_tbt": {"triton_ms": 4.8, "megakernel_ms": 4.4}},
        {"spec_hash": 7, "num_sms": 132, "batch": 8, "triton_us": 1000.0, "megakernel_us": 900.0}]}))
    t = auto.load_paths(path, 7, 132)
    assert t[1][:2] == (4800.0, 4400.0) and t[1].what == "TBT in vLLM" and t[8].what == "kernel-only step"
    choice, source = auto.choose(8, t, "paths_x.json", None)
    assert choice[1] == "megakernel" and choice[8] == "megakernel"   # kernel-only 1% apart at 1: Triton
    assert source[1].startswith("table paths_x.json, TBT in vLLM: triton 4800 us, megakernel 4400 us")
    assert source[8].startswith("table paths_x.json: triton 1000 us")


def test_packaged_h200_table_picks_the_megakernel_at_8b_batch_1_from_vllm():
    from mk_plugin.spec import LlamaSpec
    spec = LlamaSpec.from_json_file(Path(__file__).resolve().parents[1] / "bench" / "models" / "llama-3.1-8b")
    t = auto.load_paths(auto.paths_file("nvidia_h200"), spec_hash(spec), 132)
    assert t[1].what == "TBT in vLLM" and auto.pick(t[1]) == "megakernel"
    assert t[16].what == "TBT in vLLM" and auto.pick(t[16]) == "stock"   # issue 12: no plugin path beat stock
