"""bench/tbt.py parent side on CPU (--dry-run fakes the engines): table, spread, CSV."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import tbt


def _row(runs: dict[str, list[float]]) -> dict:
    return {"shape": "m", "batch": 1, "prompt": 512, "floor_ms": 0.5, "bytes": 1,
            "tbt": {k: sorted(v)[len(v) // 2] for k, v in runs.items()}, "runs": runs}


def test_spread_table_lists_every_run_only_when_there_are_several():
    assert tbt.spread_table([_row({"stock": [2.0], "megakernel": [1.5]})], ["megakernel"]) == ""
    text = tbt.spread_table([_row({"stock": [2.0, 2.4, 1.7], "megakernel": [1.5, 1.6, 1.4]})], ["megakernel"])
    assert "| m | 1 | 512 | 2.000 / 2.400 / 1.700 | 1.500 / 1.600 / 1.400 |" in text
    missing = tbt.spread_table([_row({"stock": [2.0, 2.1]})], ["megakernel"])
    assert missing.rstrip().endswith("| 2.000 / 2.100 | n/a |")


def test_dry_run_writes_table_spread_and_csv(tmp_path):
    rc = tbt.main(["--dry-run", "--models", "llama-3.2-1b-1layer", "--prompts", "512", "--batches", "1,8",
                   "--runs", "3", "--rounds", "3", "--outdir", str(tmp_path)])
    assert rc == 0
    md = next(tmp_path.glob("tbt_*_dryrun.md")).read_text()
    assert "| llama-3.2-1b-1layer | 8 | 512 |" in md and "Run-to-run spread" in md and "Round-to-round spread" in md
    assert "Steady-state decode TBT" in md and md.count("| llama-3.2-1b-1layer | 1 | 512 |") == 3   # batch 1: no row
    rows = list(csv.DictReader(next(tmp_path.glob("tbt*.csv")).read_text().splitlines()))
    # one row per (round, mode, batch), rounds alternating the modes
    assert [r["mode"] for r in rows][::2] == ["stock", "triton", "megakernel"] * 3 and len(rows) == 18
    assert all(float(r["tbt_ms"]) > 0 for r in rows)


def test_sweep_runs_every_prompt_in_one_engine_per_mode_and_plots_vs_context(tmp_path, monkeypatch):
    calls = []
    real = tbt.fake_child

    def spy(mode, batches, spec, prompts, output, runs_per=1):
        calls.append((mode, tuple(prompts), tuple(batches)))
        return real(mode, batches, spec, prompts, output, runs_per)

    monkeypatch.setattr(tbt, "fake_child", spy)
    assert tbt.main(["--dry-run", "--sweep", "--models", "llama-3.2-1b-1layer", "--outdir", str(tmp_path)]) == 0
    prompts, batches = (128, 512, 2048, 8192), (1, 2, 4, 8, 16)
    assert calls == [(m, prompts, batches) for m in ("stock", "triton", "megakernel")]
    rows = list(csv.DictReader(next(tmp_path.glob("tbt*.csv")).read_text().splitlines()))
    assert len(rows) == 3 * len(prompts) * len(batches)
    assert {(int(r["prompt"]), int(r["batch"])) for r in rows} == {(p, b) for p in prompts for b in batches}
    assert next(tmp_path.glob("tbt_*_vs_context.png")).stat().st_size > 0


def test_sweep_takes_rounds_when_given(tmp_path, monkeypatch):
    """--sweep runs one round by default; --rounds 2 alternates the modes' engines twice (stock, auto, stock, auto)."""
    calls = []
    real = tbt.fake_child

    def spy(mode, batches, spec, prompts, output, runs_per=1):
        calls.append(mode)
        return real(mode, batches, spec, prompts, output, runs_per)

    monkeypatch.setattr(tbt, "fake_child", spy)
    assert tbt.main(["--dry-run", "--sweep", "--rounds", "2", "--modes", "auto", "--models", "llama-3.2-1b-1layer",
                     "--outdir", str(tmp_path)]) == 0
    assert calls == ["stock", "auto", "stock", "auto"]


def test_child_measures_every_prompt_and_batch_in_one_engine(monkeypatch, capsys):
    """child_main against a fake vllm.LLM: one engine, (runs + 1) generate calls per (prompt, batch),
    prompts of the right length, TBT from the request metrics, results under result_key."""
    import json
    from types import SimpleNamespace

    import torch
    import vllm

    made, calls = [], []

    class FakeLLM:
        def __init__(self, **kw):
            made.append(kw)

        def generate(self, prompts, sp, use_tqdm=False):
            calls.append((len(prompts), {len(p["prompt_token_ids"]) for p in prompts}))
            n = sp.max_tokens
            m = SimpleNamespace(first_token_ts=1.0, last_token_ts=1.0 + 0.002 * (n - 1))  # 2 ms per token
            return [SimpleNamespace(request_id=str(i), metrics=m, outputs=[SimpleNamespace(token_ids=[0] * n)])
                    for i in range(len(prompts))]

        def apply_model(self, fn):
            return [{"class": "LlamaForCausalLM"}]

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    payload = {"model_dir": str(tbt.common.model_dir("llama-3.2-1b-1layer")), "prompts": [7, 20], "output_len": 5,
               "batches": [1, 3], "runs": 2, "gpu_mem": 0.5, "max_model_len": 64, "enforce_eager": False,
               "max_num_seqs": None, "seed": 0}
    tbt.child_main(payload)
    out = capsys.readouterr().out
    res = json.loads(out.split(tbt.common.RESULT_MARK)[1])
    assert len(made) == 1 and made[0]["max_model_len"] == 64
    assert calls == [(b, {p}) for p in (7, 20) for b in (1, 3) for _ in range(3)]
    assert set(res["results"]) == {tbt.result_key(p, b) for p in (7, 20) for b in (1, 3)}
    assert all(abs(r["tbt_ms"] - 2.0) < 1e-9 and len(r["runs_ms"]) == 2 for r in res["results"].values())
    assert all(abs(r["steady_ms"] - 2.0) < 1e-9 for r in res["results"].values())


