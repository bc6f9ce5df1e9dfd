"""The fp32 truth of a teacher-forced sequence and how far a decode path's logits are from it (issue 13):
bench/vllm_correctness.py part (c) and bench/soak.py judge against this instead of against stock vLLM,
whose own bf16 rounding differs from any other implementation's at near ties.

- load_checkpoint: the seeded safetensors checkpoint (HF names) as fp32 ModelWeights.
- truth_logits: mk_plugin.reference in fp32 over the same paged KV layout vLLM uses, one token per step:
  the logits after every prefix length in [first, last].
- step_metrics / summarize: per step the relative logit error ||p - t|| / ||t||, KL(softmax t || softmax p)
  and, where the truth's top-2 gap is above bf16 resolution of its top logit, whether the path's argmax is
  the truth's; then median and p99 per path.
- verdict: a plugin path passes when its median and p99 error are <= 1.1x stock's and its argmax
  agreement is >= stock's - 0.5 points.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from mk_plugin.testing import bf16_ulp

ERR_RATIO = 1.1        # plugin error (median and p99) may be at most this times stock's
AGREE_SLACK = 0.005    # plugin fp32-argmax agreement may be at most this below stock's


def load_checkpoint(wdir: Path, spec: Any, device: str = "cuda") -> Any:
    """ModelWeights (fp32) of a checkpoint written by vllm_correctness.write_random_checkpoint."""
    from safetensors.torch import load_file

    from mk_plugin.weights import LayerWeights, ModelWeights

    t: dict[str, torch.Tensor] = {}
    for f in sorted(Path(wdir).glob("*.safetensors")):
        t.update(load_file(str(f)))

    def g(name: str) -> torch.Tensor:
        return t[name].to(device=device, dtype=torch.float32)

    layers = []
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        layers.append(LayerWeights(
            input_norm=g(p + "input_layernorm.weight"),
            qkv=torch.cat([g(p + "self_attn.q_proj.weight"), g(p + "self_attn.k_proj.weight"),
                           g(p + "self_attn.v_proj.weight")]),
            o=g(p + "self_attn.o_proj.weight"), post_norm=g(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")]),
            down=g(p + "mlp.down_proj.weight")))
    embed = g("model.embed_tokens.weight")
    lm = g("lm_head.weight") if "lm_head.weight" in t else embed
    return ModelWeights(embed=embed, layers=layers, final_norm=g("model.norm.weight"), lm_head=lm)


def truth_logits(spec: Any, w: Any, tokens: list[int], first: int, last: int, device: str = "cuda",
                 block_size: int = 16) -> dict[int, torch.Tensor]:
    """seq_len L -> fp32 logits after tokens[:L] (predicting tokens[L]), for first <= L <= last: the fp32
    reference one token per step over an fp32 paged cache (blocks in reverse order: not contiguous)."""
    from mk_plugin import reference as ref

    nblk = -(-last // block_size)
    caches = [torch.zeros(nblk, 2, block_size, spec.num_kv_heads, spec.head_dim, device=device)
              for _ in range(spec.num_layers)]
    table = torch.arange(nblk - 1, -1, -1, dtype=torch.int32, device=device).view(1, -1)
    cs = ref.rope_cos_sin_cache(spec, last + 1).to(device)
    out: dict[int, torch.Tensor] = {}
    for pos in range(last):
        blk = int(table[0, pos // block_size])
        ids = torch.tensor([tokens[pos]], device=device)
        _, logits = ref.decode_step(spec, w, ids, torch.tensor([pos], device=device), caches, table,
                                    torch.tensor([pos + 1], dtype=torch.int32, device=device),
                                    torch.tensor([blk * block_size + pos % block_size], device=device), cs)
        if pos + 1 >= first:
            out[pos + 1] = logits[0].double().cpu()
    return out


def step_metrics(truth: torch.Tensor, path: torch.Tensor) -> dict[str, float | bool | None]:
    """One step: relative error, KL(truth || path) in nats, and (None when the truth's top-2 gap is within
    bf16 resolution of its top logit: a near tie no bf16 path can be held to) argmax agreement."""
    t, p = truth.double(), path.double()
    rel = float(torch.linalg.vector_norm(p - t) / torch.linalg.vector_norm(t).clamp_min(1e-30))
    lt, lp = torch.log_softmax(t, 0), torch.log_softmax(p, 0)
    kl = float((lt.exp() * (lt - lp)).sum())
    top2 = torch.topk(t, 2).values
    decided = float(top2[0] - top2[1]) > bf16_ulp(float(top2[0]))
    return {"rel": rel, "kl": kl, "agree": (int(p.argmax()) == int(t.argmax())) if decided else None}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else float("nan")


def summarize(steps: list[dict[str, Any]]) -> dict[str, float]:
    rel, kl = [s["rel"] for s in steps], [s["kl"] for s in steps]
    dec = [s["agree"] for s in steps if s["agree"] is not None]
    return {"steps": len(steps), "rel_median": _pct(rel, 0.5), "rel_p99": _pct(rel, 0.99), "kl_median": _pct(kl, 0.5),
            "kl_p99": _pct(kl, 0.99), "decided": len(dec), "agree": sum(dec) / len(dec) if dec else float("nan")}


def verdict(stock: dict[str, float], plugin: dict[str, float]) -> tuple[bool, str]:
    """(pass, why) of a plugin path against stock, both measured against the same fp32 truth."""
    bad = []
    for k in ("rel_median", "rel_p99"):
        if plugin[k] > ERR_RATIO * stock[k]:
            bad.append(f"{k} {plugin[k]:.3e} > {ERR_RATIO} x stock's {stock[k]:.3e}")
    if plugin["agree"] < stock["agree"] - AGREE_SLACK:
        bad.append(f"fp32-argmax agreement {plugin['agree']:.1%} < stock's {stock['agree']:.1%} - 0.5 points")
    return (not bad, "; ".join(bad) or "ok")


def prefill_logits(spec: Any, w: Any, tokens: list[int], device: str = "cuda") -> torch.Tensor:
    """fp32 logits after the whole of `tokens` (predicting the next one): one causal forward over the
    sequence with mk_plugin.reference's ops (its rms_norm, linear, RoPE, silu_and_mul), attention by
    torch's SDPA with the kv heads repeated. The soak's first differences are judged with this."""
    from mk_plugin import reference as ref

    n, g = len(tokens), spec.num_q_heads // spec.num_kv_heads
    pos = torch.arange(n, device=device)
    cs = ref.rope_cos_sin_cache(spec, n + 1).to(device)
    h = w.embed[torch.tensor(tokens, device=device)].float()
    for lw in w.layers:
        a, _ = ref.rms_norm(h, lw.input_norm, spec.rms_eps)
        q, k, v = ref.linear(a, lw.qkv).split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        q = ref.apply_rope(q.view(n, spec.num_q_heads, spec.head_dim), pos, cs)
        k = ref.apply_rope(k.view(n, spec.num_kv_heads, spec.head_dim), pos, cs).repeat_interleave(g, dim=1)
        v = v.view(n, spec.num_kv_heads, spec.head_dim).repeat_interleave(g, dim=1)
        att = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                               is_causal=True, scale=spec.head_dim ** -0.5)
        h = h + ref.linear(att.transpose(0, 1).reshape(n, spec.q_size), lw.o)
        m, _ = ref.rms_norm(h, lw.post_norm, spec.rms_eps)
        h = h + ref.linear(ref.silu_and_mul(ref.linear(m, lw.gate_up)), lw.down)
    hn, _ = ref.rms_norm(h[-1:], w.final_norm, spec.rms_eps)
    return ref.linear(hn, w.lm_head)[0].double().cpu()


def fp32_rule(truth: torch.Tensor, stock_tok: int, plugin_tok: int) -> tuple[bool, float]:
    """Issue 13's rule for a first difference: a bug only if the plugin's token is further below the fp32
    best than stock's token by more than bf16 resolution (one bf16 ulp of the best logit). Returns (bug,
    truth[stock] - truth[plugin]: how much worse the plugin's choice is, in fp32 logits)."""
    worse = float(truth[stock_tok] - truth[plugin_tok])
    return worse > bf16_ulp(float(truth.max())), worse
