"""The VM runs the encoded program (queue interleaving + counters) and must equal the fp32
reference decode step: tightly in fp32, within TOLERANCES[bf16]["step"] in bf16. Prefixes
(stop_after) expose the intermediate buffers, compared with the reference's intermediates."""
from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import small_specs  # tests/strategies.py

from mk_plugin import reference as ref
from mk_plugin.persistent import vm
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.encoding import Buf, Rounding
from mk_plugin.persistent.schedule import build_program, check_ordering
from mk_plugin.persistent.tuning import DEFAULT_TUNING, ScheduleTuning
from mk_plugin.persistent.variant import KernelVariant
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import assert_matches, make_decode_batch
from mk_plugin.weights import random_weights

FP32_TIGHT = {"atol": 2e-5, "rtol": 2e-5}


def _setup(spec, seq_lens, dtype, seed=0, block_size=16):
    w = random_weights(spec, seed=seed, dtype=dtype)
    batch = make_decode_batch(spec, seq_lens, block_size=block_size, seed=seed + 1, dtype=dtype)
    cs = ref.rope_cos_sin_cache(spec, max(seq_lens + [1]) + 8)
    hidden = w.embed[batch.input_ids].to(dtype)
    return w, batch, cs, hidden


def _vm_step(spec, w, batch, cs, hidden, sms, *, lm_head=True, fallback=frozenset(), order="round_robin",
             seed=0, stop_after=None, tuning=DEFAULT_TUNING, variant=None):
    p = build_program(spec, hidden.shape[0], sms, lm_head=lm_head, fallback=fallback, tuning=tuning)
    caches = batch.clone_caches()
    st_ = vm.make_state(p, w, hidden, batch.positions, caches, batch.block_table, batch.seq_lens,
                        batch.slot_mapping, cs, variant=variant)
    vm.run(p, st_, order=order, seed=seed, stop_after=stop_after)
    return p, st_, caches


def _ref_step(spec, w, batch, cs):
    caches = batch.clone_caches()
    hn, logits = ref.decode_step(spec, w, batch.input_ids, batch.positions, caches, batch.block_table,
                                 batch.seq_lens, batch.slot_mapping, cs)
    return hn, logits, caches


def _assert_fp32_step_matches(st_, caches, ref_step) -> None:
    """The VM's hidden output, logits and every layer's cache against the fp32 reference step."""
    hn, logits, rcaches = ref_step
    torch.testing.assert_close(st_.bufs[Buf.OUT], hn, **FP32_TIGHT)
    torch.testing.assert_close(st_.bufs[Buf.LOGITS], logits, **FP32_TIGHT)
    for a, b in zip(caches, rcaches):
        torch.testing.assert_close(a, b, **FP32_TIGHT)


def test_vm_fp32_matches_reference_tightly():
    spec = LlamaSpec.tiny()
    w, batch, cs, hidden = _setup(spec, [5, 0, 37, 16], torch.float32)
    _, st_, caches = _vm_step(spec, w, batch, cs, hidden, sms=7)
    _assert_fp32_step_matches(st_, caches, _ref_step(spec, w, batch, cs))


def test_vm_bf16_matches_reference_within_step_tolerance():
    spec = LlamaSpec.tiny()
    w, batch, cs, hidden = _setup(spec, [1, 33, 0], torch.bfloat16, seed=3)
    _, st_, _ = _vm_step(spec, w, batch, cs, hidden, sms=132)
    hn, logits, _ = _ref_step(spec, w, batch, cs)
    assert_matches(st_.bufs[Buf.OUT], hn, torch.bfloat16, "step")
    assert_matches(st_.bufs[Buf.LOGITS], logits, torch.bfloat16, "step")


@settings(max_examples=8, deadline=None)
@given(small_specs(), st.lists(st.integers(0, 70), min_size=1, max_size=5), st.integers(1, 9),
       st.sampled_from([8, 16]))
