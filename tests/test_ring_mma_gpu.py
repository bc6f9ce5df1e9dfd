"""The ring-fed attention on the GPU (MK_ATT_TMA; csrc/attention_ring_mma.cuh: its consumers on the tensor cores),
against the fp32 reference and the default (register-fed, CUDA-core) attention loop. Its lane mapping is checked on the CPU by
test_ring_mma_lanes.py; the helpers are tests/gpu_helpers.py's, the weights fixture conftest.py's."""
from __future__ import annotations

import pytest
from gpu_helpers import (
    DEV,
    appended_rows,
    assert_step_matches_ref_and_triton,
    gpu_batch,
    op_by_op_failures,
    run_mk,
)

from mk_plugin import reference as ref
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.testing import assert_matches, compare

pytestmark = pytest.mark.gpu


def _nan_past_lengths(batch) -> None:
    """NaN in every cache row of a request's blocks past its length: a kernel that lets a masked token's K or V
    into its sums (0 x NaN) cannot pass."""
    bs = batch.kv_caches[0].shape[2]
    for b, n in enumerate(batch.seq_lens.tolist()):
        nblk = -(-n // bs)
        for t in range(n, nblk * bs):
            blk = int(batch.block_table[b, t // bs])
            for c in batch.kv_caches:
                c[blk, :, t % bs] = float("nan")


@pytest.mark.parametrize("name,layers", [("llama-3.2-1b", 2), ("llama-3.1-8b", 1)])
@pytest.mark.parametrize("seq_lens,chunks", [
    ([1337], 0),
    ([1, 0, 4095, 65], 3),   # 3 KV chunks: ranges that start and end inside a ring slot's 8-token groups
    ([7, 300, 0, 45, 1, 129, 2049, 64, 513, 3, 88, 1000, 0, 31, 160, 2], 0),
])
def test_tensor_core_attention_matches_the_reference(models, name, layers, seq_lens, chunks):
    """csrc/attention_ring_mma.cuh: the ring-fed attention's scores and P V on the tensor cores, every
    attention task through the ring (att_tma 1), the newest token (written during the launch) in every position of
    an 8-token group across the requests, NaN in every cache row past a request's length. Against the fp32 reference
    and the build without the ring (the default loop) within the step tolerance. The newest token's rows are loaded
    at the task's start from its slot_mapping entry and staged for its group; warps take 16-token blocks at head_dim
    <= 64 (1B) and 8-token groups at 128 (8B): session 51's MK_ATT_NEWEST / MK_AM_BLOCK, the code since session 52."""
    from mk_plugin.persistent.tuning import ScheduleTuning

    spec, w = models(name, layers)
    batch = gpu_batch(spec, seq_lens, seed=21)
    _nan_past_lengths(batch)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    bsz = len(seq_lens)
    tun = {bsz: ScheduleTuning(att_tma=1, attn_chunks=chunks)}
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning=tun)
    assert dec.variant_for(bsz).att_tma == 1
    out, logits, caches = run_mk(dec, spec, w, batch, cs)
    plain = {bsz: ScheduleTuning(attn_chunks=chunks)}   # att_tma 0: every task on the default loop
    base = run_mk(MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning=plain), spec, w, batch, cs)
    rcaches = [c.clone() for c in batch.kv_caches]
    hn, rlogits = ref.decode_step(spec, w, batch.input_ids, batch.positions, rcaches, batch.block_table,
                                  batch.seq_lens, batch.slot_mapping, cs)
    dt = spec.torch_dtype
    live = batch.seq_lens > 0
    for got, want, what in ((out[live], hn[live], "out"), (logits[live], rlogits[live], "logits"),
                            (out[live], base[0][live], "out vs the default loop")):
        r = compare(got.float(), want.float(), dt, "step")
        assert r["pass"], f"{what}: {r}"
    for a, r_ in zip(caches, rcaches):   # this step's K/V appends
        assert_matches(appended_rows(a, batch.slot_mapping), appended_rows(r_, batch.slot_mapping), dt, "step")


@pytest.mark.parametrize("name,layers,seq_lens", [
    ("llama-3.2-1b", 1, [33, 0, 511, 17, 1, 250, 4000, 96]),
    ("llama-3.1-8b", 1, [129, 4000]),
])
def test_ring_attention_matches_the_vm_op_by_op(models, name, layers, seq_lens):
    """Every attention task through the ring (att_tma 1): each op's prefix on the GPU against the VM, which models the
    tensor cores' P rounded to 16 bits per warp's running maximum (vm.ring_pv_weights, per 16-token block at head_dim
    <= 64, per 8-token group above), at the op tolerances."""
    from mk_plugin.persistent.tuning import ScheduleTuning

    spec, w = models(name, layers)
    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, tuning={len(seq_lens): ScheduleTuning(att_tma=1)})
    assert dec.variant_for(len(seq_lens)).att_tma == 1
    failures = op_by_op_failures(dec, spec, w, gpu_batch(spec, seq_lens, seed=1))
    assert not failures, "first diverging op (GPU vs VM):\n" + "\n".join(failures)


def test_caches_the_ring_path_cannot_copy_turn_it_off(models, caplog):
    """The ring-fed attention (MK_ATT_TMA, from a variant or a tuning) streams K/V by 16-token tensor-map boxes;
    block_size 32 caches run the kernel without that path, after one warning, with the same results."""
    import logging

    spec, w = models("llama-3.2-1b", 2)
    batch = gpu_batch(spec, [300, 0, 1000], seed=5, block_size=32)
    cs = ref.rope_cos_sin_cache(spec, 1100).to(DEV)
    from mk_plugin.persistent.tuning import ScheduleTuning
    from mk_plugin.persistent.variant import KernelVariant

    dec = MegakernelDecoder(spec, w, 16, DEV, lm_head=True, variant=KernelVariant(att_tma=128),
                            tuning={3: ScheduleTuning(att_tma=64)})
    assert dec.variant_for(3).att_tma == 64
    with caplog.at_level(logging.WARNING, logger="vllm.mk_plugin.persistent"):
        out, logits, caches = run_mk(dec, spec, w, batch, cs)
        run_mk(dec, spec, w, batch, cs)   # the same caches again: no second warning
    assert dec.variant.att_tma == 0 and dec.variant_for(3).att_tma == 0
    assert sum("ring-fed" in r.getMessage() for r in caplog.records) == 1 and "block_size 32" in caplog.text, caplog.text
    assert_step_matches_ref_and_triton(spec, w, batch, cs, out, logits, caches)
