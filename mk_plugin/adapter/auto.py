"""MK_MODE=auto: per decode batch size, the decode path (megakernel or Triton) measured faster on this
GPU for this model. Choices come from the packaged table of measured step times
(mk_plugin/persistent/tuned/paths_<gpu>.json, written from bench/mk_step.py rows), else from a short
measurement of both steps in the worker (CUDA-graph replays, a small temporary KV cache, before vLLM
sizes its own), else Triton (the verified default). The megakernel is chosen only when it was faster by
more than AUTO_MIN_GAIN: replay noise must not flip a choice.

A table entry may also carry `vllm_tbt` (TBT of both paths measured inside vLLM by bench/tbt.py, GPU-bound,
in one job): it then decides instead of the kernel-only steps, because what a user gets is the step inside
vLLM, and there the two paths have differed by more than their kernel-only steps (8B batch 1: 1% apart
kernel-only, 7% inside vLLM in two sessions; bench/NOTES.md session 12). Where it also has stock vLLM's TBT
(`stock_ms`, same job), stock is a third choice: a plugin path is taken only when it beat stock by more than
AUTO_MIN_GAIN, else that batch size's decode steps run (and are captured) stock -- the plugin must never make
serving slower (8B batch 16: Triton level with stock at 512 tokens of context, 4% slower at 8192;
bench/NOTES.md session 25)."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch

from ..decoding import DecodeInputs

AUTO_MIN_GAIN = 0.03
PATHS_DIR = Path(__file__).resolve().parents[1] / "persistent" / "tuned"
MEASURE_CTX = 64          # tokens of context per request in the in-worker measurement (4 blocks of 16)
MEASURE_SIZES = (1, 2, 4, 8, 16)


def paths_file(gpu_slug: str) -> Path:
    return PATHS_DIR / f"paths_{gpu_slug}.json"


KERNEL_ONLY = "kernel-only step"


STOCK = "stock"


class PathTimes(NamedTuple):
    """One batch size's measured times of the two paths (us) and what was measured; stock_us: stock vLLM's
    TBT in the same job, where measured (then stock is a choice too)."""
    triton_us: float
    megakernel_us: float
    what: str = KERNEL_ONLY
    stock_us: float | None = None


def entry_times(e: Mapping[str, Any]) -> PathTimes:
    """What decides one paths-table entry: the in-vLLM TBT of both paths where it has one (`vllm_tbt`: triton_ms,
    megakernel_ms and optionally stock_ms), else the kernel-only steps."""
    v = e.get("vllm_tbt")
    if v:
        stock = v.get("stock_ms")
        return PathTimes(1000.0 * float(v["triton_ms"]), 1000.0 * float(v["megakernel_ms"]), "TBT in vLLM",
                         None if stock is None else 1000.0 * float(stock))
    return PathTimes(float(e["triton_us"]), float(e["megakernel_us"]))


def load_paths(path: Path, spec_hash: int, num_sms: int) -> dict[int, PathTimes]:
    """batch -> PathTimes (entry_times) of the table's entries for this model and SM count."""
    if not path.is_file():
        return {}
    return {int(e["batch"]): entry_times(e) for e in json.loads(path.read_text())["entries"]
            if e["spec_hash"] == spec_hash and e["num_sms"] == num_sms}


def _what(t: tuple[float, float]) -> str:
    """", TBT in vLLM" for times measured other than as kernel-only steps (plain tuples are kernel-only)."""
    what = getattr(t, "what", KERNEL_ONLY)
    return "" if what == KERNEL_ONLY else f", {what}"


def pick(times: tuple[float, float]) -> str:
    """"megakernel" when it beat Triton by more than AUTO_MIN_GAIN, else "triton"; with stock's time measured
    alongside (PathTimes.stock_us), "stock" unless that path also beat stock by more than AUTO_MIN_GAIN."""
    triton_us, mk_us = times[0], times[1]   # a PathTimes also carries what was measured
    path, us = ("megakernel", mk_us) if mk_us < triton_us * (1.0 - AUTO_MIN_GAIN) else ("triton", triton_us)
    stock_us = getattr(times, "stock_us", None)
    if stock_us is not None and not us < stock_us * (1.0 - AUTO_MIN_GAIN):
        return STOCK
    return path


def _times_text(t: tuple[float, float]) -> str:
    stock_us = getattr(t, "stock_us", None)
    return f"triton {t[0]:.0f} us, megakernel {t[1]:.0f} us" + ("" if stock_us is None else f", stock {stock_us:.0f} us")


