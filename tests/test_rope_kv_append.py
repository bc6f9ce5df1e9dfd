"""rope_kv_append (neox RoPE on q/k + K/V append into vLLM's paged cache) against
reference.apply_rope + reference.kv_append."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mk_plugin import reference as R
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import assert_matches, make_decode_batch, poison_
from mk_plugin.triton_ops.rope_kv_append import rope_kv_append, rope_kv_append_bytes

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"


def _expected(qkv, positions, cos_sin, cache, slots, qh, kvh, d):
    """(q_ref [B, qh, d] fp32, cache_ref) from the reference functions."""
    b = qkv.shape[0]
    q, k, v = qkv.float().split([qh * d, kvh * d, kvh * d], dim=-1)
    q_ref = R.apply_rope(q.view(b, qh, d), positions, cos_sin)
    k_ref = R.apply_rope(k.reshape(b, kvh, d), positions, cos_sin)
    cache_ref = cache.clone()
    R.kv_append(k_ref, v.reshape(b, kvh, d), cache_ref, slots)
    return q_ref, cache_ref


def _written_mask(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size] bool: the slots this step writes."""
    nb, _, bs = cache.shape[:3]
    m = torch.zeros(nb, bs, dtype=torch.bool)
    for s in slots.tolist():
        if s >= 0:
            m[s // bs, s % bs] = True
    return m


def _check(spec: LlamaSpec, seq_lens, dtype, *, block_size=16, cos_sin=None, device="cpu", seed=0,
           index_dtype=torch.int64, pad_position=None, strided_cache=False, q3d=False):
    qh, kvh, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    db = make_decode_batch(spec, seq_lens, block_size=block_size, seed=seed, device=device, num_layers=1,
                           dtype=dtype)
    cache = db.kv_caches[0]
    if strided_cache:  # a view with a larger dim-0 stride; the gap must stay untouched
        nb, per_block = cache.shape[0], cache[0].numel()
        big = torch.full((nb, per_block + 24), 7.0, dtype=dtype, device=device)
        view = big[:, :per_block].view(cache.shape)
        view.copy_(cache)
        cache = view
    positions, slots = db.positions.clone(), db.slot_mapping.clone()
    if pad_position is not None:  # padded entries may carry any in-range position
        positions[slots < 0] = pad_position
    positions, slots = positions.to(index_dtype), slots.to(index_dtype)
    if cos_sin is None:
        cos_sin = R.rope_cos_sin_cache(spec, max(seq_lens + [pad_position or 0]) + 8)
    cos_sin = cos_sin.to(device)
    b = len(seq_lens)
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(b, spec.qkv_size, generator=g).to(device=device, dtype=dtype)
    q_ref, cache_ref = _expected(qkv, positions, cos_sin, cache, slots, qh, kvh, d)
    before = cache.clone()
    q_out = poison_(torch.empty((b, qh, d) if q3d else (b, qh * d), dtype=dtype, device=device))
    got = rope_kv_append(qkv, positions, cos_sin, cache, slots, num_q_heads=qh, num_kv_heads=kvh,
                         head_dim=d, q_out=q_out)
    assert got is q_out
    assert_matches(got.reshape(b, qh, d), q_ref, dtype)

    written = _written_mask(cache, slots.cpu()).to(device)
    perm = lambda t: t.permute(0, 2, 1, 3, 4)  # [nb, bs, 2, kvh, d]: index by written slot
    assert torch.equal(perm(cache)[~written], perm(before)[~written]), "cache changed outside written slots"
    assert_matches(perm(cache)[written][:, 0], perm(cache_ref)[written][:, 0].float(), dtype)  # roped K
    assert torch.equal(perm(cache)[written][:, 1], perm(cache_ref)[written][:, 1]), "V must be copied raw"
    if strided_cache:
        assert bool((big[:, cache[0].numel():] == 7.0).all()), "wrote into the gap between cache blocks"
    return got


def _spec(qh, kvh, d) -> LlamaSpec:
    return LlamaSpec(num_q_heads=qh, num_kv_heads=kvh, head_dim=d)


@pytest.mark.parametrize("qh,kvh,d", [(2, 2, 64), (4, 2, 128), (8, 2, 64), (4, 1, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq_lens", [[5], [1, 17, 0], [1, 17, 33, 5, 0, 70, 16, 2]])
def test_matches_reference(qh, kvh, d, dtype, seq_lens):
    _check(_spec(qh, kvh, d), seq_lens, dtype)


@pytest.mark.parametrize("block_size", [32, 64])
def test_block_sizes_int32_indices_and_3d_q_out(block_size):
    _check(_spec(4, 2, 64), [1, 40, 0, 97], torch.bfloat16, block_size=block_size, index_dtype=torch.int32,
           q3d=True)


def test_strided_cache_view_and_padded_position():
    """vLLM may view a larger buffer (dim-0 stride > block); a padded entry's q is still defined."""
    _check(_spec(4, 2, 64), [9, 0, 33], torch.float16, strided_cache=True, pad_position=21)


@pytest.mark.parametrize("cs_dtype", [torch.float32, torch.bfloat16])
def test_llama3_rope_scaling_at_large_positions(cs_dtype):
    """Llama-3.2-1B's rope (theta 5e5, llama3 frequency scaling) around position 5000; vLLM keeps the
    cos|sin cache in bf16, the reference builds fp32: both are used as given, in fp32."""
    spec = LlamaSpec.from_json_file(MODELS / "llama-3.2-1b")
    assert spec.rope_scaling is not None
    cos_sin = R.rope_cos_sin_cache(spec, 5200).to(cs_dtype)
    small = LlamaSpec(num_q_heads=4, num_kv_heads=2, head_dim=spec.head_dim, rope_theta=spec.rope_theta,
                      rope_scaling=spec.rope_scaling)
    _check(small, [5001, 4097, 0], torch.bfloat16, cos_sin=cos_sin, pad_position=5100)


def test_allocates_q_out_when_absent():
    spec = _spec(4, 2, 64)
    db = make_decode_batch(spec, [3, 0], num_layers=1)
    qkv = torch.randn(2, spec.qkv_size).bfloat16()
    cs = R.rope_cos_sin_cache(spec, 16)
    q = rope_kv_append(qkv, db.positions, cs, db.kv_caches[0], db.slot_mapping, num_q_heads=4,
                       num_kv_heads=2, head_dim=64)
    assert q.shape == (2, 256) and q.dtype == torch.bfloat16 and q.is_contiguous()
    ref = R.apply_rope(qkv[:, :256].view(2, 4, 64), db.positions, cs)
    assert_matches(q.view(2, 4, 64), ref, torch.bfloat16)


def test_bytes_helper():
    n = rope_kv_append_bytes(2, 4, 2, 64, torch.bfloat16, torch.float32)
    assert n == 2 * (8 * 64 * 2 + 16 + 64 * 4) + 2 * 4 * 64 * 2 + 2 * 2 * 2 * 64 * 2
    assert rope_kv_append_bytes(2, 4, 2, 64, num_written=1) < n


def _args():
    spec = _spec(4, 2, 64)
    db = make_decode_batch(spec, [3, 9], num_layers=1)
    qkv = torch.randn(2, spec.qkv_size).bfloat16()
    return {"qkv": qkv, "positions": db.positions, "cos_sin_cache": R.rope_cos_sin_cache(spec, 16),
                "kv_cache": db.kv_caches[0], "slot_mapping": db.slot_mapping}


@pytest.mark.parametrize("field,bad,kw,match", [
    ("qkv", lambda t: t[:, :-64], {}, "columns"),
    ("qkv", lambda t: torch.zeros(17, t.shape[1], dtype=t.dtype), {}, "1..16"),
    ("positions", lambda t: t.float(), {}, "positions has dtype"),
    ("positions", lambda t: t[:1], {}, "positions has shape"),
    ("slot_mapping", lambda t: t.to(torch.int16), {}, "slot_mapping has dtype"),
    ("kv_cache", lambda t: t.half(), {}, "kv_cache has dtype"),
    ("kv_cache", lambda t: t[:, :, :, :1], {}, "kv heads"),
    ("kv_cache", lambda t: torch.zeros(t.shape[0], 2, 16, 64, 2, dtype=t.dtype).transpose(3, 4), {},
     "last three dims must be contiguous"),
    ("cos_sin_cache", lambda t: t[:, :32], {}, "cos_sin_cache"),
    ("qkv", lambda t: t, {"head_dim": 96}, "head_dim=96"),
    ("qkv", lambda t: t, {"num_q_heads": 3}, "multiple of num_kv_heads"),
    ("qkv", lambda t: t, {"q_out": torch.empty(2, 8, dtype=torch.bfloat16)}, "q_out has shape"),
])
def test_bad_inputs_raise(field, bad, kw, match):
    a = _args()
    a[field] = bad(a[field])
    heads = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64}
    heads.update(kw)
    with pytest.raises(ValueError, match=match):
        rope_kv_append(a["qkv"], a["positions"], a["cos_sin_cache"], a["kv_cache"], a["slot_mapping"], **heads)


# ---- GPU: Llama-3.2-1B (32/8 heads, d 64) and Llama-3.1-8B (32/8 heads, d 128) -----------------------
GPU_LENS = {1: [4093], 3: [1, 2049, 0], 8: [4096, 17, 0, 1000, 3001, 65, 2, 1531],
            16: [4095, 1, 0, 16, 33, 2000, 3999, 4017, 0, 511, 1025, 129, 7, 3333, 2222, 1111]}


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b"])
@pytest.mark.parametrize("b", [1, 3, 8, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_llama_shapes(model, b, dtype):
    spec = LlamaSpec.from_json_file(MODELS / model)
    cos_sin = R.rope_cos_sin_cache(spec, 4200)
    _check(spec, GPU_LENS[b], dtype, cos_sin=cos_sin, device="cuda", seed=b, pad_position=77)
    _check(spec, GPU_LENS[b], dtype, cos_sin=cos_sin.to(dtype), device="cuda", seed=b, strided_cache=True)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    spec = LlamaSpec.from_json_file(MODELS / "llama-3.2-1b")
    qh, kvh, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    db = make_decode_batch(spec, [100, 0, 37, 900], device="cuda", num_layers=1)
    cache = db.kv_caches[0]
    cs = R.rope_cos_sin_cache(spec, 1024).cuda().bfloat16()
    qkv = torch.randn(4, spec.qkv_size, device="cuda").bfloat16()
    q_out = torch.empty(4, qh * d, dtype=torch.bfloat16, device="cuda")
    pos, slots = db.positions.clone(), db.slot_mapping.clone()
    run = lambda: rope_kv_append(qkv, pos, cs, cache, slots, num_q_heads=qh, num_kv_heads=kvh,
                                 head_dim=d, q_out=q_out)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    pos.copy_(torch.tensor([101, 0, 38, 5], device="cuda"))
    slots.copy_(torch.tensor([int(db.block_table[0, 6]) * 16 + 5, -1, int(db.block_table[2, 2]) * 16 + 6,
                              int(db.block_table[3, 0]) * 16 + 5], device="cuda"))
    qkv.copy_(torch.randn(4, spec.qkv_size, device="cuda").bfloat16())
    q_ref, cache_ref = _expected(qkv, pos, cs, cache, slots, qh, kvh, d)
    poison_(q_out)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(q_out.view(4, qh, d), q_ref, torch.bfloat16)
    assert_matches(cache, cache_ref.float(), torch.bfloat16)
