"""`python -m mk_plugin.trace`: the megakernel's intra-kernel timeline.

    python -m mk_plugin.trace run [--config bench/models/llama-3.2-1b] [--batch 1] [--context 512]
                                  [--layers N] [--lm-head] [--fallback ops] [--outdir bench/results]
    python -m mk_plugin.trace convert RECORDS.json [--outdir DIR] [--no-png]

`run` (CUDA only) builds MegakernelDecoder(trace=True) on random weights, runs warm-up steps and one
traced step, and writes into --outdir, under the stem trace_<date>_<model>_b<B>_ctx<C>[...]:
    .records.json   the per-task records with bytes and the program's metadata (convert's input)
    .perfetto.json  Chrome/Perfetto trace: one track per SM, waits nested, producer tracks
    .png            Gantt chart: SM rows coloured by op, counter waits hatched
    .md             date, GPU, commit, command line, step times and the per-op table
It also times the step (CUDA-graph replays, median) with tracing on and off, so the cost of
recording shows. `convert` redoes the last three from a records file, on any machine.
The logic lives in mk_plugin.persistent.trace (pure functions); this module is the glue.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import importlib.util
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from .persistent import trace as T
from .persistent import trace_views as TV

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "bench" / "models" / "llama-3.2-1b"
DEFAULT_OUTDIR = REPO / "bench" / "results"


def _bench_common():
    """bench/common.py (provenance helpers) when running from a checkout, else None."""
    p = REPO / "bench" / "common.py"
    if not p.exists():
        return None
    spec = importlib.util.spec_from_file_location("_mk_bench_common", p)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def _commit() -> str:
    common = _bench_common()
    return common.git_commit() if common is not None else "unknown"


def _sm_clock_ghz(device_index: int) -> float:
    """The SM clock (cudaDevAttrClockRate, kHz) through CuPy; the H200 default when unavailable."""
    try:
        import cupy as cp
        khz = cp.cuda.runtime.deviceGetAttribute(13, device_index)  # 13 = cudaDevAttrClockRate
    except Exception:  # noqa: BLE001 - any failure: fall back to the documented default
        return T.DEFAULT_CLOCK_GHZ
    return khz / 1e6 if khz > 0 else T.DEFAULT_CLOCK_GHZ


def command_line(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return "python -m mk_plugin.trace " + " ".join(shlex.quote(a) for a in args)


def run_traced(config: str | Path = DEFAULT_CONFIG, batch: int = 1, context: int = 512, layers: int | None = None,
               lm_head: bool = False, fallback: frozenset[str] = frozenset(), warmup: int = 3,
               timing: bool = True, command: str = "") -> tuple[list[dict], dict[str, Any]]:
    """Record one megakernel step on the current CUDA device: (annotated records, meta)."""
    import torch

    from . import reference as ref
    from .persistent.backend import MegakernelDecoder
    from .spec import LlamaSpec
    from .testing import make_decode_batch
    from .timing import graph_median_ms
    from .weights import random_weights

    if not torch.cuda.is_available():
        raise SystemExit("`run` needs a CUDA GPU; use `convert` on a saved .records.json")
    spec = LlamaSpec.from_json_file(config)
    if layers is not None:
        spec = dataclasses.replace(spec, num_layers=layers)
    seq = [context] * batch
    w = random_weights(spec, device="cuda")
    b = make_decode_batch(spec, seq, device="cuda")
    cs = ref.rope_cos_sin_cache(spec, context + 16).to("cuda")
    hidden = w.embed[b.input_ids]
    out = torch.empty_like(hidden)
    logits = torch.empty(batch, spec.vocab_size, device="cuda") if lm_head else None

    def decoder(trace: bool):
        d = MegakernelDecoder(spec, w, batch, "cuda", lm_head=lm_head, fallback=fallback, trace=trace)
        d.prepare([batch])
        return d, lambda: d(hidden, b.positions, b.kv_caches, b.block_table, b.seq_lens, b.slot_mapping, cs,
                            out=out, logits_out=logits)

    dec, step = decoder(True)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    step()
    records = T.annotate(dec.trace_records(batch), dec.program(batch), seq)
    extra: dict[str, Any] = {}
    if timing:
        extra["traced_step_us"] = graph_median_ms(step) * 1e3
        extra["untraced_step_us"] = graph_median_ms(decoder(False)[1]) * 1e3
    dev = torch.cuda.current_device()
    meta = T.program_meta(dec.program(batch), seq, context=context,
                          layers_overridden=layers is not None,
                          date=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                          gpu=torch.cuda.get_device_name(dev), commit=_commit(), command=command,
                          clock_ghz=_sm_clock_ghz(dev), **extra)
    return records, meta


def default_stem(meta: dict[str, Any]) -> str:
    date = str(meta.get("date", "")).split(" ")[0] or _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")
    s = f"trace_{date}_{meta.get('model', 'model')}_b{meta.get('batch', 0)}_ctx{meta.get('context', 0)}"
    if meta.get("lm_head"):
        s += "_lmhead"
    if meta.get("layers_overridden"):
        s += f"_L{meta['layers']}"
    if meta.get("fallback"):
        s += "_fb-" + "-".join(meta["fallback"])
    return s


def report_markdown(records: list[dict], meta: dict[str, Any], files: dict[str, Path]) -> str:
    """The .md report: provenance, step times, timer granularity, the per-op table."""
    rows = T.op_table(records, clock_ghz=float(meta.get("clock_ghz", T.DEFAULT_CLOCK_GHZ)))
    gran = T.timer_granularity_ns(records)
    lines = [(f"# Megakernel trace: {meta.get('model', '?')}, batch {meta.get('batch', '?')}, "
              f"context {meta.get('context', '?')}"), ""]
    for k in ("date", "gpu", "commit", "command"):
        if meta.get(k):
            lines.append(f"- {k}: `{meta[k]}`" if k == "command" else f"- {k}: {meta[k]}")
    sms = len({r["sm"] for r in records})
    lines.append(f"- program: {len(records)} traced tasks on {sms} SMs (grid {meta.get('num_sms', '?')}), "
                 f"{meta.get('layers', '?')} layers, attention chunks {meta.get('attn_chunks', '?')}, "
                 f"lm_head {bool(meta.get('lm_head'))}, fallback {meta.get('fallback') or 'none'}")
    span = T.step_span_ns(records) / 1e3
    t = f"- traced step span (first task start to last task end): {span:.1f} us"
    if "untraced_step_us" in meta:
        t += (f"; CUDA-graph step time, median: {meta['untraced_step_us']:.1f} us untraced, "
              f"{meta['traced_step_us']:.1f} us traced")
    lines.append(t)
    warn = " (coarse: short tasks are quantised)" if gran >= 500 else ""
    lines.append(f"- %globaltimer granularity seen (gcd of timestamp offsets): {gran} ns{warn}; "
                 f"SM clock for wait_cycles: {float(meta.get('clock_ghz', T.DEFAULT_CLOCK_GHZ)):.2f} GHz")
    for k, p in files.items():
        lines.append(f"- {k}: `{p.name}`" + (" (open in ui.perfetto.dev)" if k == "perfetto" else ""))
    lines += ["", T.op_table_markdown(rows), "",
              ("busy = end - ready summed over tasks; busiest SM = max over SMs of its busy time (per-SM critical "
               "path); step = the op's share of the step span (instances in tid order, each credited its last end "
               "past the latest end so far); wait = counter wait (ready - start); wgt wait = consumers waiting for "
               "weight chunks; prod lead = mean (ready - producer's first issue); MB = unique bytes (weights + KV + "
               "activations, an instance's shared input rows once); GB/s = MB / step us."), ""]
    return "\n".join(lines)


def write_outputs(records: list[dict], meta: dict[str, Any], outdir: str | Path, stem: str | None = None, *,
                  source: Path | None = None, png: bool = True) -> dict[str, Path]:
    """Write the records JSON (unless they come from `source`, a saved one), Perfetto JSON, PNG
    and markdown; returns {kind: path}."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    stem = stem or default_stem(meta)
    files: dict[str, Path] = {}
    files["records"] = source or T.save_records(out / f"{stem}.records.json", records, meta)
    p = out / f"{stem}.perfetto.json"
    p.write_text(json.dumps(TV.to_perfetto(records, meta)))
    files["perfetto"] = p
    if png:
        try:
            files["png"] = TV.plot_gantt(records, out / f"{stem}.png",
                                        title=f"{meta.get('model', '')} batch {meta.get('batch', '?')} "
                                              f"ctx {meta.get('context', '?')} on {meta.get('gpu', '?')}")
        except ImportError:
            print("matplotlib is not importable: PNG skipped (pip install matplotlib)", file=sys.stderr)
    md = out / f"{stem}.md"
    md.write_text(report_markdown(records, meta, files))
    files["markdown"] = md
    return files


