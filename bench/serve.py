"""The real client: `vllm serve` (the OpenAI server, as users run it) driven by `vllm bench serve`, for
stock vLLM and each plugin mode, at several concurrencies; TPOT / ITL / TTFT / throughput per (model,
mode, concurrency) as a markdown table, a plot and rows of bench/results/serve.csv.

    python bench/serve.py [--models llama-3.2-1b,llama-3.1-8b] [--modes triton,megakernel,auto]
                          [--concurrency 1,4,8,16] [--input-len 512] [--output-len 128] [--prompts 64] [--rounds 1]
    python bench/serve.py --dry-run        # CPU: fake results through the table/CSV/plot code

The served folder is a copy of bench/models/<model> (config only; --load-format dummy weights) with a
generated word-level tokenizer (token i is the word "w<i>", ids 0-2 the special tokens): no hub access, and the random dataset of
`vllm bench serve` round-trips through it. Each mode gets a fresh server (stock: VLLM_PLUGINS=""; the
plugin modes: MK_MODE), identical engine arguments, one greedy completion checked to return tokens
before the benchmark, and a server log that must hold no Python traceback. With --rounds N the servers
alternate (stock, plugin, stock, plugin, ...: a server's whole run sits higher or lower at random on a
noisy host, by up to ~0.7 ms per token at 1B on the H200) and the table shows the median over rounds
with every round's TPOT; the CSV has one row per round.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # bench/common.py

CSV_HEADER = ("date", "gpu", "commit", "vllm", "shape", "mode", "concurrency", "input_len", "output_len", "prompts",
              "median_tpot_ms", "median_itl_ms", "median_ttft_ms", "output_tok_s", "completed")
METRICS = ("median_tpot_ms", "median_itl_ms", "median_ttft_ms", "output_throughput", "completed")


UNK, BOS, EOS = "<|reserved_special_token_0|>", "<|begin_of_text|>", "<|end_of_text|>"


def make_served_folder(model: Path, where: Path) -> Path:
    """model's config.json plus a word-level tokenizer over its whole vocabulary (UNK, BOS, EOS,
    "w3" .. "w<V-1>", whitespace pre-tokenizer), saved the way transformers' AutoTokenizer loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = common.load_hf_config(model)
    out = where / model.name
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(model / "config.json", out / "config.json")
    # ids 0..2 are the special tokens, named so that no word contains them (an added token "w1" would
    # also match inside "w11"), and long, as Llama 3's are: vLLM 0.24 rejects (400, before tokenizing) a
    # prompt of more characters than (max_model_len - max_tokens) x its longest token, and a random-dataset
    # prompt of 512 seven-character words plus their spaces is 4095 characters (8 of 32 requests failed
    # on the H200 with "<s>"/"</s>": 528 x 7 = 3696)
    vocab = {f"w{i}": i for i in range(int(cfg["vocab_size"]))} | {UNK: 0, BOS: 1, EOS: 2}
    for i in range(3):
        del vocab[f"w{i}"]
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, bos_token=BOS, eos_token=EOS, pad_token=UNK)
    fast.save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# `vllm` without its console script (the GPU host's vLLM is a site tree on PYTHONPATH)
