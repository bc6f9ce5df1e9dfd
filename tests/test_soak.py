"""CPU tests of bench/soak.py (the continuous-batching soak) and bench/soak_verdicts.py: the per-request
verdict, the memory check, the report and the engine comparison (the schedule and driving loop are
tests/test_soak_schedule.py). No vLLM engine, no GPU."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import soak
import soak_schedule
import soak_verdicts
import vllm_correctness as vc

VOCAB = 128256


def lp(logprob: float, rank: int | None) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank)


# ---- verdicts -------------------------------------------------------------------------------------------
REQ = soak_schedule.SoakRequest(rid=7, arrival=0, prompt_len=100, max_tokens=4)


def out(tokens: list[int], gaps: list[float] | None = None, finished: bool = True) -> dict[str, Any]:
    gaps = gaps or [1.0] * len(tokens)
    return {"tokens": tokens, "top2": [[[t, -0.5], [t + 1, -0.5 - g]] for t, g in zip(tokens, gaps, strict=True)],
            "finished": finished}


def test_judge_identical() -> None:
    v = soak_verdicts.judge(REQ, out([1, 2, 3, 4]), out([1, 2, 3, 4]))
    assert v.kind == "identical" and v.first_diff is None


def test_judge_accepts_a_near_tie() -> None:
    v = soak_verdicts.judge(REQ, out([1, 2, 3, 4], [1.0, 1.0, 0.01, 1.0]), out([1, 2, 9, 9]))
    assert v.kind == "near tie" and v.first_diff == 2 and v.gap == pytest.approx(0.01)


def test_judge_flags_a_non_tie_divergence() -> None:
    v = soak_verdicts.judge(REQ, out([1, 2, 3, 4], [1.0, 0.3, 1.0, 1.0]), out([1, 9, 3, 4]))
    assert v.kind == "BUG" and v.first_diff == 1 and v.gap == pytest.approx(0.3) and "not a near tie" in v.note


def test_judge_gap_at_the_threshold_is_a_bug() -> None:
    v = soak_verdicts.judge(REQ, out([1, 2, 3, 4], [vc.TIE_GAP] * 4), out([5, 2, 3, 4]))
    assert v.kind == "BUG"  # near tie means strictly below TIE_GAP


@pytest.mark.parametrize("stock, plugin, note", [
    (out([1, 2, 3, 4]), None, "plugin: no output"),
    (None, out([1, 2, 3, 4]), "stock: no output"),
    (out([1, 2, 3, 4]), out([1, 2, 3, 4], finished=False), "plugin: not finished"),
    (out([1, 2, 3, 4]), out([1, 2, 3]), "output lengths"),
    (out([1, 2, 3, 4]), {**out([1, 2, 3, 4]), "top2": []}, "plugin: logprobs for 0 of 4"),
    ({**out([1, 2, 3, 4]), "top2": [[[1, -0.5], [2, -0.6]], [[2, -0.5]], [], []]}, out([1, 9, 3, 4]),
     "no top-2"),
])
def test_judge_flags_broken_outputs(stock: Any, plugin: Any, note: str) -> None:
    v = soak_verdicts.judge(REQ, stock, plugin)
    assert v.kind == "BUG" and note in v.note


def test_summarize_needs_99_percent_identical_and_no_bug() -> None:
    ident = soak_verdicts.Verdict(1, 10, 4, "identical")
    tie = soak_verdicts.Verdict(2, 10, 4, "near tie", 1, 0.01)
    bug = soak_verdicts.Verdict(3, 10, 4, "BUG", 1, 0.5)
    assert soak_verdicts.summarize([ident] * 99 + [tie])["ok"]
    s = soak_verdicts.summarize([ident] * 98 + [tie] * 2)
    assert not s["ok"] and s["identical"] == 98 and len(s["near_ties"]) == 2
    s = soak_verdicts.summarize([ident] * 999 + [bug])
    assert not s["ok"] and s["bugs"] == [bug]
    assert not soak_verdicts.summarize([])["ok"]


def test_memory_growth_skips_warmup_and_the_idle_final_sample() -> None:
    samples = [{"step": 100, "alloc_mib": 500.0}, {"step": 300, "alloc_mib": 1000.0},
               {"step": 400, "alloc_mib": 1010.0}, {"step": 500, "alloc_mib": 1004.0},
               {"step": 510, "alloc_mib": 9999.0, "final": True}]
    g = soak_verdicts.memory_growth(samples, "alloc_mib", warmup_steps=200)
    assert g == {"first": 1000.0, "last": 1004.0, "max": 1010.0, "growth": 4.0, "samples": 3}
    assert soak_verdicts.memory_growth(samples, "alloc_mib", warmup_steps=450) is None
    assert soak_verdicts.memory_growth(samples, "smi_mib", warmup_steps=0) is None


def test_default_kv_blocks_force_preemption() -> None:
    a = soak.parse_args([])
    assert a.requests == 2000 and a.mode == "megakernel" and a.max_num_seqs == 16
    assert a.max_model_len >= 3000 + 128 and a.max_model_len % 16 == 0
    assert a.kv_blocks == soak.default_kv_blocks(4, a.max_model_len) == 4 * a.max_model_len // 16
    # the cache cannot hold max_num_seqs requests of the mean length
    assert a.kv_blocks * 16 < a.max_num_seqs * (1500 + 64)
    assert soak.parse_args(["--kv-blocks", "300"]).kv_blocks == 300
    with pytest.raises(SystemExit):
        soak.parse_args(["--min-prompt", "0"])


# ---- report and the parent's glue -------------------------------------------------------------------------
def engine_result(preemptions: int | None, alloc: list[float], status: list[dict[str, Any]]) -> dict[str, Any]:
    samples = [{"step": 250 * (i + 1), "smi_mib": 20000.0, "alloc_mib": m, "running": 5.0 + i % 3}
               for i, m in enumerate(alloc)]
    samples.append({"step": 250 * len(alloc) + 3, "smi_mib": 20000.0, "alloc_mib": 1.0, "final": True})
    return {"startup_s": 40.0, "steps": 250 * len(alloc) + 3, "wall_s": 10.0, "tokens": 5000, "added_while_busy": 90,
            "batch": soak_schedule.batch_stats([1, 3, 2, 5]), "samples": samples, "preemptions": preemptions,
            "status": status, "block_size": 16}


MK_STATUS = [{"class": "MkLlamaForCausalLM", "backend": "megakernel", "unsupported": None, "counts": {"decode:4": 9}}]


def test_report_renders_pass_and_fail() -> None:
    meta = {"mode": "megakernel", "date": "2026-12-01", "gpu": "NVIDIA H200", "commit": "abc1234", "vllm": "0.24.0",
            "runner": "default", "command": "python3 bench/soak.py", "setup": "setup line"}
    good = {"stock": engine_result(12, [9000.0] * 8, [{"class": "LlamaForCausalLM"}]),
            "megakernel": engine_result(15, [9000.0] * 8, MK_STATUS)}
    vs = [soak_verdicts.Verdict(i, 10, 4, "identical") for i in range(199)] + [soak_verdicts.Verdict(199, 2999, 100, "near tie", 41, 0.02)]
    summary = soak_verdicts.summarize(vs)
    checks = soak_verdicts.make_checks(summary, good, "megakernel", "ok", 1000, 64.0, 256.0)
    text = soak_verdicts.render(meta, summary, good, checks, 1000)
    assert "OVERALL: PASS" in text and "FAIL" not in text
    assert "abc1234" in text and "NVIDIA H200" in text and "python3 bench/soak.py" in text
    assert "| 199 | 2999 | 100 | 41 | 0.0200 |" in text and "199/200 (99.50%)" in text
    assert "| megakernel | 40 | 2003 | 10.0 | 500 | 2.75 / 5 / 100% | 5..7 (mean 5.9) | 15 | 90 |" in text
    assert "15 preemptions" in text and "- megakernel: class MkLlamaForCausalLM, backend megakernel" in text
    assert "'decode:4': 9" in text

    leaky = {**good, "megakernel": engine_result(0, [9000.0, 9000.0, 9000.0, 9000.0, 9100.0, 9200.0], MK_STATUS)}
    bug = soak_verdicts.Verdict(5, 1234, 64, "BUG", 3, 0.7, note="not a near tie")
    summary = soak_verdicts.summarize(vs[:-1] + [bug])
    checks = soak_verdicts.make_checks(summary, leaky, "megakernel", "no decode step took the mk path", 1000, 64.0, 256.0)
    failed = {c[0] for c in checks if not c[2]}
    assert any(c.startswith("bugs") for c in failed) and any("mk decode path" in c for c in failed)
    assert any("preemption" in c for c in failed) and any("memory_allocated" in c for c in failed)
    assert not any("nvidia-smi" in c for c in failed)
    text = soak_verdicts.render(meta, summary, leaky, checks, 1000)
    assert "OVERALL: FAIL" in text and "| 5 | 1234 | 64 | 3 | 0.7000 |" in text


def test_make_checks_preemption_counter_unavailable_is_not_faked() -> None:
    eng = {"stock": engine_result(None, [1.0] * 3, []), "triton": engine_result(None, [1.0] * 3, MK_STATUS)}
    checks = soak_verdicts.make_checks(soak_verdicts.summarize([soak_verdicts.Verdict(0, 1, 1, "identical")]), eng, "triton", "ok", 0, 64, 256)
    pre = [c for c in checks if "preemption" in c[0]]
    assert len(pre) == 2 and all(c[1] == "counter not available" and c[2] for c in pre)


def test_main_compares_the_engines_and_writes_the_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent end to end with the children replaced: verdicts come from the per-request JSON files
    and the exit status follows them."""
    args = ["--requests", "30", "--max-prompt", "50", "--max-out", "6", "--mode", "triton", "--outdir", str(tmp_path),
            "--no-fp32-rule"]   # the fp32 truth needs a GPU child: test_fp32_rule_rejudges_first_differences
    p = soak_schedule.ScheduleParams(30, VOCAB, 1, 50, 1, 6, 8.0, 0)
    sched = soak_schedule.make_schedule(p)
    target = sched[4]
    case: dict[str, float | None] = {"gap": None}  # stock's top-2 gap where the plugin diverges (None: no divergence)

    def fake_run_engines(a: Any, payload: dict[str, Any], tag: str, work: Path
                         ) -> tuple[dict[str, dict[str, Any]], list[str]]:
        assert payload["schedule"] == asdict(p) and payload["kv_blocks"] == a.kv_blocks
        res = {}
        for mode in ("stock", "triton"):
            outs = {}
            for r in sched:
                toks = [(r.rid + k) % 50 for k in range(r.max_tokens)]
                gaps = [1.0] * r.max_tokens
                if r.rid == target.rid and case["gap"] is not None:
                    gaps[0] = case["gap"]
                    if mode == "triton":
                        toks[0] += 100
                outs[str(r.rid)] = out(toks, gaps)
            f = work / f"{mode}.json"
            f.write_text(json.dumps(outs))
            status = MK_STATUS if mode == "triton" else [{"class": "LlamaForCausalLM"}]
            res[mode] = {**engine_result(3, [100.0] * 3, status), "out_json": str(f)}
        return res, []

    monkeypatch.setattr(soak, "run_engines", fake_run_engines)
    monkeypatch.setattr(vc, "seeded_checkpoint", lambda mdir, wdir, seed: tmp_path / "weights")
    for gap, rc in ((None, 0), (0.01, 1), (0.5, 1)):
        case["gap"] = gap
        assert soak.main(args) == rc  # 1 near tie in 30 requests is below 99% identical; 0.5 is a BUG
        text = next(tmp_path.glob("soak_*_llama-3.2-1b_triton.md")).read_text()
        assert ("OVERALL: PASS" in text) == (rc == 0)
        if gap == 0.5:
            assert f"| {target.rid} | {target.prompt_len} | {target.max_tokens} | 0 | 0.5000 |" in text


