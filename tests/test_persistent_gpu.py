"""Megakernel on the GPU vs the VM (op by op, through stop_after prefixes), vs the Triton decode path
and vs the fp32 reference (whole step), at Llama-3.2-1B and Llama-3.1-8B shapes with fewer layers,
batch 1/3/8/16, contexts 1..4096 not aligned to the block size, padded entries (seq_len 0, slot -1).
Also: CUDA-graph capture and replay, and Triton fallback segments. The helpers are tests/gpu_helpers.py's (the other
GPU modules share them), the weights fixture `models` conftest.py's."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from gpu_helpers import (
    DEV,
    MAX_CTX,
    assert_repeatable_step,
    assert_step_matches_ref_and_triton,
    gpu_batch,
    op_by_op_failures,
    ref_and_triton,
    run_mk,
    steps_equal,
)

from mk_plugin import reference as ref
from mk_plugin.persistent import vm
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.encoding import Buf
from mk_plugin.testing import assert_matches, compare

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name,layers,seq_lens", [
    ("tiny", 2, [5, 0, 37]),
    ("llama-3.2-1b", 2, [1, 0, 300, 77]),
    ("llama-3.2-1b", 2, [300]),   # batch 1: every linear op stages its activations whole
    # batch 8 and 16: every linear op's activations come through the column-group staging
    ("llama-3.2-1b", 1, [33, 0, 511, 17, 1, 250, 4000, 96]),
    ("llama-3.2-1b", 1, [7, 300, 0, 45, 1, 129, 2049, 64, 513, 3, 88, 1000, 0, 31, 160, 2]),
    ("llama-3.1-8b", 1, [129, 4000]),
])
def test_megakernel_vs_vm_op_by_op(models, mk_variant, name, layers, seq_lens):
    spec, w = models(name, layers)
    if mk_variant.w_tma:   # the A/B switch's build runs K % 64 == 0 models only (the decoder refuses the others)
        from mk_plugin.persistent.tensormap import check_weights_model
        try:
            check_weights_model(spec)
        except ValueError as e:
            pytest.skip(f"--mk-define MK_W_TMA=1: {e}")
    # tuning "off": the plain default program (the ring-fed attention's op-by-op run: test_ring_mma_gpu.py)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=mk_variant, tuning="off")
    failures = op_by_op_failures(dec, spec, w, gpu_batch(spec, seq_lens, seed=1))
    assert not failures, "first diverging op (GPU vs VM):\n" + "\n".join(failures)


@pytest.mark.parametrize("name,layers", [("llama-3.2-1b", 4), ("llama-3.1-8b", 2)])
@pytest.mark.parametrize("bsz", [1, 3, 8, 16])
def test_megakernel_whole_step(models, mk_variant, name, layers, bsz):
    spec, w = models(name, layers)
    rnd = random.Random(bsz * 7 + layers)
    seq_lens = [rnd.randint(1, MAX_CTX) for _ in range(bsz)]
    seq_lens[0] = rnd.choice([1, 17, 4095])
    if bsz >= 3:
        seq_lens[1] = 0                  # padded entry: seq_len 0, slot -1
    batch = gpu_batch(spec, seq_lens, seed=bsz)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=mk_variant)
    out, logits, caches = run_mk(dec, spec, w, batch, cs)
    assert_step_matches_ref_and_triton(spec, w, batch, cs, out, logits, caches)


def test_megakernel_cuda_graph_replay(models, mk_variant):
    spec, w = models("llama-3.2-1b", 2)
    seq_lens = [100, 0, 2049, 16, 1, 333, 4000, 64]
    batch = gpu_batch(spec, seq_lens, seed=5)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    dec = MegakernelDecoder(spec, w, 16, DEV, variant=mk_variant)
    dec.prepare([8])
    eager_out, _, eager_caches = run_mk(dec, spec, w, batch, cs)
    caches = [c.clone() for c in batch.kv_caches]
    hidden = w.embed[batch.input_ids]
    out = torch.empty_like(hidden)
    args = (hidden, batch.positions, caches, batch.block_table, batch.seq_lens, batch.slot_mapping, cs)
    dec(*args, out=out)  # warm-up on the capture inputs (kv pointer table)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        dec(*args, out=out)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        for c, c0 in zip(caches, batch.kv_caches):
            c.copy_(c0)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
        for a, b in zip(caches, eager_caches):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fallback", [frozenset({"attention"}), frozenset({"qkv_rope", "gate_up", "final_norm"})])
def test_megakernel_with_triton_fallback(models, mk_variant, fallback):
    spec, w = models("llama-3.2-1b", 2)
    seq_lens = [7, 0, 1500, 260, 3, 90, 1025, 31]
    batch = gpu_batch(spec, seq_lens, seed=9)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    full, _, fcaches = run_mk(MegakernelDecoder(spec, w, 16, DEV, variant=mk_variant), spec, w, batch, cs)
    part, _, pcaches = run_mk(MegakernelDecoder(spec, w, 16, DEV, fallback=fallback, variant=mk_variant), spec, w, batch, cs)
    assert_matches(part, full, spec.torch_dtype, "step")
    for a, b in zip(pcaches, fcaches):
        assert_matches(a, b, spec.torch_dtype, "step")


def test_watchdog_stops_a_hung_program(models, mk_variant, unsatisfiable_wait):
    """A deliberately corrupted program (one wait that can never be satisfied) on the GPU: the launch
    ends on its own (watchdog, no trap), the host raises MegakernelHang with the record, the CUDA
    context stays usable, check=True recomputes the step with Triton, a captured graph of the bad
    program replays without waiting again (sticky record), a program whose header fails the kernel's
    check is refused in-kernel, and afterwards the good program gives bit-identical results."""
    from mk_plugin.persistent.encoding import ErrorCode, H, HeaderCheck
    from mk_plugin.persistent.errors import MegakernelHang

    spec, w = models("llama-3.2-1b", 2)
    seq_lens = [100, 0, 2049, 16]
    batch = gpu_batch(spec, seq_lens, seed=11)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, watchdog_ms=200, variant=mk_variant)
    good_out, good_logits, good_caches = run_mk(dec, spec, w, batch, cs)
    assert not dec.pending_error()
    good = dec.program(len(seq_lens))
    dec.install_program(unsatisfiable_wait(good))

    # 1. unchecked: the launch ends by itself; the kernel wrote the pinned host mirror
    run_mk(dec, spec, w, batch, cs)  # synchronises: returns only because every CTA exited
    assert dec.pending_error()
    with pytest.raises(MegakernelHang) as e:
        dec.check_errors()
    h = e.value
    assert h.error_code == ErrorCode.COUNTER_TIMEOUT and h.seen < h.expected and h.budget_ms == 200
    assert h.elapsed_us >= 200_000 and 0 <= h.sm < dec.num_sms and h.tid >= 0 and h.op is not None
    assert "checker rejects this program" in str(h), str(h)
    assert not dec.pending_error()
    assert float((torch.ones(4, device=DEV) * 2).sum()) == 8.0  # the context is healthy

    # 2. check=True: the step is recomputed with Triton (outputs and KV valid), then raised
    caches = [c.clone() for c in batch.kv_caches]
    hidden = w.embed[batch.input_ids]
    out = torch.full_like(hidden, float("nan"))
    logits = torch.full((hidden.shape[0], spec.vocab_size), float("nan"), device=DEV)
    with pytest.raises(MegakernelHang) as e2:
        dec(hidden, batch.positions, caches, batch.block_table, batch.seq_lens, batch.slot_mapping, cs, out=out,
            logits_out=logits, check=True)
    assert e2.value.recovered
    hn, rlogits, rcaches, _, _ = ref_and_triton(spec, w, batch, cs)
    dt = spec.torch_dtype
    assert_matches(out, hn, dt, "step")
    assert_matches(logits, rlogits, dt, "step")
    for a, r in zip(caches, rcaches):
        assert_matches(a, r, dt, "step")

    # 3. a CUDA graph of the bad program: the first replay aborts, later replays exit at once
    args = (hidden, batch.positions, caches, batch.block_table, batch.seq_lens, batch.slot_mapping, cs)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        dec(*args, out=out, logits_out=logits)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    dec.clear_errors()  # capture does not run the kernel; start from a clean record
    g.replay()
    torch.cuda.synchronize()
    assert dec.pending_error()
    with pytest.raises(MegakernelHang):
        dec.check_errors(clear=False)
    out.fill_(float("nan"))
    g.replay()  # the record is still set: every CTA exits at once, nothing is written
    torch.cuda.synchronize()
    assert torch.isnan(out).all()
    dec.clear_errors()

    # 4. a header the kernel refuses (spec hash altered on the device, bypassing ProgramMismatch)
    dec.install_program(good)
    e_ = dec._entry(len(seq_lens))
    e_.seg_progs[0][H["spec_hash"]] += 1
    run_mk(dec, spec, w, batch, cs)
    rec = dec.error_record()
    assert rec["code"] == ErrorCode.BAD_PROGRAM and rec["seen"] & HeaderCheck.SPEC_HASH, rec
    dec.clear_errors()

    # 5. the good program afterwards: bit-identical to before the hangs (deterministic)
    dec.install_program(good)
    out2, logits2, caches2 = run_mk(dec, spec, w, batch, cs)
    assert torch.equal(out2, good_out) and torch.equal(logits2, good_logits)
    for a, b in zip(caches2, good_caches):
        assert torch.equal(a, b)
    assert not dec.pending_error()


@pytest.mark.parametrize("bsz", [1, 8, 16])
def test_tuned_programs_match_the_default(models, mk_variant, bsz):
    """Tunings (bench/autotune.py also checks each candidate it times): extreme splits and chunk
    counts, and the 5- and 4-stage ring variants, whose larger scratch stages activations the default
    kernel reads from L2 (batch 8: qkv_rope/o_proj/gate_up with 5 stages; batch 16, two batch
    n-tiles: with 4 stages, a staged path no default program takes), and the ring-fed attention for
    tasks of >= 128 / 100 tokens (the contexts put tasks on both paths). The output, logits and KV
    appends equal the default kernel's within the step tolerance."""
    from mk_plugin.persistent.tuning import ScheduleTuning
    spec, w = models("llama-3.2-1b", 4)
    seq_lens = ([1, 0, 4095, 260, 3, 90, 1025, 31] * 2)[:bsz] if bsz > 1 else [1337]
    batch = gpu_batch(spec, seq_lens, seed=11)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    base = run_mk(MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=mk_variant, tuning="off"),
                   spec, w, batch, cs)
    for t in (ScheduleTuning((("down", 0.25), ("gate_up", 3.0), ("lm_head", 0.5), ("o_proj", 0.5),
                              ("qkv_rope", 2.0)), attn_chunks=3, num_stages=5),
              ScheduleTuning((("down", 4.0), ("gate_up", 0.25), ("lm_head", 2.0), ("o_proj", 8.0),
                              ("qkv_rope", 0.125)), attn_chunks=32, num_stages=4),
              ScheduleTuning(num_stages=5), ScheduleTuning(attn_chunks=5, merge_in_partial=True),
              ScheduleTuning(ksplit=(("down", 4), ("o_proj", 2))),
              ScheduleTuning(att_tma=128), ScheduleTuning(attn_chunks=3, num_stages=5, att_tma=100)):
        dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=mk_variant, tuning={bsz: t})
        out, logits, caches = run_mk(dec, spec, w, batch, cs)
        assert dec.program(bsz).tuning == t
        assert_matches(out, base[0], spec.torch_dtype, "step")
        assert_matches(logits, base[1], spec.torch_dtype, "step")
        for a, b in zip(caches, base[2]):
            assert_matches(a, b, spec.torch_dtype, "step")


