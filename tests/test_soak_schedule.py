"""CPU tests of bench/soak_schedule.py (the continuous-batching soak's pure driving parts): the seeded schedule,
the driving loop on a fake engine, the batch statistics and the metric totals. No vLLM engine, no GPU."""
from __future__ import annotations

import itertools
import json
import sys
from collections import deque
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import soak_schedule

VOCAB = 128256
PARAMS = soak_schedule.ScheduleParams(requests=2000, vocab=VOCAB, min_prompt=1, max_prompt=3000, min_out=1,
                                      max_out=128, mean_gap=8.0, seed=0)


# ---- schedule -------------------------------------------------------------------------------------
def test_schedule_is_seeded_and_deterministic() -> None:
    a, b = soak_schedule.make_schedule(PARAMS), soak_schedule.make_schedule(PARAMS)
    assert a == b
    other = soak_schedule.make_schedule(soak_schedule.ScheduleParams(**{**asdict(PARAMS), "seed": 1}))
    assert [r.prompt_len for r in other] != [r.prompt_len for r in a]
    long = [r for r in a if r.prompt_len >= 10][:2]
    assert soak_schedule.prompt_ids(PARAMS, long[0]) == soak_schedule.prompt_ids(PARAMS, long[0])
    assert soak_schedule.prompt_ids(PARAMS, long[0])[:10] != soak_schedule.prompt_ids(PARAMS, long[1])[:10]


def test_schedule_within_bounds_and_poisson() -> None:
    s = soak_schedule.make_schedule(PARAMS)
    assert [r.rid for r in s] == list(range(PARAMS.requests))
    assert all(1 <= r.prompt_len <= 3000 and 1 <= r.max_tokens <= 128 for r in s)
    # uniform over the whole range: 2,000 draws reach near both ends
    assert min(r.prompt_len for r in s) < 50 and max(r.prompt_len for r in s) > 2950
    assert min(r.max_tokens for r in s) == 1 and max(r.max_tokens for r in s) == 128
    arrivals = [r.arrival for r in s]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    mean_gap = arrivals[-1] / (len(s) - 1)
    assert 0.9 * PARAMS.mean_gap < mean_gap < 1.1 * PARAMS.mean_gap
    assert any(a == b for a, b in itertools.pairwise(arrivals))  # bursts: same tick


def test_prompt_ids_in_vocab_and_length() -> None:
    for r in soak_schedule.make_schedule(PARAMS)[:20]:
        ids = soak_schedule.prompt_ids(PARAMS, r)
        assert len(ids) == r.prompt_len and all(0 <= t < VOCAB for t in ids)


def test_schedule_gap_zero_puts_everything_at_tick_zero() -> None:
    s = soak_schedule.make_schedule(soak_schedule.ScheduleParams(**{**asdict(PARAMS), "requests": 50, "mean_gap": 0.0}))
    assert {r.arrival for r in s} == {0}


def test_schedule_params_survive_the_child_payload() -> None:
    assert soak_schedule.ScheduleParams(**json.loads(json.dumps(asdict(PARAMS)))) == PARAMS


# ---- driving loop on a fake engine ----------------------------------------------------------------------
def lp(logprob: float, rank: int | None) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank)


class FakeEngine:
    """LLMEngine stand-in: at most `cap` requests run; each step gives every running request one token
    (its DELTA output with top-2 logprobs). step() with nothing to do fails, as vLLM's would block."""

    def __init__(self, cap: int = 3) -> None:
        self.cap, self.waiting, self.running = cap, deque(), []
        self.added: list[tuple[str, Any, int]] = []

    def add_request(self, request_id: str, prompt: Any, params: int) -> None:
        self.added.append((request_id, prompt, params))
        self.waiting.append({"id": request_id, "left": params, "pos": 0})

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[SimpleNamespace]:
        assert self.has_unfinished_requests(), "step() on an idle engine would block"
        while self.waiting and len(self.running) < self.cap:
            self.running.append(self.waiting.popleft())
        outs = []
        for r in self.running:
            tok = (int(r["id"]) * 7 + r["pos"]) % 100
            c = SimpleNamespace(token_ids=[tok], logprobs=[{tok + 1: lp(-2.0, 2), tok: lp(-1.0, 1)}])
            r["pos"], r["left"] = r["pos"] + 1, r["left"] - 1
            outs.append(SimpleNamespace(request_id=r["id"], outputs=[c], finished=r["left"] == 0))
        self.running = [r for r in self.running if r["left"] > 0]
        return outs


def test_drive_adds_while_busy_and_collects_every_token() -> None:
    p = soak_schedule.ScheduleParams(**{**asdict(PARAMS), "requests": 40, "max_prompt": 20, "max_out": 12, "mean_gap": 2.0})
    sched = soak_schedule.make_schedule(p)
    eng = FakeEngine(cap=3)
    res = soak_schedule.drive(eng, sched, lambda r: soak_schedule.prompt_ids(p, r), lambda r: r.max_tokens,
                     sample=lambda d: {"step": d.steps}, sample_every=5)
    assert sorted(res.outputs) == list(range(40))
    for r in sched:
        o = res.outputs[r.rid]
        assert o["finished"] and len(o["tokens"]) == r.max_tokens == len(o["top2"])
        assert o["tokens"] == [(r.rid * 7 + k) % 100 for k in range(r.max_tokens)]
        assert o["top2"][0] == [[o["tokens"][0], -1.0], [o["tokens"][0] + 1, -2.0]]  # sorted by rank
    assert [a[0] for a in eng.added] == [str(r.rid) for r in sched]
    assert eng.added[5][1] == soak_schedule.prompt_ids(p, sched[5])
    assert res.added_while_busy > 0 and res.steps == len(res.batch_sizes)
    assert len(set(res.batch_sizes)) > 1 and max(res.batch_sizes) <= 3
    assert [s["step"] for s in res.samples[:-1]] == list(range(5, res.steps + 1, 5))
    assert res.samples[-1]["final"] is True


def test_drive_jumps_the_clock_when_idle() -> None:
    sched = [soak_schedule.SoakRequest(0, 0, 5, 2), soak_schedule.SoakRequest(1, 1000, 5, 2)]
    res = soak_schedule.drive(FakeEngine(), sched, lambda r: [1] * r.prompt_len, lambda r: r.max_tokens)
    assert res.idle_jumps == 1 and res.steps == 4 and res.clock == 1002 and res.added_while_busy == 0
    assert all(res.outputs[i]["finished"] for i in (0, 1))


def test_batch_stats() -> None:
    b = soak_schedule.batch_stats([1, 2, 2, 3])
    assert b["steps"] == 4 and b["max"] == 3 and b["mean"] == 2.0 and b["distinct"] == 3
    assert b["changed"] == pytest.approx(2 / 3)
    assert soak_schedule.batch_stats([])["steps"] == 0


def test_metric_totals_sums_labels_and_skips_histograms() -> None:
    ms = [SimpleNamespace(name="vllm:num_preemptions", value=3), SimpleNamespace(name="vllm:num_preemptions", value=2),
          SimpleNamespace(name="vllm:num_requests_running", value=7.0),
          SimpleNamespace(name="vllm:e2e", buckets={}, count=1, sum=2.0), SimpleNamespace(name="flag", value=True)]
    assert soak_schedule.metric_totals(ms) == {"vllm:num_preemptions": 5.0, "vllm:num_requests_running": 7.0}
