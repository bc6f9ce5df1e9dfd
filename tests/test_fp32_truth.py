"""bench/fp32_truth.py on a CPU: the fp32 truth of a forced sequence from a seeded checkpoint, the per-step
metrics and the verdict of bench/vllm_correctness.py part (c)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fp32_truth as ft
import vllm_correctness as vc

from mk_plugin import reference as ref
from mk_plugin.spec import LlamaSpec

HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 176,
      "vocab_size": 300, "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "rope_theta": 10000.0,
      "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def test_truth_of_a_forced_sequence_matches_a_whole_prefix_forward(tmp_path):
    mdir = tmp_path / "tiny"
    mdir.mkdir()
    (mdir / "config.json").write_text(json.dumps(HF))
    wdir = vc.write_random_checkpoint(mdir, tmp_path / "w", seed=3, std=0.02)
    spec = LlamaSpec.from_hf_config(HF, name="tiny")
    w = ft.load_checkpoint(wdir, spec, "cpu")
    assert w.layers[0].qkv.shape == (spec.qkv_size, 128) and w.layers[1].gate_up.dtype == torch.float32
    toks = [(7 * i + 3) % 300 for i in range(40)]
    truth = ft.truth_logits(spec, w, toks, 20, 37, "cpu")    # 37 tokens: 3 blocks of 16
    assert sorted(truth) == list(range(20, 38))
    # the same logits from a fresh run over only the first 25 tokens (nothing leaks from later steps)
    again = ft.truth_logits(spec, w, toks[:25], 25, 25, "cpu")
    assert torch.allclose(again[25], truth[25], rtol=1e-6, atol=1e-6)
    # and the last step's logits equal a direct reference decode step at that position
    caches = [torch.zeros(3, 2, 16, 1, 64) for _ in range(2)]
    cs = ref.rope_cos_sin_cache(spec, 64)
    table = torch.tensor([[2, 1, 0]], dtype=torch.int32)
    for pos in range(37):
        blk = int(table[0, pos // 16])
        _, lg = ref.decode_step(spec, w, torch.tensor([toks[pos]]), torch.tensor([pos]), caches, table,
                                torch.tensor([pos + 1], dtype=torch.int32), torch.tensor([blk * 16 + pos % 16]), cs)
    assert torch.allclose(lg[0].double(), truth[37], rtol=1e-9, atol=1e-9)


def test_metrics_and_verdict():
    t = torch.tensor([3.0, 1.0, 0.5, -2.0])
    same = ft.step_metrics(t, t.clone())
    assert same["rel"] == 0.0 and abs(same["kl"]) < 1e-12 and same["agree"] is True
    flip = ft.step_metrics(t, torch.tensor([1.0, 3.0, 0.5, -2.0]))
    assert flip["rel"] > 0.5 and flip["kl"] > 0.5 and flip["agree"] is False
    tie = ft.step_metrics(torch.tensor([3.0, 3.0 - 1e-4, 0.0]), torch.tensor([2.9, 3.0, 0.0]))
    assert tie["agree"] is None   # top-2 gap within one bf16 ulp of 3.0: not a decided step
    s = ft.summarize([same, flip, tie])
    assert s["steps"] == 3 and s["decided"] == 2 and s["agree"] == 0.5
    stock = {"rel_median": 0.02, "rel_p99": 0.05, "agree": 0.95}
    assert ft.verdict(stock, {"rel_median": 0.021, "rel_p99": 0.054, "agree": 0.947}) == (True, "ok")
    good, why = ft.verdict(stock, {"rel_median": 0.03, "rel_p99": 0.05, "agree": 0.94})
    assert not good and "rel_median" in why and "agreement" in why


def test_dump_samples_keep_every_request_row(tmp_path):
    torch.save({"seq_lens": [30, 17], "logits": torch.randn(2, 5), "mode": "x"}, tmp_path / "logits_1_000000.pt")
    torch.save({"seq_lens": [31, 18], "logits": torch.randn(2, 5), "mode": "x"}, tmp_path / "logits_1_000001.pt")
    got = vc.load_dump_samples(tmp_path, 18, 31)
    assert sorted(n for n, _ in got) == [18, 30, 31]


def test_prefill_truth_equals_the_step_by_step_truth_and_the_rule(tmp_path):
    mdir = tmp_path / "tiny"
    mdir.mkdir()
    (mdir / "config.json").write_text(json.dumps(HF))
    spec = LlamaSpec.from_hf_config(HF, name="tiny")
    w = ft.load_checkpoint(vc.write_random_checkpoint(mdir, tmp_path / "w", seed=4, std=0.02), spec, "cpu")
    toks = [(11 * i + 5) % 300 for i in range(33)]
    steps = ft.truth_logits(spec, w, toks, 33, 33, "cpu")[33]
    assert torch.allclose(ft.prefill_logits(spec, w, toks, "cpu"), steps, rtol=1e-5, atol=1e-5)
    t = torch.tensor([5.0, 4.99, 3.0])
    assert ft.fp32_rule(t, 0, 1)[0] is False          # 0.01 below: within one bf16 ulp of 5.0 (0.03125)
    bug, worse = ft.fp32_rule(t, 0, 2)
    assert bug and abs(worse - 2.0) < 1e-12
    assert ft.fp32_rule(t, 2, 0) == (False, -2.0)    # the plugin's token is the better one