def test_vm_random_specs_fp32(spec, seq_lens, sms, block_size):
    w, batch, cs, hidden = _setup(spec, seq_lens, torch.float32, block_size=block_size)
    _, st_, caches = _vm_step(spec, w, batch, cs, hidden, sms=sms, order="random", seed=sms)
    _assert_fp32_step_matches(st_, caches, _ref_step(spec, w, batch, cs))


def test_interleaving_does_not_change_results():
    """Tasks only read what their counters guarantee: any valid interleaving gives identical bits."""
    spec = LlamaSpec.tiny()
    w, batch, cs, hidden = _setup(spec, [9, 40, 2], torch.bfloat16, seed=5)
    _, a, ca = _vm_step(spec, w, batch, cs, hidden, sms=5)
    _, b, cb = _vm_step(spec, w, batch, cs, hidden, sms=5, order="random", seed=11)
    assert torch.equal(a.bufs[Buf.OUT], b.bufs[Buf.OUT]) and torch.equal(a.bufs[Buf.LOGITS], b.bufs[Buf.LOGITS])
    assert all(torch.equal(x, y) for x, y in zip(ca, cb))


def test_merge_in_partial_gives_the_combine_tasks_bits():
    """tuning.merge_in_partial: no combine task; the last partial of each (b, g) merges. Whichever chunk
    finishes last (round robin, random orders, a fallback segment around attention), the step's bits are
    the combine tasks'; the program passes the ordering and deadlock checks."""
    spec = LlamaSpec.tiny()
    w, batch, cs, hidden = _setup(spec, [9, 40, 0, 17], torch.bfloat16, seed=7)
    chunks = ScheduleTuning(attn_chunks=3, merge_in_partial=False)
    merged = chunks.with_merge(True)
    p0, a, ca = _vm_step(spec, w, batch, cs, hidden, sms=6, tuning=chunks)
    for order, seed, fb in (("round_robin", 0, frozenset()), ("random", 3, frozenset()), ("random", 8, frozenset()),
                            ("random", 5, frozenset({"o_proj"}))):
        p, b, cb = _vm_step(spec, w, batch, cs, hidden, sms=6, tuning=merged, order=order, seed=seed, fallback=fb)
        assert torch.equal(a.bufs[Buf.OUT], b.bufs[Buf.OUT]) and torch.equal(a.bufs[Buf.LOGITS], b.bufs[Buf.LOGITS])
        assert all(torch.equal(x, y) for x, y in zip(ca, cb))
        check_ordering(p)
        vm.check_deadlock_free(p)
    ops = [t.opcode.name for t in p.taskset.tasks]
    assert "ATTN_COMBINE" in [t.opcode.name for t in p0.taskset.tasks] and "ATTN_COMBINE" not in ops
    parts = [t for t in p.taskset.tasks if t.opcode.name == "ATTN_PARTIAL"]
    assert parts and all(t.ticket is not None and t.record()[-1] == t.ticket for t in parts)
    assert len({t.ticket for t in parts}) == spec.num_layers * 4 * spec.num_kv_heads
    assert all(t.record()[-1] == -1 for t in p0.taskset.tasks)


@settings(max_examples=6, deadline=None)
@given(small_specs(), st.lists(st.integers(0, 70), min_size=1, max_size=5), st.integers(1, 9), st.integers(2, 5),
       st.integers(0, 50))
def test_merge_in_partial_random_specs(spec, seq_lens, sms, chunks, seed):
    """Odd shapes (GQA groups, head sizes, contexts that are not multiples of a block, empty requests):
    merging in the last partial gives the combine tasks' bits under a random interleaving."""
    w, batch, cs, hidden = _setup(spec, seq_lens, torch.bfloat16, seed=seed % 7)
    t = ScheduleTuning(attn_chunks=chunks, merge_in_partial=False)
    _, a, ca = _vm_step(spec, w, batch, cs, hidden, sms=sms, tuning=t)
    _, b, cb = _vm_step(spec, w, batch, cs, hidden, sms=sms, tuning=t.with_merge(True), order="random", seed=seed)
    assert torch.equal(a.bufs[Buf.OUT], b.bufs[Buf.OUT]) and torch.equal(a.bufs[Buf.LOGITS], b.bufs[Buf.LOGITS])
    assert all(torch.equal(x, y) for x, y in zip(ca, cb))


