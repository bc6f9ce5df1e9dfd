"""Stock vLLM vs the mk_plugin decode path inside vLLM, on the GPU host. Exits non-zero on failure.

Each engine runs in its own child process; stock and plugin children get identical engine args.

(a) logits, dummy weights (vLLM's dummy loader, seed 1234 per parameter: the same in both runs),
    batch 1, enforce_eager=True. Both runs are teacher-forced along the same token sequence
    (MK_FORCE_TOKENS: prompt + a fixed random continuation), so step k of both runs sees exactly the
    same context. MK_DUMP_LOGITS saves the full-vocabulary fp32 logits that vLLM's compute_logits
    returns at every step (before forcing). Compared per decode step, over the whole vocabulary:
    cosine similarity (must be >= 0.999 at every step) and top-1 agreement (>= 99% of the steps; a
    mismatch where stock's logit of the plugin's choice is within one bf16 ulp of stock's maximum,
    a tie in the bf16 logits, is counted and reported as a tie). The "stock" run here is the
    plugin's class in MK_MODE=stock (vLLM's own forward; the dump hook lives in the class); the LM
    head is vLLM's in both runs, so the comparison covers everything before it (with --mk-env
    MK_LM_HEAD=megakernel the plugin run's logits are the megakernel's own, and it covers the LM head too).
    CAVEAT: vLLM's dummy weights are uniform in [-1e-3, 1e-3] (norm weights too), so every layer adds
    only ~0.1-1% to the residual stream and the logits are dominated by the embedding: (a) with dummy
    weights checks the plumbing but cannot catch a wrong layer. `--a-weights random` (or
    `dummy,random`) repeats (a) on the seeded checkpoint of (b), where it is a strict per-step check;
    there a top-1 mismatch counts as a near tie when stock's logit gap is < 0.05, as in (b).
(b) greedy tokens, real weights: seeded N(0, 0.02) matrices and 1 + N(0, 0.02) norm weights written
    as safetensors with the model's config.json; default engine settings (CUDA graphs on), batch 1
    and batch 4 (different prompt lengths). Stock is vLLM without the plugin (VLLM_PLUGINS="").
    Tokens must be identical for the first --min-identical (64) steps of every request; a difference
    there is accepted only where stock's top-2 logprob gap at that step is < 0.05 (a near tie);
    every such case is reported.

    export PYTHONPATH=/root/vsite VLLM_USE_FLASHINFER_SAMPLER=0
    python bench/vllm_correctness.py                         # 1B, parts a and b, MK_MODE=triton
    python bench/vllm_correctness.py --models llama-3.1-8b --parts b --runner v1
    python bench/vllm_correctness.py --parts c --mode megakernel   # (c): both paths against the fp32 truth

(c) the fp32 truth (issue 13): the seeded checkpoint, teacher-forced along one sequence (batch 1, and
    batch 4 whose prompts are prefixes of it, so every request's context crosses block boundaries),
    eager, through stock (the plugin's class on vLLM's forward: the dump hook lives there) and --mode;
    every dumped step is compared with bench/fp32_truth.py's fp32 reference of the same weights and
    tokens: relative logit error, KL(fp32 || path), fp32-argmax agreement where the truth's top-2 gap is
    above bf16 resolution. A plugin path passes when its median and p99 error are <= 1.1x stock's and
    its agreement is >= stock's - 0.5 points.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from mk_plugin.testing import bf16_ulp

TIE_GAP = 0.05          # (b): a divergence is acceptable only where stock's top-2 gap is below this
MIN_COSINE = 0.999      # (a): per decode step, full vocabulary
MIN_TOP1 = 0.99         # (a): fraction of decode steps whose top-1 agrees (ties included)
WEIGHT_STD = 0.02       # seeded checkpoint: N(0, WEIGHT_STD) matrices, 1 + N(0, WEIGHT_STD) norm weights
DEFAULT_WEIGHTS_DIR = Path(tempfile.gettempdir()) / "mk_correctness_weights"  # shared with bench/soak.py


# ---- children --------------------------------------------------------------------------------------
def child_main(p: dict[str, Any]) -> None:
    if p["part"] == "truth":
        truth_child(p)
        return
    import torch
    from vllm import LLM, SamplingParams

    args: dict[str, Any] = {"model": p["model_dir"], "skip_tokenizer_init": True, "seed": 0,
                            "gpu_memory_utilization": p["gpu_mem"], "max_model_len": p["max_model_len"],
                            "enforce_eager": p["enforce_eager"]}
    if p.get("dummy"):
        args["load_format"] = "dummy"
    llm = LLM(**args)
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "engine_args": args}
    if p["part"] in ("a", "c"):
        sp = SamplingParams(max_tokens=p["max_tokens"], ignore_eos=True, temperature=0.0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": q} for q in p.get("prompts", [p.get("prompt")])], sp, use_tqdm=False)
        out["tokens"] = list(outs[0].outputs[0].token_ids)
        out["all_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    else:
        sp = SamplingParams(max_tokens=p["max_tokens"], ignore_eos=True, temperature=0.0, logprobs=2,
                            detokenize=False)
        out["batches"] = []
        for prompts in p["batches"]:
            outs = llm.generate([{"prompt_token_ids": q} for q in prompts], sp, use_tqdm=False)
            out["batches"].append([{"tokens": list(o.outputs[0].token_ids), "top2": top2_of(o.outputs[0])}
                                   for o in outs])
    out["status"] = common.worker_status(llm)
    common.emit_result(out)
    del llm  # shuts the engine core down: the next child needs the GPU memory
    gc.collect()


def top2_of(c: Any) -> list[list[list[float]]]:
    """[[token, logprob] of ranks 1 and 2] at every position of a vLLM CompletionOutput that was asked
    for logprobs=2 (an empty list where vLLM gave none). Also right for DELTA outputs (bench/soak.py),
    whose logprobs cover only the new tokens."""
    tops = []
    for pos in range(len(c.token_ids)):
        d = c.logprobs[pos] if c.logprobs is not None else {}
        ranked = sorted(d.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))
        tops.append([[int(t), float(lp.logprob)] for t, lp in ranked[:2]])
    return tops


# ---- seeded weights as safetensors (part b) ---------------------------------------------------------
def seeded_checkpoint(mdir: Path, weights_dir: Path, seed: int) -> Path:
    """The seeded N(0, WEIGHT_STD) checkpoint of mdir's config under weights_dir (written once, then
    reused: vllm_correctness.py and soak.py with the same seed share it)."""
    return write_random_checkpoint(mdir, weights_dir / f"{mdir.name}-seed{seed}", seed, WEIGHT_STD)


def write_random_checkpoint(mdir: Path, dest: Path, seed: int, std: float) -> Path:
    """config.json + one safetensors file per layer (HF names, q/k/v and gate/up separate, bf16),
    reused when dest already holds the same (config, seed, std)."""
    import torch
    from safetensors.torch import save_file

    from mk_plugin.spec import LlamaSpec

    cfg = common.load_hf_config(mdir)
    key = {"config": cfg, "seed": seed, "std": std, "format": 1}
    done = dest / "mk_complete.json"
    if done.exists() and json.loads(done.read_text()) == key:
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    spec = LlamaSpec.from_hf_config(cfg, name=mdir.name)
    g = torch.Generator().manual_seed(seed)
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size

    def mat(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g) * std).to(torch.bfloat16)

    def norm() -> torch.Tensor:
        return (1.0 + std * torch.randn(h, generator=g)).to(torch.bfloat16)

    t0 = time.time()
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        save_file({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                   p + "self_attn.q_proj.weight": mat(spec.q_size, h), p + "self_attn.k_proj.weight": mat(spec.kv_size, h),
                   p + "self_attn.v_proj.weight": mat(spec.kv_size, h), p + "self_attn.o_proj.weight": mat(h, spec.q_size),
                   p + "mlp.gate_proj.weight": mat(i, h), p + "mlp.up_proj.weight": mat(i, h),
                   p + "mlp.down_proj.weight": mat(h, i)},
                  str(dest / f"model-layer{n:03d}.safetensors"), metadata={"format": "pt"})
    top = {"model.embed_tokens.weight": mat(v, h), "model.norm.weight": norm()}
    if not spec.tie_word_embeddings:
        top["lm_head.weight"] = mat(v, h)
    save_file(top, str(dest / "model-top.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    done.write_text(json.dumps(key))
    print(f"[correctness] wrote {spec.name} weights (seed {seed}, std {std}) to {dest} in {time.time() - t0:.0f} s")
    return dest


# ---- comparisons ----------------------------------------------------------------------------------
def load_dumps(d: Path, prompt_len: int, last: int) -> dict[int, Any]:
    """seq_len -> fp32 logits [vocab] of the batch-1 request (warm-up/dummy steps are dropped)."""
    import torch

    by_len: dict[int, Any] = {}
    for f in sorted(d.glob("logits_*.pt")):
        rec = torch.load(f)
        lens = rec["seq_lens"]
        if len(lens) == 1 and prompt_len <= lens[0] <= last:
            by_len[lens[0]] = rec["logits"][0].double()
    return by_len


def compare_logits(stock: dict[int, Any], plugin: dict[int, Any], lens: list[int], tie_abs: float = 0.0
                   ) -> dict[str, Any]:
    """Per seq_len: cosine over the vocabulary and top-1; a top-1 mismatch is a tie when stock's logit
    of the plugin's choice is within max(1 bf16 ulp of stock's max, tie_abs) of stock's max."""
    import torch

    cos, exact, ties, missing = [], 0, [], []
    for n in lens:
        if n not in stock or n not in plugin:
            missing.append(n)
            continue
        s, p = stock[n], plugin[n]
        cos.append(float(torch.nn.functional.cosine_similarity(s, p, dim=0)))
        si, pi = int(s.argmax()), int(p.argmax())
        if si == pi:
            exact += 1
        elif float(s[pi]) >= float(s[si]) - max(bf16_ulp(float(s[si])), tie_abs):
            ties.append(n)
    n_cmp = len(cos)
    return {"steps": n_cmp, "missing": missing, "min_cos": min(cos) if cos else float("nan"),
            "mean_cos": sum(cos) / n_cmp if n_cmp else float("nan"), "exact": exact, "ties": ties,
            "agree": (exact + len(ties)) / n_cmp if n_cmp else 0.0}


