"""bench/sanitize.py on the CPU: the program it checks is the one served (the full model's table entry for the batch
size, applied to the cut model), not the untuned program a cut model's own lookup gives (its spec hash is its own)."""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

from mk_plugin.persistent import tuning_table as tt
from mk_plugin.persistent.tuning import DEFAULT_TUNING, ScheduleTuning
from mk_plugin.spec import LlamaSpec

REPO = Path(__file__).resolve().parents[1]
FULL = LlamaSpec.from_json_file(REPO / "bench" / "models" / "llama-3.2-1b")


def _load():
    spec = importlib.util.spec_from_file_location("bench_sanitize", REPO / "bench" / "sanitize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_served_tuning_is_the_full_models_entry(tmp_path):
    gated = ScheduleTuning(ksplit=(("down", 4),), release_gate=112, gate_ahead=2)
    e = tt.TuningEntry(tt.spec_tuning_key(FULL, 8, 132, False), gated, 90.0, 100.0, {"spec": FULL.name})
    path = tt.TuningTable("NVIDIA H200", [e]).save(tmp_path / "table.json")
    served = _load().served_tuning
    t, src = served(FULL, 8, 132, str(path), "NVIDIA H200")
    assert t == gated and "layers' entry" in src          # the LM head key takes the layers' entry
    assert served(FULL, 8, 132, "off", "NVIDIA H200")[0] == DEFAULT_TUNING
    # why the script needs it: the cut model is another model to the tables
    cut = replace(FULL, num_layers=2)
    assert tt.spec_tuning_key(cut, 8, 132, False) != tt.spec_tuning_key(FULL, 8, 132, False)
    assert served(cut, 8, 132, str(path), "NVIDIA H200")[0] != gated


def test_the_packaged_table_serves_its_1b_entries():
    path = tt.tuned_file("NVIDIA H200")
    table = tt.TuningTable.load(path, "NVIDIA H200")
    served = _load().served_tuning
    winners = [(k, e) for k, e in table.entries.items()
               if k.spec_hash == tt.spec_tuning_key(FULL, 1, 132, False).spec_hash and table.winner(k) is e]
    assert winners, "the packaged H200 table has no 1B winner to check"
    for key, e in winners:
        assert served(FULL, key.batch, key.num_sms, str(path), "NVIDIA H200")[0] == e.tuning
