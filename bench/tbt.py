"""Time between tokens (TBT) of stock vLLM vs the mk_plugin decode path, on the GPU host.

Every (model, mode) runs in its own child process, all prompt lengths in one engine (max_model_len
sized for the longest), with identical engine arguments
(dummy weights from the config-only folders in bench/models, skip_tokenizer_init with token-id
prompts, ignore_eos, greedy, disable_log_stats=False, CUDA graphs on). Modes: stock = vLLM without
the plugin (VLLM_PLUGINS=""); triton / megakernel = the plugin with MK_MODE set; mk-stock = the
plugin with MK_MODE=stock (our class on the stock path). Each child reports what its workers ran
(LLM.apply_model(mk_status)); a plugin row whose steps did not take the mk path is flagged.

TBT of a request = (last_token_ts - first_token_ts) / (n - 1) from RequestOutput.metrics; a run's
TBT is the median over its requests; an engine's TBT is the median over --runs runs after one
warm-up run, each run with fresh random prompt ids (prefix caching cannot skip prefill); the reported
TBT is the median over --rounds rounds, each round a fresh engine per mode, the modes alternating
(stock, plugin, stock, plugin, ...), because runs of one engine on this host differ by up to 0.7 ms.
Floor = (weight bytes + KV bytes of one step) / 4.8 TB/s, KV at the mean context prompt + output/2.
The steady-state table (batches > 1) gives the TBT of the request whose first token came last (steady_tbt_ms):
with long prompts chunked prefill puts other requests' prefill chunks into the first decode steps of the earlier
ones, which the per-request TBT counts.

Outputs: bench/results/tbt_<date>_<commit>.md (table), tbt_<date>_<commit>.png (if matplotlib imports), rows
appended to bench/results/tbt.csv, child logs under bench/results/logs/.

    export PYTHONPATH=/root/vsite VLLM_USE_FLASHINFER_SAMPLER=0
    python bench/tbt.py --quick
    python bench/tbt.py --models llama-3.2-1b --prompts 512,2048 --batches 1,4,8 --modes triton,megakernel
    python bench/tbt.py --sweep --models llama-3.2-1b   # batch 1,2,4,8,16 x prompt 128..8192: + TBT-vs-context plot
    python bench/tbt.py --dry-run        # no GPU: fake numbers, exercises the table/CSV/plot code

With several prompt lengths a second plot, tbt_<date>_<commit>_vs_context.png, draws TBT against the
context length per shape (a line per mode and batch).
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

CSV_HEADER = ("date", "gpu", "commit", "vllm", "shape", "batch", "prompt", "output", "mode", "tbt_ms", "gbps")


# ---- child: one engine, all batch sizes --------------------------------------------------------------
def child_main(payload: dict[str, Any]) -> None:
    import torch
    from vllm import LLM, SamplingParams

    hf = common.load_hf_config(Path(payload["model_dir"]))
    vocab = int(hf["vocab_size"])
    engine_args: dict[str, Any] = {
        "model": payload["model_dir"], "load_format": "dummy", "skip_tokenizer_init": True,
        "gpu_memory_utilization": payload["gpu_mem"], "max_model_len": payload["max_model_len"],
        "enforce_eager": payload["enforce_eager"], "disable_log_stats": False, "seed": 0}
    if payload.get("max_num_seqs"):
        engine_args["max_num_seqs"] = payload["max_num_seqs"]
    if payload.get("profile_dir"):  # vLLM's torch profiler: CPU and GPU timelines of the workers
        engine_args["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": payload["profile_dir"],
                                          "torch_profiler_with_stack": False, "ignore_frontend": True}
    t0 = time.time()
    llm = LLM(**engine_args)
    startup_s = time.time() - t0
    out_len = payload["output_len"]
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0,
                        detokenize=False)
    rng = random.Random(payload["seed"])
    results: dict[str, Any] = {}
    for prompt, b in ((p, b) for p in payload["prompts"] for b in payload["batches"]):
        runs_ms, steady_ms = [], []
        for run in range(payload["runs"] + 1):  # run 0 is the warm-up
            prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt)]} for _ in range(b)]
            outs = llm.generate(prompts, sp, use_tqdm=False)
            tbts = []
            for o in outs:
                m, n = o.metrics, len(o.outputs[0].token_ids)
                if m is None or not m.last_token_ts or n != out_len:
                    raise SystemExit(f"request {o.request_id}: metrics={m}, {n} tokens (want {out_len}); "
                                     "disable_log_stats=False must give RequestOutput.metrics")
                tbts.append(request_tbt_ms(o))
            if run > 0:
                runs_ms.append(common.median(tbts))
                steady_ms.append(steady_tbt_ms(outs))
        results[result_key(prompt, b)] = {"runs_ms": runs_ms, "tbt_ms": common.median(runs_ms),
                                          "steady_ms": common.median(steady_ms)}
    if payload.get("profile_dir"):
        # One extra, profiled run per batch after the timed ones, at the first prompt length (profiling
        # slows the host; the table keeps the unprofiled TBTs). bench/host_gap.py reads the traces.
        prompt, pdir, tag = payload["prompts"][0], Path(payload["profile_dir"]), payload["profile_tag"]
        for b in payload["batches"]:
            prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt)]} for _ in range(b)]
            before = set(pdir.glob(f"{tag}_*")) if pdir.is_dir() else set()
            llm.start_profile(profile_prefix=f"{tag}_b{b}")
            llm.generate(prompts, SamplingParams(max_tokens=min(out_len, 64), ignore_eos=True, temperature=0.0,
                                                 detokenize=False), use_tqdm=False)
            llm.stop_profile()
            name_new_traces(pdir, tag, b, before)
    common.emit_result({"results": results, "status": common.worker_status(llm),
                        "gpu": torch.cuda.get_device_name(0), "startup_s": startup_s,
                        "engine_args": engine_args})
    del llm  # shuts the engine core down: the next child needs the GPU memory
    gc.collect()


def request_tbt_ms(o: Any) -> float:
    """One request's TBT: (last_token_ts - first_token_ts) / (n - 1) from its RequestOutput.metrics, in ms."""
    m, n = o.metrics, len(o.outputs[0].token_ids)
    return (m.last_token_ts - m.first_token_ts) / (n - 1) * 1e3


