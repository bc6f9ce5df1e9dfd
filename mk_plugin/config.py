"""Every MK_* environment switch, parsed and validated here and nowhere else.

MK_MODE      auto | megakernel | triton | stock   decode path used inside vLLM (default: auto);
                                           auto: per batch size, the path measured faster on this GPU
                                           (adapter/auto.py: packaged table, else measured in the worker;
                                           Triton alone where the megakernel cannot be built here)
MK_FALLBACK  comma list of op names        ops run by the Triton kernels while the rest run in the
                                           megakernel (names: mk_plugin.ops.STEP_OPS)
MK_TRACE     0 | 1                         record the megakernel's per-task timeline
MK_VERBOSE   0 | 1                         log kernel (re)builds and decode-path decisions
MK_DUMP_LOGITS  <dir>                      debug (needs enforce_eager): every compute_logits call saves
                                           its fp32 logits and the requests' seq_lens to <dir>
MK_FORCE_TOKENS <file.json>                debug (needs enforce_eager): teacher forcing; the token
                                           sampled after a request of seq_len L is forced to file[L]
                                           (the JSON list is the whole sequence: prompt + continuation)
MK_WATCHDOG_MS  1..600000 (default 2000)   budget of every wait inside the megakernel; a wait that
                                           exceeds it aborts the launch and raises MegakernelHang on
                                           the host. Always bounded: 0 ("off") is refused.
MK_ROUNDING  fused | stock (default fused)  the megakernel's rounding points (persistent.encoding.
                                           Rounding): fused rounds once per fused op (the GPU-measured
                                           kernel); stock also rounds where vLLM's unfused ops store,
                                           to agree more often with stock vLLM at bf16 near ties
MK_TUNING    auto | off | <file.json>      the megakernel's task sizes (persistent.tuning): auto uses
             (default auto)                the winners bench/autotune.py measured for this GPU (user
                                           cache, then the packaged table), off the built-in split,
                                           a path only that table
MK_LM_HEAD   vllm | megakernel             who computes the logits of a megakernel decode step inside
             (default vllm)                vLLM: vllm's own LM head after the step (compute_logits),
                                           or the megakernel inside the step (its lm_head tasks, fp32
                                           logits; compute_logits hands them to the sampler)
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .ops import STEP_OPS

MODES = ("megakernel", "triton", "auto", "stock")
DEFAULT_MODE = "auto"   # measured at or below stock at 8B b1..16 and 1B b1 / b8 (NOTES session 23)
DEFAULT_WATCHDOG_MS = 2000
ROUNDINGS = ("fused", "stock")   # = persistent.encoding.Rounding names (config must not import torch)
DEFAULT_ROUNDING = "fused"
DEFAULT_TUNING = "auto"
LM_HEADS = ("vllm", "megakernel")
DEFAULT_LM_HEAD = "vllm"   # the megakernel's own LM head inside vLLM is not measured yet (bench/NOTES.md session 31)
WATCHDOG_MS_MAX = 600_000  # = persistent.encoding.WATCHDOG_MS_MAX (config must not import torch)


class ConfigError(ValueError):
    """An MK_* variable has a value we do not accept; the message names it and what is allowed."""


def _flag(env: Mapping[str, str], name: str) -> bool:
    v = env.get(name, "0").strip().lower()
    if v in ("0", "", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{name}={v!r} is not a boolean; use 0 or 1")


def _millis(env: Mapping[str, str], name: str, default: int) -> int:
    v = env.get(name, "").strip()
    if not v:
        return default
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"{name}={v!r} is not an integer number of milliseconds") from None


def _tuning(env: Mapping[str, str]) -> str:
    v = env.get("MK_TUNING", "").strip()
    if not v:
        return DEFAULT_TUNING
    return v.lower() if v.lower() in ("auto", "off") else v   # a path keeps its case


@dataclass(frozen=True)
class MkConfig:
    mode: str = DEFAULT_MODE
    fallback: frozenset[str] = frozenset()
    trace: bool = False
    verbose: bool = False
    dump_logits: str | None = None
    force_tokens: str | None = None
    watchdog_ms: int = DEFAULT_WATCHDOG_MS
    rounding: str = DEFAULT_ROUNDING
    tuning: str = DEFAULT_TUNING
    lm_head: str = DEFAULT_LM_HEAD

    def __post_init__(self) -> None:
        if self.lm_head not in LM_HEADS:
            raise ConfigError(f"MK_LM_HEAD={self.lm_head!r} is not supported; choose one of {', '.join(LM_HEADS)}")
        if self.tuning not in ("auto", "off") and not os.path.isfile(self.tuning):
            raise ConfigError(f"MK_TUNING={self.tuning!r} is neither auto, off nor an existing tuning table file "
                              "(bench/autotune.py writes one)")
        if self.rounding not in ROUNDINGS:
            raise ConfigError(f"MK_ROUNDING={self.rounding!r} is not supported; choose one of {', '.join(ROUNDINGS)}")
        if isinstance(self.watchdog_ms, bool) or not isinstance(self.watchdog_ms, int) \
                or not 1 <= self.watchdog_ms <= WATCHDOG_MS_MAX:
            raise ConfigError(f"MK_WATCHDOG_MS={self.watchdog_ms!r} must be an integer number of milliseconds in "
                              f"1..{WATCHDOG_MS_MAX}; every megakernel wait is bounded (0 = off is not allowed)")
        if self.mode not in MODES:
            raise ConfigError(f"MK_MODE={self.mode!r} is not supported; choose one of {', '.join(MODES)}")
        bad = sorted(set(self.fallback) - set(STEP_OPS))
        if bad:
            raise ConfigError(f"MK_FALLBACK names unknown op(s) {bad}; known ops: {', '.join(STEP_OPS)}")
        if self.force_tokens is not None and not os.path.isfile(self.force_tokens):
            raise ConfigError(f"MK_FORCE_TOKENS={self.force_tokens!r} is not a file; give a JSON list of token ids")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> MkConfig:
        env = os.environ if env is None else env
        mode = env.get("MK_MODE", DEFAULT_MODE).strip().lower() or DEFAULT_MODE
        fb = frozenset(s.strip() for s in env.get("MK_FALLBACK", "").split(",") if s.strip())
        return cls(mode=mode, fallback=fb, trace=_flag(env, "MK_TRACE"), verbose=_flag(env, "MK_VERBOSE"),
                   dump_logits=env.get("MK_DUMP_LOGITS", "").strip() or None,
                   force_tokens=env.get("MK_FORCE_TOKENS", "").strip() or None,
                   watchdog_ms=_millis(env, "MK_WATCHDOG_MS", DEFAULT_WATCHDOG_MS),
                   rounding=env.get("MK_ROUNDING", DEFAULT_ROUNDING).strip().lower() or DEFAULT_ROUNDING,
                   tuning=_tuning(env),
                   lm_head=env.get("MK_LM_HEAD", DEFAULT_LM_HEAD).strip().lower() or DEFAULT_LM_HEAD)


def get_config() -> MkConfig:
    """Read the switches now (cheap; no caching so tests and subprocesses see their own env)."""
    return MkConfig.from_env()
