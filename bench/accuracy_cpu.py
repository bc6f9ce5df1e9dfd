"""CPU accuracy study: is the megakernel's bf16 arithmetic less accurate than the Triton path's?

Runs the Llama-3.2-1B shape (all 16 layers, full 128256 vocabulary unless --layers says otherwise)
with seeded N(0, 0.02) matrices and 1 + N(0, 0.02) norm weights in bf16, generated in exactly the
order of bench/vllm_correctness.py:write_random_checkpoint (same seed -> the same weights as the
H200 run), and compares one decode step (batch 1) computed five ways from identical inputs:

  fp32    reference.decode_step, pure fp32 arithmetic and an fp32 KV cache: the truth
  rref    reference.decode_step(round_dtype=bf16): rounds where the Triton kernels store
  triton  rref plus the Triton attention kernel's numerics (paged_attention.py: online softmax over
          64-token tiles in num_splits splits, p rounded to bf16 before P@V, l summed from the
          rounded p): a torch emulation of the Triton path's rounding points (the Triton
          interpreter is ~2 min per layer here and truncates instead of rounding some casts)
  vm_stock  the same with MK_ROUNDING=1 (encoding.Rounding.STOCK: vLLM's rounding points)
  vm      the megakernel program (persistent.schedule.build_program, 132 queues, lm_head) run by
          persistent.vm (the CPU mirror of csrc/: rounding points, split-KV attention, combine)
  stock   a third, differently rounded bf16 scheme standing in for stock vLLM (approximate:
          norm output rounded twice round(round(x*rstd)*w), every linear output rounded before the
          residual add, gate/up rounded before silu*mul, FlashAttention-style P@V with bf16 p and
          l from fp32 p over 128-token tiles)

All paths use vLLM's bf16 rotary table (what the plugin passes the kernels in vLLM) and compute
fp32 logits from their final normed hidden state (the VM's own LM head task). Two sets of cases:

  forced  the H200 protocol of bench/vllm_correctness.py part (a): prompt and forced continuation
          from random.Random(seed) (512 + 256 tokens), one fp32 prefill of the whole sequence fills
          a bf16 paged cache (block table width 50, as vLLM's max_model_len 800), and decode steps
          at --forced-steps seq_lens run every path on a copy of that shared context (unlike vLLM,
          earlier decode steps' K/V are the shared fp32-prefill values, not each path's own)
  random  testing.make_decode_batch batches (N(0, 1) K/V cache, random token), contexts in
          --random-ctx, one seed per case

Per case: cosine, relative Frobenius error and max |diff| of each path's logits against the
truth's, top-1 and whether it matches the truth's, the truth's top-2 gap, the error of the top-1
vs runner-up logit difference, and the H200 metric (top-1 agreement with `stock`, a mismatch is a
tie when stock's logit of the choice is within max(1 bf16 ulp, 0.05) of stock's max). Then a per-op
localisation on --localise-layers: each op of the VM (prefix runs, stop_after = op_end) against the
fp32 op and the Triton emulation applied to the same (VM) inputs.

    /work/venv/bin/python bench/accuracy_cpu.py --json /tmp/accuracy_cpu.json
    /work/venv/bin/python bench/accuracy_cpu.py --layers 2 --forced-steps 0:256:64 --random-cases 2  # smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mk_plugin import reference as ref
from mk_plugin.persistent import vm
from mk_plugin.persistent.encoding import Buf, Rounding
from mk_plugin.persistent.schedule import build_program
from mk_plugin.persistent.variant import KernelVariant
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import bf16_ulp, make_decode_batch, rel_fro
from mk_plugin.triton_ops.paged_attention import choose_num_splits, tile_tokens
from mk_plugin.weights import LayerWeights, ModelWeights

sys.path.insert(0, str(REPO / "bench"))
from accuracy_emulation import BF16, NUM_SMS, norm_f32, rd, step_emulated, tiled_attention

TIE_GAP = 0.05
PATHS = ("rref", "triton", "vm", "vm_stock", "stock")


# ---- weights -------------------------------------------------------------------------------------
def seeded_weights(spec: LlamaSpec, seed: int, std: float) -> ModelWeights:
    """bench/vllm_correctness.py:write_random_checkpoint's tensors, in its generator order."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size

    def mat(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g) * std).to(BF16)

    def norm() -> torch.Tensor:
        return (1.0 + std * torch.randn(h, generator=g)).to(BF16)

    layers = []
    for _ in range(spec.num_layers):
        n_in, n_post = norm(), norm()
        q, k, vv, o = mat(spec.q_size, h), mat(spec.kv_size, h), mat(spec.kv_size, h), mat(h, spec.q_size)
        gate, up, down = mat(i, h), mat(i, h), mat(h, i)
        layers.append(LayerWeights(n_in, torch.cat([q, k, vv]), o, n_post, torch.cat([gate, up]), down))
    embed = mat(v, h)
    final = norm()
    lm = embed if spec.tie_word_embeddings else mat(v, h)
    return ModelWeights(embed, layers, final, lm)


