"""The programs the packaged tuning tables serve, on the GPU: every winning entry's tuning (its release gate and head
start, K-splits, ring-fed attention, rstd epilogue, wgmma build) applied to a 2-layer cut of its model at the entry's
batch size, with a padded entry and contexts not aligned to the block size: bitwise repeatable, and within the step
tolerance of the fp32 reference and the Triton path. The tables are keyed by the full model and a cut model is in no
table (its own spec hash), so the entry is applied explicitly, as bench/sanitize.py's served_tuning does; until session
38 no GPU test ran the tables' own programs (test_persistent_gpu's tuned-program test runs a fixed set)."""
from __future__ import annotations

from pathlib import Path

import pytest
from gpu_helpers import DEV, assert_repeatable_step, gpu_batch

from mk_plugin import reference as ref
from mk_plugin.persistent import tuning_table as tt
from mk_plugin.persistent.backend import MegakernelDecoder
from mk_plugin.spec import LlamaSpec

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"


def packaged_entries() -> list:
    """(model, batch, tuning) of every winning entry of the packaged tables, for the bench/models shapes; a program that
    another GPU's table serves too (the H100's entries are the H200's tunings) is checked once."""
    out, seen = [], set()
    for path in sorted(tt.TUNED_DIR.glob("megakernel_*.json")):
        table = tt.TuningTable.load(path, path.stem)
        for name in ("llama-3.2-1b", "llama-3.1-8b"):
            full_hash = tt.spec_tuning_key(LlamaSpec.from_json_file(MODELS / name), 1, 1, False).spec_hash
            for key, e in sorted(table.entries.items(), key=lambda kv: (kv[0].batch, kv[0].lm_head)):
                if key.spec_hash == full_hash and table.winner(key) is e and (name, key.batch, e.tuning) not in seen:
                    seen.add((name, key.batch, e.tuning))
                    out.append(pytest.param(name, key.batch, e.tuning,
                                            id=f"{path.stem}-{name}-b{key.batch}{'-lm_head' if key.lm_head else ''}"))
    return out


def test_the_packaged_tables_have_entries_to_check():   # on the CPU too: the GPU test's parameters
    assert packaged_entries(), "no winning entry of a bench/models shape in mk_plugin/persistent/tuned"


@pytest.mark.gpu
@pytest.mark.parametrize("name,bsz,tuning", packaged_entries())
def test_packaged_entry_programs_match_the_reference(models, mk_variant, name, bsz, tuning):
    spec, w = models(name, 2)
    seq_lens = ([517, 0, 1, 4095, 260, 33, 90, 1025] * 2)[:bsz] if bsz > 1 else [1337]
    batch = gpu_batch(spec, seq_lens, seed=13)
    cs = ref.rope_cos_sin_cache(spec, 4200).to(DEV)
    dec = MegakernelDecoder(spec, w, bsz, DEV, lm_head=True, variant=mk_variant, tuning={bsz: tuning})
    assert_repeatable_step(dec, spec, w, batch, cs)
    assert dec.program(bsz).tuning == tuning