def test_vllm_correctness_top2_of_ranks_and_missing_logprobs() -> None:
    c = SimpleNamespace(token_ids=[5, 6], logprobs=[{9: lp(-3.0, 2), 5: lp(-1.0, 1), 4: lp(-9.0, None)},
                                                    {6: lp(-0.1, 1)}])
    assert vc.top2_of(c) == [[[5, -1.0], [9, -3.0]], [[6, -0.1]]]
    assert vc.top2_of(SimpleNamespace(token_ids=[1, 2], logprobs=None)) == [[], []]


def test_vllm_correctness_seeded_checkpoint_is_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(vc, "write_random_checkpoint", lambda *args: seen.append(args) or args[1])
    assert vc.seeded_checkpoint(Path("/m/llama-3.2-1b"), tmp_path, 3) == tmp_path / "llama-3.2-1b-seed3"
    assert seen == [(Path("/m/llama-3.2-1b"), tmp_path / "llama-3.2-1b-seed3", 3, 0.02)]


def test_accumulate_on_vllm_delta_outputs() -> None:
    """vLLM's own OutputProcessor in DELTA mode with logprobs=2 (what the child asks for), fed engine-core
    outputs by hand: accumulate() rebuilds every token and its top-2, in rank order."""
    pytest.importorskip("vllm")
    import numpy as np
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.outputs import LogprobsLists

    proc = OutputProcessor(None, log_stats=False)
    sp = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0, logprobs=2, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)
    proc.add_request(EngineCoreRequest(request_id="7-internal", prompt_token_ids=[1, 2, 3], mm_features=None,
                                       sampling_params=sp, pooling_params=None, arrival_time=0.0, lora_request=None,
                                       cache_salt=None, data_parallel_rank=None, external_req_id="7"), None, None, 0)
    acc: dict[int, dict[str, Any]] = {}
    steps = [(10, 11, -0.25, -0.5), (20, 21, -0.5, -0.75), (30, 31, -1.0, -1.5)]
    for k, (tok, second, lp1, lp2) in enumerate(steps):
        # one row per token: the sampled token, then the top-2 (greedy: the sampled token is rank 1)
        lists = LogprobsLists(np.array([[tok, tok, second]]), np.array([[lp1, lp1, lp2]], dtype=np.float32),
                              np.array([1]))
        eco = EngineCoreOutput(request_id="7-internal", new_token_ids=[tok], new_logprobs=lists,
                               finish_reason=FinishReason.LENGTH if k == len(steps) - 1 else None)
        outs = proc.process_outputs([eco]).request_outputs
        assert len(outs) == 1 and outs[0].request_id == "7"  # DELTA: an output every step, external id
        soak_schedule.accumulate(acc, outs[0])
    assert acc == {7: {"tokens": [10, 20, 30], "finished": True,
                       "top2": [[[t, a], [s, b]] for t, s, a, b in steps]}}


