"""bench/ncu_stalls.py on a small hand-written export in the layout of `ncu --page source --csv`."""
from __future__ import annotations

import gzip
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ncu_stalls

HEAD = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
        '"stall_barrier","stall_long_sb","stall_wait","stall_barrier (Not Issued)"')
ROWS = [
    '"0x10","      BAR.SYNC.DEFER_BLOCKING 0x1, 0x100","2","1","0","0","2","0"',
    '"0x20","@P0   HMMA.16816.F32.BF16 R4, R8, R12, R4","5","5","0","1","4","0"',
    '"0x30","      B2R.RESULT RZ, P0","30","30","29","0","1","29"',
    '"0x40","@!P1  SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R131+URZ], R78","3","3","0","3","0","0"',
]
TEXT = '"Kernel Name","mk_decode",\n' + HEAD + "\n" + "\n".join(ROWS) + "\n"


def test_parse_reads_samples_reasons_and_mnemonics():
    ins = ncu_stalls.parse(TEXT)
    assert [i.samples for i in ins] == [2, 5, 30, 3]
    assert [i.mnemonic for i in ins] == ["BAR", "HMMA", "B2R", "SYNCS"]
    assert ins[2].reasons == {"barrier": 29, "wait": 1}   # the "(Not Issued)" columns are not counted twice


def test_summary_ranks_and_shows_context(tmp_path):
    md = ncu_stalls.summarize(ncu_stalls.parse(TEXT), top=2, context=1)
    assert md.startswith("4 instructions, 40 samples")
    assert "| barrier | 29 | 72.5% |" in md and "| B2R | 30 | 75.0% |" in md
    top = [line for line in md.splitlines() if line.startswith(("| 2 |", "| 1 |"))]
    assert top[0].startswith("| 2 | 0x30 | `B2R.RESULT RZ, P0` | 30 |") and top[1].startswith("| 1 | 0x20")
    assert "`@P0   HMMA.16816.F32.BF16 R4, R8, R12, R4` (before)" in md
    f = tmp_path / "src.csv.gz"
    f.write_bytes(gzip.compress(TEXT.encode()))
    out = tmp_path / "s.md"
    assert ncu_stalls.main([str(f), "--top", "2", "--out", str(out)]) == 0
    assert out.read_text().startswith("4 instructions, 40 samples")


def test_not_an_export_is_a_clear_error():
    with pytest.raises(ValueError, match="not an ncu source-page CSV"):
        ncu_stalls.parse("Name,Value\na,1\n")
    with pytest.raises(ValueError, match="Warp Stall Sampling"):
        ncu_stalls.parse('"Address","Source"\n"0x1","NOP"\n')


def test_fetch_summary_puts_no_inst_samples_on_their_branch_targets(tmp_path):
    head = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
            '"stall_no_inst","stall_wait"')
    rows = ['"0x10","@!P1  BRA 0x40","1","1","0","1"',
            '"0x20","      ISETP.GE.AND P1, PT, R5, 0x2, PT","9","9","6","3"',   # not a target: 6 off-target
            '"0x30","      BRA 0x40","0","0","0","0"',
            '"0x40","      VIADD R4, R4, 0x400","14","14","12","2"']             # two branches jump here
    text = '"Kernel Name","mk_decode",\n' + head + "\n" + "\n".join(rows) + "\n"
    md = ncu_stalls.fetch_summary(ncu_stalls.parse(text))
    assert md.startswith("no_inst samples: 18; on branch targets: 12 (66.7%)")
    assert "| 0x40 | `VIADD R4, R4, 0x400` | 12 | 0x10 `@!P1  BRA 0x40`; 0x30 `BRA 0x40` |" in md
    f = tmp_path / "src.csv"
    f.write_text(text)
    out = tmp_path / "s.md"
    assert ncu_stalls.main([str(f), "--fetch", "--out", str(out)]) == 0
    assert "on branch targets: 12" in out.read_text()
