"""Race detector for the megakernel's hand-offs: many CUDA-graph replays of one decode step, each compared
bitwise with the first.

The megakernel is deterministic by design (fixed task order per SM, fixed-order reductions, no float
atomics), so one step replayed with the same inputs must give the same bits every time. A hand-off that
lets a reader see stale data (a release that does not order the writer's stores, a flag seen before its
payload) shows up as a replay that differs. Every scratch buffer (Buf.*, the partial buffers) and the
output are filled with NaN inside the captured graph before each step, so a stale read of a buffer the step has not yet
written is a NaN, and a stale read of an earlier layer's value a different number: both change the
output. The KV slots the step appends are rewritten with the same values each replay.

    python bench/race_stress.py [--model bench/models/llama-3.2-1b] [--batch 1 3 8] [--replays 2000]
                                [--define MK_ATT_TMA=128 ...] [--out FILE.md]

Per batch: replays, mismatching replays (output or logits differ from the first replay in any bit), NaN
replays, and the first mismatch's index and max abs difference. Exit status 1 when any replay mismatched,
so a job script can stop on it. Timing is not measured here (bench/mk_step.py does that).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # bench/common.py

TABLE_HEADER = ("model", "build", "batch", "ctx", "replays", "mismatching", "NaN", "first mismatch", "max abs diff")


@dataclass
class Tally:
    """Mismatch counts of one (build, batch) run."""
    replays: int = 0
    mismatching: int = 0
    nan: int = 0
    first: int = -1          # replay index of the first mismatch (-1: none)
    max_abs: float = 0.0

    def add(self, i: int, equal: bool, has_nan: bool, max_abs: float) -> None:
        self.replays += 1
        if has_nan:
            self.nan += 1
        if not equal:
            self.mismatching += 1
            self.max_abs = max(self.max_abs, max_abs)
            if self.first < 0:
                self.first = i

    def row(self, model: str, build: str, batch: int, ctx: int) -> list[str]:
        first = str(self.first) if self.first >= 0 else "-"
        diff = f"{self.max_abs:.3g}" if self.mismatching else "-"
        return [model, build, str(batch), str(ctx), str(self.replays), str(self.mismatching), str(self.nan), first, diff]


def check_args(batches: list[int], replays: int, ctx: int) -> None:
    """Bad input fails before CUDA is touched, naming the value and what is supported."""
    if replays < 2:
        raise SystemExit(f"--replays {replays}: want >= 2 (the first replay is the reference)")
    for b in batches:
        if not 1 <= b <= 16:
            raise SystemExit(f"--batch {b}: the megakernel runs batch 1..16")
    if ctx < 1:
        raise SystemExit(f"--ctx {ctx}: want >= 1")


def run(model: str, batches: list[int], replays: int, ctx: int, defines: list[str]) -> tuple[list[list[str]], bool]:
    import torch

    from mk_plugin import reference as ref
    from mk_plugin.config import get_config
    from mk_plugin.persistent.backend import MegakernelDecoder
    from mk_plugin.persistent.variant import KernelVariant
    from mk_plugin.spec import LlamaSpec
    from mk_plugin.weights import random_weights

    if not torch.cuda.is_available():
        raise SystemExit("race_stress needs a CUDA GPU: none is visible")
    spec = LlamaSpec.from_json_file(model)
    variant = KernelVariant.parse(defines)
    cfg = get_config()
    w = random_weights(spec, device="cuda", draw_on_device=True)
    cs = ref.rope_cos_sin_cache(spec, ctx + 16).to("cuda")
    dec = MegakernelDecoder(spec, w, max(batches), "cuda", lm_head=True, variant=variant, tuning=cfg.tuning,
                            watchdog_ms=cfg.watchdog_ms)
    dec.prepare(batches)
    rows, clean = [], True
    for bsz in batches:
        tally = _stress_batch(dec, spec, w, cs, bsz, ctx, replays)
        rows.append(tally.row(spec.name, variant.label(), bsz, ctx))
        clean &= tally.mismatching == 0 and tally.nan == 0
        print(" | ".join(rows[-1]), flush=True)
    return rows, clean


def _stress_batch(dec, spec, w, cs, bsz: int, ctx: int, replays: int) -> Tally:
    """Capture one step of batch bsz (scratch and outputs poisoned first, inside the graph), replay it
    `replays` times and tally the replays whose output or logits differ from the first's."""
    import torch

    b, caches, pos, sl, bt, slots = common.bench_decode_batch(spec, [ctx] * bsz, bsz, "cuda")
    hidden = w.embed[b.input_ids.to("cuda")]
    out = torch.empty_like(hidden)
    logits = torch.empty(bsz, spec.vocab_size, device="cuda")
    scratch = [*dec.ws.values(), dec.part_o, dec.part_ml, dec.part_k, out, logits]   # as the gpu tests poison

    def step() -> None:
        for t in scratch:
            t.fill_(float("nan"))
        dec(hidden, pos, caches, bt, sl, slots, cs, out=out, logits_out=logits)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                      # warm-up outside the graph (compiles, uploads the program)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    g.replay()
    torch.cuda.synchronize()
    ref_out, ref_logits = out.clone(), logits.clone()
    tally = Tally()
    tally.add(0, True, bool(torch.isnan(ref_out).any() or torch.isnan(ref_logits).any()), 0.0)
    for i in range(1, replays):
        g.replay()
        eq = torch.equal(out, ref_out) and torch.equal(logits, ref_logits)
        diff = 0.0 if eq else float(torch.nan_to_num((out.float() - ref_out.float()).abs(), nan=float("inf")).max())
        tally.add(i, eq, bool(torch.isnan(out).any()), diff)
    return tally


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(Path(__file__).resolve().parent / "models" / "llama-3.2-1b"))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 3, 8])
    p.add_argument("--replays", type=int, default=2000)
    p.add_argument("--ctx", type=int, default=300, help="tokens per request (default 300: not a block multiple)")
    p.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                   help="kernel variant (variant.KernelVariant), as bench/mk_step.py; repeatable")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table to this file")
    a = p.parse_args(argv)
    check_args(a.batch, a.replays, a.ctx)
    rows, clean = run(a.model, a.batch, a.replays, a.ctx, a.define)
    md = "\n".join([f"### race_stress: {common.gpu_name()}, commit {common.git_commit()}, {common.today()}", "",
                    common.markdown_table(TABLE_HEADER, rows), ""])
    print(md)
    if a.out is not None:
        common.write_record(a.out.parent, a.out.name, md)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