def choose(max_tokens: int, table: Mapping[int, tuple[float, float]], table_name: str,
           measure: Callable[[int], tuple[float, float]] | None) -> tuple[dict[int, str], dict[int, str]]:
    """(choice, source) per batch size 1..max_tokens: "megakernel", "triton" or "stock" (pick). A size takes the
    entry of the smallest table (or measured) size >= it (vLLM pads a decode batch up to its next capture size),
    else of the largest."""
    known: dict[int, tuple[tuple[float, float], str]] = {
        b: (t, f"table {table_name}{_what(t)}: {_times_text(t)}")
        for b, t in table.items()}
    if measure is not None:
        for b in MEASURE_SIZES:
            if b <= max(max_tokens, 1) and b not in known:
                t = measure(b)
                known[b] = (t, f"measured here: triton {t[0]:.0f} us, megakernel {t[1]:.0f} us")
    choice, source = {}, {}
    keys = sorted(known)
    for b in range(1, max_tokens + 1):
        k = next((x for x in keys if x >= b), keys[-1] if keys else None)
        if k is None:
            choice[b], source[b] = "triton", "no measurement (not on a CUDA device): the verified default"
        else:
            choice[b] = pick(known[k][0])
            source[b] = known[k][1] + ("" if k == b else f" (batch {k})")
    return choice, source


@dataclass
class AutoDecoder:
    """The Decoder of MK_MODE=auto: the chosen path per batch size (inputs.batch). A size chosen "stock" never
    reaches decode(): the adapter runs vLLM's own forward for it (path_for first)."""
    triton: Any                      # TritonDecoder
    megakernel: Any                  # MegakernelDecoder
    choice: dict[int, str]
    source: dict[int, str] = field(default_factory=dict)
    backend: ClassVar[str] = "auto"

    def path_for(self, batch: int) -> str:
        return self.choice.get(batch, "triton")

    def decode(self, inputs: DecodeInputs, out: torch.Tensor, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """logits_out: where a megakernel built with its LM head writes the step's logits (the Triton path
        computes none: the adapter then leaves them to vLLM)."""
        # "stock" sizes do not come here (the adapter checks path_for); were one called directly, Triton computes
        # the same step (it is the verified reference path)
        if self.path_for(inputs.batch) == "megakernel":
            return self.megakernel.decode(inputs, out, logits_out)
        return self.triton.decode(inputs, out)


def measure_both(triton: Any, megakernel: Any, spec: Any, weights: Any, cos_sin: torch.Tensor,
                 block_size: int, replays: int = 10) -> Callable[[int], tuple[float, float]]:
    """measure(b) -> (triton_us, megakernel_us): one CUDA graph of each step for b tokens over a
    temporary KV cache of MEASURE_CTX tokens per request, median of `replays` replays. A megakernel built with
    its LM head (MK_LM_HEAD=megakernel) is timed with it, and the Triton step then with the LM head vLLM runs
    after it (a bf16 GEMM): both sides time the same work."""
    from ..timing import graph_median_ms

    def measure(b: int) -> tuple[float, float]:
        dev = weights.embed.device
        per = -(-MEASURE_CTX // block_size)
        caches = [torch.zeros(b * per + 1, 2, block_size, spec.num_kv_heads, spec.head_dim, dtype=spec.torch_dtype,
                              device=dev) for _ in range(spec.num_layers)]
        bt = torch.arange(b * per, dtype=torch.int32, device=dev).view(b, per)
        inputs = DecodeInputs(weights.embed[:b].clone(), torch.full((b,), MEASURE_CTX - 1, dtype=torch.int64,
                                                                    device=dev),
                              caches, bt, torch.full((b,), MEASURE_CTX, dtype=torch.int32, device=dev),
                              (bt[:, -1].long() * block_size + (MEASURE_CTX - 1) % block_size), cos_sin)
        out = torch.empty_like(inputs.hidden)
        if megakernel.lm_head:
            logits = torch.empty(b, spec.vocab_size, dtype=torch.float32, device=dev)
            steps = (lambda: torch.nn.functional.linear(triton.decode(inputs, out), weights.lm_head),
                     lambda: megakernel.decode(inputs, out, logits))
        else:
            steps = (lambda: triton.decode(inputs, out), lambda: megakernel.decode(inputs, out))
        t = tuple(graph_median_ms(f, replays=replays) * 1e3 for f in steps)
        del caches
        return t  # type: ignore[return-value]
    return measure


def describe(dec: AutoDecoder, sizes: Iterable[int]) -> dict[int, str]:
    """mk_status's view: batch -> "<path> (<source>)"."""
    return {b: f"{dec.path_for(b)} ({dec.source.get(b, '?')})" for b in sizes}