def test_merge_in_partial_with_one_chunk_is_the_default_program():
    spec = LlamaSpec.tiny()
    one = ScheduleTuning(attn_chunks=1, merge_in_partial=False)
    a = build_program(spec, 2, 5, tuning=one)
    b = build_program(spec, 2, 5, tuning=one.with_merge(True))
    assert all((x.encoded == y.encoded).all() for x, y in zip(a.segments, b.segments))


def test_stop_after_exposes_intermediates():
    """Bisection: after L0.qkv_rope the cache holds roped K / raw V and Q the roped q; after
    L0.attention ATTN_O is the attention output; nothing past the prefix has run."""
    spec = LlamaSpec.tiny()
    w, batch, cs, hidden = _setup(spec, [7, 0, 21], torch.float32, seed=2)
    p = build_program(spec, 3, 6)
    lw = w.layers[0]
    a, _ = ref.rms_norm(hidden, lw.input_norm, spec.rms_eps)
    q, k, v = ref.linear(a, lw.qkv).split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    q = ref.apply_rope(q.view(3, spec.num_q_heads, spec.head_dim), batch.positions, cs)
    k = ref.apply_rope(k.view(3, spec.num_kv_heads, spec.head_dim), batch.positions, cs)
    rc = batch.clone_caches()
    ref.kv_append(k, v.view(3, spec.num_kv_heads, spec.head_dim), rc[0], batch.slot_mapping)
    attn = ref.paged_attention(q, rc[0], batch.block_table, batch.seq_lens, spec.head_dim ** -0.5)

    _, st1, c1 = _vm_step(spec, w, batch, cs, hidden, sms=6, lm_head=False, stop_after=p.op_end("L0.qkv_rope"))
    torch.testing.assert_close(st1.bufs[Buf.Q].view(3, -1, spec.head_dim), q, **FP32_TIGHT)
    torch.testing.assert_close(c1[0], rc[0], **FP32_TIGHT)
    assert torch.equal(c1[1], batch.kv_caches[1]) and torch.isnan(st1.bufs[Buf.ATTN_O]).all()
    assert st1.executed and max(st1.executed) < p.op_end("L0.qkv_rope")

    _, st2, _ = _vm_step(spec, w, batch, cs, hidden, sms=6, lm_head=False, stop_after=p.op_end("L0.attention"))
    torch.testing.assert_close(st2.bufs[Buf.ATTN_O].view(3, -1, spec.head_dim), attn, **FP32_TIGHT)
    assert torch.isnan(st2.bufs[Buf.RESID]).all()


def test_backend_vm_executor_with_triton_fallback():
    """MegakernelDecoder on the CPU: megakernel segments on the VM, fallback ops through the Triton
    kernels (interpreter) on the same buffers; equals the reference within the bf16 step tolerance."""
    spec = LlamaSpec.tiny()
    w, batch, cs, hidden = _setup(spec, [4, 0, 19], torch.bfloat16, seed=7)
    hn, logits, rcaches = _ref_step(spec, w, batch, cs)
    for fb in (frozenset(), frozenset({"attention", "final_norm"})):
        dec = MegakernelDecoder(spec, w, 4, "cpu", fallback=fb, lm_head=True, num_sms=6)
        caches = batch.clone_caches()
        out = torch.full_like(hidden, float("nan"))
        lo = torch.full((3, spec.vocab_size), float("nan"))
        dec(hidden, batch.positions, caches, batch.block_table, batch.seq_lens, batch.slot_mapping, cs,
            out=out, logits_out=lo)
        assert_matches(out, hn, torch.bfloat16, "step")
        assert_matches(lo, logits, torch.bfloat16, "step")
        for a, b in zip(caches, rcaches):
            assert_matches(a, b, torch.bfloat16, "step")