def step_vm(program, w32: ModelWeights, hidden: torch.Tensor, positions, caches, block_table, seq_lens, slots, cs,
            stop_after: int | None = None, rounding: Rounding = Rounding.FUSED) -> vm.VMState:
    st = vm.make_state(program, w32, hidden, positions, caches, block_table, seq_lens, slots, cs,
                       variant=KernelVariant(rounding=rounding))
    return vm.run(program, st, stop_after=stop_after)


# ---- one case ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    label: str
    ids: torch.Tensor
    positions: torch.Tensor
    caches: list[torch.Tensor]   # bf16, shared context (cloned per path)
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slots: torch.Tensor


def run_case(c: Case, spec: LlamaSpec, w: ModelWeights, w32: ModelWeights, program, cs: torch.Tensor) -> dict:
    """Logits [V] of every path for batch-1 case c, and the hidden states."""
    out, hid, secs = {}, {}, {}
    t = time.time()
    hn, lg = ref.decode_step(spec, w32, c.ids, c.positions, [x.float() for x in c.caches], c.block_table,
                             c.seq_lens, c.slots, cs.float())
    out["fp32"], hid["fp32"], secs["fp32"] = lg[0], hn[0], time.time() - t
    t = time.time()
    hn, lg = ref.decode_step(spec, w32, c.ids, c.positions, [x.clone() for x in c.caches], c.block_table,
                             c.seq_lens, c.slots, cs.float(), round_dtype=BF16)
    out["rref"], hid["rref"], secs["rref"] = lg[0], hn[0], time.time() - t
    for kind in ("triton", "stock"):
        t = time.time()
        hn = step_emulated(kind, spec, w32, c.ids, c.positions, [x.clone() for x in c.caches], c.block_table,
                           c.seq_lens, c.slots, cs.float())
        out[kind], hid[kind], secs[kind] = (hn @ w32.lm_head.t())[0], hn[0], time.time() - t
    for name, rounding in (("vm", Rounding.FUSED), ("vm_stock", Rounding.STOCK)):
        t = time.time()
        st = step_vm(program, w32, w.embed[c.ids].to(BF16), c.positions, [x.clone() for x in c.caches],
                     c.block_table, c.seq_lens, c.slots, cs, rounding=rounding)
        out[name], hid[name], secs[name] = st.bufs[Buf.LOGITS][0].clone(), st.bufs[Buf.OUT][0].float(), time.time() - t
    return {"logits": out, "hidden": hid, "secs": secs}


