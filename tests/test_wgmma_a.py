"""MK_WGMMA_A on the CPU (A/B switch, session 28; csrc/matvec_wgmma_a.cuh): the premise of its A/B (bench/NOTES.md,
session 28), that at batch 9..16 every matvec task of the measured models takes the wgmma path -- the kernel's wga_takes
wants the task's width (K, or a K-split part's) a multiple of its 256-column chunk -- including the K-split parts of
the packaged H200 table's entries; and the variant's values. (The GPU test is test_wgmma_a_gpu.py.)"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from mk_plugin.persistent.encoding import Rounding, ksplit_range, spec_hash
from mk_plugin.persistent.tuning_table import TuningTable, tuned_file
from mk_plugin.persistent.variant import WGMMA_A_CHOICES, KernelVariant
from mk_plugin.spec import LlamaSpec

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "bench" / "models"
SRC = (ROOT / "csrc" / "wga_x.cuh").read_text()   # the wgmma path's geometry and x staging (split out in session 47)


def _kernel_chunk_cols() -> int:
    m = re.search(r"constexpr int WGA_KC = (\d+);", SRC)
    assert m, "csrc/wga_x.cuh: WGA_KC not found"
    return int(m.group(1))


def _widths(spec: LlamaSpec) -> dict[str, int]:
    """Each matvec op's reduction width (csrc/matvec_plan.cuh weight_plan)."""
    return {"qkv_rope": spec.hidden_size, "o_proj": spec.q_size, "gate_up": spec.hidden_size,
            "down": spec.intermediate_size, "lm_head": spec.hidden_size}


def test_the_kernel_condition_is_the_one_checked_here():
    from mk_plugin.persistent import encoding
    # the host's copy of the condition (encoding.wga_takes: the VM's _epi_rstd, the autotuner, the decoder) too
    assert _kernel_chunk_cols() == 256 == encoding.WGA_KC
    assert encoding.wga_takes(256, 9) and not encoding.wga_takes(256, 8) and not encoding.wga_takes(320, 16)
    assert re.search(r"bool wga_takes\(int K, int B\) \{\s+return MK_WGA_ONLY \|\| \(batch_ntiles\(B\) == 2 && "
                     r"K % WGA_KC == 0\);\s+\}", SRC)   # MK_WGA_ONLY: where the host found every K whole chunks


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b"])
def test_every_matvec_of_the_measured_models_takes_the_path(name):
    spec = LlamaSpec.from_json_file(MODELS / name)
    kc = _kernel_chunk_cols()
    assert {op: k % kc for op, k in _widths(spec).items()} == dict.fromkeys(_widths(spec), 0)
    # the packaged table's K-split parts (1B down / 4 at batch 8 and 16, 8B down / 2 at 16 when this was written): every
    # entry's, since batch 9..15 run the nearest measured batch size's (batch 9: batch 8's)
    table = TuningTable.load(tuned_file("NVIDIA H200"), "NVIDIA H200")
    entries = [e for k, e in table.entries.items() if k.spec_hash == spec_hash(spec)]
    assert any(e.key.batch > 8 for e in entries), f"no batch 9..16 entry for {name} in the packaged H200 table"
    for e in entries:
        for op, parts in e.tuning.ksplit:
            k = _widths(spec)[op]
            spans = [ksplit_range(k, p, parts) for p in range(parts)]
            assert all((hi - lo) % kc == 0 for lo, hi in spans), (name, e.key.batch, op, parts, spans)


def test_variant_values():
    assert WGMMA_A_CHOICES == (0, 1, 2, 4)
    for r in WGMMA_A_CHOICES[1:]:
        assert KernelVariant(w_tma=True, wgmma_a=r).defines() == ("-DMK_W_TMA=1", f"-DMK_WGMMA_A={r}")
    assert KernelVariant().defines() == ()


def test_wga_x_values():
    """MK_WGA_X (session 30): MK_WGMMA_A's rstd epilogue, so only with it and the fused rounding. Each bad value's
    error names it."""
    v = KernelVariant(w_tma=True, wgmma_a=4, wga_x=1, num_stages=5)
    assert v.defines() == ("-DMK_NUM_STAGES=5", "-DMK_W_TMA=1", "-DMK_WGMMA_A=4", "-DMK_WGA_X=1")
    assert KernelVariant.parse(["MK_W_TMA=1", "MK_WGMMA_A=4", "MK_WGA_X=1"]).wga_x == 1
    with pytest.raises(ValueError, match="wga_x=1 is MK_WGMMA_A's x staging"):
        KernelVariant(wga_x=1)
    assert KernelVariant(w_tma=True, wgmma_a=4, wga_x=2).defines()[-1] == "-DMK_WGA_X=2"
    with pytest.raises(ValueError, match="wga_x=3"):
        KernelVariant(w_tma=True, wgmma_a=4, wga_x=3)
    with pytest.raises(ValueError, match="wga_x=1 needs the fused rounding"):
        KernelVariant(w_tma=True, wgmma_a=4, wga_x=1, rounding=Rounding.STOCK)