def compare_greedy(stock: dict[str, Any], plugin: dict[str, Any], min_identical: int) -> dict[str, Any]:
    st, pt = stock["tokens"], plugin["tokens"]
    n = min(len(st), len(pt))
    d = next((k for k in range(n) if st[k] != pt[k]), None)
    lp_diff = 0.0
    for k in range(n if d is None else d):
        if stock["top2"][k] and plugin["top2"][k]:
            lp_diff = max(lp_diff, abs(stock["top2"][k][0][1] - plugin["top2"][k][0][1]))
    gap = None
    if d is not None and len(stock["top2"][d]) >= 2:
        gap = stock["top2"][d][0][1] - stock["top2"][d][1][1]
    if len(st) < min_identical or len(pt) < min_identical:
        verdict = "FAIL (short output)"
    elif d is None or d >= min_identical:
        verdict = "ok"
    elif gap is not None and gap < TIE_GAP:
        verdict = "ok (near tie)"
    else:
        verdict = "FAIL"
    return {"steps": n, "first_diff": d, "gap": gap, "max_lp_diff": lp_diff, "verdict": verdict}


# ---- parent ---------------------------------------------------------------------------------------
def run_pair(label: str, payload: dict[str, Any], modes: tuple[str, str], a: argparse.Namespace, shim: Path | None,
             extra: dict[str, dict[str, str]] | None = None) -> tuple[dict, dict] | None:
    res = []
    for mode in modes:
        log = a.outdir / "logs" / f"correctness_{common.run_stamp()}_{label}_{mode}.log"
        print(f"[correctness] {label}: {mode} ...", flush=True)
        try:
            res.append(common.run_child(Path(__file__), payload,
                                        common.child_env(mode, a.runner, extra=(extra or {}).get(mode), shim=shim,
                                                         mk_env=a.mk_env),
                                        log, a.timeout))
        except common.ChildFailed as e:
            print(e, file=sys.stderr)
            return None
    return res[0], res[1]


