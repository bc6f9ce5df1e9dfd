"""MK_WGMMA_B on the GPU (A/B switch, session 27; csrc/matvec_wgmma.cuh): matvec tasks at batch <= 8 whose x is staged
whole run their chunks on the warpgroup MMA (the MK_W_TMA weight tile as wgmma's B operand, x' in a compact
shared-memory layout as its A operand, the pass walked M-tile-major by the producer and the consumers alike). Against
the fp32 reference and the Triton path, bitwise repeatable (fixed-order sums), op by op against the VM (the same
products in another fp32 order: within tolerance), with a K-split program, and at batch sizes where only some ops
take the wgmma path (1B batch 5: o_proj and lm_head yes, qkv_rope / gate_up / down no; batch 8: none, the switch's
build on the default path; 8B: o_proj and lm_head at batch <= 2 only). The helpers and the weights fixture
are test_persistent_gpu.py's."""
from __future__ import annotations

import pytest
from test_persistent_gpu import (
    DEV,
    _assert_step_matches_ref_and_triton,
    _run_mk,
    assert_repeatable_step,
    gpu_batch,
    models,  # noqa: F401 (the fixture)
    op_by_op_failures,
)

from mk_plugin import reference as ref
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.tuning import ScheduleTuning
from mk_plugin.persistent.variant import KernelVariant

pytestmark = pytest.mark.gpu
WGMMA_B = KernelVariant(w_tma=True, wgmma_b=True)


@pytest.mark.parametrize("name,bsz", [("llama-3.2-1b", 1), ("llama-3.2-1b", 2), ("llama-3.2-1b", 3),
                                      ("llama-3.2-1b", 5), ("llama-3.2-1b", 8), ("llama-3.1-8b", 1),
                                      ("llama-3.1-8b", 2)])
def test_wgmma_tasks_match_the_reference(models, name, bsz):  # noqa: F811 (fixture)
    spec, w = models(name, 2)
    seq_lens = [(61 * i + 5) % 700 + 1 for i in range(bsz)]
    batch = gpu_batch(spec, seq_lens, seed=bsz + 7)
    cs = ref.rope_cos_sin_cache(spec, 800).to(DEV)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off", variant=WGMMA_B)
    assert_repeatable_step(dec, spec, w, batch, cs)


def test_wgmma_tasks_with_a_k_split(models):  # noqa: F811 (fixture)
    """down cut over K in 4 parts (2048 columns each at 1B: whole chunks, so the parts take the wgmma path) and the
    last part's merge, at batch 1."""
    spec, w = models("llama-3.2-1b", 2)
    batch = gpu_batch(spec, [300], seed=3)
    cs = ref.rope_cos_sin_cache(spec, 800).to(DEV)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=WGMMA_B,
                            tuning={1: ScheduleTuning(ksplit=(("down", 4),))})
    out, logits, caches = _run_mk(dec, spec, w, batch, cs)
    _assert_step_matches_ref_and_triton(spec, w, batch, cs, out, logits, caches)


@pytest.mark.parametrize("name,seq_lens", [("llama-3.2-1b", [33, 400]), ("llama-3.1-8b", [129])])
def test_wgmma_tasks_match_the_vm_op_by_op(models, name, seq_lens):  # noqa: F811 (fixture)
    spec, w = models(name, 1)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning="off", variant=WGMMA_B)
    failures = op_by_op_failures(dec, spec, w, gpu_batch(spec, seq_lens, seed=1))
    assert not failures, "first diverging op (GPU vs VM):\n" + "\n".join(failures)