class _FakeModule:
    """Stands in for runtime.MegakernelModule on the CPU: checks the launch arguments by name
    (pointer tables, buffers, scalars) and runs the program on the VM with exactly those tensors."""

    def __init__(self, dec: MegakernelDecoder, caches: list[torch.Tensor], cs: torch.Tensor):
        self.dec, self.caches, self.cs, self.launches = dec, caches, cs, 0

    def launch(self, device, num_queues, args):
        from mk_plugin.persistent.encoding import KERNEL_PARAMS, LP_COUNT, LayerPtr, ModelPtr, decode
        from mk_plugin.persistent.schedule import Segment
        assert set(args) == {n for n, _ in KERNEL_PARAMS}
        dec = self.dec
        prog = args["prog"].numpy()
        dp = decode(prog)
        assert dp.header["num_queues"] == num_queues == dec.num_sms
        w = args["wptr"].tolist()
        for li, lw in enumerate(dec.weights.layers):
            row = w[li * LP_COUNT:(li + 1) * LP_COUNT]
            assert row[LayerPtr.QKV] == lw.qkv.data_ptr() and row[LayerPtr.DOWN] == lw.down.data_ptr()
            assert row[LayerPtr.O] == lw.o.data_ptr() and row[LayerPtr.GATE_UP] == lw.gate_up.data_ptr()
            assert row[LayerPtr.IN_NORM] == lw.input_norm.data_ptr()
            assert row[LayerPtr.POST_NORM] == lw.post_norm.data_ptr()
        last = w[len(dec.weights.layers) * LP_COUNT:]
        assert last[ModelPtr.FINAL_NORM] == dec.weights.final_norm.data_ptr()
        assert last[ModelPtr.LM_HEAD] == dec.weights.lm_head.data_ptr()
        assert args["kvptr"].tolist() == [c.data_ptr() for c in self.caches]
        assert args["cs_rows"] == self.cs.shape[0] and args["cs_stride"] == self.cs.stride(0)
        assert args["cs_f32"] == 1 and args["block_size"] == self.caches[0].shape[2]
        assert args["bt_stride"] == args["block_table"].stride(0)
        names = {Buf.HIDDEN_IN: "hidden_in", Buf.RESID: "resid", Buf.Q: "q", Buf.ATTN_O: "attn_o",
                 Buf.ACT: "act", Buf.OUT: "out", Buf.LOGITS: "logits", Buf.PART_O: "part_o",
                 Buf.PART_ML: "part_ml", Buf.PART_K: "part_k"}
        b = dp.header["batch"]
        bufs = {k: args[n] for k, n in names.items()}
        st_ = vm.VMState(dec.spec, b, dp.header["attn_chunks"], dec.weights, bufs, self.caches, args["positions"],
                         args["slots"], args["seq_lens"], args["block_table"], args["cos_sin"],
                         [0] * int(args["counters"].numel()))
        vm.run_segment(Segment([], [], [], [], prog), st_)
        self.launches += 1


def test_cuda_launch_path_plumbing():
    """backend._run_cuda with a fake launcher: every kernel argument (by name) is the tensor / value
    it must be, the weight and kv pointer tables hold the right addresses in the right slots, and
    running the launched programs gives the reference result (segments + Triton fallback)."""
    spec = LlamaSpec.tiny()
    w, batch, cs, hidden = _setup(spec, [6, 0, 30], torch.bfloat16, seed=4)
    hn, logits, _ = _ref_step(spec, w, batch, cs)
    dec = MegakernelDecoder(spec, w, 4, "cpu", lm_head=True, num_sms=5, fallback=frozenset({"o_proj"}),
                            class_builds=False)   # every batch size on the one fake kernel
    dec.executor = "cuda"
    dec._wptr = dec._weight_table()
    caches = batch.clone_caches()
    dec._module = fake = _FakeModule(dec, caches, cs)
    dec._modules[dec.variant] = fake   # the kernel of the default tuning's ring depth
    lo = torch.full((3, spec.vocab_size), float("nan"))
    out = dec(hidden, batch.positions, caches, batch.block_table, batch.seq_lens, batch.slot_mapping, cs,
              logits_out=lo)
    assert fake.launches == 3  # [L0 qkv, attn] o_proj [L0 gate_up .. L1 attn] o_proj [L1 gate_up .. lm_head]
    assert_matches(out, hn, torch.bfloat16, "step")
    assert_matches(lo, logits, torch.bfloat16, "step")


