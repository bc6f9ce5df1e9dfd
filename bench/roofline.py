"""Per-op roofline of the megakernel: for each task type, the bytes it moves over the time it takes,
against the H200's 4.8 TB/s datasheet bandwidth and the 4.26 TB/s measured device-to-device copy
rate, from a traced step (mk_plugin.persistent.trace: the same table, bytes and times).

    python bench/roofline.py bench/results/trace_<...>.records.json [more.records.json] [--out FILE.md]
    python bench/roofline.py --run [--config bench/models/llama-3.2-1b] [--batch 1 8] [--context 512]
                             [--layers N] [--lm-head] [--out FILE.md]        (CUDA: records each step)

Columns: floor us = bytes / bandwidth (the time the op would take at that bandwidth); step us = the
op's share of the traced step; gap us = step us - floor at 4.26 TB/s (what there is to win);
GB/s while busy = bytes / (busy us / SMs): the rate while the SMs compute it (waits excluded).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mk_plugin.persistent import trace as T


def roofline_markdown(records: list[dict], meta: dict) -> str:
    """The roofline table of one traced step (records annotated with bytes)."""
    rows = T.op_table(records, clock_ghz=float(meta.get("clock_ghz", T.DEFAULT_CLOCK_GHZ)))
    if rows[-1].bytes is None:
        raise SystemExit("these records carry no bytes and no program metadata to derive them")
    sms = int(meta.get("num_sms") or len({r["sm"] for r in records}))
    head = ("| op | MB | floor us @4.8 TB/s | floor us @4.26 TB/s | step us | gap us | GB/s | % of 4.8 | "
            "% of 4.26 | GB/s while busy |")
    title = (f"### {meta.get('model', '?')}, batch {meta.get('batch', '?')}, context {meta.get('context', '?')}"
             f" ({meta.get('gpu', 'GPU ?')}, commit {meta.get('commit', '?')})")
    out = [title, "", head,
           "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        assert r.bytes is not None
        f48, f426 = r.bytes / (T.HBM_PEAK_GBPS * 1e3), r.bytes / (T.COPY_GBPS * 1e3)
        busy = r.bytes / (r.busy_us / sms * 1e3) if r.busy_us > 0 else 0.0
        op = f"**{r.op}**" if r.op == "total" else r.op
        out.append(f"| {op} | {r.bytes / 1e6:.2f} | {f48:.1f} | {f426:.1f} | {r.step_us:.1f} | {r.step_us - f426:.1f} "
                   f"| {r.gbps or 0:.0f} | {r.pct_peak or 0:.1f} | {r.pct_copy or 0:.1f} | {busy:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="*", help=".records.json files written by `python -m mk_plugin.trace run`")
    ap.add_argument("--run", action="store_true", help="trace steps now on the GPU instead")
    ap.add_argument("--config", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--lm-head", action="store_true")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    if not args.records and not args.run:
        ap.error("give records files or --run")
    sections = []
    for path in args.records:
        records, meta = T.load_records(path)
        sections.append(roofline_markdown(records, meta))
    if args.run:
        from mk_plugin.trace import DEFAULT_CONFIG, run_traced
        cmd = "python bench/roofline.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
        for b in args.batch:
            records, meta = run_traced(args.config or DEFAULT_CONFIG, b, args.context, args.layers, args.lm_head,
                                       timing=False, command=cmd)
            sections.append(roofline_markdown(records, meta))
    text = "# Megakernel per-op roofline\n\n" + "\n\n".join(sections) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