@pytest.mark.parametrize("bsz", [1, 3, 16])
def test_merge_in_partial_is_bitwise_the_combine_tasks(models, mk_variant, bsz):
    """tuning.merge_in_partial on the GPU: the last partial of each (b, g) to take its ticket merges, in
    the combine task's fixed order, so the step equals the combine-task program's bit for bit (same
    chunks), whichever SM finishes last; replayed to let a different one be last."""
    from mk_plugin.persistent.tuning import ScheduleTuning
    spec, w = models("llama-3.2-1b", 3)
    seq_lens = ([1, 0, 4095, 260, 3, 90, 1025, 31] * 2)[:bsz] if bsz > 1 else [777]
    batch = gpu_batch(spec, seq_lens, seed=13)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    tasks = ScheduleTuning(attn_chunks=4, merge_in_partial=False)   # combine tasks
    ref_out = run_mk(MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=mk_variant, tuning={bsz: tasks}),
                      spec, w, batch, cs)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=mk_variant, tuning={bsz: tasks.with_merge(True)})
    assert "ATTN_COMBINE" not in {t.opcode.name for t in dec.program(bsz).taskset.tasks}
    for _ in range(3):
        out, logits, caches = run_mk(dec, spec, w, batch, cs)
        assert torch.equal(out, ref_out[0]) and torch.equal(logits, ref_out[1])
        assert all(torch.equal(a, b) for a, b in zip(caches, ref_out[2]))


