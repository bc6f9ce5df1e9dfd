"""The whole Triton decode path against the fp32 reference decode step."""
import dataclasses

import pytest
import torch

from mk_plugin import reference as ref
from mk_plugin import triton_ops as T
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import assert_matches, make_decode_batch
from mk_plugin.weights import random_weights


def _run(spec: LlamaSpec, seq_lens: list[int], device: str, seed: int = 0):
    w = random_weights(spec, seed=seed, device=device)
    batch = make_decode_batch(spec, seq_lens, seed=seed + 1, device=device)
    cos_sin = ref.rope_cos_sin_cache(spec, max(seq_lens) + 1).to(device)
    caches_t = batch.clone_caches()
    caches_r = [c.float() for c in batch.kv_caches]
    hn = T.decode_step(spec, w, w.embed[batch.input_ids], batch.positions, caches_t, batch.block_table,
                       batch.seq_lens, batch.slot_mapping, cos_sin)
    hn_r, logits_r = ref.decode_step(spec, w, batch.input_ids, batch.positions, caches_r, batch.block_table,
                                     batch.seq_lens, batch.slot_mapping, cos_sin, round_dtype=spec.torch_dtype)
    live = batch.seq_lens > 0
    # Up to 4 layers the rounded reference is a tight truth; deeper stacks amplify rounding noise
    # (see testing.TOLERANCES), so they are held to the "drift" bound of the pure fp32 reference.
    if spec.num_layers > 4:
        _, logits_r = ref.decode_step(spec, w, batch.input_ids, batch.positions,
                                      [c.float() for c in batch.kv_caches], batch.block_table,
                                      batch.seq_lens, batch.slot_mapping, cos_sin)
        assert_matches(T.lm_head(hn, w.lm_head)[live], logits_r[live], spec.torch_dtype, "drift")
        return
    assert_matches(hn[live], hn_r[live], spec.torch_dtype, "step")
    assert_matches(T.lm_head(hn, w.lm_head)[live], logits_r[live], spec.torch_dtype, "step")
    for ct, cr in zip(caches_t, caches_r):  # this step's K/V written where the reference wrote them
        assert_matches(ct, cr.to(ct.dtype), spec.torch_dtype, "step")


def _per_layer(spec: LlamaSpec, seq_lens: list[int], device: str, seed: int = 0) -> None:
    """Layer by layer, teacher-forced: layer L of the Triton path gets the rounded reference's input
    of layer L, and its output (final-normed: decode_step's result) and its KV appends are held to
    the dtype's single-op/step tolerance, so a wrong layer shows at that layer and no depth drift
    hides it behind the looser whole-stack bound."""
    w = random_weights(spec, seed=seed, device=device)
    batch = make_decode_batch(spec, seq_lens, seed=seed + 1, device=device)
    cos_sin = ref.rope_cos_sin_cache(spec, max(seq_lens) + 1).to(device)
    dt, live = spec.torch_dtype, batch.seq_lens > 0
    one = dataclasses.replace(spec, num_layers=1)
    h = w.embed[batch.input_ids].float()  # the reference's residual stream, in its stored dtype
    for n, lw in enumerate(w.layers):
        cache_t, cache_r = batch.kv_caches[n].clone(), batch.kv_caches[n].float()
        h_in = h.to(dt)
        w1 = dataclasses.replace(w, layers=[lw])
        out = T.decode_step(one, w1, h_in, batch.positions, [cache_t], batch.block_table, batch.seq_lens,
                            batch.slot_mapping, cos_sin)
        h = ref.decode_layer(spec, lw, h_in.float(), batch.positions, cos_sin, cache_r, batch.block_table,
                             batch.seq_lens, batch.slot_mapping, round_dtype=dt)
        want, _ = ref.rms_norm(h, w.final_norm, spec.rms_eps)
        for what, got, exp in (("output", out[live], want[live]), ("KV cache", cache_t, cache_r.to(dt))):
            try:
                assert_matches(got, exp, dt, "step")
            except AssertionError as e:
                raise AssertionError(f"layer {n} {what}: {e}") from None
        h = h.to(dt).float()


@pytest.mark.parametrize("seq_lens", [[1], [37, 5, 0], [17, 33, 2, 0, 64, 9, 1, 50]])
def test_decode_step_tiny(seq_lens):
    _run(LlamaSpec.tiny(), seq_lens, "cpu")