def test_control_engine_is_stock_at_other_batching_and_reported_not_judged() -> None:
    a = soak.parse_args(["--mode", "megakernel", "--control-max-num-seqs", "4"])
    plan = soak.engine_plan(a, {"max_num_seqs": a.max_num_seqs})
    assert [(n, m, pl["max_num_seqs"]) for n, m, pl in plan] == [
        ("stock", "stock", 16), ("megakernel", "megakernel", 16), (soak.CONTROL, "stock", 4)]
    assert len(soak.engine_plan(soak.parse_args(["--control-max-num-seqs", "0"]), {"max_num_seqs": 16})) == 2
    with pytest.raises(SystemExit):
        soak.parse_args(["--control-max-num-seqs", "-1"])
    p = soak_schedule.ScheduleParams(3, VOCAB, 1, 5, 2, 2, 0.0, 0)
    sched = soak_schedule.make_schedule(p)
    stock = {r.rid: out([1, 2], [1.0, 1.0]) for r in sched}
    stock[sched[1].rid] = out([1, 2], [1.0, 0.01])  # stock's top-2 gap 0.01 at the step where they part
    control = {**stock, sched[1].rid: out([1, 3], [1.0, 0.01])}
    label, result, ok = soak.control_row(sched, stock, control, 4, failed=False)
    assert ok and "max_num_seqs 4" in label and result.startswith("identical 2/3 (66.67%), near ties 1, non-tie")
    assert soak.control_row(sched, stock, None, 4, failed=True)[1] == "control run failed (see its log)"


