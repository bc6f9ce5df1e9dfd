"""Soak test in vLLM (issue 6): continuous batching with forced preemption, stock vLLM vs the
mk_plugin decode path, compared request by request. Exits non-zero on failure.

Both engines run in their own child process with identical engine arguments: the seeded N(0, 0.02)
checkpoint of --model (vllm_correctness.seeded_checkpoint, shared with vllm_correctness.py part b),
skip_tokenizer_init, CUDA graphs on, max_num_seqs 16 (pure decode steps stay within the plugin's
16-token decode path), disable_log_stats=False (preemption counter and scheduler gauges), and a small
KV cache (num_gpu_blocks_override; default: room for --kv-requests = 4 requests of the longest
length) so that the scheduler has to preempt. Stock is vLLM without the plugin (VLLM_PLUGINS="");
the plugin run has MK_MODE=--mode.

Workload (make_schedule, seeded, identical in both engines): --requests requests, prompt lengths
uniform in --min-prompt..--max-prompt (random token ids), output lengths uniform in
--min-out..--max-out, greedy, ignore_eos, logprobs=2 in both runs. Arrivals are a Poisson process on
the clock of the driving loop (one tick per LLMEngine.step(); mean gap --mean-gap ticks): requests are
added with LLMEngine.add_request between steps while others run, so the batch changes every few
steps. When the engine runs dry the clock jumps to the next arrival (step() would block forever).
Each request's tokens and top-2 logprobs come back as DELTA outputs and are accumulated per request.

Verdict (judge, per request, on the request id; the engines may batch differently, that is fine):
  identical   same tokens end to end;
  fp32 ok     a first difference where, by the fp32 truth of the same weights and tokens
              (bench/fp32_truth.py, a GPU child after the engines; --no-fp32-rule skips it), the plugin's
              token is not below stock's by more than bf16 resolution (issue 13's rule);
  near tie    (--no-fp32-rule only) a first difference where stock's top-2 logprob gap < 0.05;
  BUG         a first difference the fp32 truth rejects (or, without it, not a near tie), a short or
              missing output, or missing logprobs.
PASS = no BUG (with the control judged by the fp32 rule too: no BUG but the rule's, whose count may be at most
1.5x the control's, make_checks); the plugin-vs-stock first-difference rate <= 1.5x the stock-vs-stock control's (>= 99%
identical when no control ran); the plugin run took the mk decode path; both runs preempted (when
vLLM's counter is readable); and no memory growth in the plugin run over the second half of the run
(samples from step max(--warmup-steps, half the last sample's step)): worker torch.cuda
memory_allocated and nvidia-smi grow by at most --mem-tol-mib / --smi-tol-mib. Stock's memory and
torch's reserved pool are reported too: on the H200 (soak_2026-11-30_dad3af1_...) nvidia-smi grew in
steps of ~170-350 MiB early in all three engines, stock included, with torch allocated flat.

Control: a third engine runs stock again on the same requests at --control-max-num-seqs (default 8),
so the batches differ. vLLM is not batch invariant (GEMM and attention split choices follow the batch
size), so first differences happen inside stock too; their rate is the yardstick the plugin's is held
to. 0 disables it; its failure does not fail the soak.

Outputs: <outdir>/soak_<date>_<commit>_<model>_<mode>.md (date, GPU, commit, command line, summary, engines,
divergences), child logs in <outdir>/logs/. Per-request tokens go to a work folder (removed unless
--keep), not to the logs: 2,000 requests are megabytes.

    export PYTHONPATH=/root/vsite VLLM_USE_FLASHINFER_SAMPLER=0
    python3 bench/soak.py --requests 2000 --mode megakernel
    python3 bench/soak.py --requests 100 --mode triton        # a short smoke run (memory verdict n/a)

Time, roughly 2-3 minutes per engine for llama-3.2-1b (3 engines with the control), derived as follows. A rough model of the
scheduler run on the default schedule (FCFS, admission only when the prompt's blocks are free, one
token per running request per step, the newest request preempted when a block is missing) gives
~17k steps at ~7.6 requests per step, ~1.3k steps with a prefill (3.05M prompt tokens, recompute
included) and ~75 preemptions; the arrival clock alone is 2,000 x 8 = 16k ticks, i.e. the engine runs
near saturation (the model saturates below a gap of ~8.6). At ~3-4 ms a step (1B stock TBT 2.3-2.7 ms
at batch 1-8 in bench/results/tbt.csv, plus logprobs and per-step output handling) that is ~60 s;
prefill of ~3M tokens is ~30-60 s for 1B; engine start ~35 s ("init engine ... took 33.54 s" in the
correctness logs); writing the 1B checkpoint once ~10-20 s. So ~2-3 min per engine. llama-3.1-8b:
~3x the step time, ~20-30 min. The fp32 child after the engines: ~0.11 s per first difference on the H200
(session 14: 450 in 48 s), i.e. ~6 min for the plugin's and the control's ~3,400 at 2,000 requests, so a
2,000-request soak takes two GPU calls of <= 10 min: --work DIR --engines-only, then the same command without
--engines-only (the engines are reused from DIR).

Layout: this file is the parent and the children (the engines, the fp32 rule's GPU child); the pure parts are
bench/soak_schedule.py (workload, driving loop) and bench/soak_verdicts.py (verdicts, summary, report, checks).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import vllm_correctness as vc
from soak_schedule import (
    KV_USAGE,
    PREEMPTIONS,
    RUNNING,
    WAITING,
    DriveResult,
    ScheduleParams,
    SoakRequest,
    batch_stats,
    drive,
    make_schedule,
    metric_totals,
    prompt_ids,
)
from soak_verdicts import (
    apply_fp32_rule,
    fp32_balance,
    fp32_items,
    judge,
    make_checks,
    render,
    split_fp32,
    summarize,
)

ASSUMED_BLOCK_SIZE = 16      # vLLM's CacheConfig.DEFAULT_BLOCK_SIZE; the child reports the real one


# ---- the fp32 rule's GPU child ----------------------------------------------------------------------
def fp32_child(p: dict[str, Any]) -> None:
    """GPU child without vLLM: the fp32 truth at every listed first difference, and the rule's verdict."""
    import fp32_truth as ft
    import torch

    from mk_plugin.spec import LlamaSpec

    spec = LlamaSpec.from_hf_config(common.load_hf_config(Path(p["model_dir"])), name="truth")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = ft.load_checkpoint(Path(p["model_dir"]), spec, dev)
    res = {}
    t0 = time.time()
    print(f"[fp32] {len(p['items'])} first differences on {dev}", flush=True)
    for i, it in enumerate(p["items"]):
        truth = ft.prefill_logits(spec, w, it["tokens"], dev)
        bug, worse = ft.fp32_rule(truth, it["stock_tok"], it["plugin_tok"])
        res[it.get("key", str(it["rid"]))] = [bug, worse, ft.bf16_ulp(float(truth.max()))]
        if i % 200 == 199:
            print(f"[fp32] {i + 1} judged in {time.time() - t0:.0f} s", flush=True)
    common.emit_result({"fp32": res})