def _stem_of(path: Path) -> str:
    name = path.name
    for suffix in (".records.json.gz", ".records.json", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mk_plugin.trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="record one megakernel step on the GPU and write all outputs")
    r.add_argument("--config", default=str(DEFAULT_CONFIG), help="config.json or its folder")
    r.add_argument("--batch", type=int, default=1, help="decode tokens (1..16)")
    r.add_argument("--context", type=int, default=512, help="tokens in each request's context")
    r.add_argument("--layers", type=int, default=None, help="run only the first N layers (default: all)")
    r.add_argument("--lm-head", action="store_true", help="fuse the LM head into the megakernel step")
    r.add_argument("--fallback", default="", help="comma list of ops run by Triton between segments")
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--no-timing", action="store_true", help="skip the CUDA-graph step timing")
    r.add_argument("--no-png", action="store_true")
    r.add_argument("--outdir", default=str(DEFAULT_OUTDIR))
    c = sub.add_parser("convert", help="Perfetto JSON, PNG and markdown from a saved records JSON (CPU is fine)")
    c.add_argument("records", help="a .records.json written by `run` (or a JSON list of trace_records rows)")
    c.add_argument("--outdir", default=None, help="default: the records file's folder")
    c.add_argument("--no-png", action="store_true")
    args = ap.parse_args(argv)

    if args.cmd == "run":
        fb = frozenset(s.strip() for s in args.fallback.split(",") if s.strip())
        records, meta = run_traced(args.config, args.batch, args.context, args.layers, args.lm_head, fb,
                                   args.warmup, not args.no_timing, command_line(argv))
        files = write_outputs(records, meta, args.outdir, png=not args.no_png)
    else:
        path = Path(args.records)
        records, meta = T.load_records(path)
        files = write_outputs(records, meta, args.outdir or path.parent, _stem_of(path), source=path,
                              png=not args.no_png)
    print(files["markdown"].read_text())
    for k, p in files.items():
        print(f"{k}: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