@pytest.mark.parametrize("name,layers,seq_lens,ksplit", [
    ("llama-3.2-1b", 2, [1, 0, 300], (("down", 4), ("o_proj", 2))),
    ("llama-3.2-1b", 1, [7, 300, 0, 45, 1, 129, 2049, 64, 513, 3, 88, 1000, 0, 31, 160, 2],
     (("down", 4), ("o_proj", 4))),
    # K = 14336 in 3 parts: 4768-column parts, so each part's last chunk is partial
    ("llama-3.1-8b", 1, [129, 4000, 5, 17, 33, 1, 2, 600, 9], (("down", 3),)),
])
def test_ksplit_matches_the_vm_and_repeats_bitwise(models, mk_variant, name, layers, seq_lens, ksplit):
    """o_proj/down cut over K (tuning.ksplit): the GPU step equals the VM's run of the same program within
    the step tolerance, and replays give the same bits whichever part of a range finishes last (the merge
    adds the parts in part order)."""
    from mk_plugin.persistent.tuning import ScheduleTuning
    spec, w = models(name, layers)
    bsz = len(seq_lens)
    batch = gpu_batch(spec, seq_lens, seed=17)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=mk_variant, tuning={bsz: ScheduleTuning(ksplit=ksplit)})
    prog = dec.program(bsz)
    assert sum(1 for t in prog.taskset.tasks if t.args[2] and t.op.name in ("o_proj", "down")) > 0
    out, logits, caches = run_mk(dec, spec, w, batch, cs)
    wc = w.to("cpu")
    bc = replace(batch, positions=batch.positions.cpu(), seq_lens=batch.seq_lens.cpu(),
                 block_table=batch.block_table.cpu(), slot_mapping=batch.slot_mapping.cpu())
    vcaches = [c.cpu() for c in batch.kv_caches]
    st = vm.make_state(prog, wc, wc.embed[bc.input_ids.cpu()], bc.positions, vcaches, bc.block_table, bc.seq_lens,
                       bc.slot_mapping, cs.cpu(), variant=dec.variant_for(bsz))
    vm.run(prog, st)
    for got, want, what in ((out, st.bufs[Buf.OUT], "out"), (logits, st.bufs[Buf.LOGITS], "logits"),
                            (dec.buffers(bsz)[Buf.RESID], st.bufs[Buf.RESID], "resid")):
        r = compare(got.float().cpu(), want.float(), spec.torch_dtype, "step")
        assert r["pass"], f"{what}: {r}"
    for _ in range(3):
        out2, logits2, caches2 = run_mk(dec, spec, w, batch, cs)
        assert torch.equal(out2, out) and torch.equal(logits2, logits)
        assert all(torch.equal(a, b) for a, b in zip(caches2, caches))


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b"])
@pytest.mark.parametrize("bsz,ksplit", [(1, ()), (5, (("down", 3),)), (9, ()), (16, (("o_proj", 3), ("down", 2)))])
def test_weight_tma_chunks_are_bitwise_the_row_copies(models, name, bsz, ksplit):
    """MK_W_TMA moves the same weight bytes into another shared-memory layout (one tensor-map copy per chunk,
    csrc/weight_tma.cuh): every MMA sees the same operands in the same order, so the step equals the default
    build's bit for bit, K-split tails (one copy per column group; 3 parts cut chunks short) and the LM head
    included."""
    from mk_plugin.persistent.tuning import ScheduleTuning
    from mk_plugin.persistent.variant import KernelVariant

    spec, w = models(name, 2)
    seq_lens = [(37 * i + 5) % 700 + 1 for i in range(bsz)]
    if bsz >= 3:
        seq_lens[1] = 0
    batch = gpu_batch(spec, seq_lens, seed=bsz + 11)
    cs = ref.rope_cos_sin_cache(spec, 800).to(DEV)
    tuning = {bsz: ScheduleTuning(ksplit=ksplit)} if ksplit else "off"
    runs = []
    for v in (KernelVariant(), KernelVariant(w_tma=True)):
        dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=v, tuning=tuning)
        runs.append(run_mk(dec, spec, w, batch, cs))
    assert steps_equal(*runs)
    assert_step_matches_ref_and_triton(spec, w, batch, cs, *runs[1])


