"""The soak's workload and driving loop (bench/soak.py; pure and engine-agnostic: tested on the CPU with a fake
engine): the seeded request schedule, each request's prompt ids, and the loop that adds requests on the arrival
clock while an engine steps, accumulating DELTA outputs per request."""
from __future__ import annotations

import itertools
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_correctness as vc  # the DELTA outputs' top-2 logprobs (top2_of)

PREEMPTIONS = "vllm:num_preemptions"
RUNNING, WAITING, KV_USAGE = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"


# ---- workload (pure) --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleParams:
    requests: int
    vocab: int
    min_prompt: int
    max_prompt: int
    min_out: int
    max_out: int
    mean_gap: float   # mean ticks between arrivals (Poisson process); 0 = everything at tick 0
    seed: int


@dataclass(frozen=True)
class SoakRequest:
    rid: int
    arrival: int      # tick of the driving loop at which the request is added
    prompt_len: int
    max_tokens: int


def make_schedule(p: ScheduleParams) -> list[SoakRequest]:
    """The seeded request schedule, sorted by arrival. Prompts are not stored (3M ids for 2,000
    requests): prompt_ids regenerates them, so the children rebuild everything from p alone."""
    rng = random.Random(f"soak-schedule-{p.seed}")
    t, out = 0.0, []
    for rid in range(p.requests):
        if rid and p.mean_gap > 0:
            t += rng.expovariate(1.0 / p.mean_gap)
        out.append(SoakRequest(rid, int(t), rng.randint(p.min_prompt, p.max_prompt),
                               rng.randint(p.min_out, p.max_out)))
    return out


def prompt_ids(p: ScheduleParams, r: SoakRequest) -> list[int]:
    """Random token ids of request r, seeded per request (independent of the order of generation)."""
    rng = random.Random(f"soak-prompt-{p.seed}-{r.rid}")
    return [rng.randrange(p.vocab) for _ in range(r.prompt_len)]


# ---- driving loop (engine-agnostic: tested on CPU with a fake engine) --------------------------------
@dataclass
class DriveResult:
    outputs: dict[int, dict[str, Any]]  # rid -> {"tokens", "top2", "finished"}
    batch_sizes: list[int] = field(default_factory=list)  # requests that got a token, per step
    samples: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0
    clock: int = 0
    idle_jumps: int = 0          # times the engine ran dry and the clock jumped to the next arrival
    added_while_busy: int = 0    # requests added while others were unfinished
    wall_s: float = 0.0


def accumulate(outputs: dict[int, dict[str, Any]], o: Any) -> None:
    """Append one DELTA RequestOutput (new tokens and their top-2 logprobs) to its request."""
    c = o.outputs[0]
    rec = outputs.setdefault(int(o.request_id), {"tokens": [], "top2": [], "finished": False})
    rec["tokens"] += [int(t) for t in c.token_ids]
    rec["top2"] += vc.top2_of(c)
    rec["finished"] = rec["finished"] or bool(o.finished)


def drive(engine: Any, schedule: list[SoakRequest], prompt_of: Callable[[SoakRequest], Any],
          params_of: Callable[[SoakRequest], Any], sample: Callable[[DriveResult], dict[str, Any]] | None = None,
          sample_every: int = 0) -> DriveResult:
    """Run the schedule on an LLMEngine-like object (add_request / step / has_unfinished_requests):
    requests whose arrival tick has come are added between steps, every step() advances the clock by
    one tick, sample(result) is recorded every sample_every steps and once at the end."""
    res = DriveResult(outputs={})
    pending = deque(sorted(schedule, key=lambda r: (r.arrival, r.rid)))
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        busy = engine.has_unfinished_requests()
        if not busy and pending[0].arrival > res.clock:
            res.clock, res.idle_jumps = pending[0].arrival, res.idle_jumps + 1
        while pending and pending[0].arrival <= res.clock:
            r = pending.popleft()
            res.added_while_busy += busy
            engine.add_request(str(r.rid), prompt_of(r), params_of(r))
            busy = True
        outs = engine.step()
        res.steps, res.clock = res.steps + 1, res.clock + 1
        res.batch_sizes.append(len(outs))
        for o in outs:
            accumulate(res.outputs, o)
        if sample is not None and sample_every and res.steps % sample_every == 0:
            res.samples.append(sample(res))
    res.wall_s = time.perf_counter() - t0
    if sample is not None:
        res.samples.append({**sample(res), "final": True})
    return res


def batch_stats(sizes: list[int]) -> dict[str, Any]:
    """How much the batch moved: steps, mean/max size, share of steps whose size differs from the step
    before (a proxy for 'batch sizes change every step')."""
    if not sizes:
        return {"steps": 0, "mean": 0.0, "max": 0, "changed": 0.0, "distinct": 0}
    changed = sum(a != b for a, b in itertools.pairwise(sizes))
    return {"steps": len(sizes), "mean": sum(sizes) / len(sizes), "max": max(sizes),
            "changed": changed / max(1, len(sizes) - 1), "distinct": len(set(sizes))}


def metric_totals(metrics: Iterable[Any]) -> dict[str, float]:
    """name -> value summed over label sets, for the Counter and Gauge entries of LLM.get_metrics()
    (histograms and vectors have no .value and are skipped)."""
    out: dict[str, float] = {}
    for m in metrics:
        v = getattr(m, "value", None)
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[m.name] = out.get(m.name, 0.0) + float(v)
    return out
