"""Hypothesis strategies shared by the schedule, VM and property tests (not a test module)."""
from __future__ import annotations

from hypothesis import strategies as st

from mk_plugin.spec import LlamaSpec, UnsupportedModel


@st.composite
def small_specs(draw):
    while True:
        d = draw(st.sampled_from([64, 128]))
        nkv = draw(st.integers(1, 3))
        g = draw(st.sampled_from([1, 2, 3, 4, 6]))
        try:
            return LlamaSpec(hidden_size=16 * draw(st.integers(2, 24)), num_layers=draw(st.integers(1, 2)),
                             num_q_heads=nkv * g, num_kv_heads=nkv, head_dim=d,
                             intermediate_size=16 * draw(st.integers(1, 30)),
                             vocab_size=draw(st.integers(16, 300)), name="rand")
        except UnsupportedModel:
            continue
