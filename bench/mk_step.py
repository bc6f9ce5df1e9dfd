"""Time one decode step of the megakernel vs the Triton decode path (Llama-3.2-1B shape, random
weights drawn on the GPU): median of many CUDA-graph replays timed with CUDA events, and the
achieved bandwidth (weight bytes + KV bytes read) / time against the H200's 4.8 TB/s.

    python bench/mk_step.py [--model bench/models/llama-3.2-1b] [--batch 1 8] [--ctx 512] [--reps 200]

The megakernel runs without the LM head (like triton_ops.decode_step) unless --lm-head is given; then a
second megakernel row, "megakernel+torch_lm_head", times the step without it followed by the bf16 GEMM vLLM's
compute_logits runs (F.linear), in the same graph: MK_LM_HEAD=megakernel against MK_LM_HEAD=vllm, kernel-only.
Every measured row is appended to --csv (default bench/results/mk_step.csv, header MK_STEP_HEADER) unless
the kernel was compiled with --define variants (those are A/B experiments: the printed table is their record).
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # bench/common.py (git_commit: .commit when newer than HEAD)

from mk_plugin import reference as ref
from mk_plugin.spec import LlamaSpec
from mk_plugin.timing import graph_median_ms
from mk_plugin.weights import random_weights

MK_STEP_HEADER = ("date", "gpu", "commit", "shape", "batch", "ctx", "path", "lm_head", "step_us", "gbps")


def time_graph(fn, reps: int) -> float:
    """Median microseconds of one replay of a CUDA graph of fn() (mk_plugin.timing)."""
    return graph_median_ms(fn, replays=reps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path(__file__).resolve().parent / "models" / "llama-3.2-1b"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ctx", type=int, default=512, help="tokens in each request's context")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--lm-head", action="store_true", help="fuse the LM head into the megakernel step")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="kernel variant (variant.KernelVariant: MK_ROUNDING, MK_NUM_STAGES, MK_DIAG and the A/B switches) for A/B runs; repeatable")
    ap.add_argument("--stages", type=int, default=0, metavar="N",
                    help="ring depth N (4, 5, 6) for every batch size instead of each batch's default or tuned one "
                         "(an A/B experiment: rows are not appended to --csv)")
    ap.add_argument("--combine-tasks", action="store_true",
                    help="attention with separate combine tasks (tuning.merge_in_partial=False, the default before "
                         "session 7) for every batch size (an A/B experiment like --stages: rows are not appended)")
    ap.add_argument("--ksplit", action="append", default=[], metavar="OP=N",
                    help="cut OP (o_proj, down) over K in N parts (tuning.ksplit) for every batch size (an A/B "
                         "experiment like --stages: rows are not appended); repeatable")
    ap.add_argument("--trace", action="store_true", help="also run one traced step and print the per-op table "
                    "(mk_plugin.persistent.trace; `python -m mk_plugin.trace run` also writes Perfetto/PNG)")
    ap.add_argument("--records-dir", type=Path, default=None,
                    help="with --trace: save each traced step's records (mk_plugin.persistent.trace format, with the "
                         "defines and commit in meta) for `python -m mk_plugin.trace convert` and bench/roofline.py")
    ap.add_argument("--csv", type=Path, default=common.RESULTS / "mk_step.csv",
                    help="append the measured rows here (skipped with --define)")
    args = ap.parse_args()

    from mk_plugin.persistent import trace as mktrace
    from mk_plugin.persistent.backend import MegakernelDecoder
    from mk_plugin.triton_ops import DecodeWorkspace, decode_step

    spec = LlamaSpec.from_json_file(args.model)
    w = random_weights(spec, device="cuda", draw_on_device=True)
    cs = ref.rope_cos_sin_cache(spec, args.ctx + 16).to("cuda")
    from mk_plugin.config import get_config
    from mk_plugin.persistent.variant import KernelVariant

    variant = KernelVariant.parse(args.define)   # the command line's NAME=VALUE, read once here
    defines = variant.defines()
    cfg = get_config()                           # MK_TUNING / MK_WATCHDOG_MS, read once here
    forced = None
    if args.stages or args.combine_tasks or args.ksplit:
        from mk_plugin.persistent.tuning import ScheduleTuning, parse_ksplit
        try:
            ksplit = parse_ksplit(args.ksplit)
        except ValueError as e:
            raise SystemExit(f"--ksplit: {e}") from None
        forced = ScheduleTuning(num_stages=args.stages, merge_in_partial=not args.combine_tasks,
                                ksplit=ksplit)  # validates N and the ops
        defines = (*defines, forced.label())              # an A/B row: printed, not appended

    def tuning_upto(n: int):
        """The decoder's tuning for batch sizes 1..n: MK_TUNING's, or the forced one for every size."""
        return cfg.tuning if forced is None else {b: forced for b in range(1, n + 1)}

    dec = MegakernelDecoder(spec, w, max(args.batch), "cuda", lm_head=args.lm_head, variant=variant,
                            tuning=tuning_upto(max(args.batch)), watchdog_ms=cfg.watchdog_ms)
    dec.prepare(args.batch)
    plain = None
    if args.lm_head:   # the same step without the LM head, for the row followed by vLLM's GEMM
        plain = MegakernelDecoder(spec, w, max(args.batch), "cuda", variant=variant,
                                  tuning=tuning_upto(max(args.batch)), watchdog_ms=cfg.watchdog_ms)
        plain.prepare(args.batch)
    rows = []
    for bsz in args.batch:
        seq = [args.ctx] * bsz
        b, caches, pos, sl, bt, slots = common.bench_decode_batch(spec, seq, bsz, "cuda")
        hidden = w.embed[b.input_ids.to("cuda")]
        out = torch.empty_like(hidden)
        logits = torch.empty(bsz, spec.vocab_size, device="cuda") if args.lm_head else None
        wbytes = spec.weight_bytes_per_step(include_lm_head=args.lm_head)
        kvbytes = spec.kv_bytes_per_step(seq)

        mk = functools.partial(dec, hidden, pos, caches, bt, sl, slots, cs, out=out, logits_out=logits)
        t_mk = time_graph(mk, args.reps)
        rows.append(("megakernel", bsz, t_mk, (wbytes + kvbytes) / (t_mk * 1e-6)))
        if plain is not None:
            def mk_then_gemm(plain=plain, hidden=hidden, pos=pos, caches=caches, bt=bt, sl=sl, slots=slots, out=out):
                plain(hidden, pos, caches, bt, sl, slots, cs, out=out)
                return torch.nn.functional.linear(out, w.lm_head)   # vLLM's compute_logits at TP 1 (bf16 logits)
            t_g = time_graph(mk_then_gemm, args.reps)
            rows.append(("megakernel+torch_lm_head", bsz, t_g, (wbytes + kvbytes) / (t_g * 1e-6)))
        if args.trace:
            tdec = MegakernelDecoder(spec, w, bsz, "cuda", lm_head=args.lm_head, trace=True, variant=variant,
                                     tuning=tuning_upto(bsz), watchdog_ms=cfg.watchdog_ms)
            for _ in range(3):
                tdec(hidden, pos, caches, bt, sl, slots, cs, out=out, logits_out=logits)
            torch.cuda.synchronize()
            recs = mktrace.annotate(tdec.trace_records(bsz), tdec.program(bsz), seq)
            print(f"\n[batch {bsz}] traced step: {mktrace.step_span_ns(recs) / 1e3:.1f} us over {len(recs)} tasks\n"
                  + mktrace.op_table_markdown(mktrace.op_table(recs)))
            if variant.phases:   # MK_TRACE_PHASES=1: where a matvec task's time goes once it is ready
                from mk_plugin.persistent import trace_phases
                print("\nmedian per task (us):\n" + trace_phases.phase_table_markdown(trace_phases.phase_table(recs)))
            if args.records_dir is not None:
                tag = "_".join(d.removeprefix("-D").replace("=", "").replace("/", "") for d in defines) or "default"
                meta = mktrace.program_meta(tdec.program(bsz), seq, context=args.ctx, defines=list(defines),
                                            commit=common.git_commit(),
                                            gpu=torch.cuda.get_device_name(), command=" ".join(sys.argv))
                path = args.records_dir / f"mk_step_{spec.name}_b{bsz}_ctx{args.ctx}_{tag}.records.json.gz"
                print(f"records: {mktrace.save_records(path, recs, meta)}")
        if not args.no_triton:
            ws = DecodeWorkspace.allocate(spec, bsz, bt.shape[1], 16, "cuda")
            tout = torch.empty_like(hidden)
            tw = spec.weight_bytes_per_step(include_lm_head=False)

            tr = functools.partial(decode_step, spec, w, hidden, pos, caches, bt, sl, slots, cs, workspace=ws,
                                   out=tout)
            t_tr = time_graph(tr, args.reps)
            rows.append(("triton", bsz, t_tr, (tw + kvbytes) / (t_tr * 1e-6)))
    print(f"\n{spec.name}: {spec.num_layers} layers, ctx {args.ctx}, lm_head in megakernel: {args.lm_head}, "
          f"{dec.num_sms} SMs, defines {list(defines) or 'none'}")
    for bsz in args.batch:
        print(f"tuning, batch {bsz}: {dec.tuning_source[bsz]}")
    print(f"{'path':<24} {'batch':>5} {'step_us':>9} {'GB/s':>8} {'% of 4.8TB/s':>13}")
    for name, bsz, t, bps in rows:
        print(f"{name:<24} {bsz:>5} {t:>9.1f} {bps / 1e9:>8.0f} {100 * bps / common.HBM_BYTES_PER_S:>12.1f}%")
    if not defines:
        gpu, commit = torch.cuda.get_device_name(), common.git_commit()
        common.append_csv(args.csv, MK_STEP_HEADER, [
            (common.today(), gpu, commit, spec.name, bsz, args.ctx, name,
             int(args.lm_head and name.startswith("megakernel")), f"{t:.1f}", f"{bps / 1e9:.0f}")
            for name, bsz, t, bps in rows])
        print(f"rows appended to {args.csv}")


if __name__ == "__main__":
    main()