def test_mk_env_reaches_plugin_children_only_and_is_checked_early() -> None:
    common = soak.common
    env = common.parse_mk_env(["MK_ROUNDING=stock"])
    assert env == {"MK_ROUNDING": "stock"}
    assert common.child_env("megakernel", mk_env=env)["MK_ROUNDING"] == "stock"
    assert "MK_ROUNDING" not in common.child_env("stock", mk_env=env)
    for bad in ("MK_ROUNDING=exact", "ROUNDING=stock", "MK_MODE=triton", "MK_ROUNDING"):
        with pytest.raises(ValueError, match="MK_"):
            common.parse_mk_env([bad])
    with pytest.raises(SystemExit):
        soak.parse_args(["--mk-env", "MK_ROUNDING=exact"])
    assert soak.parse_args(["--mk-env", "MK_ROUNDING=stock"]).mk_env == env
    assert soak.parse_args([]).mk_env == {}


def test_fp32_rule_rejudges_first_differences() -> None:
    p = soak_schedule.ScheduleParams(4, VOCAB, 3, 5, 2, 2, 0.0, 0)
    sched = soak_schedule.make_schedule(p)
    stock = {r.rid: {"tokens": [1, 2], "top2": [], "finished": True} for r in sched}
    plugin = {r.rid: {"tokens": [1, 9], "top2": [], "finished": True} for r in sched}
    vs = [soak_verdicts.Verdict(sched[0].rid, sched[0].prompt_len, 2, "identical"),
          soak_verdicts.Verdict(sched[1].rid, sched[1].prompt_len, 2, "BUG", first_diff=1, gap=0.3, note="not a near tie"),
          soak_verdicts.Verdict(sched[2].rid, sched[2].prompt_len, 2, "near tie", first_diff=1, gap=0.01),
          soak_verdicts.Verdict(sched[3].rid, sched[3].prompt_len, 2, "BUG", note="plugin: not finished")]
    items = soak_verdicts.fp32_items(vs, sched, p, stock, plugin)
    assert [it["rid"] for it in items] == [sched[1].rid, sched[2].rid]
    assert items[0]["tokens"] == soak_schedule.prompt_ids(p, sched[1]) + [1] and (items[0]["stock_tok"], items[0]["plugin_tok"]) == (2, 9)
    out = soak_verdicts.apply_fp32_rule(vs, {sched[1].rid: (False, 0.001), sched[2].rid: (True, 0.2)})
    assert [v.kind for v in out] == ["identical", "fp32 ok", "BUG", "BUG"] and "+0.2000" in out[2].note
    s = soak_verdicts.summarize(out)
    assert len(s["near_ties"]) == 1 and len(s["bugs"]) == 2