# ---- rounding points (encoding.Rounding, -DMK_ROUNDING; csrc stock_rnd / norm_elem) ---------------
def _vm_step_rounding(spec, w, batch, cs, hidden, rounding, stop_after=None):
    p = build_program(spec, hidden.shape[0], 132, lm_head=True)
    caches = batch.clone_caches()
    st_ = vm.make_state(p, w, hidden, batch.positions, caches, batch.block_table, batch.seq_lens,
                        batch.slot_mapping, cs, variant=KernelVariant(rounding=rounding))
    vm.run(p, st_, stop_after=stop_after)
    return p, st_, caches


def test_stock_rounding_stays_within_the_step_tolerance_and_differs_from_fused():
    spec = LlamaSpec.tiny()
    w, batch, cs, hidden = _setup(spec, [1, 33, 0], torch.bfloat16, seed=3)
    _, fused, _ = _vm_step_rounding(spec, w, batch, cs, hidden, Rounding.FUSED)
    _, stock, _ = _vm_step_rounding(spec, w, batch, cs, hidden, Rounding.STOCK)
    hn, logits, _ = _ref_step(spec, w, batch, cs)
    assert_matches(stock.bufs[Buf.OUT], hn, torch.bfloat16, "step")
    assert_matches(stock.bufs[Buf.LOGITS], logits, torch.bfloat16, "step")
    assert not torch.equal(stock.bufs[Buf.OUT], fused.bufs[Buf.OUT])  # the switch changes the arithmetic


def test_stock_rounding_is_a_no_op_in_fp32():
    spec = LlamaSpec.tiny()
    w, batch, cs, hidden = _setup(spec, [5, 0, 37], torch.float32)
    _, fused, _ = _vm_step_rounding(spec, w, batch, cs, hidden, Rounding.FUSED)
    _, stock, _ = _vm_step_rounding(spec, w, batch, cs, hidden, Rounding.STOCK)
    assert torch.equal(stock.bufs[Buf.LOGITS], fused.bufs[Buf.LOGITS])