def part_a(mdir: Path, a: argparse.Namespace, shim: Path | None, work: Path, weights: str) -> tuple[list, bool]:
    hf = common.load_hf_config(mdir)
    dummy = weights == "dummy"
    src = mdir if dummy else seeded_checkpoint(mdir, a.weights_dir, a.seed)
    tag = f"{mdir.name}_a_{weights}"
    rng = random.Random(a.seed)
    prompt = [rng.randrange(hf["vocab_size"]) for _ in range(a.prompt_a)]
    cont = [rng.randrange(hf["vocab_size"]) for _ in range(a.steps_a + 1)]
    force = work / f"force_{tag}.json"
    force.write_text(json.dumps(prompt + cont))
    dumps = {m: work / f"dump_{tag}_{m}" for m in ("mk-stock", a.mode)}
    for d in dumps.values():
        shutil.rmtree(d, ignore_errors=True)
    extra = {m: {"MK_DUMP_LOGITS": str(d), "MK_FORCE_TOKENS": str(force)} for m, d in dumps.items()}
    payload = {"part": "a", "model_dir": str(src), "dummy": dummy, "prompt": prompt, "max_tokens": a.steps_a + 1,
               "gpu_mem": a.gpu_mem, "enforce_eager": True,
               "max_model_len": common.max_model_len_for(a.prompt_a, a.steps_a + 1)}
    pair = run_pair(tag, payload, ("mk-stock", a.mode), a, shim, extra)
    if pair is None:
        return [[mdir.name, f"a ({weights})", "child failed", "", "", "", "", "FAIL"]], False
    rs, rp = pair
    problems = [f"{m} tokens do not follow the forced sequence" for m, r in (("stock", rs), (a.mode, rp))
                if r["tokens"] != cont]
    check = common.path_check(a.mode, rp["status"], a.mk_env)
    if check != "ok":
        problems.append(check)
    last = a.prompt_a + a.steps_a
    s, p = load_dumps(dumps["mk-stock"], a.prompt_a, last), load_dumps(dumps[a.mode], a.prompt_a, last)
    tie_abs = 0.0 if dummy else TIE_GAP
    pre = compare_logits(s, p, [a.prompt_a], tie_abs)  # the prefill step: stock path in both runs
    c = compare_logits(s, p, list(range(a.prompt_a + 1, last + 1)), tie_abs)
    if c["missing"]:
        problems.append(f"{len(c['missing'])} decode steps without dumps (first seq_len {c['missing'][0]})")
    ok = not problems and c["steps"] == a.steps_a and c["min_cos"] >= MIN_COSINE and c["agree"] >= MIN_TOP1
    row = [mdir.name, f"a ({weights}): {c['steps']} decode steps", f"{c['min_cos']:.6f} / {c['mean_cos']:.6f}",
           f"{c['exact']}/{c['steps']}", f"{len(c['ties'])}" + (f" (seq_lens {c['ties'][:8]})" if c["ties"] else ""),
           f"{c['agree'] * 100:.1f}%", f"prefill cos {pre['min_cos']:.6f}" + ("; " + "; ".join(problems) if problems else ""),
           "PASS" if ok else "FAIL"]
    if not a.keep:
        for d in dumps.values():
            shutil.rmtree(d, ignore_errors=True)
    return [row], ok


