"""MK_FMA_B1 on the GPU (session 41, an A/B switch): batch-1 passes of up to 4 M-tiles on the CUDA cores
(csrc/matvec_fma.cuh) give a step within the fp32 reference's and Triton's tolerance, bitwise repeatable, and every op
within the op tolerance of the VM from the same inputs; at shapes with partial chunks (tiny: K = 256 and down's 688
columns, fewer than a chunk's 1024) and on the 1B b1 table entry's gate. The helpers are tests/gpu_helpers.py's, the
weights fixture conftest.py's."""
from __future__ import annotations

import pytest
from gpu_helpers import DEV, assert_repeatable_step, gpu_batch, op_by_op_failures

from mk_plugin import reference as ref
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.variant import KernelVariant

pytestmark = pytest.mark.gpu

GATE = {"release_gate": 48, "gate_ahead": 2}   # the 1B b1 table entry's kernel switches


@pytest.mark.parametrize("name,ctx,gate", [("tiny", 37, False), ("llama-3.2-1b", 517, True),
                                           ("llama-3.2-1b", 4095, False)])
def test_fma_b1_step_matches_reference_and_repeats(models, name, ctx, gate):
    spec, w = models(name, 2)
    batch = gpu_batch(spec, [ctx], seed=ctx)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    dec = MegakernelDecoder(spec, w, 1, DEV, lm_head=True, variant=KernelVariant(fma_b1=True, **(GATE if gate else {})))
    assert_repeatable_step(dec, spec, w, batch, cs)


@pytest.mark.parametrize("name", ["tiny", "llama-3.2-1b"])
def test_fma_b1_ops_match_the_vm(models, name):
    spec, w = models(name, 2)
    batch = gpu_batch(spec, [300], seed=5)
    dec = MegakernelDecoder(spec, w, 1, DEV, lm_head=True, variant=KernelVariant(fma_b1=True))
    assert op_by_op_failures(dec, spec, w, batch) == []


def test_fma_b1_leaves_batch_3_alone(models):
    # B > 1 never takes the CUDA-core loop: the build's batch-3 step is bitwise the default build's
    from gpu_helpers import run_mk, steps_equal
    spec, w = models("llama-3.2-1b", 2)
    batch = gpu_batch(spec, [517, 0, 33], seed=3)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    plain = MegakernelDecoder(spec, w, 3, DEV, lm_head=True)
    fma = MegakernelDecoder(spec, w, 3, DEV, lm_head=True, variant=KernelVariant(fma_b1=True))
    assert steps_equal(run_mk(plain, spec, w, batch, cs), run_mk(fma, spec, w, batch, cs))