# ---- child: one engine ------------------------------------------------------------------------------
def worker_memory(model: Any) -> dict[str, float]:
    """For LLM.apply_model: this worker's torch allocator figures (MiB). Defined at module level of the
    child's __main__, so cloudpickle sends it by value."""
    import torch

    return {"alloc_mib": torch.cuda.memory_allocated() / 2**20, "reserved_mib": torch.cuda.memory_reserved() / 2**20}


def child_main(p: dict[str, Any]) -> None:
    if p.get("kind") == "fp32":
        fp32_child(p)
        return
    from vllm import LLM

    args: dict[str, Any] = {"model": p["model_dir"], "skip_tokenizer_init": True, "seed": 0,
                            "gpu_memory_utilization": p["gpu_mem"], "max_model_len": p["max_model_len"],
                            "max_num_seqs": p["max_num_seqs"], "num_gpu_blocks_override": p["kv_blocks"],
                            "enforce_eager": p["enforce_eager"], "disable_log_stats": False}
    t0 = time.time()
    llm = LLM(**args)
    out = {"gpu": common.gpu_name(), "engine_args": args, "startup_s": time.time() - t0, **soak_engine(llm, p),
           "status": common.worker_status(llm)}
    common.emit_result(out)
    del llm  # shuts the engine core down: the next child needs the GPU memory
    gc.collect()