def case_metrics(label: str, r: dict) -> dict:
    lg, hid = r["logits"], r["hidden"]
    t = lg["fp32"].double()
    top2 = torch.topk(t, 2)
    a, b = int(top2.indices[0]), int(top2.indices[1])
    row = {"case": label, "truth_top1": a, "truth_gap": float(top2.values[0] - top2.values[1])}
    for p in PATHS:
        x = lg[p].double()
        row[p] = {
            "cos": float(torch.nn.functional.cosine_similarity(x, t, dim=0)),
            "rel_fro": rel_fro(x, t), "max_abs": float((x - t).abs().max()),
            "hidden_rel_fro": rel_fro(hid[p], hid["fp32"]),
            "top1": int(x.argmax()), "top1_ok": int(x.argmax()) == a,
            "gap_err": float((x[a] - x[b]) - (t[a] - t[b])),   # error of the top-1 vs runner-up margin
        }
    # pairwise, and the H200 metric against the stock-like path (stock's logits rounded to bf16)
    s16 = rd(lg["stock"].float()).double()
    si = int(s16.argmax())
    s2 = torch.topk(s16, 2).indices
    sa, sb = int(s2[0]), int(s2[1])
    for p in ("rref", "triton", "vm", "vm_stock"):
        x = lg[p].double()
        # error of stock's top-1 vs runner-up margin: what decides a flip against stock
        row[p]["vs_stock_gap_err"] = float((x[sa] - x[sb]) - (s16[sa] - s16[sb]))
        row[p]["vs_stock_rel_fro"] = rel_fro(x, s16)
        pi = int(x.argmax())
        tie = pi != si and float(s16[pi]) >= float(s16[si]) - max(bf16_ulp(float(s16[si])), TIE_GAP)
        row[p]["vs_stock"] = "exact" if pi == si else ("tie" if tie else "MISMATCH")
        row[p]["vs_stock_cos"] = float(torch.nn.functional.cosine_similarity(x, s16, dim=0))
    row["vm_vs_triton"] = {"rel_fro": rel_fro(lg["vm"], lg["triton"]), "same_top1": row["vm"]["top1"] == row["triton"]["top1"],
                           "hidden_rel_fro": rel_fro(hid["vm"], hid["triton"])}
    row["vm_vs_rref"] = {"rel_fro": rel_fro(lg["vm"], lg["rref"]), "same_top1": row["vm"]["top1"] == row["rref"]["top1"]}
    row["secs"] = r["secs"]
    return row


