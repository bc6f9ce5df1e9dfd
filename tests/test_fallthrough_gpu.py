"""MK_FALLTHROUGH on the GPU (A/B switch, session 32; csrc/matvec.cuh, common.cuh chunk_wait, x_frags.cuh
group_issue): the matvec chunk loops leave their unrolled M-tile loop with one branch, the one-n-tile loop's ring wait
keeps its slow path out of line and a column group's copies at batch <= 8 are unrolled. Control flow only: the same
loads, copies, MMAs and stores in the same order, so a step is bitwise the step of the build without it -- on the
packaged tables' programs (x staged whole at batch 1, by column groups at batch 5 / 8, the wgmma path at 8B batch 16)
and on the default path's two n-tiles (tuning off at batch 13 / 16) -- and matches the fp32 reference and the Triton
path. A slow wait (the watchdog, an abort) goes through the out-of-line path: test_persistent_gpu.py's watchdog test
covers it under `--mk-define MK_FALLTHROUGH=1`. The helpers are tests/gpu_helpers.py's, the weights fixture conftest.py's."""
from __future__ import annotations

import pytest
from gpu_helpers import (
    DEV,
    assert_switch_leaves_the_step_bitwise,
    gpu_batch,
    h200_table_tuning,
)

from mk_plugin import reference as ref
from mk_plugin.persistent.variant import KernelVariant

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name,bsz,table", [("llama-3.2-1b", 1, True), ("llama-3.2-1b", 8, True),
                                            ("llama-3.2-1b", 16, False), ("llama-3.1-8b", 1, True),
                                            ("llama-3.1-8b", 5, True), ("llama-3.1-8b", 16, True),
                                            ("llama-3.1-8b", 13, False)])
def test_fallthrough_leaves_every_value_as_it_was(models, name, bsz, table):
    """table: the packaged H200 table's tuning of the whole model (the 2-layer model's own key is in no table);
    else tuning off (the default path, two n-tiles at batch 9..16)."""
    spec, w = models(name, 2)
    batch = gpu_batch(spec, [(59 * i + 23) % 600 + 2 for i in range(bsz)], seed=bsz + 9)
    cs = ref.rope_cos_sin_cache(spec, 700).to(DEV)
    tuning = h200_table_tuning(name, bsz) if table else "off"
    assert_switch_leaves_the_step_bitwise(spec, w, batch, cs, tuning, KernelVariant(fallthrough=True))