def part_b(mdir: Path, a: argparse.Namespace, shim: Path | None) -> tuple[list, bool]:
    hf = common.load_hf_config(mdir)
    wdir = seeded_checkpoint(mdir, a.weights_dir, a.seed)
    rng = random.Random(a.seed + 1)
    lens4 = [max(1, a.prompt_b + dl) for dl in (0, -13, 7, -29)]
    batches = [[[rng.randrange(hf["vocab_size"]) for _ in range(a.prompt_b)]],
               [[rng.randrange(hf["vocab_size"]) for _ in range(n)] for n in lens4]]
    payload = {"part": "b", "model_dir": str(wdir), "batches": batches, "max_tokens": a.steps_b,
               "gpu_mem": a.gpu_mem, "enforce_eager": a.eager_b,
               "max_model_len": common.max_model_len_for(max(lens4), a.steps_b)}
    pair = run_pair(f"{mdir.name}_b", payload, ("stock", a.mode), a, shim)
    if pair is None:
        return [[mdir.name, "b", "child failed", "", "", "", "", "FAIL"]], False
    rs, rp = pair
    rows, ok = [], True
    check = common.path_check(a.mode, rp["status"], a.mk_env)
    if check != "ok":
        ok = False
        rows.append([mdir.name, "b", "", "", "", "", check, "FAIL"])
    for bi, (bs, bp) in enumerate(zip(rs["batches"], rp["batches"], strict=True)):
        for ri, (qs, qp) in enumerate(zip(bs, bp, strict=True)):
            c = compare_greedy(qs, qp, a.min_identical)
            ok &= c["verdict"].startswith("ok")
            rows.append([mdir.name, f"b: batch {len(bs)} req {ri} ({len(batches[bi][ri])}-token prompt)",
                         f"{c['steps']} steps", "identical" if c["first_diff"] is None else f"first diff at {c['first_diff']}",
                         "" if c["gap"] is None else f"stock top-2 gap {c['gap']:.4f}",
                         f"max |dlogprob| {c['max_lp_diff']:.4f}", "", c["verdict"].upper() if c["verdict"] == "ok"
                         else c["verdict"]])
    return rows, ok


