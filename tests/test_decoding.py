"""The one decoder interface (mk_plugin.decoding): the Triton step and the megakernel (its CPU
interpreter here) are Decoders over the same DecodeInputs, and agree with each other."""
from __future__ import annotations

import torch

from mk_plugin import reference as ref
from mk_plugin.decoding import DecodeInputs, Decoder
from mk_plugin.ops import STEP_OPS
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import assert_matches, make_decode_batch, poison_
from mk_plugin.triton_ops import DecodeWorkspace, TritonDecoder
from mk_plugin.triton_ops.step_ops import TRITON_OPS
from mk_plugin.weights import random_weights


def test_triton_and_megakernel_are_decoders_over_the_same_inputs():
    spec = LlamaSpec.tiny()
    w = random_weights(spec, seed=5)
    b = make_decode_batch(spec, [21, 0, 40], seed=6)
    cs = ref.rope_cos_sin_cache(spec, 64)
    outs = {}
    for dec in (TritonDecoder(spec, w, DecodeWorkspace.allocate(spec, 3, b.block_table.shape[1], 16, "cpu")),
                MegakernelDecoder(spec, w, 3, "cpu", executor="vm")):
        assert isinstance(dec, Decoder)
        caches = b.clone_caches()
        inp = DecodeInputs(w.embed[b.input_ids], b.positions, caches, b.block_table, b.seq_lens, b.slot_mapping, cs)
        out = poison_(torch.empty_like(inp.hidden))
        assert dec.decode(inp, out) is out and inp.batch == 3
        outs[dec.backend] = (out, caches)
    (t_out, t_caches), (m_out, m_caches) = outs["triton"], outs["megakernel"]
    live = b.seq_lens > 0
    assert_matches(m_out[live], t_out[live], spec.torch_dtype, "step")
    for a, c in zip(m_caches, t_caches):
        assert_matches(a, c, spec.torch_dtype, "step")


def test_one_triton_call_table_covers_every_op():
    assert tuple(TRITON_OPS) == STEP_OPS
