"""Sweep LinearConfig for the decode GEMV shapes of Llama-3.2-1B / 3.1-8B on the GPU and print the
best config per (model, op, M) beside the heuristic's choice. Timing: CUDA-graph replays, weights
rotated past L2 (mk_plugin.timing). Usage: python bench/sweep_linear.py [--ms 1,8] [--models 1b,8b]"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path

import torch

from mk_plugin.spec import LlamaSpec
from mk_plugin.timing import rotating_median_ms, rotation_count
from mk_plugin.triton_ops.linear import LinearConfig, _linear, select_config, tuned_file

MODELS = {"1b": "bench/models/llama-3.2-1b", "8b": "bench/models/llama-3.1-8b"}


def shapes(spec: LlamaSpec):
    h, i = spec.hidden_size, spec.intermediate_size
    yield "qkv", spec.qkv_size, h, {"norm": True}
    yield "o_proj", h, spec.q_size, {"res": True}
    yield "gate_up", 2 * i, h, {"norm": True, "silu": True}
    yield "down", h, i, {"res": True}
    yield "lm_head", spec.vocab_size, h, {"norm": True, "fp32": True}


def candidates(m: int):
    if m == 1:
        for bn, bk, nw in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (4, 8)):
            yield LinearConfig(bn, bk, 1, False, nw, 1)
    for bn, bk, st, nw in itertools.product((16, 32, 64), (128, 256, 512), (3, 4, 6), (4,)):
        if bn * bk <= 16384:
            yield LinearConfig(bn, bk, 1, True, nw, st)


def _config_of(text: str) -> dict:
    """LinearConfig(...)'s repr -> its fields (the JSON results keep configs as repr strings)."""
    return {k: (v == "True") if v in ("True", "False") else int(v)
            for k, v in re.findall(r"(\w+)=(\w+)", text)}


def tuned_entries(results: list[dict], gpu: str, note: str) -> dict:
    """The sweep's winners as the tuned-config file `select_config` reads for this GPU model."""
    entries = [{"m": r["m"], "n_out": r["n"] // 2 if r["op"] == "gate_up" else r["n"], "k": r["k"],
                "silu": r["op"] == "gate_up", "op": f"{r['model']}:{r['op']}", "config": _config_of(r["best"]),
                "best_us": round(r["best_us"], 2), "default_us": round(r["default_us"], 2)} for r in results]
    return {"gpu": gpu, "source": note, "entries": entries}


def write_tuned(results: list[dict], gpu: str, note: str) -> Path:
    p = tuned_file(gpu)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(tuned_entries(results, gpu, note), indent=1) + "\n")
    return p


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--json", default=None)
    ap.add_argument("--write-tuned", action="store_true",
                    help="store the winners where select_config reads them for this GPU model")
    ap.add_argument("--from-json", default=None, help="no GPU: rebuild the tuned file from a saved --json")
    ap.add_argument("--gpu", default="NVIDIA H200", help="GPU model name for --from-json")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        print(write_tuned(saved, args.gpu, f"bench/sweep_linear.py results {args.from_json}"))
        return 0
    dt = torch.bfloat16
    results = []
    for mk in args.models.split(","):
        spec = LlamaSpec.from_json_file(MODELS[mk])
        for m in map(int, args.ms.split(",")):
            for op, n, k, f in shapes(spec):
                nbytes = n * k * 2
                copies = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(rotation_count(nbytes, 8))]
                x = torch.randn(m, k, device="cuda", dtype=dt)
                nw = torch.rand(k, device="cuda", dtype=dt) + 0.5 if f.get("norm") else None
                n_out = n // 2 if f.get("silu") else n
                res = torch.randn(m, n_out, device="cuda", dtype=dt) if f.get("res") else None
                out = torch.empty(m, n_out, device="cuda", dtype=torch.float32 if f.get("fp32") else dt)
                act = "silu_and_mul" if f.get("silu") else None
                default = select_config(m, n_out, k, silu=bool(f.get("silu")))

                def time_cfg(cfg, x=x, copies=copies, nw=nw, res=res, act=act, out=out):
                    return rotating_median_ms(
                        lambda j: _linear(x, copies[j], norm_weight=nw, residual=res, activation=act, out=out,
                                          out_dtype=out.dtype, config=cfg), len(copies), 15)
                t_def = time_cfg(default)
                best = (t_def, default)
                for cfg in candidates(m):
                    try:
                        t = time_cfg(cfg)
                    except Exception as e:  # noqa: BLE001 - a config the GPU rejects (shared memory) is skipped, noted
                        print(f"  skip {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    if t < best[0]:
                        best = (t, cfg)
                def gbs(t: float, nbytes: int = nbytes) -> float:
                    return nbytes / t / 1e6
                row = {"model": mk, "op": op, "m": m, "n": n, "k": k, "default_us": t_def * 1e3,
                       "default_gbs": gbs(t_def), "best_us": best[0] * 1e3, "best_gbs": gbs(best[0]),
                       "best": repr(best[1]), "default": repr(default)}
                results.append(row)
                print(json.dumps(row), flush=True)
    if args.write_tuned:
        print(write_tuned(results, torch.cuda.get_device_name(), "bench/sweep_linear.py"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print("| model | op | M | default us | default GB/s | best us | best GB/s | best config |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['op']} | {r['m']} | {r['default_us']:.1f} | {r['default_gbs']:.0f} | "
              f"{r['best_us']:.1f} | {r['best_gbs']:.0f} | {r['best']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
