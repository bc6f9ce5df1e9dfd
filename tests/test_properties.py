"""Property tests (hypothesis, CPU):

1. Every op wrapper of mk_plugin.triton_ops rejects a bad input -- wrong dtype, wrong ndim, a shape
   that disagrees with the other inputs, more than 16 tokens, a non-contiguous tensor where rows must
   be contiguous, CPU tensors without the interpreter -- with a ValueError whose message names the
   offending argument, before any kernel is launched. Each case starts from valid inputs of random
   small shapes and breaks exactly one argument in one way.
   (decode_step, the composition of those ops, checks every input before its first launch:
   test_decode_step_validates_before_launching.)
2. The schedule compiler's programs are deadlock free under ANY valid interleaving of the per-SM
   queues (random schedules, not only round robin), for random small specs and batch 1..16, and
   the watchdog test's corruption (one unsatisfiable wait) is always rejected by the checker.

Known gaps of the wrappers (documented here, reported to the lead; the tests accept them
explicitly rather than hide them): lm_head reports linear's argument names (its `hidden` is "x");
decode_step validates late or not at all (strict xfail below); the CPU-without-interpreter error
does not name an argument (check_device takes no name).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import small_specs  # tests/strategies.py

from mk_plugin.persistent import vm
from mk_plugin.persistent.encoding import decode
from mk_plugin.persistent.schedule import build_program
from mk_plugin.persistent.tuning import ScheduleTuning
from mk_plugin.spec import LlamaSpec
from mk_plugin.weights import random_weights

BF16 = torch.bfloat16
KINDS = ("dtype", "ndim", "shape", "tokens", "noncontig")


@dataclass
class Arg:
    """How one tensor argument may be broken: a dtype it must refuse, the dims whose size is tied
    to other inputs ("shape"), whether dim 0 is the token dim ("tokens"), whether a stride-2 last
    dim must be refused ("noncontig"), and the names an error may use for it. "ndim" adds two
    leading dims (one could be a legal [B, qh, d] view of a [B, qh*d] argument)."""
    bad_dtype: torch.dtype
    dims: tuple[int, ...] = ()
    tokens: bool = False
    noncontig: bool = True
    ndim: bool = True
    names: tuple[str, ...] = ()
    shrink: bool = False   # the tied size is a lower bound (tables, workspaces): break it by -1

    def kinds(self) -> list[str]:
        out = ["dtype"]
        if self.ndim:
            out.append("ndim")
        if self.dims:
            out.append("shape")
        if self.tokens:
            out.append("tokens")
        if self.noncontig:
            out.append("noncontig")
        return out


@dataclass
class Op:
    build: Callable[[Any], tuple[dict[str, Any], Callable[[dict[str, Any]], Any]]]
    args: dict[str, Arg] = field(default_factory=dict)


def _t(shape, dtype=BF16, lo=0, hi=4) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(lo, hi, shape, dtype=dtype)


# ---- valid inputs of random small shapes, per wrapper ----------------------------------------------
def _rms_norm(draw):
    from mk_plugin.triton_ops import rms_norm
    m, h = draw(st.integers(1, 4)), draw(st.sampled_from([16, 40, 64]))
    kw = {"x": _t((m, h)), "weight": _t((h,)), "residual": _t((m, h)), "out": _t((m, h)), "residual_out": _t((m, h))}
    return kw, lambda a: rms_norm(a["x"], a["weight"], 1e-5, a["residual"], out=a["out"],
                                  residual_out=a["residual_out"])


def _linear(draw):
    from mk_plugin.triton_ops import linear
    m, n, k = draw(st.integers(1, 4)), draw(st.sampled_from([16, 48])), draw(st.sampled_from([32, 64]))
    kw = {"x": _t((m, k)), "weight": _t((n, k)), "norm_weight": _t((k,)), "residual": _t((m, n)), "out": _t((m, n))}
    return kw, lambda a: linear(a["x"], a["weight"], norm_weight=a["norm_weight"], residual=a["residual"],
                                out=a["out"])


def _lm_head(draw):
    from mk_plugin.triton_ops import lm_head
    m, v, h = draw(st.integers(1, 4)), draw(st.sampled_from([16, 50])), draw(st.sampled_from([32, 64]))
    kw = {"hidden": _t((m, h)), "weight": _t((v, h)), "norm_weight": _t((h,)), "out": _t((m, v), torch.float32)}
    return kw, lambda a: lm_head(a["hidden"], a["weight"], norm_weight=a["norm_weight"], out=a["out"])


def _rope(draw):
    from mk_plugin.triton_ops import rope_kv_append
    b, kvh, g, d = draw(st.integers(1, 4)), draw(st.integers(1, 2)), draw(st.integers(1, 2)), 64
    qh = kvh * g
    kw = {"qkv": _t((b, (qh + 2 * kvh) * d)), "positions": _t((b,), torch.int64, 0, 30),
          "cos_sin_cache": _t((32, d), torch.float32), "kv_cache": _t((4, 2, 16, kvh, d)),
          "slot_mapping": _t((b,), torch.int64, 0, 64), "q_out": _t((b, qh * d))}
    return kw, lambda a: rope_kv_append(a["qkv"], a["positions"], a["cos_sin_cache"], a["kv_cache"],
                                        a["slot_mapping"], num_q_heads=qh, num_kv_heads=kvh, head_dim=d,
                                        q_out=a["q_out"])


def _attention(draw):
    from mk_plugin.triton_ops import paged_attention
    from mk_plugin.triton_ops.paged_attention import paged_attention_workspace_size
    b, kvh, g, d, splits = draw(st.integers(2, 4)), draw(st.integers(1, 2)), draw(st.integers(1, 2)), 64, 2
    qh = kvh * g
    kw = {"q": _t((b, qh * d)), "kv_cache": _t((6, 2, 16, kvh, d)), "block_table": _t((b, 3), torch.int32, 0, 6),
          "seq_lens": _t((b,), torch.int32, 1, 40), "out": _t((b, qh * d)),
          "workspace": _t((paged_attention_workspace_size(b, qh, d, splits),), torch.float32)}
    return kw, lambda a: paged_attention(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], d ** -0.5,
                                         num_splits=splits, out=a["out"], workspace=a["workspace"])


_STEP_SPEC = LlamaSpec(hidden_size=64, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=64,
                       intermediate_size=96, vocab_size=64, name="prop")
_STEP_W = random_weights(_STEP_SPEC, seed=0)


def _decode_step(draw):
    from mk_plugin.triton_ops import decode_step
    s, b = _STEP_SPEC, draw(st.integers(1, 4))
    kw = {"hidden": _t((b, s.hidden_size)), "positions": _t((b,), torch.int64, 0, 30),
          "kv_caches": _t((4, 2, 16, s.num_kv_heads, s.head_dim)), "block_table": _t((b, 2), torch.int32, 0, 4),
          "seq_lens": _t((b,), torch.int32, 1, 31), "slot_mapping": _t((b,), torch.int64, 0, 64),
          "cos_sin_cache": _t((32, s.head_dim), torch.float32), "out": _t((b, s.hidden_size))}
    return kw, lambda a: decode_step(s, _STEP_W, a["hidden"], a["positions"], [a["kv_caches"]], a["block_table"],
                                     a["seq_lens"], a["slot_mapping"], a["cos_sin_cache"], out=a["out"])


F32, I32 = torch.float32, torch.int32
OPS: dict[str, Op] = {
    "rms_norm": Op(_rms_norm, {
        "x": Arg(I32, tokens=True), "weight": Arg(I32, dims=(0,)), "residual": Arg(torch.float16, dims=(0, 1)),
        "out": Arg(torch.float16, dims=(0, 1)), "residual_out": Arg(torch.float16, dims=(0, 1))}),
    "linear": Op(_linear, {
        "x": Arg(F32, tokens=True), "weight": Arg(torch.float16, dims=(1,)), "norm_weight": Arg(I32, dims=(0,)),
        "residual": Arg(I32, dims=(0, 1)), "out": Arg(torch.float16, dims=(0, 1))}),
    "lm_head": Op(_lm_head, {
        "hidden": Arg(F32, tokens=True, names=("hidden", "x")), "weight": Arg(torch.float16, dims=(1,)),
        "norm_weight": Arg(I32, dims=(0,)), "out": Arg(BF16, dims=(0, 1))}),
    "rope_kv_append": Op(_rope, {
        "qkv": Arg(I32, dims=(1,), tokens=True), "positions": Arg(F32, dims=(0,)),
        "cos_sin_cache": Arg(I32, dims=(1,)), "kv_cache": Arg(torch.float16, dims=(1, 2, 4)),
        "slot_mapping": Arg(F32, dims=(0,)), "q_out": Arg(torch.float16, dims=(0, 1))}),
    "paged_attention": Op(_attention, {
        "q": Arg(I32, dims=(1,), tokens=True), "kv_cache": Arg(torch.float16, dims=(1, 2, 4)),
        "block_table": Arg(torch.int64, dims=(0,), shrink=True), "seq_lens": Arg(torch.int64, dims=(0,), shrink=True),
        "out": Arg(torch.float16, dims=(0, 1)), "workspace": Arg(torch.float16, dims=(0,), shrink=True)}),
}
CASES = [(op, arg, kind) for op, o in OPS.items() for arg, a in o.args.items() for kind in a.kinds()]


def _break(t: torch.Tensor, kind: str, rule: Arg, draw) -> torch.Tensor:
    """t broken in one way (everything else about it unchanged)."""
    if kind == "dtype":
        return t.to(rule.bad_dtype)
    if kind == "ndim":
        return t[None, None]
    if kind in ("shape", "tokens"):
        shape = list(t.shape)
        if kind == "tokens":
            shape[0] = 17
        else:
            shape[draw(st.sampled_from(rule.dims))] += -1 if rule.shrink else 1
        return _t(tuple(shape), t.dtype, 0, 4)
    if kind == "noncontig":
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        v = wide[..., ::2]
        v.copy_(t)
        assert not v.is_contiguous() and v.shape == t.shape
        return v
    raise AssertionError(kind)


@settings(max_examples=3, deadline=None, derandomize=True)
@given(data=st.data())
@pytest.mark.parametrize("op,arg,kind", CASES, ids=[f"{o}-{a}-{k}" for o, a, k in CASES])
def test_wrappers_reject_bad_inputs_naming_the_argument(op, arg, kind, data):
    o = OPS[op]
    rule = o.args[arg]
    kw, call = o.build(data.draw)
    assume(kind != "noncontig" or kw[arg].shape[-1] > 1)  # a length-1 dim is contiguous at any stride
    assume(not (kind == "shape" and rule.shrink and kw[arg].shape[0] < 2))
    bad = _break(kw[arg], kind, rule, data.draw)
    kw[arg] = bad
    with pytest.raises(ValueError) as e:
        call(kw)
    names = rule.names or (arg,)
    pat = r"(?<![A-Za-z_])(" + "|".join(map(re.escape, names)) + r")(?![A-Za-z_])"
    assert re.search(pat, str(e.value)), f"{op}: breaking {arg} ({kind}) raised {e.value!r}, which names none of {names}"


def _smallest(strategy):
    """A `draw` outside @given: the simplest value of the strategy."""
    from hypothesis import find
    return find(strategy, lambda _: True)


@pytest.mark.parametrize("op", list(OPS))
def test_wrappers_accept_the_unbroken_inputs(op):
    """The generators' inputs are valid, so each rejection above is due to the one broken argument."""
    kw, call = OPS[op].build(_smallest)
    call(kw)


