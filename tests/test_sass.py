"""bench/sass.py: the listing parser on a made-up nvdisasm text, and one real comparison on the CPU (nvcc and
Triton's nvdisasm are on every CI machine: a missing one is a broken machine, not a skip)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import sass  # bench/sass.py

LISTING = """
        .type           mk_decode,@function
mk_decode:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
        /*0040*/                   CALL.REL.NOINC 0x100 ;
        .type           $mk_decode$_ZN2mk11matvec_taskILi2EEEjNS_4SmemE,@function
        /*0100*/                   STL [R1], R2 ;
.L_x_2:
        /*0110*/                   LDS R3, [R2] ;
        /*0120*/              @!P1 BRA `(.L_x_3) ;
        /*0130*/                   BRA `(.L_x_2) ;
.L_x_3:
        /*0140*/                   RET.REL.NODEC R20 0x0 ;
"""


def test_parse_functions_classes_and_mma_loops():
    funcs, loops = sass.parse(LISTING)
    assert list(funcs) == ["mk_decode", "matvec_task<2>"]
    assert funcs["mk_decode"] == ["LDC", "LDSM.16.M88.4", "HMMA.16816.F32.BF16", "BRA", "CALL.REL.NOINC"]
    assert sass.classes(funcs["matvec_task<2>"]) == {"stl": 1, "lds": 1, "bra": 2}
    # the backward branch to .L_x_1 holds an MMA; the one to .L_x_2 does not; a forward branch is no loop
    assert loops == [("mk_decode", ["LDSM.16.M88.4", "HMMA.16816.F32.BF16", "BRA"])]
    rows = sass.compare(funcs, {"mk_decode": funcs["mk_decode"] + ["HMMA.16816.F32.BF16"]})
    assert "| mk_decode | 5 -> 6 (+1) | 100.0% | mma 1 -> 2 |" in rows
    assert "| matvec_task<2> | 5 -> 0 (-5) | 0.0% | bra 2 -> 0, lds 1 -> 0, stl 1 -> 0 |" in rows


def test_short_names():
    assert sass.short_name("mk_decode") == "mk_decode"
    assert sass.short_name("$mk_decode$_ZN2mk12ksplit_mergeENS_4SmemERKNS_6ParamsENS_4TaskE") == "ksplit_merge"
    assert sass.short_name("$mk_decode$_ZN2mk11matvec_taskILi1EEEjNS_4SmemE") == "matvec_task<1>"


def test_an_unused_define_keeps_every_function():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "sass.py"), "--model", str(ROOT / "bench" / "models" /
                        "llama-3.2-1b"), "--define", "MK_SASS_TEST_UNUSED=1"], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    funcs, loops = r.stdout.split("Loops that hold MMAs")
    func_rows = [ln for ln in funcs.splitlines() if ln.startswith("| ") and "->" in ln and "function" not in ln]
    loop_rows = [ln for ln in loops.splitlines() if ln.startswith("| ") and "->" in ln and "function" not in ln]
    assert any(ln.startswith("| mk_decode |") for ln in func_rows), r.stdout
    assert any(ln.startswith("| matvec_task<1> |") for ln in func_rows), r.stdout
    assert loop_rows, r.stdout   # the chunk loops of matvec_task
    for ln in func_rows:
        assert "(+0) | 100.0% | - |" in ln, ln
    for ln in loop_rows:
        assert ln.endswith("(+0) | - |"), ln


def _insn(addr: int, text: str, wbar: int = 7, wait: int = 0) -> str:
    """One instruction as cuobjdump -sass prints it: the text, then the high word holding its control bits."""
    hi = (wait << 52) | (7 << 49) | (wbar << 46) | (1 << 41)
    return f"        /*{addr:04x}*/                   {text} ;   /* 0x0000000000000000 */\n" \
           f"                                                      /* {hi:#018x} */\n"


def test_loads_a_return_waits_for():
    """bench/sass_waits.py on a made-up listing: a load nothing waited on before a RET that waits on its scoreboard is
    listed (session 31's wga_group_ready_x); a load consumed earlier is not; functions are cut at the next label."""
    import sass_waits

    cu = (_insn(0x100, "LDG.E.128.CONSTANT R4, desc[UR22][R12.64]", wbar=1)
          + _insn(0x110, "LDG.E.U16.STRONG.GPU R7, desc[UR22][R6.64]", wbar=2)
          + _insn(0x120, "IMAD.MOV.U32 R9, RZ, RZ, R7", wait=0b100)      # waits for SB2: that load is in
          + _insn(0x130, "RET.REL.NODEC R8 0x0", wait=0b10)               # waits for SB1: the first load
          + _insn(0x200, "@!P0 LDG.E.64 R2, desc[UR4][R2.64]", wbar=3)
          + _insn(0x210, "RET.REL.NODEC R2 0x0"))                          # waits for nothing
    nv = "$mk_decode$_ZN2mk1fEv:\n        /*0100*/  LDG ;\n$mk_decode$_ZN2mk1gEv:\n        /*0200*/  LDG ;\n"
    insns = sass_waits.instructions(cu)
    assert [a for a, _, _ in insns] == [0x100, 0x110, 0x120, 0x130, 0x200, 0x210]
    assert insns[0][2] == sass_waits.Control(stall=1, yield_=0, write_barrier=1, read_barrier=7, wait_mask=0)
    starts = sass_waits.function_starts(nv)
    assert starts == [(0x100, "$mk_decode$_ZN2mk1fEv"), (0x200, "$mk_decode$_ZN2mk1gEv")]
    assert sass_waits.pending_at_returns(insns, starts) == [
        ("$mk_decode$_ZN2mk1fEv", 0x130, "LDG.E.128.CONSTANT R4, desc[UR22][R12.64]")]


CHAIN = """
        .type           mk_decode,@function
        /*0000*/                   ISETP.GE.AND P1, PT, R118, 0x2, PT ;
        /*0010*/              @!P1 BRA `(.L_x_7) ;
        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
.L_x_7:
        /*0030*/                   ISETP.GE.AND P1, PT, R118, 0x3, PT ;
        /*0040*/                   NOP ;
        /*0050*/              @!P1 BRA `(.L_x_9) ;
        /*0060*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
.L_x_9:
        /*0070*/                   ISETP.GE.AND P2, PT, R5, 0x4, PT ;
        /*0080*/              @!P2 BRA `(.L_x_10) ;
        /*0090*/                   NOP ;
.L_x_10:
        /*00a0*/                   IADD3 R1, R1, 0x1, RZ ;
"""


def test_check_chains_counts_only_rungs_of_one_register():
    # 0x0000 -> a check of R118 (a rung); 0x0030 -> a check of R5 (another register: not one); 0x0070 -> no check
    assert sass.check_chains(CHAIN) == 1
    assert sass.check_chains(LISTING) == 0
