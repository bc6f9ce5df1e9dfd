"""The reference checked against independent formulations (dense attention, HF-style rope)."""
import math

import torch

from mk_plugin import reference as ref
from mk_plugin.spec import Llama3RopeScaling, LlamaSpec
from mk_plugin.testing import make_decode_batch


def test_paged_attention_equals_dense_attention_over_gathered_context():
    spec = LlamaSpec(num_q_heads=8, num_kv_heads=2)
    batch = make_decode_batch(spec, [5, 0, 37], block_size=16, seed=3, num_layers=1)
    q = torch.randn(3, 8, 64)
    out = ref.paged_attention(q, batch.kv_caches[0], batch.block_table, batch.seq_lens, 0.125)
    assert out[1].abs().max() == 0  # padded request
    for r, L in ((0, 5), (2, 37)):
        k, v = ref.gather_kv(batch.kv_caches[0], batch.block_table[r], L)
        for h in range(8):
            s = (k[:, h // 4] @ q[r, h]) * 0.125
            torch.testing.assert_close(out[r, h], torch.softmax(s, 0) @ v[:, h // 4])


def test_llama3_inv_freq_matches_closed_form():
    rs = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    spec = LlamaSpec(head_dim=128, rope_theta=500000.0, rope_scaling=rs)
    inv = ref.rope_inv_freq(spec)
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    for i in range(64):
        wl = 2 * math.pi / base[i].item()
        if wl < 8192 / 4:
            want = base[i].item()
        elif wl > 8192:
            want = base[i].item() / 8
        else:
            sm = (8192 / wl - 1) / 3
            want = (1 - sm) * base[i].item() / 8 + sm * base[i].item()
        assert math.isclose(inv[i].item(), want, rel_tol=1e-5)


def test_rope_preserves_norm_and_position_zero_is_identity():
    spec = LlamaSpec()
    cs = ref.rope_cos_sin_cache(spec, 100)
    x = torch.randn(4, 3, 64)
    pos = torch.tensor([0, 1, 50, 99])
    y = ref.apply_rope(x, pos, cs)
    torch.testing.assert_close(y[0], x[0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_kv_append_skips_padding():
    spec = LlamaSpec()
    batch = make_decode_batch(spec, [3, 0], num_layers=1, dtype=torch.float32)
    cache = batch.kv_caches[0].clone()
    k = torch.randn(2, 2, 64)
    v = torch.randn(2, 2, 64)
    ref.kv_append(k, v, cache, batch.slot_mapping)
    slot = int(batch.slot_mapping[0])
    torch.testing.assert_close(cache[slot // 16, 0, slot % 16], k[0])
    torch.testing.assert_close(cache[slot // 16, 1, slot % 16], v[0])
    changed = (cache != batch.kv_caches[0]).any(dim=(3, 4))
    assert int(changed.sum()) == 2  # one K row and one V row, nothing for the padded entry


def test_random_weights_drawn_on_a_cpu_device_equal_the_default_draw():
    """draw_on_device (the GPU benches' fast path) on the CPU: the CPU generator, the same values."""
    from mk_plugin.weights import random_weights

    spec = LlamaSpec.tiny()
    a, b = random_weights(spec, seed=4), random_weights(spec, seed=4, device="cpu", draw_on_device=True)
    assert torch.equal(a.layers[1].gate_up, b.layers[1].gate_up) and torch.equal(a.embed, b.embed)
    assert a.lm_head is a.embed or not spec.tie_word_embeddings
