"""bench/serve.py on a CPU: the generated tokenizer of the served folder, the commands it runs, and a
dry run through the table/CSV/plot code (the servers themselves need a GPU)."""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import serve

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"


def test_served_folder_has_a_word_level_tokenizer_over_the_whole_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    folder = serve.make_served_folder(MODELS / "llama-3.2-1b-1layer", tmp_path)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.encode("w11 w12 w128255", add_special_tokens=False)
    assert ids == [11, 12, 128255] and tok.decode(ids) == "w11 w12 w128255"
    assert (folder / "config.json").read_text() == (MODELS / "llama-3.2-1b-1layer" / "config.json").read_text()


def test_commands_carry_the_engine_and_benchmark_settings(tmp_path):
    a = argparse.Namespace(input_len=512, output_len=128, gpu_mem=0.8, concurrency_list=[1, 8], prompts=4)
    s = serve.server_cmd(tmp_path, 8123, a)
    assert s[3:5] == ["serve", str(tmp_path)] and "dummy" in s and s[s.index("--max-num-seqs") + 1] == "8"
    b = serve.bench_cmd(tmp_path, 8123, 8, a, tmp_path, "r.json")
    assert "--ignore-eos" in b and b[b.index("--max-concurrency") + 1] == "8"
    assert b[b.index("--num-prompts") + 1] == "16" and b[b.index("--dataset-name") + 1] == "random"


def test_server_flags_exist_in_the_installed_vllm(tmp_path):
    """Every `vllm serve` flag the script passes is an engine or frontend argument of the installed vLLM
    (0.24 dropped --disable-log-requests: the first H200 run's server exited with a usage error). The
    parser itself cannot be built without a GPU, so the flags are checked against the dataclasses it is
    built from."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import FrontendArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)} | {f.name for f in dataclasses.fields(FrontendArgs)}
    a = argparse.Namespace(input_len=512, output_len=128, gpu_mem=0.8, concurrency_list=[1, 8], prompts=4)
    flags = [x[2:].replace("-", "_") for x in serve.server_cmd(tmp_path, 8123, a) if x.startswith("--")]
    assert flags and [f for f in flags if f not in known] == []


def test_traceback_in_a_server_log_is_found(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("INFO ok\nTraceback (most recent call last):\n  File x\nValueError: boom\n")
    assert "ValueError: boom" in serve.log_traceback(log)
    log.write_text("INFO ok\n")
    assert serve.log_traceback(log) is None
    # vLLM 0.24's own traceback when the server is stopped (after the benchmark) is not the run's
    served = "INFO ok\nINFO serving\n"
    log.write_text(served + "ERROR [async_llm.py:704] Traceback (most recent call last):\nEngineDeadError\n")
    assert serve.log_traceback(log, len(served.encode())) is None and serve.log_traceback(log) is not None


def test_dry_run_writes_every_model_mode_and_concurrency(tmp_path):
    assert serve.main(["--dry-run", "--models", "llama-3.2-1b-1layer", "--modes", "triton,auto", "--concurrency",
                       "1,8", "--outdir", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "serve_dryrun.csv").read_text().splitlines()))
    assert {(r["mode"], r["concurrency"]) for r in rows} == {(m, c) for m in ("stock", "triton", "auto")
                                                            for c in ("1", "8")}
    md = next(tmp_path.glob("serve_*_dryrun.md")).read_text()
    assert "| llama-3.2-1b-1layer | 8 |" in md and "x)" in md


def test_rounds_alternate_the_servers_and_report_every_round(tmp_path, monkeypatch):
    """--rounds 2: stock, auto, stock, auto (a server's whole run shifts at random on a noisy host, so modes are
    compared side by side); the table holds the median over rounds and every round's TPOT, the CSV a row per round."""
    calls, tpot = [], iter([5.0, 4.0, 6.0, 4.4])

    def fake(mode, concs):
        calls.append(mode)
        t = next(tpot)
        return {c: {"median_tpot_ms": t, "median_itl_ms": t, "median_ttft_ms": 30.0, "output_throughput": 100.0 / t,
                    "completed": 8} for c in concs}

    monkeypatch.setattr(serve, "fake_mode", fake)
    assert serve.main(["--dry-run", "--rounds", "2", "--models", "llama-3.2-1b-1layer", "--modes", "auto",
                       "--concurrency", "1", "--outdir", str(tmp_path)]) == 0
    assert calls == ["stock", "auto", "stock", "auto"]
    rows = list(csv.DictReader((tmp_path / "serve_dryrun.csv").read_text().splitlines()))
    assert [(r["mode"], r["median_tpot_ms"]) for r in rows] == [("stock", "5.000"), ("auto", "4.000"),
                                                                ("stock", "6.000"), ("auto", "4.400")]
    md = next(tmp_path.glob("serve_*_dryrun.md")).read_text()
    assert "medians over 2 rounds" in md and "5.50 (" in md and "4.20 (" in md and "0.76x" in md
    assert "| llama-3.2-1b-1layer | 1 | 5.00 / 6.00 | 4.00 / 4.40 |" in md


def test_random_dataset_prompts_pass_vllms_length_guard(tmp_path):
    """vLLM 0.24 rejects a prompt longer than (max_model_len - max_tokens) x the tokenizer's longest
    token in characters, before tokenizing it (renderers/params.py, _text_len_check): with two-letter
    special tokens, 8 of 32 random-dataset prompts (those of seven-character words) failed with 400 on
    the H200. The prompts `vllm bench serve` sends for the default 512 in / 128 out must all pass."""
    import common
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    folder = serve.make_served_folder(MODELS / "llama-3.1-8b", tmp_path)
    tok = get_tokenizer(str(folder))
    reqs = RandomDataset(random_seed=0).sample(tokenizer=tok, num_requests=64, input_len=512, output_len=128)
    bound = (common.max_model_len_for(512, 128) - 128) * tok.max_chars_per_token
    assert max(len(r.prompt) for r in reqs) >= 4000  # the long-word prompts are among them
    assert [len(r.prompt) for r in reqs if len(r.prompt) > bound] == []
    assert all(len(tok.encode(r.prompt)) == 512 for r in reqs)
