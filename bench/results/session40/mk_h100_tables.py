"""One-off (session 40): the H100's packaged tables from the H100 rows of 2026-12-06 (commit 68c977f)."""
import csv
import json
import statistics
import sys

sys.path.insert(0, '.')
from dataclasses import replace

from mk_plugin.adapter.auto import paths_file
from mk_plugin.persistent.tuning import UNTUNED_TUNING
from mk_plugin.persistent.tuning_table import TuningEntry, TuningTable, tuned_file

GPU = "NVIDIA H100 80GB HBM3"
SLUG = "nvidia_h100_80gb_hbm3"
def rows(p):
    return list(csv.DictReader(open(p)))
unt = rows('/tmp/s40/c4/mk_step_untuned.csv') + rows('/tmp/s40/c5/mk_step_untuned.csv') + rows('/tmp/s40/c6/mk_step_untuned.csv')
tun = [r for r in rows('/tmp/s40/c4/mk_step.csv') if r['path'] == 'megakernel'] + rows('/tmp/s40/c5/mk_step_tuned_r2.csv') + rows('/tmp/s40/c6/mk_step_tuned.csv')
tri = [r for r in rows('/tmp/s40/c4/mk_step.csv') if r['path'] == 'triton']
def vals(rs, shape, b):
    return [float(r['step_us']) for r in rs if r['shape'] == shape and int(r['batch']) == b]
h200 = TuningTable.load(tuned_file("NVIDIA H200"), "NVIDIA H200")
names = {807087114: 'llama-3.1-8b', 1985708063: 'llama-3.2-1b'}
SRC = "bench/results/h100_tables_2026-12-06_68c977f.md"
out = TuningTable(GPU)
for key, e in sorted(h200.entries.items()):
    shape = names[key.spec_hash]
    u, t = vals(unt, shape, key.batch), vals(tun, shape, key.batch)
    if len(u) < 2 or len(t) < 2:
        print("not measured on the H100:", shape, key.batch); continue
    if shape == "llama-3.1-8b" and key.batch == 12:
        # h100_rows ran its "untuned" rows with this table in the checkout (MK_TUNING unset reads it): batch 12, with
        # no entry then, took batch 16's program, the very tuning of this entry. Measured again (h100_b12, 123c47d, 2
        # alternated rounds, 50 replays): untuned, batch 10's program (what b12 runs without a b12 key since the b10
        # entry) and this entry
        c13 = '/tmp/s40/c13/'
        u = vals(rows(c13 + 'mk_step_untuned.csv'), shape, 12)
        t = vals(rows(c13 + 'mk_step_h200_b12.csv'), shape, 12)
        b10p = vals(rows(c13 + 'mk_step_b10_program.csv'), shape, 12)
        assert all(a < b / 1.02 for a, b in zip(t, u))
        out.put(TuningEntry(key, e.tuning, statistics.mean(t), statistics.mean(u), {
            "spec": shape, "ctx": 512, "date": "2026-12-06", "commit": "123c47d", "reps": 50, "gpu": GPU,
            "base": UNTUNED_TUNING.to_json(),
            "measured": "cuda-graph median of 50 replays, bench/mk_step.py (h100_b12: the untuned program, batch 10's "
                        "entry, this tuning, 2 alternated rounds); best_us / default_us the means of the two rounds",
            "rule": "> 2% against the untuned program in both rounds",
            "rounds": {"untuned_us": u, "tuned_us": t, "b10_program_us": b10p},
            "tried": "batch 10's entry at batch 12: " + " / ".join(f"{x:.1f}" for x in b10p) + " us (this tuning -1.9 / "
                     "-1.4% against it, under 2%; kept as the faster of the two, as the H200 table's b12 entry)",
            "tuning_from": {"table": "megakernel_nvidia_h200.json", "commit": e.meta.get("commit"),
                            "source": e.meta.get("source")},
            "source": SRC}))
        print("8B b12", statistics.mean(t), statistics.mean(u)); continue
    bu, du = statistics.median(t), statistics.median(u)
    gains = [f"{(a / b - 1) * 100:+.1f}%" for a, b in zip(t, u)]
    b10 = shape == "llama-3.1-8b" and key.batch == 10
    c = "01798cc" if b10 else "68c977f"
    meta = {"spec": shape, "ctx": 512, "date": "2026-12-06", "commit": c, "reps": 100, "gpu": GPU,
            "base": (h200.entries[replace(key, batch=8)].tuning if b10 else UNTUNED_TUNING).to_json(),
            "measured": "cuda-graph median, bench/mk_step.py (bench/gpu_calls.sh h100_tables and its second round): "
                        "the untuned program (MK_TUNING unset: no H100 table, UNTUNED_TUNING) against this tuning "
                        "(the packaged H200 table's entry, MK_TUNING set to it), 2 rounds, each the untuned program "
                        "then this one; best_us / default_us the means of the two rounds",
            "rule": "the H200 entry's tuning where it beat the untuned program by > 2% (TUNED_MIN_GAIN) in both "
                    "rounds on the H100; no search on the H100 itself",
            "rounds": {"untuned_us": u, "tuned_us": t, "change": gains},
            "tuning_from": {"table": "megakernel_nvidia_h200.json", "commit": e.meta.get("commit"),
                            "source": e.meta.get("source")},
            "source": SRC}
    if b10:   # its "untuned" rows ran batch 8's entry of this table (MK_TUNING unset read the table in the checkout)
        meta["measured"] = ("cuda-graph median, bench/mk_step.py (bench/gpu_calls.sh h100_rows, 2 alternated rounds): "
                            "batch 8's entry of this table at batch 10 (what batch 10 ran without this entry: the "
                            "nearest) against this tuning; best_us / default_us the means of the two rounds")
        meta["rule"] = "as the H200 table's batch-10 entry: against batch 8's program at batch 10, > 2% in both rounds"
    if du / bu - 1 > 0.02 and all(a < b / 1.02 for a, b in zip(t, u)):
        out.put(TuningEntry(key, e.tuning, bu, du, meta))
    else:   # measured, and the base won: the table's convention is tuning == base, best == default
        meta["tried"] = (f"{e.tuning.label()} (the H200 entry): {bu:.1f} us against {du:.1f} ({', '.join(gains)}): "
                         "under the 2% rule in a round")
        out.put(TuningEntry(key, UNTUNED_TUNING, du, du, meta))
    print(shape, key.batch, bu, du, gains, "winner" if out.winner(key) else "the base runs")
