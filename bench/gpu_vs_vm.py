"""How close is the GPU megakernel to its CPU mirror, the VM? Bitwise, op by op (GPU host).

The CPU accuracy studies (bench/accuracy_cpu.py) model the megakernel by the VM (persistent/vm.py).
On the H200 the megakernel disagreed with stock vLLM at near ties more often than the Triton path
(18 vs 8 non-tie flips in 1280 teacher-forced steps each), while on the CPU model the two paths are
equally far from stock. This script measures whether the model is faithful: the same inputs run
through the GPU kernel and through the VM, stopped after each op of the first and the last layer
(stop_after prefixes; for the last layer the prefix holds every earlier layer), and the op's output
buffers compared: share of bitwise-equal elements, max |diff|, relative Frobenius difference.
Then the whole step's logits (LM head fused) against the VM's: relative difference and top-1.
Differences the VM cannot reproduce come from the GPU's arithmetic (MMA summation order, ex2.approx
in attention, __expf in silu).

    python3 bench/gpu_vs_vm.py [--layers 16] [--batch 1] [--ctx 512] [--define MK_ROUNDING=1] [--outdir DIR]

Writes <outdir>/gpu_vs_vm_<date>_<commit>_<model>_b<batch>.md. Needs CUDA and cupy; the VM part
runs on the host CPU (~1 min at 16 layers of the 1B shape).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from mk_plugin import reference as ref
from mk_plugin.persistent import vm
from mk_plugin.persistent.encoding import Buf
from mk_plugin.spec import LlamaSpec
from mk_plugin.testing import make_decode_batch, rel_fro
from mk_plugin.weights import random_weights

# Buffers laid out alike on both sides (the KV cache and the attention partials are not compared).
COMPARED = (Buf.Q, Buf.ATTN_O, Buf.RESID, Buf.ACT, Buf.OUT, Buf.LOGITS)


def diff_row(label: str, gpu: torch.Tensor, cpu: torch.Tensor) -> list[str]:
    """[label, bitwise-equal %, max |diff|, rel. Frobenius] of two tensors of the same shape."""
    g, c = gpu.detach().float().cpu(), cpu.detach().float().cpu()
    eq = (g == c) | (g.isnan() & c.isnan())
    return [label, f"{100.0 * float(eq.float().mean()):.1f}%", f"{float((g - c).abs().max()):.3e}", f"{rel_fro(g, c):.3e}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b", help="bench/models name or a folder with config.json")
    ap.add_argument("--layers", type=int, default=16, help="layers of the model run (default: the 1B's 16)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=512, help="context of every request")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE", help="kernel variant (MK_ROUNDING, MK_NUM_STAGES)")
    ap.add_argument("--outdir", type=Path, default=common.RESULTS)
    ap.add_argument("--device", default="cuda", help="cpu: the decoder's VM executor stands in for the GPU (a "
                                                     "plumbing check: everything must be bitwise equal)")
    a = ap.parse_args(argv)
    from mk_plugin.persistent.backend import MegakernelDecoder

    spec = replace(LlamaSpec.from_json_file(common.model_dir(a.model)), num_layers=a.layers)
    dev = a.device
    w = random_weights(spec, seed=0, device=dev, draw_on_device=True)
    wc = w.to("cpu")
    b = make_decode_batch(spec, [a.ctx] * a.batch, seed=1)   # N(0, 1) caches drawn on the CPU
    cs = ref.rope_cos_sin_cache(spec, a.ctx + 16).to(spec.torch_dtype)  # vLLM's table, model dtype
    from mk_plugin.persistent.variant import KernelVariant

    variant = KernelVariant.parse(a.define)
    defines = variant.defines()
    dec = MegakernelDecoder(spec, w, a.batch, dev, lm_head=True, variant=variant)
    prog = dec.program(a.batch)
    hidden_c = wc.embed[b.input_ids]
    to_gpu = [t.to(dev) for t in (b.positions, b.block_table, b.seq_lens, b.slot_mapping)]

    def gpu_run(stop_after: int | None):
        caches = [c.clone().to(dev) for c in b.kv_caches]
        out = torch.full((a.batch, spec.hidden_size), float("nan"), dtype=spec.torch_dtype, device=dev)
        logits = torch.full((a.batch, spec.vocab_size), float("nan"), device=dev)
        pos, bt, sl, slots = to_gpu
        dec(hidden_c.to(dev), pos, caches, bt, sl, slots, cs.to(dev), out=out, logits_out=logits,
            stop_after=stop_after)
        if out.is_cuda:
            torch.cuda.synchronize()
        bufs = {k: v.cpu() for k, v in dec.buffers(a.batch).items()}
        bufs[Buf.OUT], bufs[Buf.LOGITS] = out.cpu(), logits.cpu()
        return bufs

    def vm_run(stop_after: int | None):
        st = vm.make_state(prog, wc, hidden_c, b.positions, b.clone_caches(), b.block_table, b.seq_lens,
                           b.slot_mapping, cs, variant=dec.variant_for(a.batch))   # the build the GPU ran
        vm.run(prog, st, stop_after=stop_after)
        return st.bufs

    rows = []
    for layer in sorted({0, a.layers - 1}):
        for op in (o for o in prog.taskset.ops if o.layer == layer):
            n = prog.op_end(op.key)
            g, c = gpu_run(n), vm_run(n)
            rows += [diff_row(f"{op.key} {buf.name}", g[buf], c[buf]) for buf in COMPARED if buf.name in op.writes]
    g, c = gpu_run(None), vm_run(None)
    rows.append(diff_row("whole step OUT (final norm)", g[Buf.OUT], c[Buf.OUT]))
    rows.append(diff_row("whole step LOGITS", g[Buf.LOGITS], c[Buf.LOGITS]))
    same_top1 = bool(torch.equal(g[Buf.LOGITS].argmax(-1), c[Buf.LOGITS].argmax(-1)))
    text = (f"# GPU megakernel vs the VM, bitwise ({common.today()})\n\nGPU {common.gpu_name()}, commit "
            f"{common.git_commit()}; {spec.name} with {a.layers} layers, batch {a.batch}, context {a.ctx}, "
            f"random weights (seed 0), N(0, 1) K/V, rounding {dec.rounding.name.lower()}, defines "
            f"{list(defines) or 'none'}\n\ncommand: `python3 bench/gpu_vs_vm.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
            + common.markdown_table(["op (after its prefix) and buffer", "bitwise equal", "max |diff|", "rel. Frobenius"],
                                    rows)
            + f"\n\nwhole-step top-1 identical in every row: {same_top1}\n")
    common.write_record(a.outdir, f"gpu_vs_vm_{common.run_stamp()}_{spec.name}_b{a.batch}.md", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
