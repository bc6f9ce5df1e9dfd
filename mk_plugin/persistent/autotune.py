"""Search over ScheduleTuning for one (decoder, batch): other batch sizes' winners tried whole (seeds), then
coordinate descent over the task split of each op, the attention KV chunks, the ring depth and the other knobs,
with a measurement and a correctness check per candidate. The GPU driver is bench/autotune.py; CPU tests drive it
with the VM and the time model as the "measurement".

The search starts from `base` (bench/autotune.py: the ring-fed attention on a GPU where the model allows it,
UNTUNED_TUNING, since a search at one short context cannot see its long-context gain, so only a measured loss of
more than `min_gain` turns it off, with ATT_TMA_OFF; else the plain default).
Every candidate is run once and its output compared with the base program's output (the
tolerance table's "step" tolerance; `bitwise` is recorded too: changing only the task split of a
linear op leaves every dot product's order unchanged, a different KV chunk count does not). A
candidate that fails the check is rejected and reported, never timed: a tuning must not buy speed
with a wrong answer. The winner must beat the best so far by more than `min_gain` to move (replay
noise), so a flat landscape keeps the base.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..testing import compare
from .encoding import LAYOUT, STAGE_CHOICES, wga_takes
from .tasks import NORM_FUSED_OPS, attention_chunks, op_units, task_k_widths
from .tensormap import check_model, check_weights_model
from .tuning import (
    ATT_TMA_OFF,
    DEFAULT_TUNING,
    GATE_AHEAD_TRIED,
    KSPLIT_OPS,
    MAX_ATTN_CHUNKS,
    RELEASE_GATE_OFF,
    RELEASE_GATE_TRIED_WITH_AHEAD,
    RELEASE_GATE_TRIES,
    SPLIT_OPS,
    WGMMA_A_TUNED,
    ScheduleTuning,
    nws_depth,
)
from .tuning_table import TUNED_MIN_GAIN
from .variant import ATT_TMA_TUNED, INFLIGHT_TUNED, WGA_X_CHOICES

SPLIT_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
# The descent's knobs in their order: the ones that compile a kernel variant last (ring depth, ring-fed attention,
# in-flight cap, weight maps, ...). (The K cuts were listed by neighbours() but never tried before session 18.)
KNOBS: tuple[str, ...] = ("attn_chunks", "merge_in_partial", *SPLIT_OPS, *[f"ksplit.{o}" for o in KSPLIT_OPS],
                          "piece_deps", "num_stages", "att_tma", "inflight", "w_tma", "w_tma+inflight", "wgmma_a",
                          "wga_x", "wga_nws", "rstd_epi", "x_groups", "release_gate", "gate_ahead",
                          "release_gate+gate_ahead")
# The knobs that change only the encoded program (task splits, K cuts, attention chunks and their merge), not the
# tuning's kernel variant: a search over them compiles a kernel only where a split changes the batch's class build
# (tasks.class_build: x staged whole, every task on wgmma), so it is short (session 53: a search from a table entry)
PROGRAM_KNOBS: tuple[str, ...] = ("attn_chunks", "merge_in_partial", *SPLIT_OPS,
                                  *[f"ksplit.{o}" for o in KSPLIT_OPS], "piece_deps")


@dataclass
class Trial:
    tuning: ScheduleTuning
    predicted_us: float       # the scheduler's time model (tasks.py), before measuring
    us: float | None          # measured; None when rejected
    rel_fro: float            # output vs the base program's
    bitwise: bool
    ok: bool
    tasks: int                # tasks in the program


def effective_tasks(spec, op: str, factor: float, num_sms: int) -> int:
    """Tasks op `op` gets with `factor` (split_units caps at its unit count; qkv rounds per kv group)."""
    t = ScheduleTuning().with_split(op, factor).tasks_for(op, num_sms)
    if op == "qkv_rope":
        per_group = max(1, round(t / spec.num_kv_heads))
        return spec.num_kv_heads * min(per_group, op_units(spec, op) // spec.num_kv_heads)
    return min(t, op_units(spec, op))


def stages_some_x_whole(spec, batch: int, tuning: ScheduleTuning, *, lm_head: bool = True) -> bool:
    """Whether the tuning's ring depth stages some matvec task's x whole at this batch size, asked per task as
    csrc/megakernel.cu matvec_dispatch asks it: each task's reduction width (tasks.task_k_widths: a K-split task's
    part), a norm-fused op with its weight row (KernelLayout.staged_fits), none on the wgmma path (csrc/wga_x.cuh
    wga_takes: batch > 8, whole 256-column chunks). Where none is, x_groups changes only the build (the whole-x code compiled
    out), not the path any task takes."""
    layout = LAYOUT.with_stages(tuning.num_stages or LAYOUT.num_stages)
    for op, widths in task_k_widths(spec, tuning, lm_head=lm_head).items():
        widths = {w for w in widths if not (tuning.wgmma_a and wga_takes(w, batch))}
        if any(layout.staged_fits(w, batch, op in NORM_FUSED_OPS) for w in widths):
            return True
    return False


def neighbours(spec, batch: int, num_sms: int, base: ScheduleTuning, *, ops: Iterable[str] = SPLIT_OPS,
               factors: Iterable[float] = SPLIT_FACTORS, chunks: Iterable[int] | None = None,
               stages: Iterable[int] = STAGE_CHOICES, lm_head: bool = True,
               att_off: int = 0) -> list[tuple[str, ScheduleTuning]]:
    """Candidates differing from `base` in one knob, each with the knob's name; values that give the
    same program as another value of that knob (same task count) are dropped. att_off: the att_tma value that
    turns the ring-fed attention off (0 where the search's base has none, ATT_TMA_OFF where it has)."""
    out: list[tuple[str, ScheduleTuning]] = []
    cur_s = base.num_stages or LAYOUT.num_stages
    for n in stages:
        if n != cur_s:
            out.append(("num_stages", base.with_stages(0 if n == LAYOUT.num_stages else n)))
    default_c = attention_chunks(batch, spec.num_kv_heads, num_sms)
    if chunks is None:
        chunks = sorted({max(1, default_c // 4), max(1, default_c // 2), default_c, min(MAX_ATTN_CHUNKS, 2 * default_c)})
    cur_c = base.attn_chunks or default_c
    for c in chunks:
        if 1 <= c <= MAX_ATTN_CHUNKS and c != cur_c:
            out.append(("attn_chunks", base.with_chunks(0 if c == default_c else c)))
    if (base.attn_chunks or default_c) > 1:   # with one chunk there is nothing to merge
        out.append(("merge_in_partial", base.with_merge(not base.merge_in_partial)))
    for op in ops:
        if op == "lm_head" and not lm_head:
            continue
        seen = {effective_tasks(spec, op, base.factor(op), num_sms)}
        for f in factors:
            n = effective_tasks(spec, op, f, num_sms)
            if n not in seen:
                seen.add(n)
                out.append((op, base.with_split(op, f)))
    try:   # the ring-fed attention, where the model allows it
        check_model(spec)
    except ValueError:
        pass
    else:
        out.append(("att_tma", base.with_att_tma(att_off if base.att_tma > 0 else ATT_TMA_TUNED)))
    out.append(("inflight", base.with_inflight(0 if base.inflight else INFLIGHT_TUNED)))
    try:   # one tensor-map copy per weight chunk, where every K allows it
        check_weights_model(spec)
    except ValueError:
        pass
    else:
        out.append(("w_tma", base.with_w_tma(not base.w_tma)))
        # the pair as one step: at 8B batch 1 / 8 tensor-map copies with the cap won -194 / -163 us where each
        # alone won ~-55 (session 21), so coordinate descent over one knob at a time can miss it
        if bool(base.inflight) == base.w_tma:
            out.append(("w_tma+inflight", base.with_w_tma(not base.w_tma).with_inflight(0 if base.inflight
                                                                                      else INFLIGHT_TUNED)))
        if batch > 8:   # wgmma with the weights as A runs at two n-tiles only (session 29: R = 4 -9% at 8B b12..16)
            out.append(("wgmma_a", base.with_wgmma_a(0 if base.wgmma_a else WGMMA_A_TUNED)))
            if base.wgmma_a and spec.dtype == "bfloat16":   # its rstd epilogue (session 30: -2..-3% at batch 16)
                out += [("wga_x", base.with_wga_x(x)) for x in WGA_X_CHOICES if x != base.wga_x]
                if nws_depth(base.num_stages):   # the norm weights with wga_x 2's x groups (session 47: -1..-4%)
                    out.append(("wga_nws", base.with_wga_x(2).with_wga_nws(not base.wga_nws)))
    # the rstd epilogue (norm-fused ops whose x is not staged whole; session 29: -2..-6% at batch 8 / 16, +3% at
    # 1B batch 2): a per-batch choice
    out.append(("rstd_epi", base.with_rstd_epi(not base.rstd_epi)))
    # x by column groups where this ring depth would stage some task's x whole (so rstd_epi applies there too;
    # session 48, H100: -5..-8% at 1B batch 4..6, +4% at 1B batch 1 without rstd_epi): a per-batch choice
    if base.x_groups or stages_some_x_whole(spec, batch, base, lm_head=lm_head):
        out.append(("x_groups", base.with_x_groups(not base.x_groups)))
    # the release gate's mask: which ops' next tasks wait for their release before their weights go out (a per-batch
    # choice: session 8 at 1B against 8B, session 35's traces)
    out += [("release_gate", base.with_release_gate(m)) for m in (0, *RELEASE_GATE_TRIES) if m != base.release_gate]
    # the gated task's head start, and the pair as one step: session 36 (H100) measured mask 48 alone and ahead 2
    # alone within ~1% at 1B b1 / b16 and the two together -4..-5%, which one knob at a time would miss
    if base.release_gate != RELEASE_GATE_OFF:
        out.append(("gate_ahead", base.with_gate_ahead(0 if base.gate_ahead else GATE_AHEAD_TRIED)))
    if not base.gate_ahead:   # (a base already at one of the masks has this pair as its gate_ahead step)
        out += [("release_gate+gate_ahead", base.with_release_gate(m).with_gate_ahead(GATE_AHEAD_TRIED))
                for m in RELEASE_GATE_TRIED_WITH_AHEAD if m != base.release_gate]
    if base.ksplit_for("down") > 1:   # gate_up's pieces at down's K parts: each part waits for its piece only
        out.append(("piece_deps", base.with_piece_deps(not base.piece_deps)))
    for op in KSPLIT_OPS:   # cut over K (session 13: down in 4 parts wins at 1B batch 8 / 16, 2 at 8B batch 16)
        for parts in (1, 2, 4):
            if parts != base.ksplit_for(op):
                out.append((f"ksplit.{op}", base.with_ksplit(op, parts)))
    return out


def seed_tunings(seeds: Iterable[ScheduleTuning], batch: int) -> list[ScheduleTuning]:
    """The seeds (other batch sizes' winners) that build a program at `batch`, in order, duplicates dropped, with the
    attention KV chunks reset to the default (they are chosen per batch size: they scale with B x kv heads, as
    TuningTable.nearest resets them). wgmma with the weights as A runs at two n-tiles only (batch 9..16): a seed with
    it does not apply at batch <= 8."""
    out: list[ScheduleTuning] = []
    for t in seeds:
        t = t.with_chunks(0)
        if (t.wgmma_a and batch <= 8) or t in out:
            continue
        out.append(t)
    return out


def autotune(*, spec, batch: int, num_sms: int, lm_head: bool,
             retune: Callable[[ScheduleTuning], object],
             run_step: Callable[[], torch.Tensor],
             measure: Callable[[], float],
             predict: Callable[[], float],
             rounds: int = 2, min_gain: float = TUNED_MIN_GAIN,
             ops: Iterable[str] = SPLIT_OPS, factors: Iterable[float] = SPLIT_FACTORS,
             chunks: Iterable[int] | None = None, stages: Iterable[int] = STAGE_CHOICES,
             base: ScheduleTuning = DEFAULT_TUNING, seeds: Iterable[ScheduleTuning] = (),
             knobs: Iterable[str] | None = None,
             log: Callable[[str], None] = print) -> tuple[Trial, list[Trial]]:
    """Coordinate descent from `base` (a candidate moves the best only when > min_gain faster), after trying each
    of `seeds` (seed_tunings: other batch sizes' winners) as a whole. `knobs`: only these of the descent's knobs
    (KNOBS; e.g. PROGRAM_KNOBS, the ones that change the program and not the tuning's kernel variant); None: all.

    retune(t): make the next run_step/measure/predict use tuning t (MegakernelDecoder.retune).
    run_step(): one decode step; returns its output (copied), compared with the base's.
    measure(): microseconds of one step (GPU: CUDA-graph replays, median). predict(): the time
    model's microseconds for the current program. Returns (the best trial, every trial in order);
    the decoder is left on the best trial's tuning."""
    dtype = spec.torch_dtype
    ops, factors, stages = tuple(ops), tuple(factors), tuple(stages)
    trials: list[Trial] = []

    def trial(t: ScheduleTuning, ref: torch.Tensor | None) -> tuple[Trial, torch.Tensor]:
        prog = retune(t)
        out = run_step()
        if ref is None:
            rf, bitwise, ok = 0.0, True, bool(torch.isfinite(out.float()).all())
        else:
            # the whole-step drift bound: two right kernels that sum in another fp32 order (wgmma_a, rstd_epi) differ
            # by 2-3e-2 over 16-32 random-weight layers (session 29, H200); a wrong one by O(1)
            c = compare(out, ref, dtype, "drift")
            rf, bitwise, ok = c["rel_fro"], bool(torch.equal(out, ref)), c["pass"]
        us = measure() if ok else None
        tr = Trial(t, predict(), us, rf, bitwise, ok, getattr(prog, "num_tids", 0))
        trials.append(tr)
        status = f"{us:9.1f} us" if ok else "REJECTED (output differs from the default program's)"
        log(f"  {t.label():<40} predicted {tr.predicted_us:8.1f} us  measured {status}  "
            f"rel {rf:.1e}{' bitwise' if bitwise else ''}")
        return tr, out

    only = None if knobs is None else set(knobs)
    if only is not None and not only <= set(KNOBS):
        raise ValueError(f"knobs {sorted(only - set(KNOBS))}: not knobs of the search (KNOBS: {', '.join(KNOBS)})")
    att_off = ATT_TMA_OFF if base.att_tma > 0 else 0
    start, ref = trial(base, None)   # the base program's output is every candidate's reference
    if not start.ok:
        raise RuntimeError(f"the base program's ({base.label()}) output is not finite: fix the kernel before tuning it")
    best = start
    tried = {base}

    def try_each(cands: Iterable[ScheduleTuning], what: str = "") -> bool:
        """Trial every candidate not tried yet; the best moves to one > min_gain faster. True if it moved."""
        nonlocal best
        moved = False
        for t in cands:
            if t in tried:
                continue
            tried.add(t)
            tr, _ = trial(t, ref)
            if tr.ok and tr.us < best.us / (1 + min_gain):
                best, moved = tr, True
                log(f"  -> best so far{what}: {best.tuning.label()} {best.us:.1f} us")
        return moved

    # other batch sizes' winners first, whole: session 38 found the 1B batch-8 program -4.5% at batch 4, three knobs
    # from batch 4's winner (down's K-split alone ~-1%, under min_gain), where one knob (or one measured pair) at a
    # time does not reach
    try_each(seed_tunings(seeds, batch), " (a seed)")
    for r in range(rounds):
        moved = False
        order = [k for k in KNOBS if k not in SPLIT_OPS or (k in ops and (lm_head or k != "lm_head"))]
        for knob in (k for k in order if only is None or k in only):
            moved |= try_each(t for k, t in neighbours(spec, batch, num_sms, best.tuning, ops=ops, factors=factors,
                                                       chunks=chunks, stages=stages, lm_head=lm_head, att_off=att_off)
                              if k == knob)
        if not moved:
            break
        log(f"round {r + 1} done: {best.tuning.label()} {best.us:.1f} us (base {start.us:.1f} us)")
    retune(best.tuning)
    return best, trials
