"""paged_attention (split-KV decode attention over vLLM's paged cache) against reference.paged_attention."""
from __future__ import annotations

import math

import pytest
import torch

from mk_plugin import reference as R
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import assert_matches, make_decode_batch, poison_
from mk_plugin.triton_ops.paged_attention import (
    MAX_SPLITS,
    choose_num_splits,
    paged_attention,
    paged_attention_bytes,
    paged_attention_num_splits,
    paged_attention_workspace_size,
    tile_tokens,
)


def _spec(qh: int, kvh: int, d: int) -> LlamaSpec:
    return LlamaSpec(num_q_heads=qh, num_kv_heads=kvh, head_dim=d)


def _nan_outside_context(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Poison every cache slot no request's context covers (incl. the tail of each last block): a
    kernel reading past seq_len, or a stale block-table entry, then produces NaN."""
    nb, _, bs = cache.shape[:3]
    used = torch.zeros(nb, bs, dtype=torch.bool)
    for r, n in enumerate(seq_lens.tolist()):
        t = torch.arange(max(n, 0))
        used[block_table[r, t // bs].long(), t % bs] = True
    cache.permute(0, 2, 1, 3, 4)[~used.to(cache.device)] = float("nan")


def _garbage_past_context(block_table: torch.Tensor, seq_lens: torch.Tensor, bs: int) -> None:
    """Entries past each request's blocks hold out-of-range ids (vLLM leaves them stale)."""
    for r, n in enumerate(seq_lens.tolist()):
        block_table[r, -(-max(n, 0) // bs):] = 10**8


def _run_case(qh, kvh, d, dtype, seq_lens, num_splits, block_size=16, q3d=False, device="cpu", seed=0,
              batch=None):
    spec = _spec(qh, kvh, d)
    db = make_decode_batch(spec, seq_lens, block_size=block_size, seed=seed, device=device, num_layers=1,
                           dtype=dtype)
    cache, bt, sl = db.kv_caches[0], db.block_table, db.seq_lens
    _nan_outside_context(cache, bt.cpu(), sl.cpu())
    _garbage_past_context(bt, sl.cpu(), block_size)
    b = len(seq_lens) if batch is None else batch
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(b, qh, d, generator=g).to(device=device, dtype=dtype)
    q_in = q if q3d else q.reshape(b, qh * d)
    out = poison_(torch.empty(b, qh * d, dtype=dtype, device=device))
    got = paged_attention(q_in, cache, bt, sl, d ** -0.5, num_splits=num_splits, out=out)
    assert got is out
    ref = R.paged_attention(q, cache, bt[:b], sl[:b], d ** -0.5)
    assert_matches(got.view(b, qh, d), ref, dtype)
    for r, n in enumerate(seq_lens[:b]):
        if n == 0:
            assert torch.equal(got[r].float().cpu(), torch.zeros(qh * d)), "padded request must give exactly 0"


# (qh, kvh, d, dtype, seq_lens, num_splits, block_size, q3d): GQA groups 1/2/4, d 64/128, bf16/fp16,
# batch 1/3/8, lengths off the block size, padded entries, splits 1, > 1, > tiles, and the heuristic.
CPU_CASES = [
    (2, 2, 64, torch.bfloat16, [1, 17, 33, 5], 1, 16, False),
    (4, 2, 128, torch.float16, [17, 0, 40], 3, 16, True),
    (8, 2, 64, torch.bfloat16, [70], 1, 16, False),
    (4, 1, 128, torch.bfloat16, [1, 17, 33, 5, 0, 70, 16, 2], 4, 32, False),
    (4, 2, 64, torch.float16, [65, 3, 130], 2, 64, True),
    (4, 2, 64, torch.bfloat16, [1, 5, 0], 8, 16, False),        # more splits than tiles: neutral partials
    (4, 1, 64, torch.float16, [129, 9, 0], None, 16, False),      # heuristic
]


@pytest.mark.parametrize("qh,kvh,d,dtype,seq_lens,num_splits,block_size,q3d", CPU_CASES)
def test_paged_attention_matches_reference(qh, kvh, d, dtype, seq_lens, num_splits, block_size, q3d):
    _run_case(qh, kvh, d, dtype, seq_lens, num_splits, block_size, q3d)


@pytest.mark.parametrize("group", [1, 2, 4, 16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_groups_dims_dtypes_splits(group, d, dtype, num_splits):
    kvh = 2 if group < 16 else 1
    _run_case(group * kvh, kvh, d, dtype, [17, 0, 40], num_splits, seed=group)


def test_fewer_tokens_than_requests_and_padded_table_stride():
    """B < num_reqs, a block table that is a column slice of a wider buffer, and a cache that is a
    view with a larger dim-0 stride (vLLM may allocate one buffer for several layers)."""
    qh, kvh, d, dt, bs = 4, 2, 64, torch.bfloat16, 16
    db = make_decode_batch(_spec(qh, kvh, d), [33, 1, 18, 7], block_size=bs, num_layers=1, dtype=dt)
    nb = db.kv_caches[0].shape[0]
    per_block = 2 * bs * kvh * d
    big = torch.full((nb, per_block + 40), float("nan"), dtype=dt)
    cache = big[:, :per_block].view(nb, 2, bs, kvh, d)
    cache.copy_(db.kv_caches[0])
    assert cache.stride(0) == per_block + 40
    wide = torch.full((4, db.block_table.shape[1] + 13), 10**8, dtype=torch.int32)
    bt = wide[:, : db.block_table.shape[1]]
    bt.copy_(db.block_table)
    _garbage_past_context(bt, db.seq_lens, bs)
    b = 3
    q = torch.randn(b, qh * d).to(dt)
    ws = poison_(torch.empty(paged_attention_workspace_size(b, qh, d, 3) + 5, dtype=torch.float32))
    out = paged_attention(q, cache, bt, db.seq_lens, 0.125, num_splits=3, workspace=ws)
    ref = R.paged_attention(q.view(b, qh, d), cache, bt[:b], db.seq_lens[:b], 0.125)
    assert_matches(out.view(b, qh, d), ref, dt)


def test_all_padded_batch_gives_zeros():
    qh, kvh, d = 4, 2, 64
    db = make_decode_batch(_spec(qh, kvh, d), [0, 0], num_layers=1, dtype=torch.bfloat16)
    q = torch.randn(2, qh * d).bfloat16()
    for s in (1, 4):
        out = poison_(torch.empty(2, qh * d, dtype=torch.bfloat16))
        paged_attention(q, db.kv_caches[0], db.block_table, db.seq_lens, 0.125, num_splits=s, out=out)
        assert torch.equal(out.float(), torch.zeros(2, qh * d))


def test_choose_num_splits_uses_only_host_values():
    # fills ~132 SMs, capped by the tiles of the max context (so by its blocks too) and MAX_SPLITS
    assert choose_num_splits(1, 8, 56 * 16, 16) == min(math.ceil(132 / 8), math.ceil(896 / tile_tokens(16)))
    assert choose_num_splits(16, 8, 4096, 16) == 2
    assert choose_num_splits(16, 16, 4096, 16) == 1
    assert choose_num_splits(1, 8, 16, 16) == 1
    assert choose_num_splits(1, 1, 10**6, 16) == MAX_SPLITS
    for b in (1, 3, 8, 16):
        for ctx in (16, 100, 784, 4096):
            s = choose_num_splits(b, 8, ctx, 16)
            assert 1 <= s <= math.ceil(ctx / 16)


def test_num_splits_helper_matches_the_wrapper_choice():
    """paged_attention(num_splits=None) uses paged_attention_num_splits: a workspace sized with it
    is large enough, and a too-small one is refused (so the choice really is that many splits)."""
    qh, kvh, d = 4, 2, 64
    db = make_decode_batch(_spec(qh, kvh, d), [100, 3], num_layers=1, extra_blocks=5)
    s = paged_attention_num_splits(2, kvh, db.block_table.shape[1], 16)
    assert s == choose_num_splits(2, kvh, db.block_table.shape[1] * 16, 16) > 1
    q = torch.randn(2, qh * d).bfloat16()
    need = paged_attention_workspace_size(2, qh, d, s)
    ws = poison_(torch.empty(need))
    out = paged_attention(q, db.kv_caches[0], db.block_table, db.seq_lens, 0.125, workspace=ws)
    assert_matches(out.view(2, qh, d), R.paged_attention(q.view(2, qh, d), db.kv_caches[0], db.block_table,
                                                         db.seq_lens, 0.125), torch.bfloat16)
    with pytest.raises(ValueError, match=f"num_splits={s} need {need}"):
        paged_attention(q, db.kv_caches[0], db.block_table, db.seq_lens, 0.125, workspace=ws[:-1])


def test_bytes_helper():
    n = paged_attention_bytes([10, 0], 4, 2, 64, torch.bfloat16)
    assert n == 2 * 2 * 64 * 2 * 10 + 2 * 2 * 4 * 64 * 2 + 4 * 2 + 4 * 1
    assert paged_attention_bytes([10, 0], 4, 2, 64, torch.bfloat16, num_splits=2) > n


def _args(qh=4, kvh=2, d=64, dt=torch.bfloat16, b=2):
    db = make_decode_batch(_spec(qh, kvh, d), [5, 3][:b] if b <= 2 else [5] * b, num_layers=1, dtype=dt)
    return torch.randn(b, qh * d).to(dt), db.kv_caches[0], db.block_table, db.seq_lens


@pytest.mark.parametrize("mutate,match", [
    (lambda a: (a[0].float(), *a[1:]), "q has dtype"),
    (lambda a: (a[0], a[1].half(), *a[2:]), "kv_cache has dtype"),
    (lambda a: (a[0], a[1], a[2].long(), a[3]), "block_table has dtype"),
    (lambda a: (a[0], a[1], a[2], a[3].long()), "seq_lens has dtype"),
    (lambda a: (a[0][:, :192], *a[1:]), "num_q_heads"),
    (lambda a: (a[0][:, :100], *a[1:]), "must be"),
    (lambda a: (a[0], a[1], a[2][:1], a[3]), "exceeds num_reqs"),
    (lambda a: (a[0], a[1][..., :32], *a[2:]), "head_dim=32"),
    (lambda a: (a[0], a[1].transpose(3, 4), *a[2:]), "kv_cache"),
    (lambda a: (torch.zeros(17, a[0].shape[1], dtype=a[0].dtype), *a[1:]), "1..16"),
    (lambda a: (a[0], a[1][:, :, :8], *a[2:]), "block_size=8"),
])
def test_bad_inputs_raise(mutate, match):
    q, cache, bt, sl = mutate(_args())
    with pytest.raises(ValueError, match=match):
        paged_attention(q, cache, bt, sl, 0.125)


def test_bad_splits_and_workspace_raise():
    q, cache, bt, sl = _args()
    with pytest.raises(ValueError, match="num_splits=0"):
        paged_attention(q, cache, bt, sl, 0.125, num_splits=0)
    with pytest.raises(ValueError, match="workspace has 10 elements"):
        paged_attention(q, cache, bt, sl, 0.125, num_splits=2, workspace=torch.empty(10))
    with pytest.raises(ValueError, match="out has shape"):
        paged_attention(q, cache, bt, sl, 0.125, out=torch.empty(2, 5, dtype=q.dtype))
    with pytest.raises(ValueError, match="scale"):
        paged_attention(q, cache, bt, sl, float("nan"))


# ---- GPU: Llama-3.2-1B (32/8 heads, d 64) and Llama-3.1-8B (32/8 heads, d 128) shapes ---------------
GPU_LENS = {1: [4093], 3: [1, 2049, 777], 8: [4096, 17, 0, 1000, 3001, 65, 2, 1531],
            16: [4095, 1, 0, 16, 33, 2000, 3999, 4017, 0, 511, 1025, 129, 7, 3333, 2222, 1111]}


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b", [1, 3, 8, 16])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_llama_shapes(d, b, num_splits, dtype):
    _run_case(32, 8, d, dtype, GPU_LENS[b], num_splits, device="cuda", seed=b)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [32, 64])
def test_gpu_block_sizes(block_size):
    _run_case(32, 8, 128, torch.bfloat16, [1, 1000, 4000], None, block_size=block_size, device="cuda")


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_lengths():
    """Captured once with preallocated out/workspace; replays see new seq_lens/block tables/q."""
    qh, kvh, d, dt, b = 32, 8, 64, torch.bfloat16, 8
    spec = _spec(qh, kvh, d)
    lens0 = [100, 1, 0, 900, 35, 17, 64, 400]
    lens1 = [901, 0, 5, 16, 1000, 333, 1, 2]
    db = make_decode_batch(spec, [max(x, y) for x, y in zip(lens0, lens1)], device="cuda", num_layers=1,
                           dtype=dt)
    cache, bt = db.kv_caches[0], db.block_table
    sl = torch.tensor(lens0, dtype=torch.int32, device="cuda")
    q = torch.randn(b, qh * d, device="cuda").to(dt)
    s = paged_attention_num_splits(b, kvh, bt.shape[1], 16, "cuda")
    assert s > 1
    ws = torch.empty(paged_attention_workspace_size(b, qh, d, s), dtype=torch.float32, device="cuda")
    out = torch.empty(b, qh * d, dtype=dt, device="cuda")
    paged_attention(q, cache, bt, sl, d ** -0.5, out=out, workspace=ws)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(q, cache, bt, sl, d ** -0.5, out=out, workspace=ws)
    for lens in (lens0, lens1):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(b, qh * d, device="cuda").to(dt))
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        ref = R.paged_attention(q.view(b, qh, d), cache, bt, sl, d ** -0.5)
        assert_matches(out.view(b, qh, d), ref, dt)