@pytest.mark.parametrize("seq_lens", [[37, 5, 0], [17, 33, 2, 0, 64, 9, 1, 50]])
def test_decode_step_per_layer_tiny(seq_lens):
    _per_layer(dataclasses.replace(LlamaSpec.tiny(), num_layers=3), seq_lens, "cpu")


def test_decode_step_odd_sizes_and_tied_embeddings():
    spec = LlamaSpec(hidden_size=320, intermediate_size=880, num_q_heads=5, num_kv_heads=1, head_dim=64,
                     vocab_size=333, num_layers=1, tie_word_embeddings=True, dtype="float16")
    _run(spec, [19, 0, 3], "cpu")


def test_workspace_rejects_bad_batch():
    with pytest.raises(ValueError, match="max_tokens=17"):
        T.DecodeWorkspace.allocate(LlamaSpec.tiny(), 17, 4, 16, "cpu")


def test_workspace_splits_the_attention_per_batch_size():
    """The KV splits follow the step's own batch (a small batch of a 16-token workspace still covers the SMs), and a
    smaller batch run through the larger workspace (partials poisoned first) matches the reference."""
    spec = dataclasses.replace(LlamaSpec.tiny(), num_layers=2)
    ws = T.DecodeWorkspace.allocate(spec, 16, 64, 16, "cpu")   # 1024 tokens a request: room for many splits
    sp = ws.splits_by_batch
    assert len(sp) == 16 and sp[1] > sp[15] and list(sp) == sorted(sp, reverse=True)
    rows = ws.attn_ws.numel() // (spec.num_q_heads * (spec.head_dim + 2))
    assert all(b * s <= rows for b, s in enumerate(sp, start=1))
    w = random_weights(spec, seed=3)
    batch = make_decode_batch(spec, [100, 0, 37], seed=4)
    cos_sin = ref.rope_cos_sin_cache(spec, 128)
    ws.attn_ws.fill_(float("nan"))
    caches_r = [c.float() for c in batch.kv_caches]
    hn = T.decode_step(spec, w, w.embed[batch.input_ids], batch.positions, batch.clone_caches(), batch.block_table,
                       batch.seq_lens, batch.slot_mapping, cos_sin, workspace=ws)
    hn_r, _ = ref.decode_step(spec, w, batch.input_ids, batch.positions, caches_r, batch.block_table, batch.seq_lens,
                              batch.slot_mapping, cos_sin, round_dtype=spec.torch_dtype)
    live = batch.seq_lens > 0
    assert_matches(hn[live], hn_r[live], spec.torch_dtype, "step")


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b"])
@pytest.mark.parametrize("seq_lens", [[513], [4000, 1, 0, 700, 33, 2047, 17, 129]])
def test_decode_step_gpu(model, seq_lens):
    from pathlib import Path
    spec = LlamaSpec.from_json_file(Path(__file__).resolve().parents[1] / "bench" / "models" / model)
    _run(spec, seq_lens, "cuda")  # every layer: the rounded reference does not drift with depth
    _per_layer(spec, seq_lens, "cuda")


@pytest.mark.gpu
def test_decode_step_cuda_graph_replay():
    """Captured once, replayed with new per-step values read from the same device tensors."""
    spec = dataclasses.replace(LlamaSpec.from_json_file(
        __import__("pathlib").Path(__file__).resolve().parents[1] / "bench" / "models" / "llama-3.2-1b"), num_layers=2)
    w = random_weights(spec, device="cuda")
    batch = make_decode_batch(spec, [100, 7, 0, 33], device="cuda")
    cos_sin = ref.rope_cos_sin_cache(spec, 4096).cuda()
    ws = T.DecodeWorkspace.allocate(spec, 4, batch.block_table.shape[1], 16, "cuda")
    hidden = w.embed[batch.input_ids].clone()
    out = torch.empty_like(hidden)
    caches = batch.clone_caches()
    args = (spec, w, hidden, batch.positions, caches, batch.block_table, batch.seq_lens, batch.slot_mapping, cos_sin)
    T.decode_step(*args, workspace=ws, out=out)  # warm-up compiles every kernel outside capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        T.decode_step(*args, workspace=ws, out=out)
    caches_r = [c.float() for c in batch.kv_caches]
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    hn_r, _ = ref.decode_step(spec, w, batch.input_ids, batch.positions, caches_r, batch.block_table,
                              batch.seq_lens, batch.slot_mapping, cos_sin, round_dtype=spec.torch_dtype)
    live = batch.seq_lens > 0
    assert_matches(out[live], hn_r[live], spec.torch_dtype, "step")