@pytest.mark.parametrize("name,bsz", [("tiny", 1), ("tiny", 3), ("llama-3.2-1b", 1), ("llama-3.2-1b", 5),
                                      ("llama-3.2-1b", 7), ("llama-3.1-8b", 1), ("llama-3.1-8b", 2),
                                      ("llama-3.1-8b", 8)])
def test_one_ntile_fragments_match_the_reference(models, name, bsz):
    """The one-n-tile fragment build (x_frags.cuh: every lane loads a staged row, the padding zeroed by a select;
    MK_XFRAG until session 24, measured bitwise the former build's) at the shapes that exercise its edges: tiny
    (K = 256, one short chunk), 1B batch 1..5 (activations staged whole), 1B batch 7 and 8B batch 8 (column
    groups); the step and a second run of it are bitwise equal and match the fp32 reference and Triton."""
    spec, w = models(name, 2)
    seq_lens = [(53 * i + 9) % 600 + 1 for i in range(bsz)]
    batch = gpu_batch(spec, seq_lens, seed=bsz + 29)
    cs = ref.rope_cos_sin_cache(spec, 800).to(DEV)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off")
    assert_repeatable_step(dec, spec, w, batch, cs)


@pytest.mark.parametrize("name,parts", [("llama-3.2-1b", 4), ("llama-3.1-8b", 2)])
def test_piece_deps_are_bitwise_the_ksplit_program(models, name, parts):
    """tuning.piece_deps only changes which gate_up tasks each down part waits for (and gate_up's cut at the parts'
    boundaries): the same sums in the same order, so the step equals the K-split program's bit for bit."""
    from mk_plugin.persistent.tuning import ScheduleTuning

    spec, w = models(name, 2)
    batch = gpu_batch(spec, [300, 17, 1, 64, 0, 9, 33, 120, 5], seed=8)
    cs = ref.rope_cos_sin_cache(spec, 800).to(DEV)
    ks = ScheduleTuning(ksplit=(("down", parts),))
    runs = [run_mk(MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning={9: t}), spec, w, batch, cs)
            for t in (ks, ks.with_piece_deps(True))]
    assert steps_equal(*runs)


