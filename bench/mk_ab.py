"""A/B of megakernel builds in one process: the weights drawn once, every build compiled once, then the
builds alternated over rounds (round 1: A B C, round 2: A B C, ...), each (build, batch) timed as
mk_step.py times it (median of CUDA-graph replays). A process per build (mk_step.py --define) paid the
imports, the weights and the program build per row (~10-20 s of device time each); here a row costs its
replays. The output is the log format of bench/ab_table.py (`== round R GROUP: LABEL`, then
`megakernel BATCH STEP_US GB/s %`), so the table comes from that tool:

    python bench/mk_ab.py --model bench/models/llama-3.2-1b --batch 12 16 --rounds 2 \
        --build default --build MK_RELEASE_GATE=96 --build MK_RELEASE_GATE=96,MK_NUM_STAGES=5
    python bench/ab_table.py LOG

A build is "default" or comma-separated NAME=VALUE kernel variants (variant.KernelVariant) and program items:
ksplit.OP=N (tuning.ksplit for every batch size, e.g. --build ksplit.down=4,ksplit.o_proj=2) and chunks=N
(tuning.attn_chunks: attention KV chunks per request and kv head) and piece_deps (tuning.piece_deps: with
ksplit.down, gate_up's pieces at down's parts, each part waiting for its piece only); these replace the configured
tuning on every batch size (its table entry's other knobs, a release gate say, dropped), unless the item on_table
is given too: then they change only those knobs of each batch size's configured tuning (session 52: chunks=4 on the
1B b1 entry keeps its gate pair). And the decoder item
class_builds=0 (MegakernelDecoder(class_builds=False): every batch size on the build of both batch classes, the
default before session 50; since, a batch size whose every task takes one matvec path runs its class's build without
the others: tasks.class_build). A/B rows are
not appended to mk_step.csv (like mk_step.py --define, they are not the tuned program's step): every row goes to
bench/results/mk_ab.csv (--csv), with its build and round.
"""
from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # bench/common.py

from mk_plugin import reference as ref
from mk_plugin.persistent.tuning import ScheduleTuning, parse_ksplit
from mk_plugin.persistent.variant import KernelVariant
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import compare, poison_
from mk_plugin.timing import graph_median_ms
from mk_plugin.weights import random_weights

CSV = common.RESULTS / "mk_ab.csv"
CSV_HEADER = ("date", "gpu", "commit", "shape", "batch", "ctx", "build", "round", "step_us", "gbps")


class Build(NamedTuple):
    """One --build: the decoder's kernel variant, a tuning forced on every batch size (None: the configured
    tuning) and the decoder's class_builds."""
    variant: KernelVariant
    tuning: ScheduleTuning | None = None
    class_builds: bool = True
    on_table: bool = False   # the tuning's program items change the configured tuning's, per batch size


def on_table(base: ScheduleTuning, items: ScheduleTuning) -> ScheduleTuning:
    """`base` (a batch size's configured tuning) with the knobs a build's program items set (chunks, ksplit,
    piece_deps) taken from `items`; the rest of `base` kept."""
    return replace(base, attn_chunks=items.attn_chunks or base.attn_chunks, ksplit=items.ksplit or base.ksplit,
                   piece_deps=items.piece_deps or base.piece_deps)


def parse_build(text: str) -> Build:
    """"default" (or "") -> the default build; "A=1,B=2" -> KernelVariant.parse (its errors name the value);
    items "ksplit.OP=N" cut OP over K in N parts (tuning.ksplit, every batch size) instead of the configured
    tuning; "class_builds=0" turns the decoder's per-class builds off."""
    items = [s.strip() for s in text.split(",") if s.strip() and s.strip() != "default"]
    ks = parse_ksplit(i.removeprefix("ksplit.") for i in items if i.startswith("ksplit."))
    chunks = [i.removeprefix("chunks=") for i in items if i.startswith("chunks=")]
    if len(chunks) > 1 or (chunks and not chunks[0].isdigit()):
        raise ValueError(f"build {text!r}: give one chunks=N (attention KV chunks per request and kv head)")
    cb = [i.removeprefix("class_builds=") for i in items if i.startswith("class_builds=")]
    if len(cb) > 1 or (cb and cb[0] not in ("0", "1")):
        raise ValueError(f"build {text!r}: class_builds takes 0 or 1, once")
    pieces = "piece_deps" in items
    tuning = None
    if ks or chunks or pieces:   # validates op, parts and chunk count
        tuning = ScheduleTuning(ksplit=ks, attn_chunks=int(chunks[0]) if chunks else 0, piece_deps=pieces)
    table = "on_table" in items
    if table and tuning is None:
        raise ValueError(f"build {text!r}: on_table changes the configured tuning by program items (chunks=N, "
                         "ksplit.OP=N, piece_deps); give one")
    rest = [i for i in items if not i.startswith(("ksplit.", "chunks=", "class_builds="))
            and i not in ("piece_deps", "on_table")]
    return Build(KernelVariant.parse(rest), tuning, cb != ["0"], table)


def build_label(build: Build) -> str:
    """The header label ab_table.py reads: "default", or the defines as mk_step's --define flags give them,
    then a forced tuning's label and class_builds=0 where it is off."""
    words = [f"--define {x.removeprefix('-D')}" for x in build.variant.defines()]
    if build.tuning is not None:
        words.append(f"tuning {build.tuning.label()}{' on_table' if build.on_table else ''}")
    if not build.class_builds:
        words.append("class_builds=0")
    return " ".join(words) or "default"