# ---- case builders -----------------------------------------------------------------------------------
def forced_context(spec: LlamaSpec, w32: ModelWeights, cs: torch.Tensor, seed: int, prompt_len: int, steps: int,
                   block_size: int = 16, max_model_len: int = 800) -> tuple[list[int], list[torch.Tensor], torch.Tensor]:
    """Tokens (prompt + forced continuation as bench/vllm_correctness.py part (a)) and bf16 paged
    caches holding the fp32 prefill's K/V of every position; block table width max_model_len / bs."""
    rng = random.Random(seed)
    prompt = [rng.randrange(spec.vocab_size) for _ in range(prompt_len)]
    cont = [rng.randrange(spec.vocab_size) for _ in range(steps + 1)]
    toks = prompt + cont
    T = prompt_len + steps
    nb = -(-max_model_len // block_size)
    bt = torch.arange(nb, dtype=torch.int32)[None]
    caches = [torch.zeros(nb + 1, 2, block_size, spec.num_kv_heads, spec.head_dim, dtype=BF16)
              for _ in range(spec.num_layers)]
    pos = torch.arange(T)
    h = w32.embed[torch.tensor(toks[:T])].float()
    d, eps = spec.head_dim, spec.rms_eps
    G = spec.gqa_group
    for i, lw in enumerate(w32.layers):
        a = norm_f32(h, lw.input_norm, eps)
        q, k, v = ref.linear(a, lw.qkv).split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        q = ref.apply_rope(q.view(T, spec.num_q_heads, d), pos, cs.float())
        k = ref.apply_rope(k.view(T, spec.num_kv_heads, d), pos, cs.float())
        v = v.view(T, spec.num_kv_heads, d)
        caches[i][pos // block_size, 0, pos % block_size] = k.to(BF16)
        caches[i][pos // block_size, 1, pos % block_size] = v.to(BF16)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(G, 1).transpose(0, 1), v.repeat_interleave(G, 1).transpose(0, 1),
            is_causal=True).transpose(0, 1).reshape(T, -1)
        h = h + ref.linear(o, lw.o)
        m = norm_f32(h, lw.post_norm, eps)
        h = h + ref.linear(ref.silu_and_mul(ref.linear(m, lw.gate_up)), lw.down)
    return toks, caches, bt


def forced_case(toks: list[int], caches: list[torch.Tensor], bt: torch.Tensor, seq_len: int) -> Case:
    pos = seq_len - 1
    bs = caches[0].shape[2]
    return Case(f"forced L={seq_len}", torch.tensor([toks[pos]]), torch.tensor([pos]), caches, bt,
                torch.tensor([seq_len], dtype=torch.int32),
                torch.tensor([int(bt[0, pos // bs]) * bs + pos % bs]))


def random_case(spec: LlamaSpec, ctx: int, seed: int) -> Case:
    bt = make_decode_batch(spec, [ctx], seed=seed, dtype=BF16)
    return Case(f"random L={ctx} s={seed}", bt.input_ids, bt.positions, bt.kv_caches, bt.block_table, bt.seq_lens,
                bt.slot_mapping)


# ---- per-op localisation -------------------------------------------------------------------------------
def localise(spec: LlamaSpec, w: ModelWeights, w32: ModelWeights, program, c: Case, layer: int,
             cs: torch.Tensor) -> list[dict]:
    """For each op of `layer`: the VM's output (prefix run) vs the fp32 op and vs the Triton
    emulation of the op, both applied to the VM's own inputs of that op (state of the prefix before
    it). Errors are relative Frobenius vs the fp32 op."""
    eps, d, b = spec.rms_eps, spec.head_dim, 1
    lw = w32.layers[layer]
    hidden = w.embed[c.ids].to(BF16)
    keys = [f"L{layer}.{n}" for n in ("qkv_rope", "attention", "o_proj", "gate_up", "down")]
    last = layer == spec.num_layers - 1
    if last:
        keys.append("final_norm")
    prev = None if layer == 0 else f"L{layer - 1}.down"
    states = {}
    for key in ([prev] if prev else []) + keys:
        caches = [x.clone() for x in c.caches]
        st = step_vm(program, w32, hidden, c.positions, caches, c.block_table, c.seq_lens, c.slots, cs,
                     stop_after=program.op_end(key))
        states[key] = (st, caches)
    h_in = hidden.float() if prev is None else states[prev][0].bufs[Buf.RESID].float()
    bs = c.caches[0].shape[2]
    slot = int(c.slots[0])
    blk, off = slot // bs, slot % bs
    splits = choose_num_splits(b, spec.num_kv_heads, c.block_table.shape[1] * bs, bs, NUM_SMS)
    rows = []

    def add(op: str, vm_out: torch.Tensor, exact: torch.Tensor, emu: torch.Tensor) -> None:
        vm_out, exact, emu = vm_out.float().reshape(-1), exact.float().reshape(-1), emu.float().reshape(-1)
        rows.append({"layer": layer, "op": op, "vm_rel": rel_fro(vm_out, exact), "triton_rel": rel_fro(emu, exact),
                     "vm_vs_triton_rel": rel_fro(vm_out, emu),
                     "bitwise_equal_frac": float((vm_out == emu).float().mean())})

    # qkv_rope
    st, caches = states[keys[0]]
    y = ref.linear(norm_f32(h_in, lw.input_norm, eps), lw.qkv)
    q, k, v = y.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    qe = ref.apply_rope(q.view(b, -1, d), c.positions, cs.float())
    ke = ref.apply_rope(k.view(b, -1, d), c.positions, cs.float())
    y2 = rd(ref.linear(rd(norm_f32(h_in, lw.input_norm, eps)), lw.qkv))
    q2, k2, v2 = y2.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    qt = rd(ref.apply_rope(q2.view(b, -1, d), c.positions, cs.float()))
    kt = rd(ref.apply_rope(k2.view(b, -1, d), c.positions, cs.float()))
    add("qkv_rope: q", st.bufs[Buf.Q], qe, qt)
    add("qkv_rope: k (cache)", caches[layer][blk, 0, off], ke, kt)
    add("qkv_rope: v (cache)", caches[layer][blk, 1, off], v, v2)
    # attention, on the VM's Q and cache
    st, caches = states[keys[1]]
    qv = st.bufs[Buf.Q].float().view(b, -1, d)
    ex = ref.paged_attention(qv, caches[layer], c.block_table, c.seq_lens, d ** -0.5)
    em = rd(tiled_attention(qv, caches[layer], c.block_table, c.seq_lens, d ** -0.5, tile=tile_tokens(bs),
                            num_splits=splits, l_from_rounded=True))
    add("attention", st.bufs[Buf.ATTN_O], ex, em)
    # o_proj
    attn = st.bufs[Buf.ATTN_O].float()
    st, _ = states[keys[2]]
    ex = h_in + ref.linear(attn, lw.o)
    add("o_proj (+residual)", st.bufs[Buf.RESID], ex, rd(ex))
    # gate_up
    r1 = st.bufs[Buf.RESID].float()
    st, _ = states[keys[3]]
    ex = ref.silu_and_mul(ref.linear(norm_f32(r1, lw.post_norm, eps), lw.gate_up))
    em = rd(ref.silu_and_mul(ref.linear(rd(norm_f32(r1, lw.post_norm, eps)), lw.gate_up)))
    add("gate_up (norm+silu*mul)", st.bufs[Buf.ACT], ex, em)
    # down
    act = st.bufs[Buf.ACT].float()
    st, _ = states[keys[4]]
    ex = r1 + ref.linear(act, lw.down)
    add("down (+residual)", st.bufs[Buf.RESID], ex, rd(ex))
    if last:
        r2 = st.bufs[Buf.RESID].float()
        st, _ = states[keys[5]]
        ex = norm_f32(r2, w32.final_norm, eps)
        add("final_norm", st.bufs[Buf.OUT], ex, rd(ex))
    return rows


def check_decoder(spec: LlamaSpec, w: ModelWeights, w32: ModelWeights, program, c: Case, cs: torch.Tensor) -> bool:
    """MegakernelDecoder (bf16 weights, executor vm) gives bit-identical logits to step_vm (fp32 copies)."""
    from mk_plugin.persistent.backend import MegakernelDecoder
    dec = MegakernelDecoder(spec, w, 1, "cpu", lm_head=True, num_sms=NUM_SMS)
    hidden = w.embed[c.ids].to(BF16)
    lo = torch.full((1, spec.vocab_size), float("nan"))
    dec(hidden, c.positions, [x.clone() for x in c.caches], c.block_table, c.seq_lens, c.slots, cs, logits_out=lo)
    st = step_vm(program, w32, hidden, c.positions, [x.clone() for x in c.caches], c.block_table, c.seq_lens,
                 c.slots, cs)
    return bool(torch.equal(lo, st.bufs[Buf.LOGITS]))


# ---- summary ---------------------------------------------------------------------------------------------
def summarise(rows: list[dict]) -> dict:
    s: dict = {"cases": len(rows)}
    for p in PATHS:
        rf = [r[p]["rel_fro"] for r in rows]
        ge = [abs(r[p]["gap_err"]) for r in rows]
        s[p] = {"rel_fro_mean": statistics.fmean(rf), "rel_fro_max": max(rf),
                "cos_min": min(r[p]["cos"] for r in rows), "max_abs_max": max(r[p]["max_abs"] for r in rows),
                "hidden_rel_fro_mean": statistics.fmean(r[p]["hidden_rel_fro"] for r in rows),
                "top1_flips_vs_truth": sum(not r[p]["top1_ok"] for r in rows),
                "gap_err_rms": math.sqrt(statistics.fmean(g * g for g in ge))}
        if p != "stock":
            s[p]["vs_stock"] = {k: sum(r[p]["vs_stock"] == k for r in rows) for k in ("exact", "tie", "MISMATCH")}
            s[p]["vs_stock_gap_err_rms"] = math.sqrt(statistics.fmean(r[p]["vs_stock_gap_err"] ** 2 for r in rows))
            s[p]["vs_stock_rel_fro_mean"] = statistics.fmean(r[p]["vs_stock_rel_fro"] for r in rows)
    ratio = [r["vm"]["rel_fro"] / r["triton"]["rel_fro"] for r in rows]
    ratio_r = [r["vm"]["rel_fro"] / r["rref"]["rel_fro"] for r in rows]
    s["vm_over_triton_rel_fro"] = {"mean": statistics.fmean(ratio), "min": min(ratio), "max": max(ratio),
                                   "cases_vm_worse": sum(x > 1 for x in ratio)}
    s["vm_over_rref_rel_fro"] = {"mean": statistics.fmean(ratio_r), "min": min(ratio_r), "max": max(ratio_r),
                                 "cases_vm_worse": sum(x > 1 for x in ratio_r)}
    s["vm_vs_triton_top1_differs"] = sum(not r["vm_vs_triton"]["same_top1"] for r in rows)
    s["vm_vs_triton_rel_fro_mean"] = statistics.fmean(r["vm_vs_triton"]["rel_fro"] for r in rows)
    s["truth_gap_lt_0.05"] = sum(r["truth_gap"] < TIE_GAP for r in rows)
    return s


def fmt_table(rows: list[dict]) -> str:
    hdr = ("| case | truth gap | " + " | ".join(f"{p} rel / cos / max / top1" for p in PATHS)
           + " | vm-vs-triton rel | vm, triton vs stock |")
    lines = [hdr, "|" + "---|" * (4 + len(PATHS))]
    for r in rows:
        cells = [f"{r[p]['rel_fro']:.2e} / {r[p]['cos']:.6f} / {r[p]['max_abs']:.3f} / "
                 f"{'ok' if r[p]['top1_ok'] else 'FLIP'}" for p in PATHS]
        lines.append(f"| {r['case']} | {r['truth_gap']:.4f} | " + " | ".join(cells)
                     + f" | {r['vm_vs_triton']['rel_fro']:.2e} | {r['vm']['vs_stock']}, {r['triton']['vs_stock']} |")
    return "\n".join(lines)


def parse_range(s: str) -> list[int]:
    a, b, n = (int(x) for x in s.split(":"))
    if n <= 0:
        return []
    return sorted({a + round(k * (b - a - 1) / max(1, n - 1)) for k in range(n)})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=str(REPO / "bench/models/llama-3.2-1b"))
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the config (default: all)")
    p.add_argument("--seed", type=int, default=0, help="weights and forced-sequence seed (H200 run: 0)")
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--forced-total", type=int, default=256, help="forced continuation length")
    p.add_argument("--forced-steps", default="0:256:40",
                   help="START:STOP:N: N decode steps evenly spaced in [START, STOP) of the continuation")
    p.add_argument("--random-cases", type=int, default=12)
    p.add_argument("--random-ctx", default="512:700", help="LO:HI context lengths of the random cases")
    p.add_argument("--localise-layers", default="0,last", help="comma list of layers (or 'last'); '' for none")
    p.add_argument("--no-check-decoder", action="store_true", help="skip the MegakernelDecoder bit-equality check")
    p.add_argument("--json", default=None, help="write every per-case row and the summary here")
    a = p.parse_args(argv)
    torch.manual_seed(0)

    spec = LlamaSpec.from_json_file(a.model_dir)
    if a.layers is not None:
        spec = dataclasses.replace(spec, num_layers=a.layers)
    print(f"[acc] {spec.name}: {spec.num_layers} layers, H {spec.hidden_size}, I {spec.intermediate_size}, "
          f"V {spec.vocab_size}; torch threads {torch.get_num_threads()}", flush=True)
    t0 = time.time()
    w = seeded_weights(spec, a.seed, a.std)
    w32 = w.to(dtype=torch.float32)      # the same values; saves a bf16->fp32 copy per matmul
    print(f"[acc] weights in {time.time() - t0:.0f} s", flush=True)
    max_pos = a.prompt_len + a.forced_total + 64
    cs = ref.rope_cos_sin_cache(spec, max(max_pos, 1024)).to(BF16)   # vLLM's table, in the model dtype
    program = build_program(spec, 1, NUM_SMS, lm_head=True)
    rows: list[dict] = []
    local: list[dict] = []
    forced_lens = [a.prompt_len + 1 + j for j in parse_range(a.forced_steps)]
    first_forced = None
    if forced_lens:
        t0 = time.time()
        toks, caches, bt = forced_context(spec, w32, cs, a.seed, a.prompt_len, a.forced_total)
        print(f"[acc] fp32 prefill of {len(toks) - 1} tokens in {time.time() - t0:.0f} s", flush=True)
        for L in forced_lens:
            c = forced_case(toks, caches, bt, L)
            first_forced = first_forced or c
            r = case_metrics(c.label, run_case(c, spec, w, w32, program, cs))
            rows.append(r)
            print(f"[acc] {c.label}: " + ", ".join(f"{q} {r[q]['rel_fro']:.2e}{'' if r[q]['top1_ok'] else ' FLIP'}"
                                                   for q in PATHS)
                  + f"; gap {r['truth_gap']:.3f}; {sum(r['secs'].values()):.1f} s", flush=True)
    lo, hi = (int(x) for x in a.random_ctx.split(":"))
    rng = random.Random(a.seed + 100)
    for k in range(a.random_cases):
        c = random_case(spec, rng.randrange(lo, hi + 1), 1000 + k)
        r = case_metrics(c.label, run_case(c, spec, w, w32, program, cs))
        rows.append(r)
        print(f"[acc] {c.label}: " + ", ".join(f"{q} {r[q]['rel_fro']:.2e}{'' if r[q]['top1_ok'] else ' FLIP'}"
                                               for q in PATHS)
              + f"; gap {r['truth_gap']:.3f}; {sum(r['secs'].values()):.1f} s", flush=True)
    loc_case = first_forced or (random_case(spec, 600, 999) if a.localise_layers else None)
    for tok in filter(None, a.localise_layers.split(",")):
        layer = spec.num_layers - 1 if tok == "last" else int(tok)
        local += localise(spec, w, w32, program, loc_case, layer, cs)
    dec_ok = None
    if not a.no_check_decoder and rows:
        dec_ok = check_decoder(spec, w, w32, program, loc_case or random_case(spec, 600, 999), cs)
    groups = {"forced": [r for r in rows if r["case"].startswith("forced")],
              "random": [r for r in rows if r["case"].startswith("random")], "all": rows}
    summary = {g: summarise(rs) for g, rs in groups.items() if rs}
    print("\n" + fmt_table(rows))
    print("\nper-op localisation (rel Frobenius vs the fp32 op on the VM's own inputs):")
    print("| layer | op | vm rel | triton-emu rel | vm vs triton-emu rel | bitwise equal |\n|---|---|---|---|---|---|")
    for x in local:
        print(f"| {x['layer']} | {x['op']} | {x['vm_rel']:.3e} | {x['triton_rel']:.3e} | {x['vm_vs_triton_rel']:.3e} "
              f"| {x['bitwise_equal_frac']:.1%} |")
    print("\nMegakernelDecoder(vm) == direct VM run (bitwise):", dec_ok)
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps({"spec": dataclasses.asdict(spec) | {"rope_scaling": str(spec.rope_scaling)},
                                            "args": vars(a), "rows": rows, "local": local, "summary": summary,
                                            "decoder_bitwise_equal": dec_ok}, indent=1))


if __name__ == "__main__":
    main()
