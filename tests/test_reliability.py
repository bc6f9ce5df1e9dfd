"""The megakernel's reliability layer on the CPU: watchdog configuration and kernel-source guards,
the deliberate corruption used by the GPU watchdog test, the VM executor's model of the watchdog
(error record, sticky abort, check_errors / MegakernelHang, check=True recovery through Triton),
the ProgramMeta guard rails (ProgramMismatch lists every mismatch), and the vLLM adapter's hang
handling in compute_logits (eager step and a simulated FULL-graph replay).
The GPU side (the kernel really stopping, the CUDA context staying usable) is
tests/test_persistent_gpu.py::test_watchdog_stops_a_hung_program."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mk_plugin import reference as ref
from mk_plugin.config import DEFAULT_WATCHDOG_MS, ConfigError, MkConfig
from mk_plugin.decoding import DecodeInputs
from mk_plugin.persistent import encoding as enc
from mk_plugin.persistent import vm
from mk_plugin.persistent.backend import (
    MegakernelDecoder,
    ProgramMeta,
    meta_mismatches,
    program_meta,
)
from mk_plugin.persistent.errors import MegakernelHang, ProgramMismatch
from mk_plugin.persistent.header import generate_header
from mk_plugin.persistent.schedule import build_program
from mk_plugin.persistent.tuning import ScheduleTuning
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import assert_matches, make_decode_batch
from mk_plugin.weights import random_weights

ROOT = Path(__file__).resolve().parents[1]
# Small enough that a Triton recompute under the interpreter takes a few seconds.
SMALL = LlamaSpec(hidden_size=64, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=96,
                  vocab_size=80, name="small")


# ---- configuration and kernel-source guards ------------------------------------------------------------
def test_watchdog_budget_config():
    assert MkConfig.from_env({}).watchdog_ms == DEFAULT_WATCHDOG_MS == 2000
    assert MkConfig.from_env({"MK_WATCHDOG_MS": " 250 "}).watchdog_ms == 250
    for bad in ("0", "-5", "600001", "2s", "1.5"):
        with pytest.raises(ConfigError, match="MK_WATCHDOG_MS"):
            MkConfig.from_env({"MK_WATCHDOG_MS": bad})


def test_kernel_has_no_trap_no_float_atomics_and_bounded_waits():
    src = {p.name: p.read_text() for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cuh", ".h")}
    code = {n: re.sub(r"//[^\n]*", "", s) for n, s in src.items()}  # comments may mention them
    assert not any("__trap" in s for s in code.values())
    # Determinism: no floating-point atomics anywhere (reductions run in a fixed order); the only
    # atomics are the integer dependency counters (red.release.gpu.add.u32) and the error word's CAS.
    for n, s in code.items():
        assert not re.search(r"\b(atom|red)\.[\w.]*\.(f16|bf16|f32|f64)\b", s), n
        assert not re.search(r"\batomic(Add|Max|Min)\s*\(", s), n
    # Every polling loop lives in sync.cuh's bounded slow paths.
    for n, s in code.items():
        if n != "sync.cuh":
            assert not re.search(r"while\s*\(\s*!?\s*mbar_try_wait", s), n
            assert "ld_acquire_gpu(" not in s or n == "common.cuh", n
    assert "counter_wait_slow" in code["sync.cuh"] and "mbar_wait_slow" in code["sync.cuh"]
    names = [n for n, _ in enc.KERNEL_PARAMS]
    assert names[-3:] == ["err", "err_host", "watchdog_ms"]
    h = generate_header()
    assert "ERR_COUNTER_TIMEOUT = 1" in h and "constexpr int ERROR_WORDS = 16;" in h and "E_BUDGET_MS" in h


# ---- the deliberate corruption ---------------------------------------------------------------------------
def test_unsatisfiable_wait_is_rejected_by_the_checker(unsatisfiable_wait):
    p = build_program(LlamaSpec.tiny(), 3, 6, lm_head=True)
    vm.check_deadlock_free(p)
    bad = unsatisfiable_wait(p)
    with pytest.raises(vm.DeadlockError, match="signals add up to"):
        vm.check_deadlock_free(bad)
    vm.check_deadlock_free(p)  # the original is untouched
    tid = p.op_ranges["L1.gate_up"][0]
    bad2 = unsatisfiable_wait(p, tid)
    seg = bad2.segments[0]
    i = [t.tid for t in seg.tasks].index(tid)
    c, target = seg.waits[i][0]
    assert target == p.counters[c].total + 1
    with pytest.raises(ValueError, match="not a megakernel task"):
        unsatisfiable_wait(p, p.op_ranges["L0.qkv_rope"][0])  # layer 0's qkv waits on nothing


# ---- the VM executor's watchdog model --------------------------------------------------------------------
def _setup(spec, seq_lens, seed=0):
    w = random_weights(spec, seed=seed)
    b = make_decode_batch(spec, seq_lens, block_size=16, seed=seed + 1)
    cs = ref.rope_cos_sin_cache(spec, max(seq_lens) + 8)
    return w, b, cs, w.embed[b.input_ids]


def _call(dec, b, cs, hidden, caches, **kw):
    out = torch.full_like(hidden, float("nan"))
    lo = torch.full((hidden.shape[0], dec.spec.vocab_size), float("nan")) if dec.lm_head else None
    dec(hidden, b.positions, caches, b.block_table, b.seq_lens, b.slot_mapping, cs, out=out, logits_out=lo, **kw)
    return out, lo


def test_vm_watchdog_record_sticky_abort_and_check_errors(unsatisfiable_wait):
    spec = LlamaSpec.tiny()
    w, b, cs, hidden = _setup(spec, [21, 0, 40])
    dec = MegakernelDecoder(spec, w, 4, "cpu", num_sms=6, lm_head=True, watchdog_ms=150)
    good = dec.program(3)
    tid = good.op_ranges["L1.o_proj"][0]
    dec.install_program(unsatisfiable_wait(good, tid))
    out, _ = _call(dec, b, cs, hidden, b.clone_caches())          # no check: returns, nothing raised
    assert dec.pending_error() and not torch.isfinite(out).all()   # final_norm never ran
    rec = dec.error_record()
    seg = dec.program(3).segments[0]
    i = [t.tid for t in seg.tasks].index(tid)
    c, target = seg.waits[i][0]
    # The reporting waiter may be the corrupted task or one blocked behind it (as on the GPU, where
    # the first waiter to exceed the budget reports); either way its wait is really unsatisfied.
    assert rec["code"] == enc.ErrorCode.COUNTER_TIMEOUT and rec["batch"] == 3 and rec["budget_ms"] == 150
    assert rec["tid"] >= tid and rec["seen"] < rec["expected"] and 0 <= rec["sm"] < 6 and rec["task_index"] >= 0
    stuck = next(t for t in seg.tasks if t.tid == rec["tid"])
    assert (rec["counter"], rec["expected"]) in [(cc, tt) for cc, tt in seg.waits[seg.tasks.index(stuck)]]
    assert rec["opcode"] == stuck.opcode and rec["layer"] == stuck.op.layer

    with pytest.raises(MegakernelHang) as e:
        dec.check_errors(clear=False)
    h = e.value
    assert dec.pending_error()

    # sticky: while the record is set, launches do nothing (outputs stay poisoned)
    dec.install_program(good)
    out2, _ = _call(dec, b, cs, hidden, b.clone_caches())
    assert torch.isnan(out2).all()
    with pytest.raises(MegakernelHang):
        dec.check_errors()

    msg = str(h)
    for needle in (f"counter {rec['counter']} >= {rec['expected']}", f"{rec['seen']} seen", f"tid {rec['tid']}",
                   stuck.op.key, stuck.opcode.name, f"SM {rec['sm']}", "budget 150 ms", "batch 3", "COUNTER_TIMEOUT",
                   # the diagnosis names the root cause: the corrupted task's unsatisfiable wait
                   f"checker rejects this program: task {tid} waits for counter {c} >= {target}"):
        assert needle in msg, (needle, msg)
    assert (h.counter, h.expected, h.seen, h.op) == (rec["counter"], rec["expected"], rec["seen"], stuck.op.key)
    assert not h.recovered
    assert not dec.pending_error() and dec.error_record() is None and len(dec.hangs) == 2

    # cleared: the good program runs again, bit-identical to a fresh decoder (determinism)
    caches = b.clone_caches()
    out3, lo3 = _call(dec, b, cs, hidden, caches)
    fresh = MegakernelDecoder(spec, w, 4, "cpu", num_sms=6, lm_head=True)
    caches_f = b.clone_caches()
    out4, lo4 = _call(fresh, b, cs, hidden, caches_f)
    assert torch.equal(out3, out4) and torch.equal(lo3, lo4)
    assert all(torch.equal(x, y) for x, y in zip(caches, caches_f))


def test_check_true_recomputes_the_step_with_triton(unsatisfiable_wait):
    w, b, cs, hidden = _setup(SMALL, [13, 0, 30])
    hn, logits = ref.decode_step(SMALL, w, b.input_ids, b.positions, rcaches := b.clone_caches(), b.block_table,
                                 b.seq_lens, b.slot_mapping, cs)
    dec = MegakernelDecoder(SMALL, w, 4, "cpu", num_sms=5, lm_head=True)
    bad = unsatisfiable_wait(dec.program(3))
    dec.install_program(bad)
    caches = b.clone_caches()
    with pytest.raises(MegakernelHang) as e:
        out, lo = _call(dec, b, cs, hidden, caches, check=True)
    assert e.value.recovered and "recomputed with the Triton path" in str(e.value)
    assert not dec.pending_error()  # cleared by check=True
    # the outputs of the raising call are valid: rerun to get them (same buffers, same inputs)
    caches2 = b.clone_caches()
    out, lo = _call(dec, b, cs, hidden, caches2, check=True, on_hang="fallback")  # logs, returns
    assert len(dec.hangs) == 2 and dec.hangs[1].recovered
    assert_matches(out, hn, SMALL.torch_dtype, "step")
    assert_matches(lo, logits, SMALL.torch_dtype, "step")
    for got, want in zip(caches2, rcaches):  # the aborted launch's KV writes were all rewritten
        assert_matches(got, want, SMALL.torch_dtype, "step")
    with pytest.raises(ValueError, match="on_hang"):
        _call(dec, b, cs, hidden, caches2, check=True, on_hang="ignore")


# ---- guard rails -----------------------------------------------------------------------------------------
def test_program_mismatch_lists_every_mismatch():
    spec = LlamaSpec.tiny()
    w = random_weights(spec, seed=0)
    other = LlamaSpec(hidden_size=320, num_layers=2, name="other")
    p = build_program(other, 3, 6)
    dec = MegakernelDecoder(spec, w, 4, "cpu", num_sms=5, lm_head=True)
    with pytest.raises(ProgramMismatch) as e:
        dec.install_program(p)
    msg = str(e.value)
    assert len(e.value.mismatches) == 3 and "3 mismatches" in msg
    assert "model spec" in msg and "'other'" in msg and "SM count (grid): program 6, decoder 5" in msg
    assert "lm_head: program False, decoder True" in msg
    assert isinstance(e.value, ValueError)

    # header words are what is checked: a program whose words say another encoding version
    good = build_program(spec, 2, 5, lm_head=True)
    seg = good.segments[0]
    words = seg.encoded.copy()
    words[enc.H["version"]] = enc.VERSION - 1
    stale = replace(good, steps=[replace(seg, encoded=words)])
    with pytest.raises(ProgramMismatch, match=f"encoding version: program {enc.VERSION - 1}, decoder {enc.VERSION}"):
        dec.install_program(stale)
    dec.install_program(good)  # a matching program is accepted

    # a program cut into more KV chunks than the decoder's partial buffers hold is refused
    more = build_program(spec, 2, 5, lm_head=True, tuning=ScheduleTuning(attn_chunks=dec.attn_chunks(2) + 3))
    with pytest.raises(ProgramMismatch, match=f"attention chunks .*program {dec.attn_chunks(2) + 3}, decoder "
                                              f"{dec.attn_chunks(2)}"):
        dec.install_program(more)

    # the live device's limits (CUDA decoders pass them): all reported in one error
    meta = program_meta(build_program(spec, 2, 132, lm_head=True))
    want = replace(dec.expected_meta(2), num_sms=132, source_hash="0" * 16, attn_chunks=meta.attn_chunks)
    bad = meta_mismatches(meta, want, device_sms=114, device_smem=166912)
    assert len(bad) == 3 and any("kernel source hash" in m for m in bad)
    assert any("exceeds the device's 114 SMs" in m for m in bad)
    assert any(f"needs {enc.LAYOUT.smem_bytes} bytes per block, the device allows 166912" in m for m in bad)
    assert isinstance(meta, ProgramMeta) and meta.encoding_version == enc.VERSION and meta.batch == 2


def test_megakernel_hang_message_for_each_code():
    base = dict.fromkeys(enc.ERROR_FIELDS, 0) | {"sm": 7, "thread": 256, "batch": 8, "task_index": 3, "tid": 99,
                                                 "opcode": int(enc.Opcode.DOWN), "layer": 2, "budget_ms": 2000}
    m = str(MegakernelHang(base | {"code": int(enc.ErrorCode.MBAR_TIMEOUT), "counter": enc.MBAR_TAG_EMPTY + 4,
                                   "expected": 1, "seen": 40, "elapsed_us": 4000000}))
    assert "producer waiting for a free ring slot" in m and "slot 4" in m and "chunk 40" in m and "SM 7" in m
    m = str(MegakernelHang(base | {"code": int(enc.ErrorCode.BAD_PROGRAM), "task_index": -1,
                                   "seen": int(enc.HeaderCheck.SPEC_HASH | enc.HeaderCheck.NUM_QUEUES)}))
    assert "SPEC_HASH" in m and "NUM_QUEUES" in m and "no task" in m


# ---- the vLLM adapter ------------------------------------------------------------------------------------
def test_vllm_v2_runner_computes_logits_outside_the_full_graph():
    """The adapter's hang check lives in compute_logits because vLLM's V2 runner calls it in Python
    after replaying a FULL graph (the graph holds only the model forward)."""
    import importlib.util
    root = Path(importlib.util.find_spec("vllm").origin).parent / "v1" / "worker" / "gpu"
    runner = (root / "model_runner.py").read_text()
    execute = runner[runner.index("    def execute_model("):runner.index("    def sample_tokens(")]
    sample = runner[runner.index("    def sample(\n"):runner.index("    def ", runner.index("    def sample(\n") + 10)]
    assert "self.cudagraph_manager.run_fullgraph(" in execute and "compute_logits" not in execute
    assert "self.model.compute_logits(" in sample
    cg = (root / "cudagraph_utils.py").read_text()
    fwd = cg[cg.index("            def forward_fn(cg_mode"):cg.index("            return forward_fn, AttentionState")]
    assert "model(**model_inputs)" in fwd and "compute_logits" not in fwd


def test_adapter_switches_to_triton_and_recomputes_after_a_hang(monkeypatch, unsatisfiable_wait):
    pytest.importorskip("mk_plugin.triton_ops")
    from vllm_fakes import SPEC, bind_kv, fa_md, fwd_ctx, make_model, profile_run

    from mk_plugin import vllm_adapter as va

    warned: list[str] = []
    monkeypatch.setattr(va.logger, "warning", lambda fmt, *a: warned.append(fmt % a))
    model, w = make_model(monkeypatch, "megakernel")
    profile_run(model)
    st = model._mk_state
    mk = st.decoder
    assert st.backend == "megakernel" and isinstance(mk, MegakernelDecoder)
    mk.install_program(unsatisfiable_wait(mk.program(3)))
    cs = ref.rope_cos_sin_cache(SPEC, 4096).to(SPEC.torch_dtype)

    # an eager step hangs; compute_logits sees the record, switches, recomputes the step
    b = make_decode_batch(SPEC, [37, 5, 0], block_size=16, seed=1)
    rcaches = b.clone_caches()
    _, rlogits = ref.decode_step(SPEC, w, b.input_ids, b.positions, rcaches, b.block_table, b.seq_lens,
                                 b.slot_mapping, cs)
    bind_kv(model, b.kv_caches)
    st.out_buf.fill_(float("nan"))
    with fwd_ctx(fa_md(b)):
        out = model(b.input_ids, b.positions)
    assert mk.pending_error() and not torch.isfinite(out).all()
    logits = model.compute_logits(out[:3])
    assert_matches(logits[:2], rlogits[:2], SPEC.torch_dtype, "step")
    assert st.backend == "triton" and st.workspace is not None and mk.pending_error()  # record left set
    assert len(warned) == 1 and "MegakernelHang [COUNTER_TIMEOUT]" in warned[0] and "disabled" in warned[0]
    assert model.mk_status()["hang"].startswith("MegakernelHang") and model._mk_counts["recomputed"] == 1

    # a FULL-graph replay after the switch: forward does not run in Python, the captured megakernel
    # exits at once (sticky record); compute_logits recomputes from the graph's static tensors.
    b2 = make_decode_batch(SPEC, [9, 70, 0], block_size=16, seed=4)
    rcaches2 = b2.clone_caches()
    _, rlogits2 = ref.decode_step(SPEC, w, b2.input_ids, b2.positions, rcaches2, b2.block_table, b2.seq_lens,
                                  b2.slot_mapping, cs)
    bind_kv(model, b2.kv_caches)
    st.embed_buf[:3] = w.embed[b2.input_ids]          # what the replayed graph's embedding wrote
    st.out_buf.fill_(float("nan"))                     # what the exiting megakernel left
    model._mk_graph_calls[4] = va._DecodeCall(
        DecodeInputs(st.embed_buf[:3], b2.positions, b2.kv_caches, b2.block_table, b2.seq_lens, b2.slot_mapping,
                     st.cos_sin), st.out_buf[:3], "megakernel")
    logits2 = model.compute_logits(st.out_buf[:3].clone())
    assert_matches(logits2[:2], rlogits2[:2], SPEC.torch_dtype, "step")
    for got, want in zip(b2.kv_caches, rcaches2):
        for slot in b2.slot_mapping[:2].tolist():
            assert_matches(got[slot // 16, :, slot % 16], want[slot // 16, :, slot % 16], SPEC.torch_dtype, "op")
    assert model._mk_counts["recomputed"] == 2 and len(warned) == 1

    # a replay of a graph that MK_MODE=auto captured stock (marked None, a larger size than the megakernel's 4):
    # stock computed its rows, so nothing is recomputed
    model._mk_graph_calls[8] = None
    hidden = torch.ones(6, SPEC.hidden_size, dtype=SPEC.torch_dtype)
    assert torch.equal(model.compute_logits(hidden), hidden.float() @ w.lm_head.float().t())
    assert model._mk_counts["recomputed"] == 2