def steady_tbt_ms(outs: list[Any]) -> float:
    """The TBT of the request whose first token came last: once it has its first token no prompt is left to
    prefill, so its steps are decode steps only, where a request that started earlier also spent decode steps
    beside other requests' prefill chunks (long prompts x batch: chunked prefill). Its last few steps may run
    at a smaller batch, after the earlier requests finished."""
    return request_tbt_ms(max(outs, key=lambda o: o.metrics.first_token_ts))


def name_new_traces(pdir: Path, tag: str, batch: int, before: set[Path], wait_s: float = 60.0) -> list[Path]:
    """Give the traces that appeared since `before` the name of `batch`'s profiled run. vLLM 0.24's
    worker keeps the trace name of its first start_profile() (gpu_worker.profile: the profiler wrapper
    is built once), so every later batch's trace would carry the first batch's prefix. Waits up to
    wait_s for the worker to write the file (it may lag the stop_profile() reply)."""
    deadline = time.monotonic() + wait_s
    while True:
        new = sorted(set(pdir.glob(f"{tag}_*")) - before) if pdir.is_dir() else []
        if new or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    out = []
    for f in new:
        m = re.match(rf"{re.escape(tag)}_b\d+_(.*)", f.name)
        target = f.with_name(f"{tag}_b{batch}_{m.group(1)}") if m else f
        if target != f:
            f.rename(target)
        out.append(target)
    return out


def result_key(prompt: int, batch: int) -> str:
    """Key of one (prompt length, batch) result in a child's JSON."""
    return f"p{prompt}_b{batch}"


