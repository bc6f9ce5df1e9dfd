"""bench/mk_ab.py's answer check on CPU (fake decoders): a build that disagrees with the first is left out of the timed
rounds, and an MK_DIAG build (timing only, wrong results by design) is run but not compared."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import mk_ab  # bench/mk_ab.py

from mk_plugin.persistent.variant import KernelVariant


def _dec(value: float):
    def run(hidden, pos, caches, bt, sl, slots, cs, *, out):
        out.fill_(value)
    return run


def test_wrong_builds_leave_the_rounds_and_diag_builds_stay(capsys):
    hidden = torch.zeros(2, 8, dtype=torch.bfloat16)
    inputs = {2: (hidden, None, [torch.zeros(3)], None, None, None, None, None)}
    variants = [mk_ab.Build(KernelVariant()), mk_ab.Build(KernelVariant(release_gate=48)),
                mk_ab.Build(KernelVariant(release_gate=34)), mk_ab.Build(KernelVariant(diag=32, w_tma=True))]
    decs = [_dec(1.0), _dec(1.0), _dec(5.0), _dec(-7.0)]
    assert mk_ab.check_builds(variants, decs, inputs, None) == [True, True, False, True]
    log = capsys.readouterr().out
    assert "MISMATCH, left out of the rounds" in log and "not compared (MK_DIAG: timing only" in log