def test_stock_rounding_points_of_layer_0():
    """Layer 0 under STOCK against explicit torch formulas: q = round(rope(round(xn @ Wq^T))) with
    xn = round(round(x * rstd) * w); RESID = round(h + round(attn_o @ Wo^T)); ACT = round(silu(round(g))
    * round(u)). Compared bitwise on the VM's own inputs of each op."""
    spec = LlamaSpec.tiny()
    dt = torch.bfloat16
    w, batch, cs, hidden = _setup(spec, [9, 20], dt, seed=5)
    p, _, _ = _vm_step_rounding(spec, w, batch, cs, hidden, Rounding.STOCK)
    lw = w.layers[0]

    def rd(t):
        return t.to(dt).float()

    def normed(x, nw):
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + spec.rms_eps)
        return rd(rd(xf * r) * nw.float())

    # qkv_rope: q of every head
    _, st_q, _ = _vm_step_rounding(spec, w, batch, cs, hidden, Rounding.STOCK, stop_after=p.op_end("L0.qkv_rope"))
    q = rd(normed(hidden, lw.input_norm) @ lw.qkv[: spec.q_size].float().t())
    d, half = spec.head_dim, spec.head_dim // 2
    c = cs.float()[batch.positions.long()]
    q = q.view(q.shape[0], spec.num_q_heads, d)
    cos, sin = c[:, None, :half], c[:, None, half:]
    q1, q2 = q[..., :half], q[..., half:]
    want_q = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1).reshape(q.shape[0], -1).to(dt)
    assert torch.equal(st_q.bufs[Buf.Q], want_q)
    # o_proj: residual add of the rounded GEMM output
    _, st_a, _ = _vm_step_rounding(spec, w, batch, cs, hidden, Rounding.STOCK, stop_after=p.op_end("L0.attention"))
    _, st_o, _ = _vm_step_rounding(spec, w, batch, cs, hidden, Rounding.STOCK, stop_after=p.op_end("L0.o_proj"))
    want_r = (hidden.float() + rd(st_a.bufs[Buf.ATTN_O].float() @ lw.o.float().t())).to(dt)
    assert torch.equal(st_o.bufs[Buf.RESID], want_r)
    # gate_up: silu(round(g)) * round(u), both from the double-rounded norm
    _, st_g, _ = _vm_step_rounding(spec, w, batch, cs, hidden, Rounding.STOCK, stop_after=p.op_end("L0.gate_up"))
    xn = normed(st_o.bufs[Buf.RESID], lw.post_norm)
    i = spec.intermediate_size
    g, u = rd(xn @ lw.gate_up[:i].float().t()), rd(xn @ lw.gate_up[i:].float().t())
    assert torch.equal(st_g.bufs[Buf.ACT], (g / (1.0 + torch.exp(-g)) * u).to(dt))


def test_piece_deps_give_the_ksplit_programs_bits():
    """tuning.piece_deps with down cut over K: gate_up's tasks cut at down's part boundaries, one counter per
    piece, and each down part waits for its piece only. Under random interleavings (a down part may now run
    before the other pieces of gate_up) the step's bits are the K-split program's; the program passes the
    ordering and deadlock checks, and each part's wait is exactly the tasks that wrote its ACT columns."""
    from mk_plugin.persistent.encoding import ksplit_parts, ksplit_range
    from mk_plugin.persistent.tasks import gate_up_pieces

    spec = LlamaSpec.tiny()
    w, batch, cs, hidden = _setup(spec, [9, 40, 0], torch.bfloat16, seed=3)
    ks = ScheduleTuning(ksplit=(("down", 3),))
    _, a, ca = _vm_step(spec, w, batch, cs, hidden, sms=7, tuning=ks)
    for order, seed, fb in (("round_robin", 0, frozenset()), ("random", 4, frozenset()), ("random", 9, frozenset()),
                            ("random", 2, frozenset({"o_proj"}))):
        p, b, cb = _vm_step(spec, w, batch, cs, hidden, sms=7, tuning=ks.with_piece_deps(True), order=order,
                            seed=seed, fallback=fb)
        assert torch.equal(a.bufs[Buf.OUT], b.bufs[Buf.OUT]) and torch.equal(a.bufs[Buf.LOGITS], b.bufs[Buf.LOGITS])
        assert all(torch.equal(x, y) for x, y in zip(ca, cb))
        check_ordering(p)
        vm.check_deadlock_free(p)
    ts = p.taskset
    pieces = gate_up_pieces(spec, ks.with_piece_deps(True))
    assert len(pieces) == 3 and sum(n for _, n in pieces) == spec.intermediate_size // 16
    for layer in range(spec.num_layers):
        lo, hi = ts.op_ranges[f"L{layer}.gate_up"]
        signals = {}
        for t in ts.tasks[lo:hi]:
            signals.setdefault(t.signal[0], []).append(t)
        assert len(signals) == 3   # one counter per piece, each task inside one piece
        dlo, dhi = ts.op_ranges[f"L{layer}.down"]
        for t in ts.tasks[dlo:dhi]:
            (ctr, target), = t.waits
            k0, k1 = ksplit_range(spec.intermediate_size, *ksplit_parts(t.args[2]))
            writers = signals[ctr]
            assert target == ts.counters[ctr].total == sum(x.args[1] for x in writers)
            assert min(x.args[0] for x in writers) * 16 == k0 and max(x.args[0] + x.args[1] for x in writers) * 16 == k1
    # without a down K-split there is nothing to cut at: the default program
    plain = build_program(spec, 3, 7, tuning=ScheduleTuning(piece_deps=True))
    assert [x.record() for x in plain.taskset.tasks] == [x.record() for x in build_program(spec, 3, 7).taskset.tasks]