# 1B b3 (h100_b3_5, 720702d, 2 alternated rounds): the H100 table's untuned base there (its b4 entry's), the H200 b4
# entry, and batch 1's program (the H200 table without its b4 key). Batch 1's program takes a b3 key: -4.8 / -4.3%
# (the H200 b4 entry's -4.3 / -4.3% is as good, but batch 1's keeps batch 2 on the program it ran: b2's nearest keys
# are 1 and 3, the tie goes to 3)
c11 = '/tmp/s40/c11/'
u3 = vals(rows(c11 + 'mk_step_h100_base.csv'), 'llama-3.2-1b', 3)
t3 = vals(rows(c11 + 'mk_step_b1_program.csv'), 'llama-3.2-1b', 3)
a3 = vals(rows(c11 + 'mk_step_h200_b4.csv'), 'llama-3.2-1b', 3)
k1 = next(k for k in h200.entries if k.spec_hash == 1985708063 and k.batch == 1)
assert all(a < b / 1.02 for a, b in zip(t3, u3))
out.put(TuningEntry(replace(k1, batch=3), h200.entries[k1].tuning, statistics.mean(t3), statistics.mean(u3), {
    "spec": "llama-3.2-1b", "ctx": 512, "date": "2026-12-06", "commit": "720702d", "reps": 100, "gpu": GPU,
    "base": UNTUNED_TUNING.to_json(),
    "measured": "cuda-graph median, bench/mk_step.py (bench/gpu_calls.sh h100_b3_5, 2 alternated rounds): this "
                "table's untuned base at batch 3 (its b4 entry's) against batch 1's tuning there; best_us / default_us "
                "the means of the two rounds",
    "rule": "> 2% in both rounds",
    "rounds": {"untuned_us": u3, "tuned_us": t3, "h200_b4_entry_us": a3},
    "tried": "the H200 table's b4 entry at b3: " + " / ".join(f"{x:.1f}" for x in a3) + " us (as good); at b4 batch "
             "1's program was +1.9 / +1.3%, the H200 b4 entry -0.9 / -1.3% (b4 keeps the base); b5 all within 0.4%",
    "tuning_from": {"table": "megakernel_nvidia_h200.json", "batch": 1},
    "source": SRC}))
print("1B b3", statistics.mean(t3), statistics.mean(u3))
out.save(tuned_file(GPU))
# paths: the one job with both paths (the first round)
ents = []
for shape, hsh in (('llama-3.2-1b', 1985708063), ('llama-3.1-8b', 807087114)):
    for b in sorted({int(r['batch']) for r in tri if r['shape'] == shape}):
        ents.append({"spec": shape, "spec_hash": hsh, "num_sms": 132, "batch": b,
                     "triton_us": vals(tri, shape, b)[0],
                     "megakernel_us": next(float(r['step_us']) for r in rows('/tmp/s40/c4/mk_step.csv')
                                           if r['shape'] == shape and int(r['batch']) == b and r['path'] == 'megakernel'),
                     "commit": "68c977f", "date": "2026-12-06", "ctx": 512,
                     "note": "the megakernel ran the H200 table's program for this batch size (MK_TUNING set to it), "
                             "which megakernel_nvidia_h100_80gb_hbm3.json serves on this GPU where it won; " + SRC})
body = {"format": 1, "gpu": GPU,
        "source": "bench/results/mk_step.csv rows of 2026-12-06 (bench/mk_step.py, both paths in one job on the H100, "
                  "ctx 512, no LM head, median of 100 CUDA-graph replays; bench/gpu_calls.sh h100_tables); no "
                  "in-vLLM rows yet", "entries": ents}
p = paths_file(SLUG); p.write_text(json.dumps(body, indent=1) + "\n"); print(p)
