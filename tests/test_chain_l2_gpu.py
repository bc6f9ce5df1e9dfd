"""MK_CHAIN_L2 on the GPU (session 40, an A/B switch): the idle SMs' L2 prefetch of gate_up rows (csrc/l2_prefetch.cuh)
changes no bit of the step against the same build without it, and the step stays within the fp32 reference's and
Triton's tolerance, bitwise repeatable. The helpers are tests/gpu_helpers.py's, the weights fixture conftest.py's."""
from __future__ import annotations

from dataclasses import replace

import pytest
from gpu_helpers import DEV, assert_repeatable_step, gpu_batch, run_mk, steps_equal

from mk_plugin import reference as ref
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.encoding import Opcode
from mk_plugin.persistent.variant import KernelVariant

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bsz,tiles", [(1, 3), (3, 6), (8, 1)])
def test_chain_l2_prefetch_changes_no_bit(models, bsz, tiles):
    spec, w = models("llama-3.2-1b", 2)
    batch = gpu_batch(spec, [517, 0, 33, 1, 260, 4095, 16, 90][:bsz], seed=bsz + 7)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    base = KernelVariant(w_tma=True, inflight=2, release_gate=48, gate_ahead=2)
    plain = MegakernelDecoder(spec, w, bsz, DEV, lm_head=True, variant=base)
    chain = MegakernelDecoder(spec, w, bsz, DEV, lm_head=True, variant=replace(base, chain_l2=tiles))
    p = chain.program(bsz)
    assert p.chain_l2 and any(t.opcode == Opcode.L2_PREFETCH for t in p.taskset.tasks)
    assert steps_equal(run_mk(plain, spec, w, batch, cs), run_mk(chain, spec, w, batch, cs))
    assert_repeatable_step(chain, spec, w, batch, cs)