def test_checks_hold_the_first_difference_rate_to_the_control() -> None:
    eng = {"triton": engine_result(3, [100.0] * 3, MK_STATUS)}
    summary = soak_verdicts.summarize([soak_verdicts.Verdict(0, 1, 1, "identical"), soak_verdicts.Verdict(1, 1, 1, "fp32 ok", first_diff=0)])
    ok = soak_verdicts.make_checks(summary, eng, "triton", "ok", 0, 64, 256, control_diff=0.4)[0]
    bad = soak_verdicts.make_checks(summary, eng, "triton", "ok", 0, 64, 256, control_diff=0.2)[0]
    assert ok[2] and "vs control 40.00%" in ok[1] and not bad[2]


def test_run_child_passes_a_payload_past_the_argument_limit(tmp_path: Path, monkeypatch) -> None:
    """Session 13: the soak's fp32 payload (every token of 2,000 requests) as one argv string failed with
    E2BIG; run_child now hands the child a file, which common.child_payload reads back."""
    import common
    monkeypatch.setattr(common, "wait_gpu_released", lambda *a, **k: None)
    script = tmp_path / "echo_child.py"
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    script.write_text(f"import sys\nsys.path.insert(0, {bench!r})\nimport common\n"
                      "p = common.child_payload(sys.argv[2])\ncommon.emit_result({'n': len(p['items'])})\n")
    payload = {"items": [[i, list(range(64))] for i in range(8000)]}   # ~2.5 MB of JSON
    got = common.run_child(script, payload, dict(__import__("os").environ), tmp_path / "child.log", timeout=120)
    assert got == {"n": 8000}
    assert "bytes in child.log.payload.json" in (tmp_path / "child.log").read_text()
    assert common.child_payload('{"a": 1}') == {"a": 1}