# ---- (c): every step against the fp32 truth (bench/fp32_truth.py) -------------------------------------
def load_dump_samples(d: Path, lo: int, hi: int) -> list[tuple[int, Any]]:
    """(seq_len, fp32 logits) of every request row of every dumped step with lo <= seq_len <= hi."""
    import torch

    out = []
    for f in sorted(d.glob("logits_*.pt")):
        rec = torch.load(f)
        out += [(n, rec["logits"][r]) for r, n in enumerate(rec["seq_lens"]) if lo <= n <= hi]
    return out


def truth_child(p: dict[str, Any]) -> None:
    """GPU child without vLLM: the fp32 truth of the forced sequence, then each path's metrics."""
    import fp32_truth as ft
    import torch

    from mk_plugin.spec import LlamaSpec

    spec = LlamaSpec.from_hf_config(common.load_hf_config(Path(p["model_dir"])), name="truth")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = ft.load_checkpoint(Path(p["model_dir"]), spec, dev)
    truth = ft.truth_logits(spec, w, p["tokens"], p["lo"], p["hi"], dev, p["block_size"])
    res = {}
    for path, d in p["dumps"].items():
        samples = load_dump_samples(Path(d), p["lo"], p["hi"])
        res[path] = ft.summarize([ft.step_metrics(truth[n], lg) for n, lg in samples])
    common.emit_result({"summaries": res})


