"""MK_WARP_ARRIVE on the GPU (A/B switch, session 28; csrc/common.cuh slot_free): ring slots freed by one mbarrier arrive
per consumer warp instead of one per thread. Only the hand-back of the slots changes, so every output is bitwise the
default build's: with the packaged tables' programs (the ring-fed attention and K-split down at 1B batch 16) at 1B
batch 1 and 16, with MK_WGMMA_A at 8B batch 16 (its own slot hand-back, on the table's ring and K-split), and under
stop_after cuts (a launch that ends between tasks still frees what it read). Few builds: each costs a compile on the
GPU host. The helpers and the weights fixture are test_persistent_gpu.py's."""
from __future__ import annotations

from dataclasses import replace

import pytest
from test_persistent_gpu import (
    DEV,
    _run_mk,
    gpu_batch,
    models,  # noqa: F401 (the fixture)
    steps_equal,
)

from mk_plugin import reference as ref
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.variant import KernelVariant

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name,bsz,base", [("llama-3.2-1b", 1, KernelVariant()), ("llama-3.2-1b", 16, KernelVariant()),
                                           ("llama-3.1-8b", 16, KernelVariant(w_tma=True, wgmma_a=4))])
def test_warp_arrive_is_bitwise_the_default(models, name, bsz, base):  # noqa: F811 (fixture)
    spec, w = models(name, 2)
    batch = gpu_batch(spec, [(61 * i + 5) % 700 + 130 for i in range(bsz)], seed=bsz + 3)   # >= 128: the ring's tasks
    cs = ref.rope_cos_sin_cache(spec, 1000).to(DEV)
    runs = []
    for v in (base, replace(base, warp_arrive=True)):
        dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=v)   # the packaged table's tuning
        runs.append(_run_mk(dec, spec, w, batch, cs))
    assert steps_equal(runs[0], runs[1])


def test_warp_arrive_under_stop_after_cuts(models):  # noqa: F811 (fixture)
    spec, w = models("llama-3.2-1b", 2)
    batch = gpu_batch(spec, [200], seed=9)
    cs = ref.rope_cos_sin_cache(spec, 800).to(DEV)
    decs = [MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=KernelVariant(warp_arrive=a)) for a in (False, True)]
    prog = decs[0].program(1)
    for op in ("L0.gate_up", "L1.attention", "L1.down"):
        n = prog.op_end(op)
        assert steps_equal(*(_run_mk(d, spec, w, batch, cs, stop_after=n) for d in decs)), op