def test_an_engine_run_is_reused_only_for_the_same_payload_and_mode(tmp_path) -> None:
    # a soak longer than one GPU call: engines in one call (--engines-only --work DIR), the verdict in the next
    child = {"model_dir": "/m", "max_num_seqs": 16, "out_json": str(tmp_path / "stock.json")}
    assert soak.reused_engine(tmp_path, "stock", "stock", child) is None   # nothing run yet
    (tmp_path / "stock.result.json").write_text(json.dumps({"mode": "stock", "payload": child, "result": {"a": 1}}))
    assert soak.reused_engine(tmp_path, "stock", "stock", child) is None   # outputs missing
    (tmp_path / "stock.json").write_text("{}")
    assert soak.reused_engine(tmp_path, "stock", "stock", child) == {"a": 1}
    assert soak.reused_engine(tmp_path, "stock", "megakernel", child) is None
    assert soak.reused_engine(tmp_path, "stock", "stock", {**child, "max_num_seqs": 8}) is None
    a = soak.parse_args(["--work", str(tmp_path), "--engines-only"])
    assert a.work == tmp_path and a.engines_only


def test_fp32_results_split_by_set_and_balance() -> None:
    got = {"plugin:3": [True, 0.05, 0.0156], "plugin:4": [False, -0.03, 0.0156], "control:3": [False, 0.01, 0.0156],
           "7": [False, 0.0, 0.0156]}   # an unkeyed item is the plugin's
    s = soak_verdicts.split_fp32(got)
    assert s["plugin"][3] == (True, 0.05, 0.0156) and s["control"][3] == (False, 0.01, 0.0156) and 7 in s["plugin"]
    assert soak_verdicts.fp32_balance(s["plugin"]) == {"n": 3, "worse": 1, "better": 1, "within": 1}
    assert soak_verdicts.fp32_balance(s["control"]) == {"n": 1, "worse": 0, "better": 0, "within": 1}