def test_layout_staged_fits_mirrors_the_kernel():
    """KernelLayout.staged_fits is csrc/x_frags.cuh's staged_fits: 1B (K 2048) stages x whole up to batch 6 and 8B
    (K 4096) up to batch 2 with the norm row at 6 stages (session 26: MK_RSTD_EPI applies at 1B >= 7, 8B >= 3)."""
    from pathlib import Path

    from mk_plugin.persistent.encoding import LAYOUT
    src = (Path(__file__).resolve().parents[1] / "csrc" / "x_frags.cuh").read_text()
    assert "constexpr int STAGE_PART_BYTES = 4 * CONSUMER_WARPS * MAX_BATCH;" in src
    assert "return (B + (norm ? 1 : 0)) * (K * 2 + 16) <= UNION_BYTES - STAGE_PART_BYTES;" in src
    assert "if (MK_X_GROUPS) return false;" in src   # the A/B switch: never staged whole (KernelVariant.stages_x_whole)
    assert [b for b in range(1, 17) if LAYOUT.staged_fits(2048, b, True)] == list(range(1, 7))
    assert [b for b in range(1, 17) if LAYOUT.staged_fits(4096, b, True)] == [1, 2]
    assert LAYOUT.staged_fits(2048, 7, False) and not LAYOUT.staged_fits(2048, 8, False)
    assert LAYOUT.with_stages(4).staged_fits(2048, 16, True)   # 96.5 KiB of scratch
    assert KernelVariant().stages_x_whole(2048, 3, True) and not KernelVariant(x_groups=True).stages_x_whole(2048, 1, False)
    assert not KernelVariant(num_stages=4, x_groups=True).stages_x_whole(2048, 16, True)


# K = 2048 (1B's hidden size) on one small layer: x is staged whole up to batch 6, by column groups above
_WIDE = LlamaSpec(name="wide", hidden_size=2048, intermediate_size=320, num_layers=1, num_q_heads=4, num_kv_heads=2,
                  head_dim=64, vocab_size=97)


def _variant_bits(w, batch, cs, hidden, variant: KernelVariant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_WIDE's VM step (5 SMs, LM head) under `variant`: (OUT, LOGITS, layer 0's cache), to compare builds' bits."""
    _, st_, caches = _vm_step(_WIDE, w, batch, cs, hidden, 5, variant=variant)
    return st_.bufs[Buf.OUT].clone(), st_.bufs[Buf.LOGITS].clone(), caches[0].clone()


def test_vm_models_x_groups_with_rstd_epi_at_small_batches():
    """MK_X_GROUPS (session 47, A/B switch): x never staged whole, so MK_RSTD_EPI's epilogue also applies at a batch whose
    x would be (batch 3 of K 2048); without rstd_epi the column groups' x' is the staged path's: bitwise the default."""
    spec = _WIDE
    w, batch, cs, hidden = _setup(spec, [9, 30, 1], torch.bfloat16)
    outs = {v: _variant_bits(w, batch, cs, hidden, v) for v in (
        KernelVariant(), KernelVariant(x_groups=True), KernelVariant(rstd_epi=True), KernelVariant(rstd_epi=True, x_groups=True))}
    base = outs[KernelVariant()]
    assert all(torch.equal(a, b) for a, b in zip(base, outs[KernelVariant(x_groups=True)]))
    assert all(torch.equal(a, b) for a, b in zip(base, outs[KernelVariant(rstd_epi=True)]))   # staged at batch 3
    epi = outs[KernelVariant(rstd_epi=True, x_groups=True)]
    assert not all(torch.equal(a, b) for a, b in zip(base, epi))
    hn, logits, _ = _ref_step(spec, w, batch, cs)
    assert_matches(epi[0], hn, torch.bfloat16, "step")
    assert_matches(epi[1], logits, torch.bfloat16, "step")


