"""Autotune the megakernel's task sizes per (GPU, model shape, batch, lm_head) and cache the winners.

    python bench/autotune.py [--models 1b 8b] [--batch 1 2 4 8 16] [--lm-head both] [--ctx 512 [4096 ...]]
                             [--rounds 2] [--reps 200] [--seeds table|none] [--write-tuned]

For each key: the tables' winners at the model's other batch sizes tried whole (--seeds table, the default), then
coordinate descent over persistent.tuning.ScheduleTuning (tasks per op, attention KV
chunks; persistent/autotune.py) from the base an untuned model runs on a GPU (the ring-fed attention where
the model allows it, tuning.UNTUNED_TUNING: at one short --ctx the ring cannot show its long-context gain,
so only a loss of more than 2% there turns it off), every candidate first checked against the base program's output,
then timed as the median of CUDA-graph replays with CUDA events (mk_plugin.timing, the mk_step.py
method). Winners go to the user cache (~/.cache/mk_plugin/megakernel_<gpu>.json), which
MegakernelDecoder reads under MK_TUNING=auto (the default); with --write-tuned also to the packaged
table mk_plugin/persistent/tuned/megakernel_<gpu>.json, to commit. A markdown report with every
trial (predicted by the time model, measured, error vs the base) is written to --outdir.

--device cpu runs the same loop on the VM with the time model standing in for the measurement
(plumbing check only: no timing, nothing written to the packaged table).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # bench/common.py

from mk_plugin import reference as ref
from mk_plugin.persistent.autotune import PROGRAM_KNOBS, autotune
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.persistent.runtime import source_hash
from mk_plugin.persistent.tensormap import check_model
from mk_plugin.persistent.tuning import DEFAULT_TUNING, UNTUNED_TUNING, ScheduleTuning
from mk_plugin.persistent.tuning_table import (
    TuningEntry,
    TuningTable,
    spec_tuning_key,
    tuned_file,
    user_cache_file,
)
from mk_plugin.spec import LlamaSpec
from mk_plugin.weights import random_weights


def load_spec(name: str) -> LlamaSpec:
    return LlamaSpec.tiny() if name == "tiny" else LlamaSpec.from_json_file(common.model_dir(name))


def search_base(spec: LlamaSpec, cuda: bool) -> ScheduleTuning:
    """What the search starts from: what resolve gives a model no table knows (UNTUNED_TUNING on a GPU) where the
    model allows the ring-fed attention, else the plain default."""
    if not cuda:
        return DEFAULT_TUNING
    try:
        check_model(spec)
    except ValueError:
        return DEFAULT_TUNING
    return UNTUNED_TUNING


def table_seeds(spec: LlamaSpec, bsz: int, num_sms: int, lm_head: bool, tables: list[Path]) -> list[ScheduleTuning]:
    """The winners of the other batch sizes of this model (SM count, lm_head) in `tables`, in order: the search tries
    each whole before its one-knob steps (persistent/autotune.py seed_tunings)."""
    key = spec_tuning_key(spec, bsz, num_sms, lm_head)
    return [e.tuning for p in tables for e in TuningTable.load(p, "").other_batch_winners(key)]


def table_entry(spec: LlamaSpec, bsz: int, num_sms: int, lm_head: bool, tables: list[Path]) -> ScheduleTuning | None:
    """This key's tuning in the first of `tables` that has an entry for it (its winner, or the entry's base where the
    base won: what the decoder runs), else None."""
    key = spec_tuning_key(spec, bsz, num_sms, lm_head)
    for p in tables:
        table = TuningTable.load(p, "")
        if key in table.entries:
            return table.runs(key)
    return None


def step_at(dec: MegakernelDecoder, w, cs: torch.Tensor, bsz: int, ctx: int) -> tuple:
    """One decode step of bsz requests of ctx tokens on dec: (step, run_step), run_step restoring the KV caches first
    (every run appends the same K/V: the inputs stay identical) and returning a copy of the output."""
    spec, device, lm_head = dec.spec, dec.device, dec.lm_head
    b, caches, pos, sl, bt, slots = common.bench_decode_batch(spec, [ctx] * bsz, bsz, device)
    pristine = [c.clone() for c in caches]
    hidden = w.embed[b.input_ids.to(device)]
    out = torch.empty_like(hidden)
    logits = torch.empty(bsz, spec.vocab_size, device=device) if lm_head else None

    def step() -> None:
        dec(hidden, pos, caches, bt, sl, slots, cs, out=out, logits_out=logits)

    def run_step() -> torch.Tensor:
        for c, p in zip(caches, pristine):
            c.copy_(p)
        step()
        return (logits if lm_head else out).clone()
    return step, run_step


def tune_batch(dec: MegakernelDecoder, w, cs: torch.Tensor, bsz: int, args, log,
               seed_tables: list[Path]) -> tuple[TuningEntry, list]:
    """Autotune dec's program for bsz tokens of each context in args.ctx (a candidate's time: the mean step over
    them, so that a move which wins at one context and loses at another is weighed at both; its output is checked
    at the first), first trying the winners of the model's other batch sizes in seed_tables; the table entry and
    every trial."""
    spec, device, lm_head = dec.spec, dec.device, dec.lm_head
    cuda = device.type == "cuda"
    steps = [step_at(dec, w, cs, bsz, ctx) for ctx in args.ctx]
    run_step = steps[0][1]

    def retune(t):
        dec.retune(bsz, t)
        dec.prepare([bsz])
        return dec.program(bsz)

    def predict() -> float:
        return dec.program(bsz).predicted_ns / 1e3

    def measure() -> float:
        if not cuda:
            return predict()   # plumbing only: the time model stands in for the GPU
        from mk_plugin.timing import graph_median_ms
        return sum(graph_median_ms(step, replays=args.reps) for step, _ in steps) * 1e3 / len(steps)

    log(f"\n{spec.name} batch {bsz} lm_head {lm_head} ctx {ctx_label(args)} ({dec.num_sms} SMs)")
    t0 = time.time()
    # --start table: the descent from this key's own entry (the first table that has one), no seeds
    own = table_entry(spec, bsz, dec.num_sms, lm_head, seed_tables) if args.start == "table" else None
    if args.start == "table" and own is None:
        log(f"  --start table: no entry for batch {bsz} in {[str(p) for p in seed_tables]}; from the base")
    if own is None:
        base, seeds = search_base(spec, cuda), table_seeds(spec, bsz, dec.num_sms, lm_head, seed_tables)
    else:
        base, seeds = own, []
    knobs = PROGRAM_KNOBS if args.knobs == "program" else None
    best, trials = autotune(spec=spec, batch=bsz, num_sms=dec.num_sms, lm_head=lm_head, retune=retune,
                            run_step=run_step, measure=measure, predict=predict, rounds=args.rounds, base=base,
                            seeds=seeds, knobs=knobs, log=log)
    meta = {"spec": spec.name, "ctx": args.ctx[0] if len(args.ctx) == 1 else list(args.ctx), "base": base.to_json(),
            "date": common.today(), "commit": common.git_commit(),
            "source_hash": source_hash(), "reps": args.reps, "seconds": round(time.time() - t0, 1),
            "measured": "cuda-graph median" if cuda else "time model (cpu plumbing run)"}
    key = spec_tuning_key(spec, bsz, dec.num_sms, lm_head)
    return TuningEntry(key, best.tuning, best.us, trials[0].us, meta), trials


def ctx_label(args) -> str:
    return ", ".join(map(str, args.ctx)) + (" (the mean step)" if len(args.ctx) > 1 else "")


def tune_model(spec: LlamaSpec, args, device: str, log, seed_tables: list[Path]) -> list[tuple[TuningEntry, list]]:
    cuda = device == "cuda"
    w = random_weights(spec, device=device, draw_on_device=cuda)
    cs = ref.rope_cos_sin_cache(spec, max(args.ctx) + 16).to(device)
    results = []
    for lm_head in {"off": [False], "on": [True], "both": [False, True]}[args.lm_head]:
        dec = MegakernelDecoder(spec, w, max(args.batch), device, lm_head=lm_head, tuning="off",
                                num_sms=None if cuda else args.num_sms)
        results += [tune_batch(dec, w, cs, bsz, args, log, seed_tables) for bsz in args.batch]
    return results


def report(spec_results, args, gpu: str) -> str:
    lines = [f"# Megakernel autotune ({common.today()})", "",
             f"- gpu: {gpu}", f"- commit: {common.git_commit()}", f"- command: `python3 {' '.join(sys.argv)}`",
             (f"- context {ctx_label(args)} tokens per request; measured: median of {args.reps} CUDA-graph replays "
              "(CPU run: the time model, not a measurement)"), "",
             "## Winners", "",
             common.markdown_table(["model", "batch", "lm_head", "base", "base us", "best us", "gain", "tuning"],
                                   [(e.meta["spec"], e.key.batch, e.key.lm_head, e.base.label(), f"{e.default_us:.1f}",
                                     f"{e.best_us:.1f}", f"{100 * e.gain:+.1f}%", e.tuning.label())
                                    for e, _ in spec_results]), ""]
    for e, trials in spec_results:
        lines += [f"## {e.meta['spec']} batch {e.key.batch} lm_head {e.key.lm_head}", "",
                  common.markdown_table(["tuning", "tasks", "predicted us", "measured us", "rel err vs base",
                                         "bitwise", "ok"],
                                        [(t.tuning.label(), t.tasks, f"{t.predicted_us:.1f}",
                                          "-" if t.us is None else f"{t.us:.1f}", f"{t.rel_fro:.1e}", t.bitwise, t.ok)
                                         for t in trials]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["1b"], help="model folders / aliases (1b, 8b); 'tiny' on cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--lm-head", choices=("off", "on", "both"), default="both",
                    help="tune the program without the LM head (what vLLM runs), with it (mk_step's headline), or both")
    ap.add_argument("--ctx", type=int, nargs="+", default=[512],
                    help="context(s) per request; with several, a candidate's time is the mean step over them")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seeds", choices=("table", "none"), default="table",
                    help="table: first try the packaged table's and the cache's winners of the model's other batch "
                         "sizes, each as a whole; none: coordinate descent from the base only")
    ap.add_argument("--start", choices=("base", "table"), default="base",
                    help="base: the search from the untuned base after the seeds; table: from this batch size's own "
                         "entry in the packaged table (or the cache), no seeds")
    ap.add_argument("--knobs", choices=("all", "program"), default="all",
                    help="program: only the knobs that change the encoded program (task splits, K cuts, attention "
                         "chunks), not the kernel build: a short search")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--num-sms", type=int, default=132, help="cpu only: SMs of the modelled GPU")
    ap.add_argument("--write-tuned", action="store_true", help="also write the packaged table (to commit)")
    ap.add_argument("--outdir", type=Path, default=common.RESULTS)
    ap.add_argument("--cache", type=Path, default=None, help="tuning table to update (default: the user cache)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a GPU; --device cpu runs the plumbing on the VM")
    if any(not 1 <= b <= 16 for b in args.batch):
        raise SystemExit(f"--batch {args.batch}: the megakernel handles 1..16 tokens")
    if args.device == "cpu" and args.write_tuned:
        raise SystemExit("--write-tuned records GPU measurements; a cpu run has none")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    cache = args.cache or user_cache_file(gpu)
    seed_tables = [tuned_file(gpu), cache] if args.seeds == "table" else []
    all_results = []
    for name in args.models:
        all_results += tune_model(load_spec(name), args, args.device, print, seed_tables)
    tag = "-".join(s for s in args.models if "/" not in s) or "models"
    name = f"autotune_{common.run_stamp()}_{tag}_{args.device}.md"
    paths = [cache] + ([tuned_file(gpu)] if args.write_tuned else [])
    for p in paths:
        table = TuningTable.load(p, gpu)
        for e, _ in all_results:
            if args.start == "table":   # keep each entry's record; a move becomes one of its updates
                what = table.merge_from_entry(e, table_update(e, gpu, args, name))
                print(f"  {p.name}: {e.meta['spec']} batch {e.key.batch} lm_head {e.key.lm_head}: {what}")
            else:
                table.put(e)
        print(f"tuning table: {table.save(p)}")
    common.write_record(args.outdir, name, report(all_results, args, gpu))
    return 0


def table_update(e: TuningEntry, gpu: str, args, report_name: str) -> dict:
    """The `updates` record of a table entry that a --start table search moved (TuningTable.merge_from_entry)."""
    return {"date": e.meta["date"], "commit": e.meta["commit"], "gpu": gpu,
            "change": (f"bench/autotune.py --start table --knobs {args.knobs} from this entry (ctx {ctx_label(args)}, "
                       f"{args.rounds} rounds): {e.base.label()} {e.default_us:.1f} us -> {e.tuning.label()} "
                       f"{e.best_us:.1f} us ({100 * (e.best_us / e.default_us - 1):+.1f}%); not yet checked before / "
                       "after at other contexts"),
            "source": f"bench/results/{report_name}"}


if __name__ == "__main__":
    raise SystemExit(main())