# ---- parent --------------------------------------------------------------------------------------------
def floor_bytes(spec: Any, batch: int, prompt: int, output: int) -> int:
    """Bytes one decode step must read: every weight once (LM head included) + K/V of every request
    at the mean context of the generation (prompt + output / 2)."""
    return spec.weight_bytes_per_step() + spec.kv_bytes_per_step([prompt + output // 2] * batch)


def gpu_busy_ms(profile_dir: Path, tag: str, batch: int) -> float | None:
    """Median GPU busy time per engine step (ms) of the profiled run `tag`_b`batch` (bench/host_gap.py
    over vLLM's torch-profiler trace), or None when there is no readable trace."""
    import host_gap  # bench/host_gap.py

    files = sorted(profile_dir.glob(f"{tag}_b{batch}*.json*"))
    if not files:
        return None
    try:
        s = host_gap.summarize(host_gap.steps(host_gap.gpu_events(host_gap.load_trace(files[-1])),
                                              host_gap.DEFAULT_ANCHOR))
    except (ValueError, OSError, json.JSONDecodeError):
        return None
    return s["busy_us"] / 1e3


def bound_table(rows: list[dict[str, Any]], modes: list[str]) -> str:
    """TBT next to the profiled GPU busy time per step: a row says whether the loop was GPU-bound
    (busy >= 90% of TBT: a faster step lowers TBT) or host-bound (vLLM's per-step host work sets TBT)."""
    allm = ["stock"] + modes
    if not any(r.get("busy") for r in rows):
        return ""

    def cell(r: dict[str, Any], m: str) -> str:
        busy = [x for x in r.get("busy", {}).get(m, []) if x is not None]
        ms = r["tbt"].get(m)
        if not busy or ms is None:
            return "n/a"
        b = common.median(busy)
        return f"{ms:.3f} / {b:.3f} ({'GPU' if b >= 0.9 * ms else 'host'}-bound)"
    body = [[r["shape"], r["batch"], r["prompt"]] + [cell(r, m) for m in allm] for r in rows if r.get("busy")]
    return ("\nTBT vs GPU busy per step (ms, profiled run of each engine at the first prompt length; "
            "GPU-bound when busy >= 90% of TBT):\n\n"
            + common.markdown_table(["shape", "batch", "prompt"] + [f"{m} TBT / busy" for m in allm], body) + "\n")


def fake_child(mode: str, batches: list[int], spec: Any, prompts: list[int], output: int, runs_per: int = 1
               ) -> dict[str, Any]:
    """--dry-run: plausible numbers without a GPU (checks the parent's tables, CSV and plot)."""
    rnd = random.Random(f"{mode}-{prompts}-{spec.hidden_size}")
    speed = {"stock": 1.0, "mk-stock": 1.0, "triton": 1.3, "megakernel": 1.8, "auto": 1.8}[mode]
    res = {}
    for prompt, b in ((p, b) for p in prompts for b in batches):
        floor_ms = floor_bytes(spec, b, prompt, output) / common.HBM_BYTES_PER_S * 1e3
        runs = [floor_ms * 2.2 / speed * (1 + 0.05 * rnd.random()) for _ in range(runs_per)]
        res[result_key(prompt, b)] = {"runs_ms": runs, "tbt_ms": common.median(runs),
                                      "steady_ms": 0.95 * common.median(runs)}
    st = {"stock": {"class": "LlamaForCausalLM"}}.get(mode, {"class": "MkLlamaForCausalLM", "backend": mode,
                                                           "counts": {"decode:1": 1}, "unsupported": None})
    return {"results": res, "status": [st], "gpu": "dry-run", "startup_s": 0.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b", help="comma list of bench/models names or paths")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--prompts", default="512,2048")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--modes", default="triton,megakernel",
                   help=f"plugin modes measured against stock (always run); any of {common.MODES[1:]}, each "
                        "optionally with MK_* switches of its own joined by '+' (megakernel+MK_LM_HEAD=megakernel)")
    p.add_argument("--runs", type=int, default=5, help="measured runs per engine, after one warm-up run")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of engines (default 3; 1 with --sweep): each round runs stock, then each plugin mode, "
                        "each in a fresh engine (stock, plugin, stock, plugin, ...): the host is noisy, so modes are "
                        "compared side by side and the reported TBT is the median over rounds, with every round shown "
                        "in the spread table. Engines of one mode differ by up to ~1 ms at 1B on the H200 host "
                        "(bench/NOTES.md session 24): a one-round comparison of host-bound rows says little")
    p.add_argument("--quick", action="store_true", help="1B, prompt 512, batches 1,8, 2 runs, mode triton")
    p.add_argument("--sweep", action="store_true",
                   help="issue 5's sweep: batches 1,2,4,8,16 x prompts 128,512,2048,8192, 2 runs, one round unless "
                        "--rounds says more (models and modes as given)")
    p.add_argument("--runner", choices=common.RUNNERS, default="default", help="vLLM model runner (default: V2)")
    p.add_argument("--eager", action="store_true", help="enforce_eager=True (default: CUDA graphs)")
    p.add_argument("--gpu-mem", type=float, default=0.85)
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine max_num_seqs (default: vLLM's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--outdir", type=Path, default=common.RESULTS)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    p.add_argument("--dry-run", action="store_true", help="no vLLM: fake numbers, for checking the outputs")
    p.add_argument("--profile", action="store_true",
                   help="after the timed runs, one torch-profiled run per batch (64 tokens) into "
                        "<outdir>/profiles/; `python bench/host_gap.py <trace>` tells GPU- from host-bound")
    common.add_mk_env_arg(p)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.models, a.prompts, a.batches, a.runs, a.modes, a.rounds = "llama-3.2-1b", "512", "1,8", 2, "triton", 1
    if a.sweep:
        a.prompts, a.batches, a.runs = "128,512,2048,8192", "1,2,4,8,16", 2
    if a.rounds is None:
        a.rounds = 1 if a.sweep else 3
    a.model_list = [m for m in a.models.split(",") if m]
    a.batch_list = [int(x) for x in a.batches.split(",") if x]
    a.prompt_list = [int(x) for x in a.prompts.split(",") if x]
    try:
        a.mode_list = common.plugin_modes(a.modes)
    except ValueError as e:
        p.error(f"--modes: {e}")
    if a.output_len < 2 or a.runs < 1 or a.rounds < 1 or not a.batch_list or not a.prompt_list:
        p.error("need --output-len >= 2, --runs >= 1, --rounds >= 1 and at least one batch and prompt")
    return a


def render(rows: list[dict[str, Any]], modes: list[str], meta: dict[str, str], notes: list[str]) -> str:
    header = ["shape", "batch", "prompt", "floor ms", "stock ms (% floor)"]
    for m in modes:
        header += [f"{m} ms (% floor)", f"{m} speedup"]
    body = []
    for r in rows:
        fl = r["floor_ms"]

        def cell(ms: float | None, fl: float = fl) -> str:
            return "n/a" if ms is None else f"{ms:.3f} ({100 * fl / ms:.0f}%)"
        line = [r["shape"], r["batch"], r["prompt"], f"{fl:.3f}", cell(r["tbt"].get("stock"))]
        for m in modes:
            ms, st = r["tbt"].get(m), r["tbt"].get("stock")
            line += [cell(ms), "n/a" if ms is None or st is None else f"{st / ms:.2f}x"]
        body.append(line)
    head = (f"# TBT: stock vLLM vs mk_plugin ({meta['date']})\n\nGPU {meta['gpu']}, commit {meta['commit']}, "
            f"vLLM {meta['vllm']}, runner {meta['runner']}, {'eager' if meta['eager'] == 'True' else 'CUDA graphs'}, "
            f"output {meta['output']} tokens, median over {meta.get('rounds', '1')} round(s) of fresh engines (modes "
            f"alternating) of each engine's median of {meta['runs']} runs after a warm-up; dummy weights.\n"
            f"% floor = (weight + KV bytes per step) / 4.8 TB/s divided by the TBT (100% = at the HBM floor).\n")
    return (head + "\n" + common.markdown_table(header, body) + "\n" + steady_table(rows, modes)
            + bound_table(rows, modes) + spread_table(rows, modes) + ("\n" + "\n".join(notes) + "\n" if notes else ""))


def steady_table(rows: list[dict[str, Any]], modes: list[str]) -> str:
    """The steady-state decode TBT (steady_tbt_ms) per mode, medians over rounds; only for batches > 1, where it
    can differ from the per-request TBT."""
    allm = ["stock"] + modes
    rs = [r for r in rows if r["batch"] > 1 and r.get("steady")]
    if not rs:
        return ""

    def cell(r: dict[str, Any], m: str) -> str:
        ms, st = r["steady"].get(m), r["steady"].get("stock")
        if ms is None:
            return "n/a"
        return f"{ms:.3f}" + ("" if m == "stock" or st is None else f" ({st / ms:.2f}x)")
    body = [[r["shape"], r["batch"], r["prompt"]] + [cell(r, m) for m in allm] for r in rs]
    return ("\nSteady-state decode TBT (ms; the request whose first token came last, every one of its steps a "
            "decode step: the TBT above also counts decode steps that shared the GPU with other requests' prefill "
            "chunks; speed-up against stock):\n\n"
            + common.markdown_table(["shape", "batch", "prompt"] + [f"{m} steady" for m in allm], body) + "\n")


def spread_table(rows: list[dict[str, Any]], modes: list[str]) -> str:
    """Every run's TBT per mode: on a host-bound loop runs of one engine differ by up to 0.6 ms
    (bench/NOTES.md), so a speed-up means something only against this spread. Empty with one run."""
    allm = ["stock"] + modes
    out = ""
    if any(len(v) > 1 for r in rows for v in r.get("rounds", {}).values()):
        body = [[r["shape"], r["batch"], r["prompt"]]
                + [" / ".join(f"{x:.3f}" for x in r.get("rounds", {}).get(m, [])) or "n/a" for m in allm]
                for r in rows]
        out += ("\nRound-to-round spread (each fresh engine's TBT, ms, rounds alternating the modes; the table "
                "above takes their median):\n\n"
                + common.markdown_table(["shape", "batch", "prompt"] + [f"{m} rounds" for m in allm], body) + "\n")
    if any(len(v) > 1 for r in rows for v in r.get("runs", {}).values()):
        body = [[r["shape"], r["batch"], r["prompt"]]
                + [" / ".join(f"{x:.3f}" for x in r.get("runs", {}).get(m, [])) or "n/a" for m in allm] for r in rows]
        out += ("\nRun-to-run spread (each run's TBT, ms, in run order):\n\n"
                + common.markdown_table(["shape", "batch", "prompt"] + [f"{m} runs" for m in allm], body) + "\n")
    return out


def plot(rows: list[dict[str, Any]], modes: list[str], path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: plot skipped"
    shapes = list(dict.fromkeys(r["shape"] for r in rows))  # in the order measured
    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 4.5), squeeze=False)
    allm = ["stock"] + modes
    for ax, shape in zip(axes[0], shapes):
        rs = [r for r in rows if r["shape"] == shape]
        x = list(range(len(rs)))
        w = 0.8 / len(allm)
        for k, m in enumerate(allm):
            ys = [r["tbt"].get(m) or 0.0 for r in rs]
            ax.bar([i + k * w for i in x], ys, w, label=m)
        ax.hlines([r["floor_ms"] for r in rs], [i - w / 2 for i in x], [i + (len(allm) - 0.5) * w for i in x],
                  colors="k", linestyles="--", label="HBM floor")
        ax.set_xticks([i + 0.4 - w / 2 for i in x], [f"B{r['batch']}/P{r['prompt']}" for r in rs])
        ax.set_ylabel("TBT ms")
        ax.set_title(shape)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def plot_vs_context(rows: list[dict[str, Any]], modes: list[str], path: Path) -> str | None:
    """TBT against the prompt length, one panel per shape, a line per (mode, batch): colour = mode,
    marker = batch; the HBM floor of each batch dashed in grey."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: plot skipped"
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    markers = "os^Dv<>p*h"
    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 4.8), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for k, m in enumerate(["stock"] + modes):
            for j, b in enumerate(batches):
                rs = sorted((r for r in rows if r["shape"] == shape and r["batch"] == b and m in r["tbt"]),
                            key=lambda r: r["prompt"])
                if rs:
                    ax.plot([r["prompt"] for r in rs], [r["tbt"][m] for r in rs], color=f"C{k}",
                            marker=markers[j % len(markers)], label=f"{m} B{b}", lw=1.2, ms=4)
        for b in batches:
            rs = sorted((r for r in rows if r["shape"] == shape and r["batch"] == b), key=lambda r: r["prompt"])
            ax.plot([r["prompt"] for r in rs], [r["floor_ms"] for r in rs], color="0.6", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (context at the first decode step)")
        ax.set_ylabel("TBT ms")
        ax.set_title(f"{shape} (grey dashed: HBM floor per batch)")
        ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        child_main(common.child_payload(a.child))
        return 0
    from mk_plugin.spec import LlamaSpec

    shim = None if a.dry_run else common.ensure_plugin_visible()
    meta = {"date": common.today(), "gpu": "dry-run" if a.dry_run else common.gpu_name(),
            "commit": common.git_commit(), "vllm": common.vllm_version(), "runner": a.runner + (f" (plugin env {common.mk_env_text(a.mk_env)})" if a.mk_env else ""),
            "eager": str(a.eager), "output": str(a.output_len), "runs": str(a.runs), "rounds": str(a.rounds)}
    a.outdir.mkdir(parents=True, exist_ok=True)
    # The commit in every file name: two runs on one day must not overwrite each other's records.
    stamp = common.run_stamp() + ("_dryrun" if a.dry_run else "")
    md_path, png_path = a.outdir / f"tbt_{stamp}.md", a.outdir / f"tbt_{stamp}.png"
    csv_path = a.outdir / ("tbt_dryrun.csv" if a.dry_run else "tbt.csv")
    rows: dict[tuple, dict[str, Any]] = {}
    notes: list[str] = []
    failed = False
    for model in a.model_list:
        mdir = common.model_dir(model)
        spec = LlamaSpec.from_json_file(mdir)
        mml = common.max_model_len_for(max(a.prompt_list), a.output_len)
        for prompt in a.prompt_list:
            for b in a.batch_list:
                fb = floor_bytes(spec, b, prompt, a.output_len)
                rows[(mdir.name, prompt, b)] = {"shape": mdir.name, "batch": b, "prompt": prompt, "bytes": fb,
                                                "floor_ms": fb / common.HBM_BYTES_PER_S * 1e3, "tbt": {}}
        ptag = "p" + "-".join(str(x) for x in a.prompt_list)
        for rnd, mode in ((r, m) for r in range(a.rounds) for m in ["stock"] + a.mode_list):
            payload = {"model_dir": str(mdir), "prompts": a.prompt_list, "output_len": a.output_len,
                       "batches": a.batch_list, "runs": a.runs, "gpu_mem": a.gpu_mem, "max_model_len": mml,
                       "enforce_eager": a.eager, "max_num_seqs": a.max_num_seqs, "seed": a.seed}
            if a.profile:
                payload["profile_dir"] = str((a.outdir / "profiles").resolve())
                payload["profile_tag"] = (f"tbt_{stamp}_{mdir.name}_p{a.prompt_list[0]}_{common.mode_tag(mode)}"
                                          f"_r{rnd + 1}")   # a file name: no '+' or '=' of a mode's switches
            label = (f"{mdir.name} prompts {','.join(map(str, a.prompt_list))} {mode}"
                     + (f" round {rnd + 1}/{a.rounds}" if a.rounds > 1 else ""))
            print(f"[tbt] {label} ...", flush=True)
            log = a.outdir / "logs" / (f"tbt_{stamp}_{mdir.name}_{ptag}_{common.mode_tag(mode)}"
                                       f"{f'_r{rnd + 1}' if a.rounds > 1 else ''}.log")
            base, env = common.split_mode(mode)
            try:
                if a.dry_run:
                    res = fake_child(base, a.batch_list, spec, a.prompt_list, a.output_len, a.runs)
                else:
                    res = common.run_child(Path(__file__), payload,
                                           common.child_env(base, a.runner, shim=shim, mk_env=a.mk_env | env),
                                           log, a.timeout)
            except common.ChildFailed as e:
                failed = True
                notes.append(f"- {label}: FAILED (log: {log})")
                print(e, file=sys.stderr)
                continue
            if meta["gpu"] == "unknown":
                meta["gpu"] = res.get("gpu", "unknown")
            check = common.path_check(mode, res["status"], a.mk_env)
            for msg in (res["status"][0].get("logged") or {}).values() if res["status"] else []:
                print(f"[tbt]   worker: mk_plugin: {msg}")
            if check != "ok":
                notes.append(f"- {label}: {check}")
                print(f"[tbt] WARNING {label}: {check}", flush=True)
            csv_rows = []
            for prompt in a.prompt_list:
                for b in a.batch_list:
                    got = res["results"][result_key(prompt, b)]
                    ms = got["tbt_ms"]
                    r = rows[(mdir.name, prompt, b)]
                    r.setdefault("rounds", {}).setdefault(mode, []).append(ms)
                    r["tbt"][mode] = common.median(r["rounds"][mode])
                    r.setdefault("runs", {}).setdefault(mode, []).extend(got["runs_ms"])
                    if "steady_ms" in got:
                        r.setdefault("steady_rounds", {}).setdefault(mode, []).append(got["steady_ms"])
                        r.setdefault("steady", {})[mode] = common.median(r["steady_rounds"][mode])
                    csv_rows.append([meta["date"], meta["gpu"], meta["commit"], meta["vllm"], mdir.name, b, prompt,
                                     a.output_len, mode, f"{ms:.4f}", f"{r['bytes'] / (ms * 1e-3) / 1e9:.1f}"])
                    print(f"[tbt]   prompt {prompt} batch {b}: {ms:.3f} ms  runs "
                          f"{[f'{x:.3f}' for x in got['runs_ms']]}")
            if a.profile and not a.dry_run:
                for b in a.batch_list:
                    r = rows[(mdir.name, a.prompt_list[0], b)]
                    busy = gpu_busy_ms(Path(payload["profile_dir"]), payload["profile_tag"], b)
                    r.setdefault("busy", {}).setdefault(mode, []).append(busy)
            common.append_csv(csv_path, CSV_HEADER, csv_rows)
            md_path.write_text(render(list(rows.values()), a.mode_list, meta, notes))  # partial results survive
    md_path.write_text(render(list(rows.values()), a.mode_list, meta, notes))
    print(md_path.read_text())
    if any(r["tbt"] for r in rows.values()):
        msg = plot(list(rows.values()), a.mode_list, png_path)
        print(msg or f"plot: {png_path}")
        if len(a.prompt_list) > 1:
            ctx_path = a.outdir / f"tbt_{stamp}_vs_context.png"
            msg = plot_vs_context(list(rows.values()), a.mode_list, ctx_path)
            print(msg or f"plot: {ctx_path}")
    print(f"table: {md_path}\ncsv: {csv_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