def test_checks_hold_the_fp32_rejections_to_the_controls() -> None:
    # issue 13's rule on both pairs: the plugin's fp32 "bugs" may be 1.5x the control's; other bugs are bugs
    eng = {"megakernel": engine_result(3, [100.0] * 3, MK_STATUS)}
    fp32_bug = soak_verdicts.Verdict(1, 1, 1, "BUG", first_diff=0, note="fp32: the plugin's token is +0.0300 below stock's")
    summary = soak_verdicts.summarize([soak_verdicts.Verdict(0, 1, 1, "identical"), fp32_bug, fp32_bug])
    rows = {c[0]: c for c in soak_verdicts.make_checks(summary, eng, "megakernel", "ok", 0, 64, 256,
                                              control_fp32={"n": 9, "worse": 2, "better": 2, "within": 5})}
    rule = next(c for k, c in rows.items() if k.startswith("first differences the fp32 rule rejects"))
    assert rule[2] and rule[1] == "2 vs control 2 (of 9)"
    assert rows["bugs other than the fp32 rule's (short/missing output or logprobs)"][2]
    tight = soak_verdicts.make_checks(summary, eng, "megakernel", "ok", 0, 64, 256,
                             control_fp32={"n": 9, "worse": 1, "better": 2, "within": 6})
    assert not next(c for c in tight if c[0].startswith("first differences the fp32 rule rejects"))[2]
    short = soak_verdicts.summarize([fp32_bug, soak_verdicts.Verdict(2, 1, 1, "BUG", note="plugin: not finished")])
    other = soak_verdicts.make_checks(short, eng, "megakernel", "ok", 0, 64, 256,
                             control_fp32={"n": 9, "worse": 2, "better": 2, "within": 5})
    assert not next(c for c in other if c[0].startswith("bugs other than"))[2]
    # without the control's fp32 judgement the rule's rejections are bugs outright, as before
    plain = soak_verdicts.make_checks(summary, eng, "megakernel", "ok", 0, 64, 256)
    assert not next(c for c in plain if c[0].startswith("bugs (non-tie"))[2]


def test_main_judges_the_control_by_the_same_fp32_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the control engine and the fp32 rule: one child judges both pairs' first differences (keyed by set),
    and the plugin passes with as many rule rejections as the control has."""
    args = ["--requests", "30", "--max-prompt", "50", "--max-out", "6", "--mode", "triton", "--outdir", str(tmp_path)]
    p = soak_schedule.ScheduleParams(30, VOCAB, 1, 50, 1, 6, 8.0, 0)
    sched = soak_schedule.make_schedule(p)
    diverge = {"triton": sched[4].rid, soak.CONTROL: sched[7].rid}

    def fake_run_engines(a: Any, payload: dict[str, Any], tag: str, work: Path
                         ) -> tuple[dict[str, dict[str, Any]], list[str]]:
        res = {}
        for name in ("stock", "triton", soak.CONTROL):
            outs = {}
            for r in sched:
                toks = [(r.rid + k) % 50 for k in range(r.max_tokens)]
                if diverge.get(name) == r.rid:
                    toks[0] += 100
                outs[str(r.rid)] = out(toks, [1.0] * r.max_tokens)
            f = work / f"{name}.json"
            f.write_text(json.dumps(outs))
            status = MK_STATUS if name == "triton" else [{"class": "LlamaForCausalLM"}]
            res[name] = {**engine_result(3, [100.0] * 3, status), "out_json": str(f)}
        return res, []

    seen: list[str] = []

    def fake_child(script: Path, payload: dict[str, Any], env: dict[str, str], log: Path, timeout: float):
        assert payload["kind"] == "fp32"
        seen.extend(it["key"] for it in payload["items"])
        return {"fp32": {it["key"]: [True, 0.05, 0.0156] for it in payload["items"]}}

    monkeypatch.setattr(soak, "run_engines", fake_run_engines)
    monkeypatch.setattr(soak.common, "run_child", fake_child)
    monkeypatch.setattr(vc, "seeded_checkpoint", lambda mdir, wdir, seed: tmp_path / "weights")
    assert soak.main(args) == 0
    assert sorted(seen) == sorted([f"plugin:{diverge['triton']}", f"control:{diverge[soak.CONTROL]}"])
    text = next(tmp_path.glob("soak_*_llama-3.2-1b_triton.md")).read_text()
    assert "| first differences the fp32 rule rejects <= 1.5x the stock-vs-stock control's | 1 vs control 1 (of 1) |" \
        in text and "OVERALL: PASS" in text
    assert "triton vs stock by fp32, worse / better / within one bf16 ulp | 1 / 0 / 0 of 1" in text
