"""The encoding is the single source of truth: csrc/tasks.h must equal its generator output, the
program format must round-trip, and the layout constants must fit the hardware."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mk_plugin.persistent import encoding as enc
from mk_plugin.persistent.header import generate_header
from mk_plugin.persistent.schedule import build_program
from mk_plugin.spec import LlamaSpec

ROOT = Path(__file__).resolve().parents[1]


def test_committed_header_equals_generator():
    committed = (ROOT / "csrc" / "tasks.h").read_text()
    assert committed == generate_header(), (
        "csrc/tasks.h is stale: regenerate it with\n  python -c \"from mk_plugin.persistent.header "
        "import generate_header; open('csrc/tasks.h','w').write(generate_header())\"")


def test_header_mentions_every_enum_and_field():
    h = generate_header()
    for op in enc.Opcode:
        assert f"OP_{op.name} = {int(op)}" in h
    for b in enc.Buf:
        assert f"BUF_{b.name} = {int(b)}" in h
    for i, f in enumerate(enc.TASK_FIELDS):
        assert f"constexpr int F_{f.upper()} = {i};" in h
    assert f"constexpr int SMEM_BYTES = {enc.LAYOUT.smem_bytes};" in h
    assert len(enc.TASK_FIELDS) == enc.TASK_WORDS and len(enc.HEADER_FIELDS) == enc.HEADER_WORDS


def test_layout_fits_sm90():
    lay = enc.LAYOUT
    assert lay.smem_bytes <= enc.SMEM_LIMIT
    assert lay.acc_tiles == lay.consumer_warps  # one accumulator tile per warp in the epilogue
    assert lay.slot_bytes == 16 * lay.row_bytes and lay.slot_bytes % 128 == 0
    assert (lay.row_bytes // 16) % 2 == 1        # ldmatrix rows hit distinct bank groups
    assert lay.chunk_cols * 2 >= 2048            # bulk copies of >= 2 KiB per row


records = st.lists(st.lists(st.integers(-2**31, 2**31 - 1), min_size=enc.TASK_WORDS, max_size=enc.TASK_WORDS),
                   min_size=0, max_size=40)


@settings(max_examples=30, deadline=None)
@given(records, st.integers(1, 9), st.integers(1, 16), st.integers(1, 32), st.randoms(use_true_random=False))
def test_encode_decode_roundtrip(recs, nq, batch, chunks, rnd):
    order = list(range(len(recs)))
    rnd.shuffle(order)
    queues = [[] for _ in range(nq)]
    for i in order:
        queues[rnd.randrange(nq)].append(i)
    prog = enc.encode(recs, queues, batch=batch, attn_chunks=chunks, spec_hash=123)
    assert prog.dtype == np.int32
    assert enc.tasks_offset(nq) % enc.TASK_WORDS == 0
    dp = enc.decode(prog)
    assert dp.header["batch"] == batch and dp.header["attn_chunks"] == chunks
    assert dp.header["num_queues"] == nq and dp.num_tasks == len(recs)
    for q, dq in zip(queues, dp.queues):
        assert [[d[f] for f in enc.TASK_FIELDS] for d in dq] == [recs[i] for i in q]


def test_encode_rejects_bad_queues():
    rec = [0] * enc.TASK_WORDS
    with pytest.raises(ValueError, match="exactly one queue"):
        enc.encode([rec, rec], [[0], [0]], batch=1, attn_chunks=1, spec_hash=0)
    with pytest.raises(ValueError, match=f"record 1 has 3 words, expected {enc.TASK_WORDS}"):
        enc.encode([rec, [1, 2, 3], rec], [[1, 0], [2]], batch=1, attn_chunks=1, spec_hash=0)
    with pytest.raises(OverflowError):
        enc.encode([[2**31] * enc.TASK_WORDS], [[0]], batch=1, attn_chunks=1, spec_hash=0)
    with pytest.raises(ValueError, match="not a megakernel program"):
        enc.decode(np.zeros(64, dtype=np.int32))


def test_program_header_carries_spec_hash_and_defines_are_stable():
    spec = LlamaSpec.tiny()
    p = build_program(spec, 3, 8)
    dp = enc.decode(p.segments[0].encoded)
    assert dp.header["spec_hash"] == enc.spec_hash(spec)
    d = enc.kernel_defines(spec)
    assert "-DMK_HIDDEN=256" in d and "-DMK_DTYPE_BF16=1" in d and d == enc.kernel_defines(spec)
    other = LlamaSpec(hidden_size=320)
    assert enc.spec_hash(other) != enc.spec_hash(spec)


def test_kernel_params_generate_the_signature_and_pack_in_order():
    import types

    import torch

    from mk_plugin.persistent.runtime import pack_args, ptr
    h = generate_header()
    assert "#define MK_DECODE_PARAMS const int* __restrict__ prog, " in h
    assert "mk_decode(MK_DECODE_PARAMS)" in (ROOT / "csrc" / "megakernel.cu").read_text()
    fake_cp = types.SimpleNamespace(int32=np.int32, uint64=np.uint64)
    t = torch.zeros(4)
    args = {n: (7 if c == "int" else t) for n, c in enc.KERNEL_PARAMS}
    args["logits"] = None
    args["kvptr"] = ptr(4096)
    packed = pack_args(fake_cp, args)
    assert len(packed) == len(enc.KERNEL_PARAMS)
    for (n, c), v in zip(enc.KERNEL_PARAMS, packed):
        if c == "int":
            assert isinstance(v, np.int32) and v == 7
        else:
            assert isinstance(v, np.uint64)
            assert int(v) == {"logits": 0, "kvptr": 4096}.get(n, t.data_ptr())
    with pytest.raises(ValueError, match="missing"):
        pack_args(fake_cp, {k: v for k, v in args.items() if k != "q"})


def test_kernel_variant_is_typed_and_renders_its_defines():
    from mk_plugin.persistent.encoding import Rounding
    from mk_plugin.persistent.runtime import MegakernelModule
    from mk_plugin.persistent.variant import KernelVariant
    from mk_plugin.spec import LlamaSpec

    assert KernelVariant().defines() == () and KernelVariant().label() == "default"
    v = KernelVariant(rounding=Rounding.STOCK, num_stages=5)
    assert v.defines() == ("-DMK_ROUNDING=1", "-DMK_NUM_STAGES=5") and v.label() == "rounding=stock,stages=5"
    m = MegakernelModule(LlamaSpec.tiny(), variant=KernelVariant(num_stages=5))
    assert m.num_threads == 288 and m.options[-1] == "-DMK_NUM_STAGES=5" and m.layout.num_stages == 5
    assert MegakernelModule(LlamaSpec.tiny()).key != m.key  # a variant is its own cached binary
    for bad, msg in (({"num_stages": 3}, "num_stages=3: choose one of 4, 5, 6"), ({"diag": 512}, "diag=512"),
                     ({"diag": 128}, "128: the wgmma path.*norm-weight loads.*set wga_x"),
                     ({"diag": 64}, "64 / 128: the wgmma path.s x ready steps.*set wga_x"),
                     ({"diag": 32}, r"diag=32 \(32: weights folded into L2\).*w_tma"),
                     ({"wga_nws": True, "wgmma_a": 4, "w_tma": True, "wga_x": 1}, "wga_nws=True.*wga_x 2 at 6 ring"),
                     ({"wga_nws": True, "wgmma_a": 4, "w_tma": True, "wga_x": 2, "num_stages": 5}, "num_stages=5"),
                     ({"wga_nws": 1}, "wga_nws=1 must be true or false")):
        with pytest.raises(ValueError, match=msg):
            KernelVariant(**bad)
    assert KernelVariant(diag=32, w_tma=True).defines() == ("-DMK_DIAG=32", "-DMK_W_TMA=1")
    nws = KernelVariant.parse(["MK_W_TMA=1", "MK_WGMMA_A=4", "MK_WGA_X=2", "MK_WGA_NWS=1"])
    assert nws.defines()[-1] == "-DMK_WGA_NWS=1" and nws.label().endswith("wga_nws")
    # session 40's fold window (timing only): gate_up's chunks A .. A + N - 1 from L2, on the default chunk loop only
    win = KernelVariant.parse(["MK_W_TMA=1", "MK_DIAG=32", "MK_DIAG_L2_FROM=2", "MK_DIAG_L2_N=8"])
    assert win.defines() == ("-DMK_DIAG=32", "-DMK_W_TMA=1", "-DMK_DIAG_L2_FROM=2", "-DMK_DIAG_L2_N=8")
    assert "#define MK_DIAG_L2_N 0" in (ROOT / "csrc" / "tasks.h").read_text()
    for bad, msg in (({"diag_l2_n": 4}, "set diag's bit 32"), ({"diag_l2_from": 2, "diag": 32, "w_tma": True},
                                                                "set diag's bit 32 and N >= 1"),
                     ({"diag_l2_n": 65, "diag": 32, "w_tma": True}, "diag_l2_n=65: gate_up chunks"),
                     ({"diag_l2_n": 4, "diag": 32, "w_tma": True, "wgmma_a": 4}, "not the wgmma path")):
        with pytest.raises(ValueError, match=msg):
            KernelVariant(**bad)
    with pytest.raises(TypeError, match="must be a Rounding"):
        KernelVariant(rounding=1)
    # MK_INFLIGHT caps the chunks in flight below the ring's depth (a cap of the depth would be no cap)
    assert KernelVariant.parse(["MK_INFLIGHT=2"]).defines() == ("-DMK_INFLIGHT=2",)
    assert KernelVariant(inflight=3, num_stages=4).label() == "stages=4,inflight=3"
    for bad in ({"inflight": 6}, {"inflight": 4, "num_stages": 4}, {"inflight": -1}, {"inflight": True}):
        with pytest.raises(ValueError, match="inflight=.*: 0 \\(off\\) or the weight chunks in flight"):
            KernelVariant(**bad)
    assert "ROUNDING_STOCK = 1" in (ROOT / "csrc" / "tasks.h").read_text()
    # MK_LINEINFO (bench only): NVRTC's line info for Nsight Compute's source page, a binary of its own
    li = MegakernelModule(LlamaSpec.tiny(), variant=KernelVariant.parse(["MK_LINEINFO=1"]))
    assert li.options[-2:] == ("-DMK_LINEINFO=1", "--generate-line-info") and li.key != MegakernelModule(LlamaSpec.tiny()).key
    assert "--generate-line-info" not in MegakernelModule(LlamaSpec.tiny()).options


def test_kernel_variant_parse_is_the_command_line_boundary():
    from mk_plugin.persistent.encoding import Rounding
    from mk_plugin.persistent.variant import RELEASE_GATE_DEFAULT, KernelVariant

    assert KernelVariant.parse(["MK_ROUNDING=stock", "-DMK_NUM_STAGES=4", "MK_DIAG=3"]) == \
        KernelVariant(Rounding.STOCK, 4, 3)
    assert KernelVariant.parse(["MK_ROUNDING=1"]).rounding == Rounding.STOCK and KernelVariant.parse([]) == KernelVariant()
    with pytest.raises(ValueError, match="unknown kernel variant 'MK_FOO'"):
        KernelVariant.parse(["MK_FOO=1"])
    with pytest.raises(ValueError, match="MK_ROUNDING=7: bad value"):
        KernelVariant.parse(["MK_ROUNDING=7"])
    with pytest.raises(ValueError, match="NAME=VALUE"):
        KernelVariant.parse(["MK_NUM_STAGES"])
    g = KernelVariant.parse(["MK_RELEASE_GATE=96"])   # bits of GATE_UP and DOWN
    assert g.release_gate == (1 << enc.Opcode.GATE_UP) | (1 << enc.Opcode.DOWN) and g.defines() == ("-DMK_RELEASE_GATE=96",)
    assert g.label() == "release_gate=96"
    # the default gates after gate_up (measured): naming it is the default build; 0 (off) is a variant
    assert KernelVariant.parse(["MK_RELEASE_GATE=32"]) == KernelVariant() and KernelVariant().defines() == ()
    assert KernelVariant().release_gate == 1 << enc.Opcode.GATE_UP == RELEASE_GATE_DEFAULT
    assert KernelVariant.parse(["MK_RELEASE_GATE=0"]).defines() == ("-DMK_RELEASE_GATE=0",)
    with pytest.raises(ValueError, match="release_gate=512: a mask of opcodes"):
        KernelVariant(release_gate=512)
    # the gate's head start (session 35) needs the gate it moves
    ga = KernelVariant.parse(["MK_RELEASE_GATE=48", "MK_GATE_AHEAD=2"])
    assert ga.defines() == ("-DMK_RELEASE_GATE=48", "-DMK_GATE_AHEAD=2")
    with pytest.raises(ValueError, match=r"gate_ahead=6: .*1 \.\. 5 \(num_stages - 1\)"):
        KernelVariant(release_gate=48, gate_ahead=6)
    with pytest.raises(ValueError, match="unknown kernel variant 'MK_GATE_L2'"):
        KernelVariant.parse(["MK_RELEASE_GATE=48", "MK_GATE_AHEAD=2", "MK_GATE_L2=8"])   # measured slower in session 37
    with pytest.raises(ValueError, match="unknown kernel variant 'MK_ATTN_PREFETCH'"):
        KernelVariant.parse(["MK_ATTN_PREFETCH=1"])   # measured slower in session 8: removed
    # session 9's measured switches left the kernel with their A/B: the winners are the code, the losers gone
    for gone in ("MK_GATE_WORD", "MK_POLL_ACQUIRE", "MK_PTR_EARLY", "MK_GROUP_NONORM", "MK_ROPE_EARLY",
                 "MK_ATTN_OVERLAP", "MK_MERGE_BATCH", "MK_NT2_SLOTS", "MK_ATT_AU", "MK_NT2_FULL",
                 "MK_XFRAG"):   # measured: removed (MK_XFRAG won in session 24 and is the code)
        with pytest.raises(ValueError, match=f"unknown kernel variant '{gone}'"):
            KernelVariant.parse([f"{gone}=1"])
    with pytest.raises(ValueError, match="phases=1 must be true or false"):
        KernelVariant(phases=1)  # type: ignore[arg-type]
    # MK_RSTD_EPI (A/B switch, session 26): a -D of its own, the fused rounding only
    e = KernelVariant.parse(["MK_RSTD_EPI=1"])
    assert e.rstd_epi and e.defines() == ("-DMK_RSTD_EPI=1",) and e.label() == "rstd_epi"
    with pytest.raises(ValueError, match="rstd_epi=True needs the fused rounding"):
        KernelVariant(rstd_epi=True, rounding=enc.Rounding.STOCK)
    assert "#define MK_RSTD_EPI 0" in (ROOT / "csrc" / "tasks.h").read_text()
    # MK_WGMMA_A (A/B switch, session 28): 64-row blocks per pass; copies its chunks with MK_W_TMA's maps; x' normalised
    # before the MMAs
    a = KernelVariant.parse(["MK_W_TMA=1", "MK_WGMMA_A=4"])
    assert a.wgmma_a == 4 and a.defines() == ("-DMK_W_TMA=1", "-DMK_WGMMA_A=4") and a.label() == "w_tma,wgmma_a=4"
    with pytest.raises(ValueError, match="wgmma_a=1 copies its chunks with MK_W_TMA's tensor maps"):
        KernelVariant.parse(["MK_WGMMA_A=1"])
    with pytest.raises(ValueError, match="wgmma_a=2 normalises x' with the rows' rstd"):
        KernelVariant(w_tma=True, wgmma_a=2, rstd_epi=True)
    for bad in (3, 8, True):
        with pytest.raises(ValueError, match=r"0 \(off\) or the 64-row blocks per pass, 1, 2, 4"):
            KernelVariant(w_tma=True, wgmma_a=bad)
    assert "#define MK_WGMMA_A 0" in (ROOT / "csrc" / "tasks.h").read_text()
    # session 14's A/B: ldmatrix activation fragments became the NT = 2 code, the attention preload lost
    for gone in ("MK_B_LDSM", "MK_ATT_PRELOAD"):
        with pytest.raises(ValueError, match=f"unknown kernel variant '{gone}'"):
            KernelVariant.parse([f"{gone}=1"])
    # session 15's A/B: both switches lost and left
    for gone in ("MK_ACT_LL", "MK_ATT_MMA", "MK_RSTD_PARTS"):   # (session 25's ring-fed MMAs won: the ring's code)
        with pytest.raises(ValueError, match=f"unknown kernel variant '{gone}'"):
            KernelVariant.parse([f"{gone}=1"])
    # session 16's bulk-copy hand-offs raced (session 17's race detector) and left in session 18
    for gone in ("MK_BULK_RELEASE", "MK_BULK_QKV"):
        with pytest.raises(ValueError, match=f"unknown kernel variant '{gone}'"):
            KernelVariant.parse([f"{gone}=1"])
    # session 25's A/B: both switches measured slower and left (bench/NOTES.md session 25); session 26's
    # MK_RING_MMA won and is the ring-fed attention's code
    for gone in ("MK_XPIPE", "MK_FULLK", "MK_RING_MMA"):
        with pytest.raises(ValueError, match=f"unknown kernel variant '{gone}'"):
            KernelVariant.parse([f"{gone}=1"])
        assert gone not in (ROOT / "csrc" / "tasks.h").read_text()
    # measured slower on the H200 (2026-12-05) and removed: wgmma with the weights as B at batch <= 8, one ring-slot
    # release per warp
    for gone in ("MK_WGMMA_B", "MK_WARP_ARRIVE"):
        with pytest.raises(ValueError, match=f"unknown kernel variant '{gone}'"):
            KernelVariant.parse([f"{gone}=1"])
        assert gone not in (ROOT / "csrc" / "tasks.h").read_text()
    b = KernelVariant.parse(["MK_RELEASE_GATE=0"])
    assert b.defines() == ("-DMK_RELEASE_GATE=0",) and b.label() == "release_gate=0"
    assert KernelVariant().layout == enc.LAYOUT and KernelVariant(num_stages=5).layout.smem_bytes == enc.LAYOUT.smem_bytes
    assert "BULK_STAGE_BYTES" not in (ROOT / "csrc" / "tasks.h").read_text()
    with pytest.raises(ValueError, match="unknown kernel variant 'MK_LDSM_BATCH'"):
        KernelVariant.parse(["MK_LDSM_BATCH=2"])   # measured no faster in session 8: removed
    with pytest.raises(ValueError, match="unknown kernel variant 'MK_RES_PREFETCH'"):
        KernelVariant.parse(["MK_RES_PREFETCH=1"])   # measured faster in session 7: always on, no switch


def test_backend_takes_its_rounding_from_the_variant():
    import torch

    from mk_plugin.persistent.backend import MegakernelDecoder
    from mk_plugin.persistent.encoding import Rounding
    from mk_plugin.persistent.variant import KernelVariant
    from mk_plugin.spec import LlamaSpec
    from mk_plugin.weights import random_weights

    spec = LlamaSpec.tiny()
    w = random_weights(spec, seed=0, dtype=torch.bfloat16)
    assert MegakernelDecoder(spec, w, 2, "cpu").rounding == Rounding.FUSED
    assert MegakernelDecoder(spec, w, 2, "cpu", variant=KernelVariant(rounding=Rounding.STOCK)).rounding == Rounding.STOCK