def soak_engine(llm: Any, p: dict[str, Any]) -> dict[str, Any]:
    """Drive the schedule through llm.llm_engine; per-request outputs go to p["out_json"], the figures
    are returned."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sched_params = ScheduleParams(**p["schedule"])
    schedule = make_schedule(sched_params)
    engine = llm.llm_engine
    cache = engine.vllm_config.cache_config  # num_gpu_blocks: filled in from the engine core's handshake

    def params_of(r: SoakRequest) -> Any:
        # DELTA: every step returns the new token of each request that got one (per-step batch size)
        return SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0, logprobs=2,
                              detokenize=False, output_kind=RequestOutputKind.DELTA)

    def sample(res: DriveResult) -> dict[str, Any]:
        s: dict[str, Any] = {"step": res.steps, "clock": res.clock,
                             "done": sum(o["finished"] for o in res.outputs.values()),
                             "smi_mib": common.gpu_memory_used_mib()}
        try:
            s.update(llm.apply_model(worker_memory)[0])
        except Exception as e:  # noqa: BLE001 - reported as n/a, the soak itself goes on
            s["alloc_error"] = f"{type(e).__name__}: {e}"
        try:
            m = metric_totals(llm.get_metrics())
        except Exception as e:  # noqa: BLE001 - the figures become n/a; never fake them
            m, s["metrics_error"] = {}, f"{type(e).__name__}: {e}"
        s.update({"running": m.get(RUNNING), "waiting": m.get(WAITING), "kv_usage": m.get(KV_USAGE),
                  "preemptions": m.get(PREEMPTIONS)})
        print(f"[soak] step {s['step']} clock {s['clock']}: {s['done']}/{len(schedule)} done, running "
              f"{s['running']}, waiting {s['waiting']}, preemptions {s['preemptions']}, "
              f"nvidia-smi {s['smi_mib']} MiB, torch allocated {s.get('alloc_mib')}, reserved {s.get('reserved_mib')}",
              flush=True)
        return s

    # LLMEngine.add_request takes a raw TokensPrompt (vLLM 0.24 logs a deprecation warning once)
    res = drive(engine, schedule, lambda r: {"prompt_token_ids": prompt_ids(sched_params, r)}, params_of,
                sample, p["sample_every"])
    Path(p["out_json"]).write_text(json.dumps({str(k): v for k, v in res.outputs.items()}))
    pre = res.samples[-1].get("preemptions")
    return {"block_size": getattr(cache, "block_size", None), "num_gpu_blocks": getattr(cache, "num_gpu_blocks", None),
            "steps": res.steps, "clock": res.clock, "idle_jumps": res.idle_jumps,
            "added_while_busy": res.added_while_busy, "wall_s": res.wall_s,
            "tokens": sum(len(o["tokens"]) for o in res.outputs.values()), "batch": batch_stats(res.batch_sizes),
            "samples": res.samples, "preemptions": None if pre is None else int(pre), "out_json": p["out_json"]}


# ---- parent -----------------------------------------------------------------------------------------
def default_kv_blocks(kv_requests: int, max_model_len: int, block_size: int = ASSUMED_BLOCK_SIZE) -> int:
    """Blocks for kv_requests requests of the longest length: fewer than the concurrent requests need."""
    return kv_requests * math.ceil(max_model_len / block_size)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b", help="bench/models name (1b, 8b) or a folder with config.json")
    p.add_argument("--mode", choices=common.PLUGIN_MODES, default="megakernel", help="MK_MODE of the plugin run")
    p.add_argument("--runner", choices=common.RUNNERS, default="default", help="vLLM model runner (default: V2)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--min-prompt", type=int, default=1)
    p.add_argument("--max-prompt", type=int, default=3000)
    p.add_argument("--min-out", type=int, default=1)
    p.add_argument("--max-out", type=int, default=128)
    p.add_argument("--mean-gap", type=float, default=8.0,
                   help="mean ticks (engine steps) between arrivals; the default keeps the default KV cache busy "
                        "(see the time estimate)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--control-max-num-seqs", type=int, default=8,
                   help="a third engine, stock again at this max_num_seqs (other batching, same requests): the "
                        "stock-vs-stock identical fraction is reported beside the plugin's; 0 = no control run")
    p.add_argument("--kv-requests", type=int, default=4,
                   help="KV cache = room for this many requests of the longest length (sets --kv-blocks)")
    p.add_argument("--kv-blocks", type=int, default=None, help="num_gpu_blocks_override (default: from --kv-requests)")
    p.add_argument("--eager", action="store_true", help="enforce_eager=True (default: CUDA graphs)")
    p.add_argument("--gpu-mem", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=0, help="seed of the request schedule and prompts")
    p.add_argument("--weight-seed", type=int, default=0, help="seed of the checkpoint (0 = vllm_correctness's)")
    p.add_argument("--weights-dir", type=Path, default=vc.DEFAULT_WEIGHTS_DIR)
    p.add_argument("--sample-every", type=int, default=250, help="steps between memory/gauge samples")
    p.add_argument("--warmup-steps", type=int, default=2000, help="memory samples before this step are not judged")
    p.add_argument("--mem-tol-mib", type=float, default=64.0, help="allowed torch allocated growth (plugin run)")
    p.add_argument("--smi-tol-mib", type=float, default=256.0, help="allowed nvidia-smi growth (plugin run)")
    p.add_argument("--outdir", type=Path, default=common.RESULTS)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    p.add_argument("--keep", action="store_true", help="keep the per-request outputs (JSON) in the work folder")
    p.add_argument("--work", type=Path, default=None,
                   help="work folder, kept: engines already finished there for the same payload are reused "
                        "(run the engines in one call, the fp32 verdict in the next)")
    p.add_argument("--engines-only", action="store_true",
                   help="run (or reuse) the engines and stop before judging: with --work, the first of two calls")
    p.add_argument("--fp32-rule", action=argparse.BooleanOptionalAction, default=True,
                   help="judge each first difference by the fp32 truth (bench/fp32_truth.py; issue 13), not by "
                        "stock's top-2 gap (a GPU child after the engines)")
    common.add_mk_env_arg(p)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not (1 <= a.min_prompt <= a.max_prompt and 1 <= a.min_out <= a.max_out and a.requests >= 1):
        p.error("need 1 <= --min-prompt <= --max-prompt, 1 <= --min-out <= --max-out and --requests >= 1")
    if a.mean_gap < 0 or a.sample_every < 1 or not 1 <= a.max_num_seqs or a.control_max_num_seqs < 0:
        p.error("need --mean-gap >= 0, --sample-every >= 1, --max-num-seqs >= 1 and --control-max-num-seqs >= 0")
    a.max_model_len = common.max_model_len_for(a.max_prompt, a.max_out)
    a.kv_blocks = a.kv_blocks or default_kv_blocks(a.kv_requests, a.max_model_len)
    return a


CONTROL = "stock-control"  # stock again, same requests, other max_num_seqs: stock's own batch variance


def engine_plan(a: argparse.Namespace, payload: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, MK mode, payload) of each child: stock, the plugin, and the stock control unless disabled."""
    plan = [("stock", "stock", payload), (a.mode, a.mode, payload)]
    if a.control_max_num_seqs:
        plan.append((CONTROL, "stock", {**payload, "max_num_seqs": a.control_max_num_seqs}))
    return plan