@pytest.mark.parametrize("op", list(OPS))
def test_cpu_tensors_without_interpreter_are_rejected(op, monkeypatch):
    kw, call = OPS[op].build(_smallest)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA") as e:
        call(kw)
    assert "TRITON_INTERPRET" in str(e.value)


class _Launched(Exception):
    pass


@pytest.mark.parametrize("arg", ["hidden", "out", "block_table"])
def test_decode_step_validates_before_launching(arg, monkeypatch):
    import importlib
    ds = importlib.import_module("mk_plugin.triton_ops.step_ops")  # the op table decode_step chains

    def launched(*a, **k):
        raise _Launched("a kernel was launched before the inputs were validated")

    for name in ("linear", "rope_kv_append", "paged_attention", "rms_norm"):
        monkeypatch.setattr(ds, name, launched)
    kw, call = _decode_step(_smallest)
    kw[arg] = {"hidden": lambda t: _t((t.shape[0], t.shape[1] + 1)), "out": lambda t: t.to(torch.float16),
               "block_table": lambda t: t.to(torch.int64)}[arg](kw[arg])
    with pytest.raises(ValueError, match=rf"\b{arg}\b"):
        call(kw)


# ---- schedule compiler: deadlock freedom under any interleaving --------------------------------------
def _random_order_run(program, seed: int) -> int:
    """Simulate every segment with a random choice among the runnable queue heads; return the task
    count. vm.schedule_order raises DeadlockError if at some point no head can run."""
    n = 0
    for seg in program.segments:
        counters = [0] * program.num_counters
        dp = decode(seg.encoded)
        signalled = set()
        for _, t in vm.schedule_order(dp, counters, order="random", seed=seed):
            if t["signal_ctr"] >= 0:
                counters[t["signal_ctr"]] += t["signal_add"]
            signalled.add(t["signal_ctr"])
            n += 1
        # every counter ends at its total (the K-split parts' and merged chunks' signals included)
        assert all(counters[c] == program.counters[c].total for c in signalled - {-1})
    return n


# K-split cuts (ticketed parts) beside merge-in-partial attention (the default)
_KSPLITS = ((), (("down", 4),), (("down", 3), ("o_proj", 2)))


@settings(max_examples=40, deadline=None)
@given(small_specs(), st.integers(1, 16), st.integers(1, 24), st.booleans(), st.integers(0, 2 ** 16),
       st.sampled_from(_KSPLITS))
def test_programs_are_deadlock_free_under_random_interleavings(unsatisfiable_wait, spec, batch, sms, lm_head, seed,
                                                               ksplit):
    p = build_program(spec, batch, sms, lm_head=lm_head, tuning=ScheduleTuning(ksplit=ksplit))
    vm.check_deadlock_free(p)
    assert _random_order_run(p, seed) == p.num_tids
    # the watchdog test's corruption is always caught on the CPU, before any launch
    with pytest.raises(vm.DeadlockError):
        vm.check_deadlock_free(unsatisfiable_wait(p))