def check_builds(builds, decs, inputs, cs) -> list[bool]:
    """One step of every build at every batch (poisoned output, the same pristine KV cache each) against the
    first build's: within the tolerance table's whole-step bound, or the build is left out of the timed rounds
    (a fast wrong build must not reach the table). The lines say each build's distance from the first. A build with
    MK_DIAG set is timing-only by definition (wrong results): it is run, not compared, and its label names the mask."""
    agree = [True] * len(decs)
    for bsz, (hidden, pos, caches, bt, sl, slots, _, _) in inputs.items():
        pristine = [c.clone() for c in caches]
        first = None
        for i, (bd, dec) in enumerate(zip(builds, decs)):
            for c, p in zip(caches, pristine):
                c.copy_(p)
            out = poison_(torch.empty_like(hidden))
            dec(hidden, pos, caches, bt, sl, slots, cs, out=out)
            if bd.variant.diag and first is not None:
                print(f"check batch {bsz} {build_label(bd)}: not compared (MK_DIAG: timing only, wrong results)")
                continue
            if first is None:
                first = out.clone()
                ok = bool(torch.isfinite(out.float()).all())
                print(f"check batch {bsz} {build_label(bd)}: {'finite' if ok else 'NON-FINITE'} (the reference build)")
            else:
                c = compare(out, first, out.dtype, "drift")
                ok = c["pass"]
                print(f"check batch {bsz} {build_label(bd)}: rel_fro {c['rel_fro']:.2e} max_abs {c['max_abs']:.3g} "
                      f"against the first build: {'ok' if ok else 'MISMATCH, left out of the rounds'}")
            agree[i] = agree[i] and ok
        for c, p in zip(caches, pristine):
            c.copy_(p)
    return agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--group", default="", help="column group in the headers (default: the model's name)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--build", action="append", required=True, metavar="default|NAME=VALUE[,...]")
    ap.add_argument("--csv", type=Path, default=CSV, help=f"rows appended here (default {CSV})")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: must be >= 1")
    builds = [parse_build(b) for b in args.build]   # bad input fails here, before the GPU work

    from mk_plugin.config import get_config
    from mk_plugin.persistent.backend import MegakernelDecoder
    from mk_plugin.persistent.tuning_table import resolve, spec_tuning_key

    spec = LlamaSpec.from_json_file(args.model)
    group = args.group or spec.name
    cfg = get_config()
    w = random_weights(spec, device="cuda", draw_on_device=True)
    cs = ref.rope_cos_sin_cache(spec, args.ctx + 16).to("cuda")
    sizes = range(1, max(args.batch) + 1)
    configured = []   # the configured tuning per batch size, as the decoder resolves it: only for on_table builds
    if any(bd.on_table for bd in builds):
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        keys = [spec_tuning_key(spec, b, sms, False) for b in sizes]
        configured = [t for t, _ in resolve(cfg.tuning, torch.cuda.get_device_name(), keys)]
    decs = []
    for bd in builds:   # compile and prepare every build before the first timed row
        tun = cfg.tuning if bd.tuning is None else {b: bd.tuning for b in sizes}
        if bd.on_table:
            tun = {b: on_table(t, bd.tuning) for b, t in zip(sizes, configured)}
        dec = MegakernelDecoder(spec, w, max(args.batch), "cuda", variant=bd.variant, tuning=tun,
                                watchdog_ms=cfg.watchdog_ms, class_builds=bd.class_builds)
        dec.prepare(args.batch)
        decs.append(dec)
        print(f"built {build_label(bd)}", flush=True)
    inputs = {}
    for bsz in args.batch:
        seq = [args.ctx] * bsz
        b, caches, pos, sl, bt, slots = common.bench_decode_batch(spec, seq, bsz, "cuda")
        hidden = w.embed[b.input_ids.to("cuda")]
        nbytes = spec.weight_bytes_per_step(include_lm_head=False) + spec.kv_bytes_per_step(seq)
        inputs[bsz] = (hidden, pos, caches, bt, sl, slots, torch.empty_like(hidden), nbytes)
    commit, gpu, date = common.git_commit(), torch.cuda.get_device_name(), common.today()
    print(f"{spec.name}: ctx {args.ctx}, {decs[0].num_sms} SMs, commit {commit}, gpu {gpu}, reps {args.reps}")
    agree = check_builds(builds, decs, inputs, cs)
    for r in range(1, args.rounds + 1):
        for bd, dec, ok in zip(builds, decs, agree):
            if not ok:
                continue
            print(f"== round {r} {group}: {build_label(bd)}")
            for bsz in args.batch:
                hidden, pos, caches, bt, sl, slots, out, nbytes = inputs[bsz]
                fn = functools.partial(dec, hidden, pos, caches, bt, sl, slots, cs, out=out)
                us = graph_median_ms(fn, replays=args.reps) * 1e3
                bps = nbytes / (us * 1e-6)
                print(f"megakernel {bsz:>5} {us:>9.1f} {bps / 1e9:>8.0f} {100 * bps / common.HBM_BYTES_PER_S:>12.1f}%", flush=True)
                common.append_csv(args.csv, CSV_HEADER, [[date, gpu, commit, spec.name, bsz, args.ctx,
                                                          build_label(bd), r, f"{us:.1f}", f"{bps / 1e9:.0f}"]])


if __name__ == "__main__":
    main()