def part_c(mdir: Path, a: argparse.Namespace, shim: Path | None, work: Path) -> tuple[list, bool]:
    """Teacher-forced batch 1 and batch 4 (prefixes of one sequence: contexts cross block boundaries)
    through stock (the plugin's class on vLLM's forward, where the dump hook lives) and --mode; every
    dumped step against the fp32 truth; the verdict of fp32_truth.verdict."""
    import fp32_truth as ft

    hf = common.load_hf_config(mdir)
    wdir = seeded_checkpoint(mdir, a.weights_dir, a.seed)
    rng = random.Random(a.seed + 2)
    seq = [rng.randrange(hf["vocab_size"]) for _ in range(a.prompt_c + a.steps_c + 1)]
    force = work / f"force_{mdir.name}_c.json"
    force.write_text(json.dumps(seq))
    rows, ok = [], True
    for batch in (1, 4):
        prompts = [seq[: a.prompt_c - d] for d in (0, 13, 29, 46)[:batch]]
        lo, hi = min(map(len, prompts)) + 1, a.prompt_c + a.steps_c
        tag = f"{mdir.name}_c_b{batch}"
        dumps = {m: work / f"dump_{tag}_{m}" for m in ("mk-stock", a.mode)}
        extra = {m: {"MK_DUMP_LOGITS": str(d), "MK_FORCE_TOKENS": str(force)} for m, d in dumps.items()}
        payload = {"part": "c", "model_dir": str(wdir), "prompts": prompts, "max_tokens": a.steps_c,
                   "gpu_mem": a.gpu_mem, "enforce_eager": True, "max_model_len": common.max_model_len_for(hi, 1)}
        pair = run_pair(tag, payload, ("mk-stock", a.mode), a, shim, extra)
        if pair is None:
            rows.append([mdir.name, f"c: batch {batch}", "child failed", "", "", "", "", "FAIL"])
            ok = False
            continue
        truth_payload = {"part": "truth", "model_dir": str(wdir), "tokens": seq, "lo": lo, "hi": hi,
                         "block_size": 16, "dumps": {m: str(d) for m, d in dumps.items()}}
        try:
            summ = common.run_child(Path(__file__), truth_payload, common.child_env("stock", a.runner),
                                    a.outdir / "logs" / f"correctness_{common.run_stamp()}_{tag}_truth.log",
                                    a.timeout)["summaries"]
        except common.ChildFailed as e:
            print(e, file=sys.stderr)
            rows.append([mdir.name, f"c: batch {batch}", "truth child failed", "", "", "", "", "FAIL"])
            ok = False
            continue
        good, why = ft.verdict(summ["mk-stock"], summ[a.mode])
        ok &= good
        for m in ("mk-stock", a.mode):
            s = summ[m]
            rows.append([mdir.name, f"c: batch {batch}, {m}: {s['steps']} steps", f"{s['rel_median']:.3e} / {s['rel_p99']:.3e}",
                         f"{s['kl_median']:.2e} / {s['kl_p99']:.2e}", f"{s['decided']} decided steps",
                         f"{s['agree'] * 100:.2f}%", "" if m == "mk-stock" else why,
                         "" if m == "mk-stock" else ("PASS" if good else "FAIL")])
        if not a.keep:
            for d in dumps.values():
                shutil.rmtree(d, ignore_errors=True)
    return rows, ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama-3.2-1b", help="comma list: llama-3.2-1b, llama-3.1-8b (or 1b, 8b)")
    p.add_argument("--parts", default="a,b")
    p.add_argument("--mode", choices=common.PLUGIN_MODES, default="triton", help="MK_MODE of the plugin run")
    p.add_argument("--runner", choices=common.RUNNERS, default="default", help="vLLM model runner (default: V2)")
    p.add_argument("--a-weights", default="dummy", help="(a) weights: dummy, random or dummy,random")
    p.add_argument("--steps-a", type=int, default=256, help="(a) decode steps compared")
    p.add_argument("--prompt-a", type=int, default=512)
    p.add_argument("--steps-b", type=int, default=96, help="(b) tokens generated per request")
    p.add_argument("--min-identical", type=int, default=64, help="(b) steps that must agree (near ties excepted)")
    p.add_argument("--prompt-b", type=int, default=128)
    p.add_argument("--steps-c", type=int, default=1024, help="(c) teacher-forced decode steps per request")
    p.add_argument("--prompt-c", type=int, default=200, help="(c) the longest prompt (the others 13, 29, 46 shorter)")
    p.add_argument("--eager-b", action="store_true", help="(b) with enforce_eager=True (default: CUDA graphs)")
    p.add_argument("--gpu-mem", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights-dir", type=Path, default=DEFAULT_WEIGHTS_DIR,
                   help="(b) where the seeded safetensors are written (reused across runs)")
    p.add_argument("--outdir", type=Path, default=common.RESULTS)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    p.add_argument("--keep", action="store_true", help="keep the (a) logit dumps")
    common.add_mk_env_arg(p)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.part_list = [x for x in a.parts.split(",") if x]
    if set(a.part_list) - {"a", "b", "c"}:
        p.error("--parts takes a comma list of a, b, c")
    a.a_weight_list = [x for x in a.a_weights.split(",") if x]
    if set(a.a_weight_list) - {"dummy", "random"} or not a.a_weight_list:
        p.error("--a-weights takes dummy, random or dummy,random")
    if a.steps_b < a.min_identical:
        p.error("--steps-b must be >= --min-identical")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        child_main(common.child_payload(a.child))
        return 0
    shim = common.ensure_plugin_visible()
    work = Path(tempfile.mkdtemp(prefix="mk_correctness_"))
    rows, ok = [], True
    for model in [m for m in a.models.split(",") if m]:
        mdir = common.model_dir(model)
        if "a" in a.part_list:
            for weights in a.a_weight_list:
                r, good = part_a(mdir, a, shim, work, weights)
                rows += r
                ok &= good
        if "b" in a.part_list:
            r, good = part_b(mdir, a, shim)
            rows += r
            ok &= good
        if "c" in a.part_list:
            r, good = part_c(mdir, a, shim, work)
            rows += r
            ok &= good
    header = ["model", "check", "a: cosine min / mean; b: steps", "a: top-1 exact; b: first diff",
              "a: ties; b: stock top-2 gap", "a: top-1 incl. ties; b: max logprob diff", "notes", "verdict"]
    table = common.markdown_table(header, rows)
    text = (f"# vLLM correctness: stock vs MK_MODE={a.mode} ({common.today()})\n\nGPU {common.gpu_name()}, "
            f"commit {common.git_commit()}, vLLM {common.vllm_version()}, runner {a.runner}"
            f"{', plugin env ' + common.mk_env_text(a.mk_env) if a.mk_env else ''}\n"
            f"(a) {'/'.join(a.a_weight_list)} weights, teacher-forced, eager, batch 1: pass = cosine >= {MIN_COSINE} "
            f"every step and top-1 (ties included) >= {MIN_TOP1:.0%}\n(b) seeded N(0, 0.02) weights, greedy, "
            f"{'eager' if a.eager_b else 'CUDA graphs'}: pass = identical for {a.min_identical} steps, or the first "
            f"difference is a near tie (stock top-2 gap < {TIE_GAP})\n(c) seeded weights, teacher-forced, eager, batch 1 and 4, "
            f"every step against the fp32 truth (columns: rel logit error median / p99, KL median / p99, decided "
            f"steps, fp32-argmax agreement): pass = plugin error <= 1.1x stock's, agreement >= stock's - 0.5 points\n\n{table}\n\nOVERALL: {'PASS' if ok else 'FAIL'}\n")
    common.write_record(a.outdir, f"correctness_{common.run_stamp()}_{a.mode}_{a.runner}.md", text)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
