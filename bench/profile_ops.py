"""Nsight Compute, through nsight-python (the `profile` extra), on every Triton op of one decode layer, the
LM head and the whole megakernel step, at several batch sizes: duration, DRAM bytes read and written,
and the DRAM throughput they imply (GB/s, % of the 4.8 TB/s datasheet rate), as CSV rows appended to
bench/results/profile_ops.csv, a markdown table and a plot.

    python bench/profile_ops.py [--model bench/models/llama-3.2-1b] [--batch 1 8 16] [--ctx 512] [--runs 3]
    python bench/profile_ops.py --dry-run        # CPU: the op list and the table/plot code on made-up numbers

On the GPU host nsight-python and its needs travel as wheels: `bash bench/profile_wheels.sh` (here) fills
.whl/, then in the run: `pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl` and
PYTHONPATH=/tmp/site. Nsight Compute must attach before CUDA starts: nsight is imported before any
tensor is made. Clocks are left as they are (clock_control="none").
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # bench/common.py

PEAK_GBPS = 4800.0
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")
HEADER = ("date", "gpu", "commit", "model", "op", "batch", "ctx", "duration_us", "dram_read_mb", "dram_write_mb",
          "dram_gbps", "dram_pct_of_4800")
TRITON_OPS = ("rms_norm", "qkv_rope.linear", "qkv_rope.rope_kv_append", "attention", "o_proj", "gate_up", "down",
              "lm_head")
OPS = TRITON_OPS + ("megakernel_step",)


def table_rows(records: Iterable[dict], meta: dict) -> list[tuple]:
    """CSV rows (HEADER) from nsight-python's results (records with Annotation, batch, Metric, AvgValue;
    one per metric), one per (op, batch) in first-seen order; throughput = (read + write) / duration."""
    by: dict[tuple[str, int], dict[str, float]] = {}
    for r in records:
        by.setdefault((r["Annotation"], int(r["batch"])), {})[r["Metric"]] = float(r["AvgValue"])
    rows = []
    for (op, batch), v in by.items():
        ns = v["gpu__time_duration.sum"]
        rd, wr = v["dram__bytes_read.sum"], v["dram__bytes_write.sum"]
        gbps = (rd + wr) / ns if ns > 0 else 0.0
        rows.append((meta["date"], meta["gpu"], meta["commit"], meta["model"], op, batch, meta["ctx"],
                     f"{ns / 1e3:.1f}", f"{rd / 1e6:.2f}", f"{wr / 1e6:.2f}", f"{gbps:.0f}",
                     f"{100 * gbps / PEAK_GBPS:.1f}"))
    return rows


def plot(rows: list[tuple], path: Path) -> Path | None:
    """DRAM throughput per op, one bar group per batch size (None without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ops = list(dict.fromkeys(r[4] for r in rows))
    batches = sorted({r[5] for r in rows})
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / max(1, len(batches))
    for i, b in enumerate(batches):
        vals = {r[4]: float(r[10]) for r in rows if r[5] == b}
        ax.bar([k + i * width for k in range(len(ops))], [vals.get(o, 0.0) for o in ops], width, label=f"batch {b}")
    ax.axhline(PEAK_GBPS, color="k", lw=0.8, ls="--", label="4.8 TB/s")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(ops))], ops, rotation=25, ha="right")
    ax.set_ylabel("DRAM GB/s (Nsight Compute)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _batch_calls(spec, w, dec, cs, b: int, ctx: int) -> dict[str, Callable[[], None]]:
    """The calls of op_calls for one batch size (their own tensors: closures bind this frame)."""
    import torch

    from mk_plugin import triton_ops as T

    lw, dt, eps = w.layers[0], spec.torch_dtype, spec.rms_eps
    bt, caches, pos, sl, tab, slots = common.bench_decode_batch(spec, [ctx] * b, b, "cuda")
    x = torch.randn(b, spec.hidden_size, device="cuda").to(dt)
    qkv = torch.empty(b, spec.qkv_size, device="cuda", dtype=dt)
    q = torch.empty(b, spec.q_size, device="cuda", dtype=dt)
    att = torch.empty_like(q)
    act = torch.empty(b, spec.intermediate_size, device="cuda", dtype=dt)
    h2 = torch.empty_like(x)
    lo = torch.empty(b, spec.vocab_size, device="cuda", dtype=torch.float32)
    hidden, out = w.embed[bt.input_ids.to("cuda")], torch.empty_like(x)
    return {
        "rms_norm": lambda: T.rms_norm(x, lw.input_norm, eps, out=h2),
        "qkv_rope.linear": lambda: T.linear(x, lw.qkv, norm_weight=lw.input_norm, eps=eps, out=qkv),
        "qkv_rope.rope_kv_append": lambda: T.rope_kv_append(
            qkv, pos, cs, caches[0], slots, num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, q_out=q),
        "attention": lambda: T.paged_attention(q, caches[0], tab, sl, spec.head_dim ** -0.5, out=att),
        "o_proj": lambda: T.linear(att, lw.o, residual=x, out=h2),
        "gate_up": lambda: T.linear(h2, lw.gate_up, norm_weight=lw.post_norm, eps=eps,
                                    activation="silu_and_mul", out=act),
        "down": lambda: T.linear(act, lw.down, residual=h2, out=x),
        "lm_head": lambda: T.lm_head(x, w.lm_head, norm_weight=w.final_norm, eps=eps, out=lo),
        "megakernel_step": lambda: dec(hidden, pos, caches, tab, sl, slots, cs, out=out),
    }


def op_calls(model: Path, batches: Iterable[int], ctx: int) -> dict[tuple[str, int], Callable[[], None]]:
    """One zero-argument call per (op, batch): layer 0's Triton ops on their real inputs, the LM head, and the
    whole megakernel step (every layer, no LM head). Each call is run once here (compiles, warms up)."""
    import torch

    from mk_plugin import reference as ref
    from mk_plugin.persistent.backend import MegakernelDecoder
    from mk_plugin.spec import LlamaSpec
    from mk_plugin.weights import random_weights

    spec = LlamaSpec.from_json_file(model)
    w = random_weights(spec, device="cuda", draw_on_device=True)
    cs = ref.rope_cos_sin_cache(spec, ctx + 16).to("cuda")
    batches = list(batches)
    dec = MegakernelDecoder(spec, w, max(batches), "cuda", tuning="off", trace=False)
    dec.prepare(batches)
    calls: dict[tuple[str, int], Callable[[], None]] = {}
    for b in batches:
        for op, fn in _batch_calls(spec, w, dec, cs, b, ctx).items():
            fn()
            calls[(op, b)] = fn
    torch.cuda.synchronize()
    return calls


def _fake_records(batches: list[int]) -> list[dict]:
    return [{"Annotation": op, "batch": b, "Metric": m, "AvgValue": val}
            for b in batches for k, op in enumerate(OPS)
            for m, val in zip(METRICS, (1000.0 * (k + 1) * b, 2e6 * (k + 1), 1e5 * b))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=common.MODELS / "llama-3.2-1b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3, help="profiled runs per (op, batch); the table takes their mean")
    ap.add_argument("--outdir", type=Path, default=common.RESULTS)
    ap.add_argument("--dry-run", action="store_true", help="no GPU: made-up metrics through the table and plot code")
    args = ap.parse_args(argv)
    if any(not 1 <= b <= 16 for b in args.batch):
        raise SystemExit(f"--batch {args.batch}: the decode paths handle 1..16 tokens")
    meta = {"date": common.today(), "commit": common.git_commit(), "model": args.model.name, "ctx": args.ctx}
    if args.dry_run:
        meta["gpu"] = "dry-run"
        records = _fake_records(args.batch)
    else:
        import nsight  # before any CUDA work: Nsight Compute attaches at import
        import torch

        meta["gpu"] = torch.cuda.get_device_name()
        calls = op_calls(args.model, args.batch, args.ctx)

        # One config per batch size, every op under its own annotation in each: nsight-python expects every
        # annotation in every config and run (0.9.6: "Expect same number of kernels per run" otherwise).
        @nsight.analyze.kernel(configs=[(b,) for b in args.batch], runs=args.runs,
                               metrics=list(METRICS), clock_control="none", combine_kernel_metrics=lambda a, b: a + b)
        def profile(batch: int) -> None:
            for op in OPS:
                with nsight.annotate(op):
                    calls[(op, batch)]()

        records = profile().to_dataframe().to_dict("records")
    rows = table_rows(records, meta)
    stem = f"profile_ops_{common.run_stamp()}_{args.model.name}" + ("_dry" if args.dry_run else "")
    csv_path = args.outdir / ("profile_ops_dry.csv" if args.dry_run else "profile_ops.csv")
    common.append_csv(csv_path, HEADER, rows)
    md = common.markdown_table(HEADER[3:], [r[3:] for r in rows])
    common.write_record(args.outdir, f"{stem}.md", f"# Nsight Compute per op ({meta['gpu']}, {meta['commit']})\n\n"
                        f"`python3 {' '.join(sys.argv)}`; mean of {args.runs} profiled runs; multi-kernel ops "
                        "summed.\n\n" + md + "\n")
    png = plot(rows, args.outdir / f"{stem}.png")
    print(md)
    print(f"rows appended to {csv_path}" + (f"; plot {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