def test_a_tunings_weight_maps_and_cap_are_bitwise_the_default(models):
    """ScheduleTuning.w_tma / .inflight compile MK_W_TMA / MK_INFLIGHT into one batch's kernel: the weight maps are
    built when a tuning first asks for them (at construction, or by retune() on a decoder that had none), and the
    step equals the default build's bit for bit (same operands, same MMA order; the cap only delays copies)."""
    from mk_plugin.persistent.tuning import ScheduleTuning

    spec, w = models("llama-3.1-8b", 2)
    batch = gpu_batch(spec, [300, 17, 1], seed=5)
    cs = ref.rope_cos_sin_cache(spec, 800).to(DEV)
    base = MegakernelDecoder(spec, w, 4, DEV, lm_head=True, tuning="off")
    ref_run = run_mk(base, spec, w, batch, cs)
    tuned = MegakernelDecoder(spec, w, 4, DEV, lm_head=True, tuning={3: ScheduleTuning(w_tma=True, inflight=2)})
    assert tuned._wmaps is not None and tuned.variant_for(3).defines() == ("-DMK_W_TMA=1", "-DMK_INFLIGHT=2")
    base.retune(3, ScheduleTuning(w_tma=True))   # the maps arrive with the first tuning that copies by them
    assert base._wmaps is not None
    for dec in (tuned, base):
        o, lg, c = run_mk(dec, spec, w, batch, cs)
        assert torch.equal(o, ref_run[0]) and torch.equal(lg, ref_run[1])
        assert all(torch.equal(a, b) for a, b in zip(c, ref_run[2]))
