"""One megakernel decode step (with the fused LM head) for compute-sanitizer, checked afterwards.

    compute-sanitizer --tool memcheck --kernel-name kns=mk_decode python3 bench/sanitize.py --batch 1
    bash bench/sanitize.sh [outdir]          # memcheck, racecheck, synccheck at batch 1 and 8

Llama-3.2-1B shape (--layers to cut the layer count when a tool is slow), contexts not aligned to
the block size with one padded entry (slot -1) at batch > 1, random weights drawn on the GPU. The
watchdog budget is raised (instrumented spin waits are ~100x slower; the default 2 s would fire).
The step runs the program served at this batch size: the full model's entry of MK_TUNING's tables (the packaged
table by default) applied to the cut model (--tuning table; a cut model has its own spec hash, which no table
knows: before session 38 every run checked the untuned program, never the tables' gates, K-splits or wgmma builds).
After the step the output is compared with the Triton decode path and the watchdog record must be
clear: the script exits non-zero on any mismatch, so a tool that perturbs the run shows up too.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # bench/common.py

from mk_plugin import reference as ref
from mk_plugin.config import get_config
from mk_plugin.persistent.tuning import ScheduleTuning
from mk_plugin.persistent.tuning_table import resolve, spec_tuning_key
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import compare
from mk_plugin.weights import random_weights


def served_tuning(full: LlamaSpec, batch: int, num_sms: int, setting: str, gpu: str) -> tuple[ScheduleTuning, str]:
    """The tuning (and where it came from) that MK_TUNING=`setting` gives the full model at `batch` with the LM head:
    what a decoder of that model runs, to be applied to a cut copy of it."""
    (t, src), = resolve(setting, gpu, [spec_tuning_key(full, batch, num_sms, True)])
    return t, src


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path(__file__).resolve().parent / "models" / "llama-3.2-1b"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0, help="0: the model's own layer count")
    ap.add_argument("--watchdog-ms", type=int, default=120_000)
    ap.add_argument("--tuning", choices=("table", "untuned"), default="table",
                    help="table: the full model's tuning for --batch from MK_TUNING's tables (the program served); "
                         "untuned: what a model no table knows runs (the cut model's own lookup)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="kernel variant (variant.KernelVariant) to check before it becomes the default; repeatable")
    args = ap.parse_args()
    from mk_plugin.persistent.variant import KernelVariant
    variant = KernelVariant.parse(args.define)   # the command line's NAME=VALUE, read once here

    from mk_plugin.persistent.backend import MegakernelDecoder
    from mk_plugin.triton_ops import DecodeWorkspace, decode_step

    full = LlamaSpec.from_json_file(args.model)
    spec = replace(full, num_layers=args.layers) if args.layers else full
    w = random_weights(spec, device="cuda", draw_on_device=True)
    seq = [517 + 61 * i for i in range(args.batch)]
    if args.batch > 1:
        seq[1] = 0  # a padded entry (slot -1, seq_len 0), as in vLLM's CUDA-graph batches
    g = torch.Generator("cuda").manual_seed(7)
    b, caches, pos, sl, bt, slots = common.bench_decode_batch(spec, seq, args.batch, "cuda", generator=g)
    cs = ref.rope_cos_sin_cache(spec, max(seq) + 16).to("cuda")
    hidden = w.embed[b.input_ids.to("cuda")]

    tcaches = [c.clone() for c in caches]
    ws = DecodeWorkspace.allocate(spec, args.batch, bt.shape[1], 16, "cuda")
    tout = torch.empty_like(hidden)
    decode_step(spec, w, hidden, pos, tcaches, bt, sl, slots, cs, workspace=ws, out=tout)

    tuning: str | dict[int, ScheduleTuning] = "auto"   # --tuning untuned: the cut model's own lookup
    if args.tuning == "table":
        t, src = served_tuning(full, args.batch, torch.cuda.get_device_properties(0).multi_processor_count,
                               get_config().tuning, torch.cuda.get_device_name())
        print(f"tuning {t.label()} ({src})")
        tuning = {args.batch: t}
    dec = MegakernelDecoder(spec, w, args.batch, "cuda", lm_head=True, watchdog_ms=args.watchdog_ms,
                            variant=variant, tuning=tuning)
    out = torch.full_like(hidden, float("nan"))
    logits = torch.full((args.batch, spec.vocab_size), float("nan"), device="cuda")
    dec(hidden, pos, caches, bt, sl, slots, cs, out=out, logits_out=logits)
    torch.cuda.synchronize()
    dec.check_errors()  # raises MegakernelHang if a wait timed out under the tool
    live = [i for i, s in enumerate(seq) if s > 0]
    # Both paths round to bf16 at different points: deep random nets amplify that (the "drift" row).
    dt = spec.torch_dtype
    r = compare(out[live], tout[live], dt, "drift")
    kvs = [compare(a, c, dt, "drift") for a, c in zip(caches, tcaches)]
    finite = bool(torch.isfinite(logits[live]).all())
    ok = finite and r["pass"] and all(k["pass"] for k in kvs)
    print(f"sanitize-run {spec.name} layers={spec.num_layers} batch={args.batch} seq={seq} "
          f"build {dec.variant_for(args.batch).label()}, tuning {dec.tunings[args.batch].label()}: "
          f"hidden rel vs triton {r['rel_fro']:.2e}, worst kv rel {max(k['rel_fro'] for k in kvs):.2e}, "
          f"logits finite {finite} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