def test_steady_tbt_is_the_request_that_started_last():
    """Requests that started early decode beside later prefills (slower steps); the last to start does not."""
    from types import SimpleNamespace

    def out(first, last, n):
        return SimpleNamespace(metrics=SimpleNamespace(first_token_ts=first, last_token_ts=last),
                               outputs=[SimpleNamespace(token_ids=[0] * n)])
    outs = [out(1.0, 1.0 + 0.010 * 100, 101), out(1.5, 1.5 + 0.004 * 100, 101), out(1.2, 2.0, 101)]
    assert abs(tbt.steady_tbt_ms(outs) - 4.0) < 1e-9


def test_gpu_busy_from_a_profiled_trace_and_the_bound_table(tmp_path):
    import host_gap

    anchor = host_gap.DEFAULT_ANCHOR
    ev = []
    for k in range(12):  # 12 steps of 1000 us, 400 us of GPU work each: host-bound
        t0 = k * 1000.0
        ev.append({"ph": "X", "cat": "kernel", "name": anchor, "ts": t0, "dur": 10.0})
        ev.append({"ph": "X", "cat": "kernel", "name": "mk_decode", "ts": t0 + 20, "dur": 390.0})
    (tmp_path / "tbt_x_b8_rank0.1.pt.trace.json").write_text(json.dumps({"traceEvents": ev}))
    busy = tbt.gpu_busy_ms(tmp_path, "tbt_x", 8)
    assert abs(busy - 0.4) < 1e-9 and tbt.gpu_busy_ms(tmp_path, "tbt_x", 1) is None
    rows = [{"shape": "m", "batch": 8, "prompt": 512, "tbt": {"stock": 1.0, "megakernel": 0.42},
             "busy": {"stock": [0.4], "megakernel": [0.4]}}]
    t = tbt.bound_table(rows, ["megakernel"])
    assert "1.000 / 0.400 (host-bound)" in t and "0.420 / 0.400 (GPU-bound)" in t


def test_later_profiled_batches_get_their_own_trace_names(tmp_path):
    # vLLM keeps the first start_profile()'s name: the batch-8 trace arrives named like batch 1's
    first = tmp_path / "tbt_x_b1_rank0.100.pt.trace.json.gz"
    first.write_text("{}")
    before = set(tmp_path.glob("tbt_x_*"))
    (tmp_path / "tbt_x_b1_rank0.200.pt.trace.json.gz").write_text("{}")
    got = tbt.name_new_traces(tmp_path, "tbt_x", 8, before, wait_s=0)
    assert [p.name for p in got] == ["tbt_x_b8_rank0.200.pt.trace.json.gz"]
    assert first.exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "tbt_x_b1_rank0.100.pt.trace.json.gz", "tbt_x_b8_rank0.200.pt.trace.json.gz"]
    assert tbt.name_new_traces(tmp_path, "tbt_x", 16, set(tmp_path.iterdir()), wait_s=0) == []


def test_modes_with_switches_of_their_own(tmp_path):
    """`megakernel+MK_LM_HEAD=megakernel` is a mode of its own: side by side with plain megakernel in one job, its
    switches in its children's environment only, checked while the command line is read."""
    import common

    assert common.split_mode("megakernel+MK_LM_HEAD=megakernel") == ("megakernel", {"MK_LM_HEAD": "megakernel"})
    assert common.split_mode("auto") == ("auto", {})
    assert common.mode_tag("megakernel+MK_LM_HEAD=megakernel") == "megakernel_MK_LM_HEAD-megakernel"
    for bad, needle in (("mega", "mode 'mega'"), ("stock+MK_TRACE=1", "takes no MK_* switch"),
                        ("triton+MK_LM_HEAD=fused", "MK_LM_HEAD='fused'"), ("auto+MK_MODE=triton", "not MK_MODE")):
        try:
            common.split_mode(bad)
        except ValueError as e:
            assert needle in str(e)
        else:
            raise AssertionError(f"{bad} accepted")
    env = common.child_env("megakernel", mk_env={"MK_LM_HEAD": "megakernel"})
    assert env["MK_MODE"] == "megakernel" and env["MK_LM_HEAD"] == "megakernel"
    ok = [{"class": "MkLlamaForCausalLM", "backend": "megakernel", "counts": {"decode:1": 3}, "lm_head": "megakernel"}]
    assert common.path_check("megakernel+MK_LM_HEAD=megakernel", ok) == "ok"
    assert "the LM head ran in megakernel" in common.path_check("megakernel", ok)
    assert "ran in vllm" in common.path_check("megakernel+MK_LM_HEAD=megakernel", [ok[0] | {"lm_head": "vllm"}])

    modes = "megakernel,megakernel+MK_LM_HEAD=megakernel"
    assert tbt.main(["--dry-run", "--models", "llama-3.2-1b-1layer", "--prompts", "512", "--batches", "1",
                     "--rounds", "1", "--modes", modes, "--outdir", str(tmp_path)]) == 0
    rows = list(csv.DictReader(next(tmp_path.glob("tbt*.csv")).read_text().splitlines()))
    assert [r["mode"] for r in rows] == ["stock", "megakernel", "megakernel+MK_LM_HEAD=megakernel"]
    assert "megakernel+MK_LM_HEAD=megakernel ms" in next(tmp_path.glob("tbt_*_dryrun.md")).read_text()
