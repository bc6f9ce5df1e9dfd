"""bench/paths_table.py: the packaged paths table's kernel-only rows refreshed from bench/mk_step.py rows."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import paths_table

from mk_plugin.adapter.auto import load_paths, paths_file

HEADER = "date,gpu,commit,shape,batch,ctx,path,lm_head,step_us,gbps\n"
LINES = [
    "2026-12-06,NVIDIA H200,new1234,llama-3.2-1b,12,512,megakernel,0,1000.0,1\n",
    "2026-12-06,NVIDIA H200,new1234,llama-3.2-1b,12,512,triton,0,1070.0,1\n",
    "2026-12-06,NVIDIA H200,new1234,llama-3.2-1b,12,512,megakernel,0,1004.0,1\n",   # a second round: the median
    "2026-12-06,NVIDIA H200,new1234,llama-3.2-1b,12,512,triton,0,1072.0,1\n",
    "2026-12-06,NVIDIA H200,new1234,llama-3.2-1b,12,4096,megakernel,0,1.0,1\n",     # another context: not read
    "2026-12-06,NVIDIA H200,new1234,llama-3.2-1b,2,512,megakernel,1,1.0,1\n",       # with the LM head: not read
    "2026-12-06,NVIDIA H100 80GB HBM3,new1234,llama-3.2-1b,1,512,megakernel,0,1.0,1\n",   # another GPU
    "2026-12-06,NVIDIA H200,old0000,llama-3.2-1b,1,512,megakernel,0,1.0,1\n",       # another commit
    "2026-12-06,NVIDIA H200,new1234,llama-3.1-8b,16,512,megakernel,0,4000.0,1\n",
    "2026-12-06,NVIDIA H200,new1234,llama-3.1-8b,16,512,triton,0,4800.0,1\n",
    "2026-12-06,NVIDIA H200,new1234,llama-3.2-1b,3,512,megakernel,0,900.0,1\n",     # one path only: skipped
]
ROWS = HEADER + "".join(LINES)


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    p = tmp_path / "mk_step.csv"
    p.write_text(ROWS)
    return p


def test_read_rows_keeps_one_gpu_commit_and_context(rows: Path):
    m, date = paths_table.read_rows(rows, "NVIDIA H200", "new1234")
    assert date == "2026-12-06"
    assert m[("llama-3.2-1b", 12)] == {"megakernel": [1000.0, 1004.0], "triton": [1070.0, 1072.0]}
    assert set(m) == {("llama-3.2-1b", 12), ("llama-3.1-8b", 16), ("llama-3.2-1b", 3)}


def test_refresh_replaces_times_keeps_vllm_tbt_and_adds_new_sizes(rows: Path, tmp_path: Path):
    packaged = paths_file("nvidia_h200")
    table = tmp_path / "paths.json"
    table.write_text(packaged.read_text())
    before = json.loads(table.read_text())
    old_8b16 = next(e for e in before["entries"] if e["spec"] == "llama-3.1-8b" and e["batch"] == 16)
    assert paths_table.main([str(rows), "--gpu", "NVIDIA H200", "--commit", "new1234", "--table", str(table),
                             "--write"]) == 0
    after = json.loads(table.read_text())
    by = {(e["spec"], e["batch"]): e for e in after["entries"]}
    assert len(after["entries"]) == len(before["entries"])   # b12 and 8B b16 replaced in place, b3 skipped
    e12 = by[("llama-3.2-1b", 12)]
    assert (e12["megakernel_us"], e12["triton_us"], e12["commit"], e12["ctx"]) == (1002.0, 1071.0, "new1234", 512)
    e16 = by[("llama-3.1-8b", 16)]
    assert e16["vllm_tbt"] == old_8b16["vllm_tbt"] and e16["megakernel_us"] == 4000.0
    untouched = [k for k in by if k not in {("llama-3.2-1b", 12), ("llama-3.1-8b", 16)}]
    assert all(by[k] == next(e for e in before["entries"] if (e["spec"], e["batch"]) == k) for k in untouched)
    # what auto reads from it: b12 the megakernel (kernel-only, 6% faster), 8B b16 still its in-vLLM TBT's choice
    h1b = e12["spec_hash"]
    assert load_paths(table, h1b, 132)[12][:2] == (1071.0, 1002.0)


def test_report_lines_and_new_entries(rows: Path, tmp_path: Path, capsys):
    table = tmp_path / "empty.json"
    table.write_text(json.dumps({"format": 1, "gpu": "NVIDIA H200", "entries": []}))
    paths_table.main([str(rows), "--gpu", "NVIDIA H200", "--commit", "new1234", "--table", str(table), "--write"])
    out = capsys.readouterr().out
    assert "llama-3.2-1b b12: new -> mk 1002.0 / triton 1071.0 (0.936x); auto - -> megakernel" in out
    assert "llama-3.2-1b b3: skipped, one path unmeasured (megakernel)" in out
    assert [(e["spec"], e["batch"]) for e in json.loads(table.read_text())["entries"]] == [
        ("llama-3.1-8b", 16), ("llama-3.2-1b", 12)]


def test_no_rows_names_the_filter(rows: Path, tmp_path: Path):
    with pytest.raises(SystemExit, match="no rows of gpu 'NVIDIA H200' at commit 'nope'"):
        paths_table.main([str(rows), "--gpu", "NVIDIA H200", "--commit", "nope", "--table", str(tmp_path / "t.json")])


def test_note_replaces_a_refreshed_entrys_note_only(rows: Path, tmp_path: Path):
    table = tmp_path / "paths.json"
    table.write_text(json.dumps({"format": 1, "gpu": "NVIDIA H200", "entries": [
        {"spec": "llama-3.2-1b", "spec_hash": 1, "num_sms": 132, "batch": 12, "triton_us": 1.0, "megakernel_us": 2.0,
         "commit": "old", "note": "rows of the old job"},
        {"spec": "llama-3.2-1b", "spec_hash": 1, "num_sms": 132, "batch": 1, "triton_us": 1.0, "megakernel_us": 2.0,
         "commit": "old", "note": "not measured again"}]}))
    paths_table.main([str(rows), "--gpu", "NVIDIA H200", "--commit", "new1234", "--table", str(table), "--write",
                      "--note", "the new job's rows"])
    by = {(e["spec"], e["batch"]): e for e in json.loads(table.read_text())["entries"]}
    assert by[("llama-3.2-1b", 12)]["note"] == "the new job's rows"
    assert by[("llama-3.2-1b", 1)]["note"] == "not measured again"
    assert by[("llama-3.1-8b", 16)]["note"] == "the new job's rows"   # a new entry takes it too
