"""MK_WGMMA_A on the GPU (A/B switch, session 28; csrc/matvec_wgmma_a.cuh): matvec passes at batch 9..16 stream chunks
of the pass's 64 rows x 256 columns (MK_W_TMA's 16-row boxes placed as one 64-row swizzled tile) and run them on the
warpgroup MMA, the weights as its A operand and x' (one 512-column group at a time, in the 128-byte swizzled layout) as
its B operand. Against the fp32 reference and the Triton path, bitwise repeatable (fixed-order sums), op by op against
the VM (the same products in another fp32 order: within tolerance), with the packaged tables' K-split programs (1B
down / 4, 8B down / 2: parts of 2048 and 7168 columns, whole chunks), at a shallower ring (its scratch moves with the
ring's depth) and at batch 8, where no pass takes the path (the switch's build on the default path). MK_WGA_X (session
30: rstd in the epilogue, and with x staged per warpgroup) at 6 and 5 ring slots (2 and 4 x group buffers) the same way.
The helpers are tests/gpu_helpers.py's, the weights fixture conftest.py's."""
from __future__ import annotations

import pytest
from gpu_helpers import (
    DEV,
    assert_repeatable_step,
    assert_step_matches_ref_and_triton,
    gpu_batch,
    op_by_op_failures,
    run_mk,
)

from mk_plugin import reference as ref
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.tuning import ScheduleTuning
from mk_plugin.persistent.variant import KernelVariant

pytestmark = pytest.mark.gpu
WGMMA_A = KernelVariant(w_tma=True, wgmma_a=4)   # the largest pass; 1 and 2 are its special cases


@pytest.mark.parametrize("name,bsz", [("llama-3.2-1b", 9), ("llama-3.2-1b", 13), ("llama-3.2-1b", 16),
                                      ("llama-3.2-1b", 8), ("llama-3.1-8b", 11), ("llama-3.1-8b", 16)])
def test_wgmma_a_tasks_match_the_reference(models, name, bsz):
    spec, w = models(name, 2)
    seq_lens = [(61 * i + 5) % 700 + 1 for i in range(bsz)]
    batch = gpu_batch(spec, seq_lens, seed=bsz + 11)
    cs = ref.rope_cos_sin_cache(spec, 800).to(DEV)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off", variant=WGMMA_A)
    assert_repeatable_step(dec, spec, w, batch, cs)


@pytest.mark.parametrize("name,parts,stages", [("llama-3.2-1b", 4, 0), ("llama-3.1-8b", 2, 0), ("llama-3.2-1b", 4, 5)])
def test_wgmma_a_tasks_with_a_k_split_and_ring_depths(models, name, parts, stages):
    """down cut over K as the packaged tables cut it at batch 16 (the parts' merge after the wgmma sums), the ring-fed
    attention on, and a 5-slot ring (the scratch then starts at another offset, still 1024-byte aligned)."""
    spec, w = models(name, 2)
    batch = gpu_batch(spec, [300 + 37 * i for i in range(16)], seed=parts + stages)
    cs = ref.rope_cos_sin_cache(spec, 1000).to(DEV)
    tuning = ScheduleTuning(ksplit=(("down", parts),), att_tma=128, num_stages=stages)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=WGMMA_A, tuning={16: tuning})
    out, logits, caches = run_mk(dec, spec, w, batch, cs)
    assert_step_matches_ref_and_triton(spec, w, batch, cs, out, logits, caches)


@pytest.mark.parametrize("name,bsz", [("llama-3.2-1b", 16), ("llama-3.1-8b", 10)])
def test_wgmma_a_tasks_match_the_vm_op_by_op(models, name, bsz):
    spec, w = models(name, 1)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off", variant=WGMMA_A)
    failures = op_by_op_failures(dec, spec, w, gpu_batch(spec, [40 + 23 * i for i in range(bsz)], seed=2))
    assert not failures, "first diverging op (GPU vs VM):\n" + "\n".join(failures)


