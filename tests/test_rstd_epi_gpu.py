"""MK_RSTD_EPI on the GPU (A/B switch, session 26; csrc/x_frags.cuh, matvec.cuh): a norm-fused op whose activations
are not staged whole takes rstd out of its fragments and scales its accumulators in the epilogue, the first pass
summing x^2 from the column groups. Against the fp32 reference and the Triton path; bitwise repeatable (fixed-order
sums), and op by op against the VM, which models it since session 27 (vm._norm_operand). The helpers are
tests/gpu_helpers.py's, the weights fixture conftest.py's. Also MK_NTILES (session 49), a build of one batch class."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gpu_helpers import (
    DEV,
    assert_repeatable_step,
    gpu_batch,
    op_by_op_failures,
    run_mk,
    steps_equal,
)

from mk_plugin import reference as ref
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.variant import KernelVariant

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name,bsz", [("llama-3.2-1b", 7), ("llama-3.2-1b", 8), ("llama-3.2-1b", 16),
                                      ("llama-3.1-8b", 3), ("llama-3.1-8b", 9), ("llama-3.1-8b", 16),
                                      ("llama-3.2-1b", 1)])   # batch 1: staged whole, the switch does not apply
def test_rstd_in_the_epilogue_matches_the_reference(models, name, bsz):
    spec, w = models(name, 2)
    seq_lens = [(53 * i + 9) % 600 + 1 for i in range(bsz)]
    batch = gpu_batch(spec, seq_lens, seed=bsz + 41)
    cs = ref.rope_cos_sin_cache(spec, 800).to(DEV)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off", variant=KernelVariant(rstd_epi=True))
    assert_repeatable_step(dec, spec, w, batch, cs)


@pytest.mark.parametrize("name,seq_lens", [("llama-3.2-1b", [33, 0, 511, 17, 1, 250, 97, 96]),
                                           ("llama-3.1-8b", [129, 3, 400])])
def test_rstd_in_the_epilogue_matches_the_vm_op_by_op(models, name, seq_lens):
    spec, w = models(name, 1)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off", variant=KernelVariant(rstd_epi=True))
    failures = op_by_op_failures(dec, spec, w, gpu_batch(spec, seq_lens, seed=1))
    assert not failures, "first diverging op (GPU vs VM):\n" + "\n".join(failures)


# MK_X_GROUPS (A/B switch, session 47): x by column groups at every batch size, so the column-group path (and, with
# rstd_epi, the epilogue's rstd) runs where x would be staged whole: 1B batch 1..6, 8B batch 1..2. Batch 1 and 2 had
# never taken the group path before (down at 1B batch 2 was its smallest), hence batch 1 / 2 / 4 here, a padded slot
# at batch 4 (seq_len 0), with and without rstd_epi.
@pytest.mark.parametrize("epi", [False, True])
@pytest.mark.parametrize("name,seq_lens", [("llama-3.2-1b", [33]), ("llama-3.2-1b", [129, 3]),
                                           ("llama-3.2-1b", [33, 0, 511, 17]), ("llama-3.1-8b", [129, 3])])
def test_x_groups_matches_the_vm_op_by_op(models, name, seq_lens, epi):
    spec, w = models(name, 1)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off",
                            variant=KernelVariant(rstd_epi=epi, x_groups=True))
    failures = op_by_op_failures(dec, spec, w, gpu_batch(spec, seq_lens, seed=len(seq_lens) + 3))
    assert not failures, "first diverging op (GPU vs VM):\n" + "\n".join(failures)


@pytest.mark.parametrize("name,bsz", [("llama-3.2-1b", 1), ("llama-3.2-1b", 4), ("llama-3.1-8b", 2)])
def test_x_groups_with_rstd_epi_matches_the_reference(models, name, bsz):
    spec, w = models(name, 2)
    seq_lens = [(53 * i + 9) % 600 + 1 for i in range(bsz)]
    batch = gpu_batch(spec, seq_lens, seed=bsz + 43)
    cs = ref.rope_cos_sin_cache(spec, 800).to(DEV)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off",
                            variant=KernelVariant(rstd_epi=True, x_groups=True))
    assert_repeatable_step(dec, spec, w, batch, cs)


@pytest.mark.parametrize("name,bsz,wgmma,only", [
    ("llama-3.2-1b", 3, 0, ""), ("llama-3.2-1b", 8, 0, ""), ("llama-3.2-1b", 12, 0, ""), ("llama-3.2-1b", 12, 4, ""),
    ("llama-3.2-1b", 12, 4, "wga_only"), ("llama-3.1-8b", 16, 4, "wga_only"),
    ("llama-3.2-1b", 1, 0, "x_whole"), ("llama-3.1-8b", 1, 0, "x_whole")])
def test_ntiles_builds_one_batch_class_bit_for_bit(models, name, bsz, wgmma, only, monkeypatch):
    """MK_NTILES (session 49's A/B): each batch size runs the build of its own class, bit for bit the build of both
    classes' step (the same code path, the other class compiled out; with MK_WGA_ONLY every task on the wgmma path, with
    MK_X_WHOLE every x staged whole, as they were: since session 50 the decoder's default at batch 1, class_builds); a
    build of the other class refuses the program in its header check (HeaderCheck.BATCH) and writes nothing."""
    from mk_plugin.persistent.encoding import ErrorCode, HeaderCheck

    spec, w = models(name, 2)
    batch = gpu_batch(spec, [(37 * i + 5) % 300 + 1 for i in range(bsz)], seed=bsz + 71)
    cs = ref.rope_cos_sin_cache(spec, 400).to(DEV)
    base = KernelVariant(w_tma=True, wgmma_a=wgmma) if wgmma else KernelVariant()
    plain = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off", variant=base, class_builds=False)
    on = {only: True} if only else {}
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off", variant=replace(base, ntiles=1, **on))
    assert dec.variant_for(bsz) == replace(base, ntiles=1 if bsz <= 8 else 2, **on)
    if only == "x_whole":   # session 50: the decoder's default (class_builds) at batch 1 is this build
        assert MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off").variant_for(bsz) == dec.variant_for(bsz)
    assert steps_equal(run_mk(plain, spec, w, batch, cs), run_mk(dec, spec, w, batch, cs))
    wrong = replace(dec.variant_for(bsz), wga_only=False).for_batch(1 if bsz > 8 else 9)   # the other class's build
    monkeypatch.setattr(dec, "variant_for", lambda b: wrong)
    out, _, _ = run_mk(dec, spec, w, batch, cs)
    rec = dec.error_record()
    assert rec["code"] == ErrorCode.BAD_PROGRAM and rec["seen"] & HeaderCheck.BATCH, rec
    assert torch.isnan(out).all()
    dec.clear_errors()