def run_engines(a: argparse.Namespace, payload: dict[str, Any], tag: str, work: Path
                ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Stock, the plugin, then the control; returns the results that came back and the failures."""
    shim = common.ensure_plugin_visible()
    results, failures = {}, []
    for name, mode, pl in engine_plan(a, payload):
        log = a.outdir / "logs" / f"soak_{tag}_{name}.log"
        child = {**pl, "out_json": str(work / f"{name}.json")}
        saved = reused_engine(work, name, mode, child)
        if saved is not None:
            print(f"[soak] {name}: reusing the finished run in {work}", flush=True)
            results[name] = saved
            continue
        print(f"[soak] {name} ... (log {log})", flush=True)
        try:
            results[name] = common.run_child(Path(__file__), child,
                                             common.child_env(mode, a.runner, shim=shim, mk_env=a.mk_env), log,
                                             a.timeout)
            (work / f"{name}.result.json").write_text(json.dumps({"mode": mode, "payload": child,
                                                                  "result": results[name]}))
        except common.ChildFailed as e:
            print(e, file=sys.stderr)
            failures.append(f"{name}: child failed (log {log})")
    return results, failures


def reused_engine(work: Path, name: str, mode: str, child: dict[str, Any]) -> dict[str, Any] | None:
    """An engine run that an earlier soak with the same --work folder finished for the same payload and mode
    (its result and per-request outputs kept there), else None: a soak longer than one call (the GPU host's
    10-minute limit) runs its engines in one call and its fp32 verdict in the next."""
    rfile = work / f"{name}.result.json"
    if not rfile.is_file() or not Path(child["out_json"]).is_file():
        return None
    saved = json.loads(rfile.read_text())
    return saved["result"] if saved.get("mode") == mode and saved.get("payload") == child else None


def control_row(schedule: list[SoakRequest], stock: dict[int, Any], control: dict[int, Any] | None,
                max_num_seqs: int, failed: bool) -> tuple[str, str, bool]:
    """Stock vs stock under other batching, judged like the plugin. Reported, not judged: it measures
    how often bf16 near ties flip inside stock vLLM itself (GEMM and attention split choices depend on
    the batch), the yardstick for the plugin's identical fraction."""
    label = f"reference, not judged: stock vs stock at max_num_seqs {max_num_seqs} (same requests)"
    if control is None:
        return label, "control run failed (see its log)" if failed else "not run", True
    s = summarize([judge(r, stock.get(r.rid), control.get(r.rid)) for r in schedule])
    return label, (f"identical {s['identical']}/{s['requests']} ({s['identical_frac']:.2%}), near ties "
                   f"{len(s['near_ties'])}, non-tie differences {len(s['bugs'])}"), True


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        child_main(common.child_payload(a.child))
        return 0
    mdir = common.model_dir(a.model)
    params = ScheduleParams(a.requests, int(common.load_hf_config(mdir)["vocab_size"]), a.min_prompt, a.max_prompt,
                            a.min_out, a.max_out, a.mean_gap, a.seed)
    wdir = vc.seeded_checkpoint(mdir, a.weights_dir, a.weight_seed)
    payload = {"model_dir": str(wdir), "gpu_mem": a.gpu_mem, "max_model_len": a.max_model_len,
               "max_num_seqs": a.max_num_seqs, "kv_blocks": a.kv_blocks, "enforce_eager": a.eager,
               "schedule": asdict(params), "sample_every": a.sample_every}
    tag = f"{common.run_stamp()}_{mdir.name}_{a.mode}"
    work = a.work or Path(tempfile.mkdtemp(prefix="mk_soak_"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    engines, failures = run_engines(a, payload, tag, work)
    if a.engines_only:
        print(f"[soak] engines done ({', '.join(engines)}; failures: {failures or 'none'}), kept in {work}")
        return 1 if failures else 0
    schedule = make_schedule(params)
    control_failed = any(f.startswith(CONTROL + ":") for f in failures)
    failures = [f for f in failures if not f.startswith(CONTROL + ":")]  # the control is not judged
    if failures:  # the engines that did come back are still tabulated
        summary, checks = summarize([]), [(f, "see the log", False) for f in failures]
    else:
        outs = {m: {int(k): v for k, v in json.loads(Path(r["out_json"]).read_text()).items()}
                for m, r in engines.items()}
        verdicts = [judge(r, outs["stock"].get(r.rid), outs[a.mode].get(r.rid)) for r in schedule]
        fp32_failed = False
        control = outs.get(CONTROL)
        control_verdicts = None if control is None else [judge(r, outs["stock"].get(r.rid), control.get(r.rid))
                                                         for r in schedule]
        balance: dict[str, dict[str, int]] = {}
        if a.fp32_rule:  # issue 13: a first difference is a bug only if the fp32 truth says so
            # the control's first differences (stock vs stock) go through the same rule: its yardstick
            sets = [("plugin", verdicts, outs[a.mode])]
            if control_verdicts is not None:
                sets.append(("control", control_verdicts, control))
            items = [{**it, "key": f"{name}:{it['rid']}"} for name, vs, other in sets
                     for it in fp32_items(vs, schedule, params, outs["stock"], other)]
            try:
                got = split_fp32(common.run_child(Path(__file__), {"kind": "fp32", "model_dir": str(wdir),
                                                                   "items": items}, common.child_env("stock", a.runner),
                                                  a.outdir / "logs" / f"soak_{tag}_fp32.log", a.timeout)["fp32"])
                verdicts = apply_fp32_rule(verdicts, {k: (b, x) for k, (b, x, _) in got["plugin"].items()})
                balance = {name: fp32_balance(got[name]) for name, _, _ in sets}
            except common.ChildFailed as e:
                print(e, file=sys.stderr)
                fp32_failed = True
        summary = summarize(verdicts)
        judged = {m: r for m, r in engines.items() if m != CONTROL}
        control_diff = None
        if a.control_max_num_seqs and control_verdicts is not None:
            cs = summarize(control_verdicts)
            control_diff = 1.0 - cs["identical_frac"] if cs["requests"] else None
        checks = make_checks(summary, judged, a.mode, common.path_check(a.mode, engines[a.mode]["status"], a.mk_env),
                             a.warmup_steps, a.mem_tol_mib, a.smi_tol_mib, control_diff, balance.get("control"))
        for name, b in balance.items():   # reported: how the first differences split by the fp32 truth
            who = a.mode if name == "plugin" else CONTROL
            checks.append((f"reference, not judged: {who} vs stock by fp32, worse / better / within one bf16 ulp",
                           f"{b['worse']} / {b['better']} / {b['within']} of {b['n']}", True))
        if fp32_failed:
            checks.append(("first differences judged by the fp32 truth", "the fp32 child failed (see its log)", False))
        if a.control_max_num_seqs:
            checks.append(control_row(schedule, outs["stock"], outs.get(CONTROL), a.control_max_num_seqs,
                                      control_failed))
    block = next((r["block_size"] for r in engines.values() if r.get("block_size")), ASSUMED_BLOCK_SIZE)
    mean_out = sum(r.max_tokens for r in schedule) / len(schedule)
    meta = {"mode": a.mode, "date": common.today(), "gpu": common.gpu_name(), "commit": common.git_commit(),
            "vllm": common.vllm_version(), "runner": a.runner,
            "command": shlex.join(["python3", "bench/soak.py", *(sys.argv[1:] if argv is None else argv)]),
            "setup": (f"model {mdir.name}, seeded N(0, {vc.WEIGHT_STD}) weights (seed {a.weight_seed}), "
                      f"{'eager' if a.eager else 'CUDA graphs'}, max_num_seqs {a.max_num_seqs}, max_model_len "
                      f"{a.max_model_len}, KV cache {a.kv_blocks} blocks x {block} = {a.kv_blocks * block} tokens "
                      f"(num_gpu_blocks_override). {a.requests} requests (seed {a.seed}), prompts "
                      f"{a.min_prompt}..{a.max_prompt}, outputs {a.min_out}..{a.max_out} (mean {mean_out:.1f}), "
                      f"Poisson arrivals every {a.mean_gap} steps on average, greedy, ignore_eos, logprobs=2. "
                      f"Total time {time.time() - t0:.0f} s (both engines, start-up included).")}
    common.write_record(a.outdir, f"soak_{tag}.md", render(meta, summary, engines, checks, a.warmup_steps))
    if not a.keep and a.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(c[2] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