@pytest.mark.parametrize("name,bsz,stages,x", [("llama-3.2-1b", 13, 6, 1), ("llama-3.2-1b", 16, 5, 1),
                                               ("llama-3.1-8b", 11, 5, 1), ("llama-3.1-8b", 16, 6, 1),
                                               ("llama-3.1-8b", 9, 5, 1), ("llama-3.2-1b", 16, 6, 2),
                                               ("llama-3.2-1b", 9, 5, 2), ("llama-3.1-8b", 16, 6, 2),
                                               ("llama-3.1-8b", 12, 5, 2)])
def test_wga_x_tasks_match_the_reference(models, name, bsz, stages, x):
    """MK_WGA_X: rstd in the epilogue (the first pass's sums of squares in a fixed order: bitwise repeatable), the norm
    weights a group ahead, 3 groups of x in flight at 5 slots (4 buffers); x = 2 each warpgroup's own half of x."""
    spec, w = models(name, 2)
    seq_lens = [(53 * i + 7) % 650 + 1 for i in range(bsz)]
    batch = gpu_batch(spec, seq_lens, seed=bsz + stages + x)
    cs = ref.rope_cos_sin_cache(spec, 800).to(DEV)
    variant = KernelVariant(w_tma=True, wgmma_a=4, wga_x=x, num_stages=stages)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off", variant=variant)
    assert_repeatable_step(dec, spec, w, batch, cs)


@pytest.mark.parametrize("x", [1, 2])
@pytest.mark.parametrize("name,bsz", [("llama-3.2-1b", 16), ("llama-3.1-8b", 10)])
def test_wga_x_tasks_match_the_vm_op_by_op(models, name, bsz, x):
    """rstd in the epilogue (5 slots: 4 buffers) against the VM's op with the same rounding points (vm._epi_rstd; on
    2026-12-05 the VM normalised first and 8B batch 10's gate_up missed the op tolerance in one element, 0.0625)."""
    spec, w = models(name, 1)
    variant = KernelVariant(w_tma=True, wgmma_a=4, wga_x=x, num_stages=5)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off", variant=variant)
    failures = op_by_op_failures(dec, spec, w, gpu_batch(spec, [40 + 23 * i for i in range(bsz)], seed=3))
    assert not failures, "first diverging op (GPU vs VM):\n" + "\n".join(failures)


@pytest.mark.parametrize("name,bsz", [("llama-3.2-1b", 16), ("llama-3.2-1b", 9), ("llama-3.1-8b", 12)])
def test_wga_nws_is_bitwise_the_wga_x_build(models, name, bsz):
    """MK_WGA_NWS (session 46): the norm weights by cp.async with the x groups instead of a register load a group
    ahead: the same weights in the same normalisation, so the step is bitwise the wga_x 2 build's (6 ring slots), and
    against the fp32 reference and Triton; K-split down and the ring-fed attention on (the tables' batch-16 tuning)."""
    spec, w = models(name, 2)
    batch = gpu_batch(spec, [(47 * i + 3) % 600 + 1 for i in range(bsz)], seed=bsz + 46)
    cs = ref.rope_cos_sin_cache(spec, 800).to(DEV)
    tuning = {bsz: ScheduleTuning(ksplit=(("down", 2),), att_tma=128)}
    runs = []
    for nws in (False, True):
        variant = KernelVariant(w_tma=True, wgmma_a=4, wga_x=2, wga_nws=nws)
        dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=variant, tuning=tuning)
        runs.append(run_mk(dec, spec, w, batch, cs))
    (out0, log0, cache0), (out1, log1, cache1) = runs
    assert_step_matches_ref_and_triton(spec, w, batch, cs, out1, log1, cache1)
    assert (out0 == out1).all() and (log0 == log1).all(), "MK_WGA_NWS changed the step's bits"
    for a, b in zip(cache0, cache1):
        assert (a == b).all(), "MK_WGA_NWS changed the KV cache's bits"