VLLM_CLI = [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def server_cmd(folder: Path, port: int, args: argparse.Namespace) -> list[str]:
    return [*VLLM_CLI, "serve", str(folder), "--port", str(port), "--load-format", "dummy",
            "--max-model-len", str(common.max_model_len_for(args.input_len, args.output_len)),
            "--gpu-memory-utilization", str(args.gpu_mem), "--max-num-seqs", str(max(args.concurrency_list)),
            "--seed", "0"]  # request logging is off by default in vLLM 0.24 (--disable-log-requests is gone)


def bench_cmd(folder: Path, port: int, conc: int, args: argparse.Namespace, result_dir: Path, name: str) -> list[str]:
    return [*VLLM_CLI, "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", str(folder), "--tokenizer", str(folder),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(max(args.prompts, 2 * conc)),
            "--max-concurrency", str(conc), "--request-rate", "inf", "--ignore-eos", "--seed", "0",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", name]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"vllm serve not ready after {timeout:.0f} s")


def greedy_completion(port: int, folder: Path) -> list[str]:
    """One greedy completion through the server: it must return tokens."""
    body = json.dumps({"model": str(folder), "prompt": "w11 w12 w13 w14", "max_tokens": 8, "temperature": 0.0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        text = json.loads(r.read())["choices"][0]["text"]
    words = text.split()
    if not words:
        raise RuntimeError(f"the greedy completion returned no tokens: {text!r}")
    return words


def log_traceback(log: Path, upto: int | None = None) -> str | None:
    """The first Python traceback in the server log's first `upto` bytes (all of it: None). run_mode
    passes the size the log had when the benchmark ended: stopping the server with SIGTERM makes vLLM
    0.24 itself log an EngineDeadError traceback from its output handler (seen on the H200), which says
    nothing about the run."""
    text = log.read_bytes()[:upto].decode(errors="replace")
    i = text.find("Traceback (most recent call last)")
    return None if i < 0 else text[i: i + 2000]


def run_mode(folder: Path, mode: str, args: argparse.Namespace, outdir: Path, stamp: str,
             tag: str | None = None) -> dict[int, dict]:
    """Start a server in `mode`, check it, run the benchmark per concurrency; {concurrency: metrics}. `tag`
    (default: the mode) names its log files: one per round."""
    port = free_port()
    tag = common.mode_tag(tag or mode)
    log = outdir / "logs" / f"serve_{stamp}_{folder.name}_{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    base, mode_env = common.split_mode(mode)
    env = common.child_env(base, args.runner, mk_env=args.mk_env | mode_env)
    res: dict[int, dict] = {}
    with open(log, "w") as f:
        proc = subprocess.Popen(server_cmd(folder, port, args), env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            wait_ready(port, proc, args.timeout)
            print(f"[serve] {folder.name} {mode}: greedy completion {greedy_completion(port, folder)[:4]}", flush=True)
            for conc in args.concurrency_list:
                name = f"serve_{stamp}_{folder.name}_{tag}_c{conc}.json"
                r = subprocess.run(bench_cmd(folder, port, conc, args, outdir / "logs", name), env=env,
                                   capture_output=True, text=True, timeout=args.timeout, check=False)
                if r.returncode != 0:
                    raise RuntimeError(f"vllm bench serve (concurrency {conc}) failed:\n{r.stderr[-3000:]}")
                got = json.loads((outdir / "logs" / name).read_text())
                if got.get("failed"):
                    # vllm bench serve prints up to 10 of the failed requests' errors
                    errs = [ln for ln in r.stdout.splitlines() if ln.startswith("Error ")][:10]
                    raise RuntimeError(f"{got['failed']} of {got['num_prompts']} requests failed at concurrency {conc} "
                                       f"({mode}); vllm bench serve's errors:\n" + ("\n".join(errs) or r.stdout[-3000:]))
                res[conc] = {k: got[k] for k in METRICS}
                print(f"[serve]   concurrency {conc}: TPOT {got['median_tpot_ms']:.2f} ms, "
                      f"{got['output_throughput']:.0f} tok/s", flush=True)
        finally:
            served = log.stat().st_size  # what the server logged while serving (see log_traceback)
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    tb = log_traceback(log, served)
    if tb:
        raise RuntimeError(f"the {mode} server logged a traceback ({log}):\n{tb}")
    return res


def fake_mode(mode: str, concs: list[int]) -> dict[int, dict]:
    base = {"stock": 5.0, "triton": 4.8, "megakernel": 4.6, "auto": 4.8, "mk-stock": 5.0}[mode]
    return {c: {"median_tpot_ms": base + 0.05 * c, "median_itl_ms": base + 0.04 * c, "median_ttft_ms": 30.0 + c,
                "output_throughput": 1000.0 * c / (base + 0.05 * c), "completed": 64} for c in concs}


def over_rounds(rounds: list[dict[int, dict]]) -> dict[int, dict]:
    """Each metric's median over the rounds, per concurrency measured in every round."""
    concs = [c for c in rounds[0] if all(c in r for r in rounds)]
    return {c: {k: statistics.median(r[c][k] for r in rounds) for k in METRICS} for c in concs}


def spread_table(per_round: dict[tuple[str, str], list[dict[int, dict]]], modes: list[str], concs: list[int]) -> str:
    """Every round's median TPOT per (model, concurrency, mode), in round order."""
    rows = []
    for shape in dict.fromkeys(s for s, _ in per_round):
        for c in concs:
            cells = [" / ".join(f"{r[c]['median_tpot_ms']:.2f}" for r in per_round.get((shape, m), []) if c in r) or "n/a"
                     for m in ["stock"] + modes]
            rows.append([shape, c] + cells)
    return ("\nEvery round's median TPOT ms (servers alternating, in round order):\n\n"
            + common.markdown_table(["model", "concurrency"] + [f"{m} rounds" for m in ["stock"] + modes], rows) + "\n")


def render(results: dict[tuple[str, str], dict[int, dict]], modes: list[str], concs: list[int], meta: dict) -> str:
    head = (f"# vllm serve + vllm bench serve ({meta['gpu']}, commit {meta['commit']}, vLLM {meta['vllm']})\n\n"
            f"random dataset, {meta['input']} in / {meta['output']} out, --ignore-eos, dummy weights; median TPOT ms "
            f"(output tok/s){'' if meta.get('rounds', 1) == 1 else ', medians over ' + str(meta['rounds']) + ' rounds'}; "
            "the plugin columns' ratio is against stock at the same concurrency.\n\n")
    allm = ["stock"] + modes
    rows = []
    for shape in dict.fromkeys(s for s, _ in results):
        for c in concs:
            st = results.get((shape, "stock"), {}).get(c)
            cells = []
            for m in allm:
                r = results.get((shape, m), {}).get(c)
                if r is None:
                    cells.append("n/a")
                    continue
                ratio = "" if m == "stock" or st is None else f", {r['median_tpot_ms'] / st['median_tpot_ms']:.2f}x"
                cells.append(f"{r['median_tpot_ms']:.2f} ({r['output_throughput']:.0f} tok/s{ratio})")
            rows.append([shape, c] + cells)
    return head + common.markdown_table(["model", "concurrency"] + [f"{m} TPOT" for m in allm], rows) + "\n"


def plot(results: dict[tuple[str, str], dict[int, dict]], path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for (shape, mode), per in results.items():
        cs = sorted(per)
        ax.plot(cs, [per[c]["median_tpot_ms"] for c in cs], marker="o", label=f"{shape} {mode}")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("median TPOT (ms)")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--modes", default="triton,megakernel,auto",
                    help=f"plugin modes besides stock: {common.MODES[1:]}, each optionally with MK_* switches of its "
                         "own joined by '+' (megakernel+MK_LM_HEAD=megakernel)")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=64, help="requests per concurrency (at least 2x the concurrency)")
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--runner", choices=common.RUNNERS, default="default")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for a server start or one benchmark")
    ap.add_argument("--outdir", type=Path, default=common.RESULTS)
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of servers, modes alternating (stock, plugin, stock, plugin, ...); the table shows "
                         "the median over rounds and every round's TPOT")
    ap.add_argument("--dry-run", action="store_true")
    common.add_mk_env_arg(ap)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")
    args.concurrency_list = [int(c) for c in args.concurrency.split(",") if c]
    try:
        modes = common.plugin_modes(args.modes)
    except ValueError as e:
        ap.error(f"--modes: {e}")
    if not args.concurrency_list or min(args.concurrency_list) < 1:
        ap.error(f"--concurrency {args.concurrency!r}: want a comma list of integers >= 1")
    meta = {"date": common.today(), "commit": common.git_commit(), "gpu": "dry-run" if args.dry_run else common.gpu_name(),
            "vllm": common.vllm_version(), "input": args.input_len, "output": args.output_len, "rounds": args.rounds}
    stamp = common.run_stamp() + ("_dryrun" if args.dry_run else "")
    results: dict[tuple[str, str], dict[int, dict]] = {}   # the median over the rounds so far
    per_round: dict[tuple[str, str], list[dict[int, dict]]] = {}
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"mk_serve_{stamp}"
    for name in [m for m in args.models.split(",") if m]:
        mdir = common.model_dir(name)
        folder = mdir if args.dry_run else make_served_folder(mdir, work)
        for rnd, mode in ((r, m) for r in range(args.rounds) for m in ["stock"] + modes):
            tag = mode if args.rounds == 1 else f"{mode}_r{rnd + 1}"
            per = fake_mode(common.split_mode(mode)[0], args.concurrency_list) if args.dry_run else run_mode(folder, mode, args, args.outdir,
                                                                                       stamp, tag)
            per_round.setdefault((mdir.name, mode), []).append(per)
            results[(mdir.name, mode)] = over_rounds(per_round[(mdir.name, mode)])
            rows = [(meta["date"], meta["gpu"], meta["commit"], meta["vllm"], mdir.name, mode, c,
                     args.input_len, args.output_len, args.prompts, f"{r['median_tpot_ms']:.3f}",
                     f"{r['median_itl_ms']:.3f}", f"{r['median_ttft_ms']:.1f}",
                     f"{r['output_throughput']:.1f}", r["completed"]) for c, r in per.items()]
            # appended per mode: a later mode's failure keeps the rows measured before it
            common.append_csv(args.outdir / ("serve_dryrun.csv" if args.dry_run else "serve.csv"), CSV_HEADER, rows)
            # table and plot rewritten after every mode: a run cut short (a call's timeout) keeps them
            done = [m for m in modes if any(k[1] == m for k in results)]
            text = render(results, done, args.concurrency_list, meta)
            if args.rounds > 1:
                text += spread_table(per_round, done, args.concurrency_list)
            common.write_record(args.outdir, f"serve_{stamp}.md", text)
            png = plot(results, args.outdir / f"serve_{stamp}.png")
    print(f"plot: {png}" if png else "plot: matplotlib not importable")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