def test_vm_models_rstd_epi_where_the_kernel_takes_it():
    """MK_RSTD_EPI (session 26, A/B switch): where a norm-fused op's x is not staged whole the kernel's B operand is
    round(x * w) and the sums take 1/rms in the epilogue. The VM with rstd_epi: not bitwise the default there, both
    within the bf16 step tolerance of the fp32 reference; bitwise the default where x is staged (batch 3, or 4 ring
    stages) and under att_tma / num_stages it passes through."""
    spec = _WIDE
    for seq_lens, stages, applies in (([9, 30, 1, 17, 44, 3, 60, 2], 6, True), ([9, 30, 1], 6, False),
                                      ([9, 30, 1, 17, 44, 3, 60, 2], 4, False)):
        w, batch, cs, hidden = _setup(spec, seq_lens, torch.bfloat16)
        outs = {epi: _variant_bits(w, batch, cs, hidden, KernelVariant(rstd_epi=epi, num_stages=stages))
                for epi in (False, True)}
        same = all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
        assert same != applies, (seq_lens, stages)
        hn, logits, _ = _ref_step(spec, w, batch, cs)
        assert_matches(outs[True][0], hn, torch.bfloat16, "step")
        assert_matches(outs[True][1], logits, torch.bfloat16, "step")
        if applies:   # the CPU decoder runs the VM with its batch's variant: MK_RSTD_EPI included
            dec = MegakernelDecoder(spec, w, 8, "cpu", lm_head=True, num_sms=5, variant=KernelVariant(rstd_epi=True))
            out = torch.full_like(hidden, float("nan"))
            dec(hidden, batch.positions, batch.clone_caches(), batch.block_table, batch.seq_lens, batch.slot_mapping,
                cs, out=out)
            assert torch.equal(out, outs[True][0])


def test_vm_models_the_wgmma_paths_rstd_epilogue():
    """MK_WGA_X (session 30): where a norm-fused op takes MK_WGMMA_A's path (batch > 8, K a multiple of 256 columns) the
    kernel's B operand is round(x * w) and its sums take 1/rms in the epilogue, as MK_RSTD_EPI's. The VM with wga_x:
    not bitwise the default at batch 10, bitwise it at batch 8 (one n-tile: the default path), within the bf16 step
    tolerance of the fp32 reference; the CPU decoder runs the VM with the same variant."""
    spec = _WIDE
    wa = KernelVariant(w_tma=True, wgmma_a=4)
    for seq_lens, applies in (([9, 30, 1, 17, 44, 3, 60, 2, 21, 5], True), ([9, 30, 1, 17, 44, 3, 60, 2], False)):
        w, batch, cs, hidden = _setup(spec, seq_lens, torch.bfloat16)
        outs = {x: _variant_bits(w, batch, cs, hidden, replace(wa, wga_x=x)) for x in (0, 1)}
        same = all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
        assert same != applies, seq_lens
        hn, logits, _ = _ref_step(spec, w, batch, cs)
        assert_matches(outs[1][0], hn, torch.bfloat16, "step")
        assert_matches(outs[1][1], logits, torch.bfloat16, "step")
        if applies:
            dec = MegakernelDecoder(spec, w, 16, "cpu", lm_head=True, num_sms=5, variant=replace(wa, wga_x=1))
            out = torch.full_like(hidden, float("nan"))
            dec(hidden, batch.positions, batch.clone_caches(), batch.block_table, batch.seq_lens, batch.slot_mapping,
                cs, out=out)
            assert torch.equal(out, outs[1][0])
