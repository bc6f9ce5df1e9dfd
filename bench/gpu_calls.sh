#!/usr/bin/env bash
# The GPU host's calls, by name: one device `run` each (`bash bench/gpu_calls.sh NAME $OUT` from the project root),
# so the machine's ~30 s warm window is not spent typing. Until session 34 every session wrote its own
# bench/gpu_session<N>.sh (38 of them, most naming switches that have left the kernel since); they are in git history
# (the last at commit a15299f) and bench/NOTES.md cites them by session and call number.
#
# On an H100 (the device tool lends one when no H200 comes) the calls run the packaged H200 table's tunings: its keys
# are model, batch and 132 SMs, which the H100 SXM shares, so every build is the H200 program (say which card gave
# each figure); the vLLM calls (vllm_env) unset it and read the H100's own tables (session 40). Calls that need vLLM (vllm_env) unpack the bundle once per machine: `part0` and `part1` carry
# .gpuhost/part.0 / part.1, the first vLLM call carries .gpuhost/part.2 and .gpuhost/unpack.sh.
#
#   paths          issue 11: both decode paths, 1B b1/4/8/12/16 and 8B b1/8/16 at ctx 512 and 4096; the op-by-op and
#                  tuned-program GPU tests (~170 s on an H200). Then, on the CPU, `python bench/paths_table.py
#                  OUT/mk_step.csv --gpu "NVIDIA H200" --commit C --write` refreshes auto's kernel-only rows
#   wga_x          issue 11: the table's wga_x against the other value at 8B b12 / b16 and 1B b16, 2 alternated rounds
#   lm_head        MK_LM_HEAD kernel-only: the LM head as megakernel tasks against vLLM's GEMM after the step
#   kernel_tests   the kernel GPU tests other than op-by-op (~390 s)
#   table_tests    the packaged tables' own programs (every winning entry on a 2-layer cut of its model) against the fp32
#                  reference and Triton: tests/test_packaged_tables_gpu.py (new in session 38; ~150-300 s)
#   sanitize       compute-sanitizer on the default build, each batch size's table program (b1 / 8 / 16; racecheck up to
#                  300 s a run: session 38's b8 run passed 200 s without a report)
#   sanitize_wga   compute-sanitizer on the wgmma path's x staging (b16 / 12; ~150 s)
#   sanitize_nws   compute-sanitizer on MK_WGA_NWS's build (b16 / 9; ~150 s)
#   ncu_b1         Nsight Compute stall samples of one b1 step (1B, 8B), mapped to csrc lines (MK_LINEINFO)
#   trace_1b       the 1B b1 and b16 traces with phases: records, PNG and per-op table (mk_plugin.trace convert)
#   gate           MK_RELEASE_GATE 34 / 48 / 50 (also after qkv / o_proj / both), MK_GATE_AHEAD 2: 1B b1/8/16, 8B b1/16
#   gate_h200      session 36's release_gate 48 + gate_ahead 2 against the table without them, 1B b1 / b16 (for an H200)
#   b16_gate       batch 16's releases (qkv 1.9 us a task at 1B b16 against 0.5 at b1, session 38's H100 trace): masks
#                  with qkv_rope's bit (50, 54, 114) under a 2-chunk head start, 1B b16 and 8B b16 (~150 s)
#   release_prefetch  release_probe streams 3 / 4: does a release wait for its own SM's L2 prefetches (session 37's
#                  reading of the gate L2 prefetch's cost)? The kernel's release (modes 0, 7) idle, beside copies, beside
#                  prefetches paced 1000 / 250 ns a 32 KB chunk (~20 s)
#   b16_inflight   MK_INFLIGHT 2 / 3 on the wgmma path (the b12 / b16 entries have no cap): 8B and 1B b12 / b16, 2 rounds
#                  (~250 s)
#   b16_ready      MK_DIAG=64 (timing only): the wgmma path's x groups after a pass's first used without their wait,
#                  normalisation or barrier, 8B and 1B b16, 2 rounds, and both builds' 1B b16 phase traces (~270 s)
#   b16_streams    the 8B and 1B b16 traces of the table's program and of MK_DIAG 64's bound, with the weight-streams
#                  view: does qkv_rope's stage hold its weight stream at ~half gate_up's rate an SM? (~150 s)
#   b16_nw         MK_DIAG 64 / 128 / 192 (timing only): the wgmma path's x waits, norm-weight loads and both skipped after a
#                  pass's first group, and MK_WGA_NWS (the norm weights by cp.async), 8B b16 / b12 and 1B b16, 2 rounds,
#                  after MK_WGA_NWS's GPU test: are the two per-group round trips coupled? (~250 s)
#   nws_tables     the tables' wga_nws entries (session 47) on the GPU tests, and 1B batch 9..13 with batch 10's gate
#                  mask against batch 16's (batch 12 moved to batch 10's entry; ~150 s)
#   b16_nws_gate   8B b12 / b16: MK_WGA_NWS, and with the gate pair 48 + ahead 2, against the table (2 rounds; ~120 s)
#   x_groups       MK_X_GROUPS (x by column groups at every batch) at 1B b1..6 and 8B b1..2 after its GPU tests, and the
#                  1B b4 phase traces of both builds (~250 s)
#   xg_tables      session 48's table entries (x_groups, 8B b12 / b16's NWS + gate pair): GPU tests, the batch sizes they
#                  serve unmeasured against the table without them, and on an H100 its own 1B b4 entry with x_groups
#   ntiles         MK_NTILES (a build per batch class: the other class's matvec path compiled out) at 1B b1 / 8 / 16
#                  (NTILES_MORE=1: b4 / 10 too), MK_WGA_ONLY (every task on wgmma) at b16, MK_X_WHOLE (every x staged
#                  whole) at b1, 2 rounds, then their GPU test (~400 s)
#   ntiles_8b      the same at 8B b1 / 8 / 16 and xg_wide's 1B half (~500 s)
#   xg_wide        MK_X_GROUPS where nothing is staged whole (1B b8 / 10 / 16, 8B b1 / 8 / 10 / 16): the build without the
#                  whole-x code, 2 rounds (~200 s)
#   b1_inflight    MK_INFLIGHT 2 / 3 at 1B b1 / b4 under the tables' gates (qkv_rope's b1 stage shrinks as the producer's
#                  lead grows: its x load queues behind the SM's copies in flight; ~120 s)
#   release_coresident  release_probe streams 5 / 6 / 7 (session 39): two CTAs per SM; does a release wait for the copies
#                  of another CTA on its SM (a producer CTA beside a consumer CTA) or only for its own CTA's? (~40 s)
#   l2_window      MK_DIAG_L2_FROM / _N (timing only): 1B b1 with gate_up's chunks 2.. of each task from L2 (N = 3 / 6 /
#                  14) against the table's program, its w_tma + cap build, and every weight from L2 (2 rounds; ~150 s)
#   cluster_probe  bench/cluster_probe.py: a hand-off between a cluster's two CTAs (L2 + gpu / cluster-scope release,
#                  DSMEM + remote mbarrier arrive, st.async, DSMEM bulk copy), idle / others streaming / all streaming,
#                  256 B and 4 KB payloads (~60 s)
#   cluster_residency  grids of clusters of 8 / 16 CTAs at one CTA per SM: all co-resident? on which SMs? (~10 s)
#   cluster_allgather  clusters of 2 / 4 resident?; the all-gather of a cluster of 8 by st.async (16 / 64 / 128-word
#                  slices, idle / other clusters streaming / all streaming) beside the 1:1 hand-off at those sizes (~30 s)
#   l2_diag        MK_DIAG=32 (weights L2-resident, timing only) against the tensor-map build and MK_DIAG=2 (no copies)
#   l2_probe       bulk_probe: 17 / 35 / 52 MB regions re-read 40 times a launch (L2-resident) against 1 GB once
#   h100_tables    an H100 only: the untuned program (what an H100 got without a table of its own) against the packaged
#                  H200 table's programs and Triton, 1B b1/4/8/12/16 and 8B b1/8/16: the H100's packaged tables (~350 s)
#   h100_rows      an H100 only: the 8B b10 / b12 entries against the untuned program (2 alternated rounds), then the
#                  packaged H100 table as a user gets it (MK_TUNING unset) at 1B b1 / b4, its tuning lines shown (~120 s)
#   search         any card (session 53): bench/autotune.py --start table --knobs program (the program knobs only, from
#                  this GPU's packaged table's entries, 2 rounds, --write-tuned) at 1B b1 / 4 / 8 / 10 / 12 / 16 and 8B b1
#                  / 8 / 16, then every changed batch size before / after at ctx 512 and 4096, 2 rounds (ABBA, one
#                  process per batch size: ~7 s of start each); the table comes back in $OUT (~5-7 min). Its H100-only first form, h100_search (1B b16 / b1), ran in session
#                  53 and is in git at f343e66
#   h100_b8_k2     an H100 only (session 54): the H100 table's 1B b8 entry with down's K-split 2 (the search's -2.9% trial at
#                  ctx 512) against the table, b6 / 8 / 9 at ctx 512 and b8 at 4096, 2 rounds ABBA, then the packaged
#                  tables' GPU test with it (~250 s)
#   probe_warps    issue 11 (session 55, any card): bench/wgmma_probe.py --grid warps, 2 rounds: the batch-1 chain's one-M-tile
#                  chunk (mma.sync-1M) and the four-M-tile one at 8 against 16 consumer warps and with two accumulator
#                  chains, resident and streamed (~90 s)
#   h100_b4_k2     an H100 only (session 55): the H100 table's 1B b4 entry with down's K-split 2 (what b8's entry took this
#                  session) against the table, b3 / 4 / 5 (the batch sizes it serves) and b6 (b8's entry: a same-program
#                  control) at ctx 512 and b4 at 4096, 2 rounds ABBA, then the packaged tables' GPU test with it (~200 s)
#   h100_check     an H100 only (session 53): the search's moves where it did not measure them: 1B b8 at ctx 4096 with the
#                  held-back attn_chunks 1 table, 1B b13..15 (served by the b16 entry) and b16 at ctx 4096 with the new
#                  o_proj split, each before / after in 2 alternated rounds (~90 s)
#   h100_b3_5      an H100 only: 1B b3 / 4 / 5 on the H100 table's untuned base against the H200 b4 entry and batch 1's
#                  program there (the H200 table without its b4 key), 2 alternated rounds (~100 s)
#   tbt_auto_8b    issue 12: 8B TBT inside vLLM, stock alternated with the default mode (auto), b1 / 4 / 8 / 16, 2 rounds
#   tbt_auto_8b_long  issue 12 on an H100: 8B TBT at prompt 2048 / 8192, stock alternated with auto, b8 / b16, 2 rounds
#                  (the H100 paths table has kernel-only rows at ctx 512; the H200 chose stock at 8B b16 from such rows)
#   part0 part1    copy a vLLM bundle part to /root/parts
#   tbt_8b         issue 11 in vLLM: 8B TBT, stock alternated with the megakernel (and its LM head), b1 / b8, 2 rounds
#   correctness    vLLM correctness (greedy with CUDA graphs; eager against the fp32 truth), 1B, MK_LM_HEAD=megakernel
#   serve_1b       issue 12: bench/serve.py 1B, stock against auto, concurrency 1 / 8 / 16, 2 rounds
#   serve_8b       issue 12: bench/serve.py 8B, stock against auto, concurrency 1 / 8 / 16
#   tbt_1layer     issue 12: the one-layer model (vLLM's host floor) against stock, 3 rounds with profiles
#   soak_engines   the megakernel's 2,000-request soak with preemption, first call: the engines' runs
#   soak           its second call on the same machine: the verdict against stock and the fp32 truth
set -uo pipefail
n=${1:?call name (see the list at the top)}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), copy_parts(), vllm_env(), serve_auto, tbt_1layer_profiled, soak
if nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100; then
  export MK_TUNING=$PWD/mk_plugin/persistent/tuned/megakernel_nvidia_h200.json
  echo "H100: the H200 table's tunings (MK_TUNING=$MK_TUNING)"
fi
W=MK_W_TMA=1,MK_WGMMA_A=4   # the wgmma path's builds, as the tables' b10..16 entries compile them
{
case $n in
  paths)   # batch 10 since session 47 (the 1B b10 entry, the 8B b10 entry's wga_nws)
    T=120 step --model bench/models/llama-3.2-1b --batch 1 4 8 10 12 16
    T=170 step --model bench/models/llama-3.1-8b --batch 1 8 10 16
    timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py tests/test_ring_mma_gpu.py \
      tests/test_wgmma_a_gpu.py -k "op_by_op or tuned_programs" 2>&1 | tail -8
    T=150 step --model bench/models/llama-3.1-8b --batch 1 8 16 --ctx 4096
    T=100 step --model bench/models/llama-3.2-1b --batch 1 8 16 --ctx 4096 ;;
  h100_tables)   # the untuned rows go to their own CSV (not the tuned program's step); the tuned rows are `paths`' first two
    if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then echo "h100_tables: not an H100"; exit 2; fi
    E=$(untuned_table); U="--no-triton --csv $out/mk_step_untuned.csv"
    MK_TUNING=$E T=110 step --model bench/models/llama-3.2-1b --batch 1 4 8 12 16 $U
    MK_TUNING=$E T=150 step --model bench/models/llama-3.1-8b --batch 1 8 16 $U
    rm -f "$E"
    T=110 step --model bench/models/llama-3.2-1b --batch 1 4 8 12 16
    T=150 step --model bench/models/llama-3.1-8b --batch 1 8 16 ;;
  h100_rows)   # (as run in session 40 its "untuned" rows read the new H100 table: MK_TUNING unset; now an empty table)
    if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then echo "h100_rows: not an H100"; exit 2; fi
    E=$(untuned_table)
    for r in 1 2; do
      MK_TUNING=$E T=120 step --model bench/models/llama-3.1-8b --batch 10 12 --no-triton --csv "$out/mk_step_untuned.csv"
      T=120 step --model bench/models/llama-3.1-8b --batch 10 12 --no-triton --csv "$out/mk_step_tuned.csv"
    done
    # no MK_TUNING: the packaged table of this GPU (mk_plugin/persistent/tuned/megakernel_nvidia_h100_80gb_hbm3.json)
    MK_TUNING= timeout 90 python3 bench/mk_step.py --reps 100 --model bench/models/llama-3.2-1b --batch 1 4 --no-triton \
      --csv "$out/mk_step_h100_table.csv" 2>&1 | tail -12
    rm -f "$E" ;;
  search)   # the table as this GPU's decoder reads it; MK_TUNING set per run (gpu_calls exports the H200 table on an H100)
    H=$(python3 -c 'import torch; from mk_plugin.persistent.tuning_table import tuned_file
print(tuned_file(torch.cuda.get_device_name()))')
    cp "$H" "$out/table_before.json" 2>/dev/null || echo '{"format": 1, "gpu": "none", "entries": []}' > "$out/table_before.json"
    timeout 200 python3 bench/autotune.py --models 1b --batch 1 4 8 10 12 16 --lm-head off --start table --knobs program \
      --rounds 2 --write-tuned --outdir "$out" --cache "$out/search_cache.json" 2>&1 | grep -i "best so far\|no entry"
    timeout 200 python3 bench/autotune.py --models 8b --batch 1 8 16 --lm-head off --start table --knobs program \
      --rounds 2 --write-tuned --outdir "$out" --cache "$out/search_cache.json" 2>&1 | grep -i "best so far\|no entry"
    cp "$H" "$out/"
    # per model folder, the batch sizes whose entry (without the LM head) changed: "MODEL_DIR B1 B2 ..." a line
    python3 - "$out/table_before.json" "$H" > "$out/changed.txt" <<'PY'
import json, sys
from pathlib import Path
from mk_plugin.persistent.encoding import spec_hash
from mk_plugin.spec import LlamaSpec
models = {spec_hash(LlamaSpec.from_json_file(d)): d for d in sorted(Path("bench/models").iterdir())
          if (d / "config.json").exists()}
def entries(p):
    return {(e["key"]["spec_hash"], e["key"]["batch"]): e["tuning"] for e in json.load(open(p))["entries"]
            if not e["key"]["lm_head"]}
a, b = entries(sys.argv[1]), entries(sys.argv[2])
changed = {}
for k in sorted(b):
    if a.get(k) != b[k] and k[0] in models:
        changed.setdefault(models[k[0]], []).append(k[1])
for d, bs in changed.items():
    print(d, *bs)
PY
    cat "$out/changed.txt"
    while read -r m bs; do
      # rounds in ABBA order (session 54: the same program measured "before" then "after" read -0.5..-2.2%), one
      # process per batch size (session 55: a later batch size of one process moved 1.6% with what ran before it)
      for order in "before after" "after before"; do
        for ctx in 512 4096; do
          for tab in $order; do
            if [ $tab = before ]; then TAB=$out/table_before.json; else TAB=$H; fi
            for b in $bs; do
              MK_TUNING=$TAB T=60 step --model "$m" --batch $b --ctx $ctx --no-triton --csv "$out/mk_step_$tab.csv" < /dev/null
            done
          done
        done
      done
    done < "$out/changed.txt" ;;
  h100_check)
    if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then echo "h100_check: not an H100"; exit 2; fi
    R=$PWD/bench/results/session53
    for r in 1 2; do
      MK_TUNING=$R/h100_table_before.json T=60 step --model bench/models/llama-3.2-1b --batch 8 16 --ctx 4096 --no-triton \
        --csv "$out/mk_step_before.csv"
      MK_TUNING=$R/h100_table_with_b8_chunks1.json T=60 step --model bench/models/llama-3.2-1b --batch 8 16 --ctx 4096 \
        --no-triton --csv "$out/mk_step_after.csv"
      MK_TUNING=$R/h100_table_before.json T=60 step --model bench/models/llama-3.2-1b --batch 13 14 15 --no-triton \
        --csv "$out/mk_step_before.csv"
      MK_TUNING= T=60 step --model bench/models/llama-3.2-1b --batch 13 14 15 --no-triton --csv "$out/mk_step_after.csv"
    done ;;
  probe_warps)   # session 55 (bench/NOTES.md: the prediction): does a resident chunk's time follow the per-warp stream?
    for r in 1 2; do
      timeout 240 python3 bench/wgmma_probe.py --grid warps --reps 10 --out "$out/wgmma_probe_warps_r$r.md" \
        --csv "$out/wgmma_probe.csv" 2>&1 | tail -22
    done ;;
  h100_b4_k2)   # session 55's candidate (bench/NOTES.md: the prediction)
    R=$PWD/bench/results/session55
    h100_table_ab "$R/h100_table_before_b4.json" "$R/h100_table_b4_down_k2.json" 70 "3 4 5 6" 4 || exit 2 ;;
  h100_b8_k2)   # session 54's candidate (bench/NOTES.md: predicted b8 -2..-3% at both contexts)
    R=$PWD/bench/results/session54
    h100_table_ab "$R/h100_table_before.json" "$R/h100_table_b8_down_k2.json" 60 "6 8 9" 8 || exit 2 ;;
  h100_b3_5)
    if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then echo "h100_b3_5: not an H100"; exit 2; fi
    python3 -c 'import json, sys
t = json.load(open(sys.argv[1]))
t["entries"] = [e for e in t["entries"] if not (e["key"]["spec_hash"] == 1985708063 and e["key"]["batch"] == 4)]
json.dump(t, open(sys.argv[2], "w"))' "$MK_TUNING" "$out/table_without_1b_b4.json"
    for r in 1 2; do
      MK_TUNING= T=60 step --model bench/models/llama-3.2-1b --batch 3 4 5 --no-triton --csv "$out/mk_step_h100_base.csv"
      T=60 step --model bench/models/llama-3.2-1b --batch 3 4 5 --no-triton --csv "$out/mk_step_h200_b4.csv"
      MK_TUNING=$out/table_without_1b_b4.json T=60 step --model bench/models/llama-3.2-1b --batch 3 4 5 --no-triton \
        --csv "$out/mk_step_b1_program.csv"
    done
    rm -f "$out/table_without_1b_b4.json" ;;
  wga_x)   # the 8B b14..16 entry takes wga_x 2 since session 34 (H100 only), b12 keeps 1; the 1B b16 entry 2
    ab 200 llama-3.1-8b --batch 16 --rounds 2 --build default --build $W,MK_WGA_X=1
    ab 200 llama-3.1-8b --batch 12 --rounds 2 --build default --build $W,MK_WGA_X=2
    ab 150 llama-3.2-1b --batch 16 --rounds 2 --build default --build $W,MK_WGA_X=1 ;;
  lm_head)   # rows megakernel (LM head inside) and megakernel+torch_lm_head, one graph each
    T=200 step --model bench/models/llama-3.1-8b --batch 1 8 16 --lm-head --no-triton
    T=120 step --model bench/models/llama-3.2-1b --batch 1 8 16 --lm-head --no-triton ;;
  kernel_tests)
    timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py tests/test_rstd_epi_gpu.py \
      tests/test_wgmma_a_gpu.py tests/test_ring_mma_gpu.py tests/test_decode_step.py -k "not op_by_op" 2>&1 | tail -8 ;;
  table_tests)
    timeout 450 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_packaged_tables_gpu.py 2>&1 | tail -8 ;;
  sanitize)   # 2 layers, the full model's table program per batch size (sanitize.py --tuning table; before session 38
    # the untuned one). Racecheck under the tool varies run to run (the atomic polls): one program took > 90 s / 37 s at
    # b1 and 11 s / > 200 s at b8 (sessions 34 / 38, H100)
    MK_SAN_TIMEOUT=300 timeout 590 bash bench/sanitize.sh "$out/san_default" 2 2>&1 | grep -E "SUMMARY|exit code" | sort | uniq -c ;;
  sanitize_wga)
    MK_SAN_DEFINES="MK_W_TMA=1 MK_WGMMA_A=4 MK_WGA_X=2" MK_SAN_BATCHES="16 12" MK_SAN_TIMEOUT=120 \
      timeout 300 bash bench/sanitize.sh "$out/san_wga_x2" 2 2>&1 | grep -E "SUMMARY|exit code" | sort | uniq -c ;;
  sanitize_nws)   # MK_WGA_NWS's one-writer norm-weight buffer and its extra warpgroup barrier under racecheck / synccheck
    MK_SAN_DEFINES="MK_W_TMA=1 MK_WGMMA_A=4 MK_WGA_X=2 MK_WGA_NWS=1" MK_SAN_BATCHES="16 9" MK_SAN_TIMEOUT=120 \
      timeout 300 bash bench/sanitize.sh "$out/san_nws" 2 2>&1 | grep -E "SUMMARY|exit code" | sort | uniq -c ;;
  ncu_b1)   # session 29's question: 0.9-1.2 us a resident chunk in the b1 loops for 0.26-0.56 us of MMA instructions
    for m in ${NCU_MODELS:-llama-3.2-1b llama-3.1-8b}; do   # NCU_MODELS=llama-3.2-1b: the 1B step only
      timeout 240 ncu --clock-control none -k regex:mk_decode -s 4 -c 1 --section WarpStateStats \
        --section SourceCounters -o "$out/ncu_${m}_b1" -f python3 bench/mk_step.py --model bench/models/$m \
        --batch 1 --reps 3 --no-triton --define MK_LINEINFO=1 --csv /dev/null > "$out/ncu_${m}_b1_run.log" 2>&1
      echo "ncu $m rc $?"
      # the CUDA page needs the source NVRTC compiled: CuPy's temporary <hash>.cubin.cu is gone by now (session 39's
      # export found nothing), so it is written again under that name (from ncu's own warning) for --source-folders
      mkdir -p "$out/src"
      cu=$(timeout 120 ncu --import "$out/ncu_${m}_b1.ncu-rep" --page source --csv --print-source cuda 2>&1 \
        | grep -o '[0-9a-f]*\.cubin\.cu' | head -1)
      [ -n "$cu" ] && python3 -c 'import sys; from mk_plugin.persistent.runtime import build_source
open(sys.argv[1], "w").write(build_source())' "$out/src/$cu"
      timeout 120 ncu --import "$out/ncu_${m}_b1.ncu-rep" --page source --csv --print-source sass \
        > "$out/ncu_${m}_b1_sass.csv" 2>&1
      # (session 39: one of the two flags found the file -- the export does not say which -- but the plain cuda view had
      # no metric columns; cuda,sass interleaves the source lines with the SASS rows that carry the samples)
      for flag in --resolve-source-file --source-folders; do
        arg="$out/src/$cu"; [ "$flag" = --source-folders ] && arg="$out/src"
        timeout 120 ncu --import "$out/ncu_${m}_b1.ncu-rep" --page source --csv --print-source cuda,sass "$flag" "$arg" \
          > "$out/ncu_${m}_b1_cuda.csv" 2>&1
        grep -qiE "unable to open source|unrecogni|unknown option|invalid option" "$out/ncu_${m}_b1_cuda.csv" || break
      done
      gzip -f "$out/ncu_${m}_b1_sass.csv" "$out/ncu_${m}_b1_cuda.csv"
      rm -rf "$out/src"
      python3 bench/ncu_stalls.py "$out/ncu_${m}_b1_sass.csv.gz" --top 30 --context 3 --fetch \
        --out "$out/ncu_${m}_b1_stalls.md" | head -40
      rm -f "$out/ncu_${m}_b1.ncu-rep"
    done ;;
  trace_1b)   # issue 11's trace PNG and per-op table of the current 1B step (the committed one is from d1c7c62)
    for b in 1 16; do
      timeout 90 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
        --records-dir "$out" --model bench/models/llama-3.2-1b --batch $b 2>&1 | tail -2
    done
    convert_traces ;;
  gate)   # session 35's H100 traces: the ungated releases (o_proj 1.9 us at 1B b1, 4.3 at b16; qkv 1.8, down 1.5)
    G="--build default --build MK_RELEASE_GATE=34 --build MK_RELEASE_GATE=48 --build MK_RELEASE_GATE=50"
    ab 240 llama-3.2-1b --batch 1 8 16 --rounds 2 $G --build MK_RELEASE_GATE=48,MK_GATE_AHEAD=2
    ab 300 llama-3.1-8b --batch 1 16 --rounds 2 $G ;;
  gate_h200)   # the 1B b1 / b16 entries' pair (session 36, H100 only) against the same table without it
    ab_without_gate 150 llama-3.2-1b --batch 1 16 --rounds 2 --build default \
      --build MK_RELEASE_GATE=48,MK_GATE_AHEAD=2 ;;
  b16_gate)   # session 38's H100 traces: at b16 qkv_rope's release takes 1.89 us a task (0.51 at b1), o_proj's 1.79 (0.48):
    # the next task's copies in flight at the fence. 34 / 50 alone lost at 1B b16 in session 36 (+2.3..+2.7%: no head
    # start); with the 2-chunk head start the 1B b16 entry's 48 won -3.2%. The 1B entry keeps its gate_ahead 2, the 8B
    # entry (no gate of its own) gets it named
    # (MK_GATE_AHEAD=1: o_proj's release waits for gate_up's head-start chunks in flight; 1 instead of 2 halves them)
    ab 170 llama-3.2-1b --batch 16 --rounds 2 --build default --build MK_RELEASE_GATE=50 --build MK_RELEASE_GATE=54 \
      --build MK_RELEASE_GATE=114 --build MK_GATE_AHEAD=1
    ab 220 llama-3.1-8b --batch 16 --rounds 2 --build default --build MK_RELEASE_GATE=48,MK_GATE_AHEAD=2 \
      --build MK_RELEASE_GATE=50,MK_GATE_AHEAD=2 --build MK_RELEASE_GATE=114,MK_GATE_AHEAD=2 ;;
  b16_inflight)   # session 39's 8B b16 trace: the x stage costs ~1.5 us a 512-column group in qkv_rope, gate_up and down
    # against 0.5 in o_proj, whose weights are mostly in the ring before it starts: x's cp.async reads wait behind the
    # SM's weight copies in flight (session 21's reading of w_tma at b16, when the cap won). Predicted 8B b16 -2..-5%,
    # 1B b16 -1..-3%, or slower if fewer bytes in flight starve the weight stream (inflight 2 = 64 KB an SM; a table's cap
    # is 1..3, tuning.INFLIGHT_MAX, and session 20 had 2 beat 4 at 8B)
    ab 240 llama-3.1-8b --batch 16 12 --rounds 2 --build default --build MK_INFLIGHT=2 --build MK_INFLIGHT=3
    ab 150 llama-3.2-1b --batch 16 12 --rounds 2 --build default --build MK_INFLIGHT=2 --build MK_INFLIGHT=3 ;;
  b16_ready)   # session 44: is the batch 9..16 x stage (per 512-column group: 1.5 us at 8B b16 on the H100, 0.5 in o_proj,
    # whose weights are in the ring before it starts; the in-flight caps and deeper x prefetch lost) on the step's
    # critical path? Bound: every group after a pass's first skips its copies' wait, normalisation and barrier (wrong
    # results). Predicted (H100): 1B b16 -4..-8%, 8B b16 -3..-7%. Rule: >= 5% at either b16 -> the next
    # design takes x out of the group loop (staged whole per task where the scratch holds it, or multicast); < 2% ->
    # the stage is off the critical path and the b16 bars need the releases or the chunk loops instead
    R=$W,MK_WGA_X=2,MK_DIAG=64
    ab 200 llama-3.1-8b --batch 16 --rounds 2 --build default --build $R
    ab 150 llama-3.2-1b --batch 16 --rounds 2 --build default --build $R
    # which op's stage the bound takes away: the 1B b16 phase trace of both builds (the table's program each)
    for d in "" "--define ${R//,/ --define }"; do
      timeout 90 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 $d --records-dir "$out" \
        --model bench/models/llama-3.2-1b --batch 16 --csv /dev/null 2>&1 | tail -1
    done
    for f in "$out"/*.records.json.gz; do python3 -m mk_plugin.persistent.trace_phases "$f" 2>&1 | sed -n 1,12p; done ;;
  b16_streams)   # session 46 (CPU, the committed 8B b16 traces): qkv_rope / o_proj stream their weights at ~15 GB/s an SM
    # at b16 (qkv ~27 at 8B b1), gate_up / down at ~30 (H200). Is qkv's stream held back by its stage (the consumer
    # frees ring slots at the stage's pace), when b16_ready's bound (MK_DIAG 64) took only 0.7% off the 8B b16 step?
    # The 8B and 1B b16 traces of the table's program and of the bound, with the streams view (trace_phases
    # --streams). Predicted (H100): default qkv 13-17 GB/s an SM; under the bound, if the stage holds the stream,
    # qkv >= 20 GB/s and its busy <= 20 us (8B); if qkv's rate stays within 15%, the ring's turnover is not the stage
    R=$W,MK_WGA_X=2,MK_DIAG=64
    for m in llama-3.1-8b llama-3.2-1b; do
      for d in "" "--define ${R//,/ --define }"; do
        timeout 120 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 $d \
          --records-dir "$out" --model bench/models/$m --batch 16 --csv /dev/null 2>&1 | tail -1
      done
    done
    for f in "$out"/*.records.json.gz; do python3 -m mk_plugin.persistent.trace_phases --streams "$f" 2>&1 | sed -n 1,26p; done ;;
  b16_nw)   # session 46: are the wgmma path's two per-group round trips coupled? A norm-fused op's ready step waits
    # for its x copies (issued one group ahead) and its RET for the next group's norm-weight load (sass_waits.py);
    # session 45's bound (64) removed the first and kept the second, session 33's L1 prefetch of the norm weights the
    # reverse: -0.7 / -1.0% at 8B b16. 128 skips the norm-weight load (timing only), 192 both. Predicted (H100): 64
    # and 128 alone as before (-0.5..-1.5%); 192 -4..-8% at 8B b16, -2..-5% at 1B b16 if each removal alone moves the
    # wait to the other. Rule: 192 >= 4% at 8B b16 and MK_WGA_NWS well short of it -> the copies' wait is what
    # remains (x three groups ahead next); < 2% -> the ready step is off the critical path, and qkv_rope's half-rate
    # stream (NOTES session 46) comes from elsewhere (b16_streams)
    # MK_WGA_NWS (the norm weights by cp.async with the x groups: the real form of 128; bitwise the table's build)
    # beside them, after its GPU test. Predicted: within 1 point of 128 alone (the copies' wait is still there); it
    # becomes the b10..16 entries' knob if >= 2% at 8B b16 in both rounds and no row slower by > 0.5%
    timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_wgmma_a_gpu.py -k nws 2>&1 | tail -4
    ab 280 llama-3.1-8b --batch 16 12 --rounds 2 --build default --build $W,MK_WGA_X=2,MK_DIAG=64 \
      --build $W,MK_WGA_X=2,MK_DIAG=128 --build $W,MK_WGA_X=2,MK_DIAG=192 --build $W,MK_WGA_X=2,MK_WGA_NWS=1
    ab 150 llama-3.2-1b --batch 16 --rounds 2 --build default --build $W,MK_WGA_X=2,MK_DIAG=64 \
      --build $W,MK_WGA_X=2,MK_DIAG=128 --build $W,MK_WGA_X=2,MK_DIAG=192 --build $W,MK_WGA_X=2,MK_WGA_NWS=1 ;;
  nws_tables)   # session 47: the tables' wga_nws entries (1B b16, 8B b10 with wga_x 2, the new 1B b10 = batch 8's program
    # on the wgmma path) against the fp32 reference and Triton, then batch 9..13 at 1B: batch 12 moved from batch 16's entry
    # to batch 10's (nearest), which differs in the gate's mask only (112 against 48): predicted within 1% of each other
    timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_packaged_tables_gpu.py 2>&1 | tail -6
    ab 150 llama-3.2-1b --batch 9 10 11 12 13 --rounds 2 --build default --build MK_RELEASE_GATE=48 ;;
  b16_nws_gate)   # session 47: the 8B b12 / b16 entries with MK_WGA_NWS (-1.1 / -1.8% alone on the H100: under the 2% rule)
    # and with the gate pair too (48 + ahead 2: -0.7% alone at 8B b16, session 39). Predicted (H100) -1.8 and -2.3..-2.8%
    # at b16; the pair enters the b16 entry if >= 2% in both rounds and no row is > 0.5% slower (~120 s)
    ab 200 llama-3.1-8b --batch 16 12 --rounds 2 --build default --build $W,MK_WGA_X=2,MK_WGA_NWS=1 \
      --build $W,MK_WGA_X=2,MK_WGA_NWS=1,MK_RELEASE_GATE=48,MK_GATE_AHEAD=2 ;;
  x_groups)   # session 47: MK_X_GROUPS (x by column groups at every batch; with the tables' rstd_epi the epilogue's rstd)
    # at the batch sizes whose x is staged whole (1B b1..6, 8B b1..2). Why: on the H100 1B b4 (the b8 program, x staged
    # whole, restaged per pass after the wait) took 997 us against b8's 969. Predicted (H100): 1B b3..5 -2..-4% (towards
    # b8's step), b1 / b2 / b6 -1..+1%, 8B b1 / b2 -0.5..+0.5% (x is 3-6% of a task's bytes there). Rule: a per-batch knob
    # (ScheduleTuning.x_groups, to build) where >= 2% in both rounds at a table entry's batch; the traces say where it went
    timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_rstd_epi_gpu.py -k x_groups 2>&1 | tail -4
    ab 200 llama-3.2-1b --batch 1 2 3 4 5 6 --rounds 2 --build default --build MK_X_GROUPS=1 \
      --build MK_X_GROUPS=1,MK_RSTD_EPI=1
    ab 150 llama-3.1-8b --batch 1 2 --rounds 2 --build default --build MK_X_GROUPS=1
    for d in "" "--define MK_X_GROUPS=1"; do
      timeout 60 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 $d \
        --records-dir "$out" --model bench/models/llama-3.2-1b --batch 4 --csv /dev/null 2>&1 | tail -1
    done
    for f in "$out"/*_b4_*.records.json.gz; do python3 -m mk_plugin.persistent.trace_phases "$f" 2>&1 | sed -n 1,12p; done ;;
  xg_tables)   # session 48: the tables' new entries (x_groups at 1B b4 / b8 and a new 8B b2 entry; wga_nws + the gate pair
    # 48 / ahead 2 at 8B b12 / b16) on the GPU tests, then the batch sizes they serve that session 48's A/Bs did not
    # measure, against the table without them: 1B b7 (o_proj's x staged whole; predicted -2..-6% like b6's -8%), 8B b3
    # (o_proj's; predicted -1..-2%) and b4 (nothing staged: the same program, +-0.5%); 8B b11 / 13 / 14 / 15 with the pair
    # (predicted -2..-3% like b12 / b16), and b9 / b10 (the b10 entry + the pair: its candidate). On an H100 also this
    # GPU's own table at 1B b3..5: its b4 entry (att_tma 128 only) against the H200 entry's program with x_groups
    # (predicted -5..-10%). A served batch > 0.5% slower in both rounds takes its entry's change back (~350 s)
    timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_packaged_tables_gpu.py 2>&1 | tail -4
    O=$(edited_table table_before_s48 'd["entries"] = [e for e in d["entries"]
                if not (e["meta"]["spec"] == "llama-3.1-8b" and e["key"]["batch"] == 2)]
for e in d["entries"]:
    e["tuning"].pop("x_groups", None)
    if e["meta"]["spec"] == "llama-3.1-8b" and e["key"]["batch"] in (12, 16):
        for k in ("wga_nws", "release_gate", "gate_ahead"): e["tuning"].pop(k, None)') || exit 1
    MK_TUNING=$O ab 150 llama-3.2-1b --batch 3 5 6 7 8 --rounds 2 --build default --build MK_X_GROUPS=1
    MK_TUNING=$O ab 120 llama-3.1-8b --batch 2 3 4 --rounds 2 --build default --build MK_X_GROUPS=1
    MK_TUNING=$O ab 200 llama-3.1-8b --batch 9 10 11 13 14 15 --rounds 2 --build default \
      --build $W,MK_WGA_X=2,MK_WGA_NWS=1,MK_RELEASE_GATE=48,MK_GATE_AHEAD=2
    rm -f "$O"
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then
      MK_TUNING=$PWD/mk_plugin/persistent/tuned/megakernel_nvidia_h100_80gb_hbm3.json ab 100 llama-3.2-1b --batch 3 4 5 \
        --rounds 2 --build default --build ksplit.down=4,MK_ATT_TMA=128,MK_RELEASE_GATE=112,MK_GATE_AHEAD=2,MK_RSTD_EPI=1,MK_X_GROUPS=1
    fi ;;
  ntiles)   # session 49: MK_NTILES (each batch size's build compiles its own batch class only: at 1B b8 the table's
    # build drops matvec_task<2>, 2962 of ~14.2k SASS instructions, at b16 matvec_task<1>, 3224 of ~21.4k:
    # bench/sass.py).
    # Is code size what made session 48's x_groups build of the same program 1.4% faster at 1B b8? Predicted (H100):
    # 1B b1 / b4 / b8 -1..-2%, b10 / b16 -0.5..-1.5%; MK_WGA_ONLY on top at b10 / b16 (every task on wgmma: b16's build
    # 21.4k -> 13.7k instructions) -1..-2% more. Rule: the default (variant_for) where >= 1% in both rounds at every
    # batch measured and nothing slower. MK_X_WHOLE at b1 (every x staged whole: the column-group path out too, 1B b1's
    # build 14.0k -> 8.9k) -1..-2% more. The A/Bs first (mk_ab checks every build's step against the first's before
    # timing), the GPU test last (bitwise against the default build, the other class's build refused)
    ab 100 llama-3.2-1b --batch 1 --rounds 2 --build default --build MK_NTILES=1 --build MK_NTILES=1,MK_X_WHOLE=1
    ab 100 llama-3.2-1b --batch 16 --rounds 2 --build default --build MK_NTILES=1 --build MK_NTILES=1,MK_WGA_ONLY=1
    ab 80 llama-3.2-1b --batch 8 --rounds 2 --build default --build MK_NTILES=1
    timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_rstd_epi_gpu.py -k ntiles 2>&1 | tail -4
    [ -n "${NTILES_MORE:-}" ] && ab 120 llama-3.2-1b --batch 4 10 --rounds 2 --build default --build MK_NTILES=1 ;;
  ntiles_8b)   # the same at 8B (predicted -0.3..-1%: longer tasks), and xg_wide's 1B half (see there)
    ab 120 llama-3.1-8b --batch 1 --rounds 2 --build default --build MK_NTILES=1 --build MK_NTILES=1,MK_X_WHOLE=1
    ab 100 llama-3.1-8b --batch 8 --rounds 2 --build default --build MK_NTILES=1
    ab 150 llama-3.1-8b --batch 16 --rounds 2 --build default --build MK_NTILES=1 --build MK_NTILES=1,MK_WGA_ONLY=1
    ab 150 llama-3.2-1b --batch 8 10 16 --rounds 2 --build default --build MK_X_GROUPS=1 ;;
  xg_wide)   # session 48: xg_tables measured the x_groups build -1.4% at 1B b8 and -0.7% at 8B b4, where no op's x is staged
    # whole (the same program, bitwise; 167 against 168 registers, no spills either way): is the build without the
    # whole-x code faster at the batch sizes above too? Predicted 1B b8 -1..-1.5%, 8B b8 -0.5..-1%, the wgmma batch
    # sizes (1B b10 / b16, 8B b10 / b16) +-0.5%. Rule: x_groups into an entry where >= 2% in both rounds at its batch
    ab 150 llama-3.2-1b --batch 8 10 16 --rounds 2 --build default --build MK_X_GROUPS=1
    ab 200 llama-3.1-8b --batch 1 8 10 16 --rounds 2 --build default --build MK_X_GROUPS=1 ;;
  b1_inflight)   # session 38's H100 b1 trace: qkv_rope's stage 2.19 us at the shortest producer leads, 1.63 at the
    # longest (x's 4 KB load behind the SM's weight copies in flight). Predicted -0.5..-1.5% at b1, 0..-1% at b4
    ab 150 llama-3.2-1b --batch 1 4 --rounds 2 --build default --build MK_INFLIGHT=2 --build MK_INFLIGHT=3 ;;
  release_coresident)   # predicted: per SM (6 near 5, far above 7); if 6 is near 7, the fence is per CTA
    timeout 150 python3 bench/release_probe.py --modes 0,7 --stream 0,2,1,5,6,7 --iters 1000 --reps 5 \
      --csv "$out/release_probe_v3.csv" --out "$out/release_probe_coresident.md" | tail -14 ;;
  release_prefetch)   # stream 2 = the others copy; 4 = that plus the two ping-pong SMs' own prefetches in flight
    timeout 150 python3 bench/release_probe.py --modes 0,7 --stream 0,2,4,3 --pace-ns 1000,250 --iters 1000 --reps 5 \
      --out "$out/release_prefetch.md" --csv "$out/release_probe_v3.csv" | tail -16 ;;
  l2_window)   # session 40: is gate_up's weight stream past its first chunks worth prefetching into L2 during the
    # chain (by SMs with no release to make)? The bound: those chunks folded onto an L2-resident region (wrong results).
    # Predicted on the H100 at 1B b1: N = 6 -7..-9% against the w_tma + cap build, N = 14 -15..-20%; the rule: a
    # dedicated-SM prefetch is built only if N = 6 beats the table's program (default) by >= 4% in both rounds
    F="MK_W_TMA=1,MK_INFLIGHT=2"
    ab 240 llama-3.2-1b --batch 1 --rounds 2 --build default --build $F --build $F,MK_DIAG=32 \
      --build $F,MK_DIAG=32,MK_DIAG_L2_FROM=2,MK_DIAG_L2_N=3 --build $F,MK_DIAG=32,MK_DIAG_L2_FROM=2,MK_DIAG_L2_N=6 \
      --build $F,MK_DIAG=32,MK_DIAG_L2_FROM=2,MK_DIAG_L2_N=14 ;;
  cluster_probe)   # session 41: does a hand-off inside a cluster escape the release fence's drain? Predicted (H100):
    # modes 0 / 1 identical (same SASS), idle 1.2-1.9 us, all streaming 15-25 us; mode 2 (MEMBAR kept) 60-80% of mode 0;
    # mode 3 (st.async) idle 0.4-0.8 us and <= 1.5 us streaming; mode 4 (TMA) near idle with the two not streaming, 2-6
    # us behind their own copies. Rule: mode 3 at 4 KB, all streaming, <= 2 us -> the chain-in-a-cluster design
    timeout 170 python3 bench/cluster_probe.py --stream 0,2,1 --words 64,1024 --iters 1000 --reps 5 \
      --csv "$out/cluster_probe.csv" --out "$out/cluster_probe.md" | tail -36 ;;
  cluster_residency)   # session 41: can the persistent grid be clusters of 8 / 16 CTAs (one per SM), all co-resident?
    timeout 60 python3 bench/cluster_probe.py --residency 8,16 --out "$out/cluster_residency.md" | tail -8 ;;
  cluster_allgather)   # session 41: the chain-in-a-cluster design's hand-off is an all-gather among 8 CTAs (a KV
    # group's q / k / v rows to its attention chunks, the chunks' (m, l, o) to every CTA). Predicted (H100): 256-B
    # slices idle 1.0-1.3 us a round (1:1 at 256 B: 0.63), the other clusters streaming 1.3-2, all streaming ~3
    timeout 60 python3 bench/cluster_probe.py --residency 2,4 --out "$out/cluster_residency_2_4.md" | grep -E "^\| [0-9]" | cut -c1-120
    timeout 90 python3 bench/cluster_probe.py --allgather --stream 0,2,1 --words 16,64,128 --iters 1000 --reps 5 \
      --csv "$out/cluster_probe.csv" --out "$out/cluster_allgather.md" | tail -14
    timeout 90 python3 bench/cluster_probe.py --modes 0,3 --stream 0,2,1 --words 16,64,128 --iters 1000 --reps 5 \
      --csv "$out/cluster_probe.csv" --out "$out/cluster_pingpong_small.md" | tail -22 ;;
  l2_diag)   # the step with its weights in L2 (bound on parking them there), between w_tma and no weight copies
    D="--build MK_W_TMA=1 --build MK_W_TMA=1,MK_DIAG=32 --build MK_W_TMA=1,MK_DIAG=2"
    ab 200 llama-3.2-1b --batch 1 8 16 --rounds 2 $D
    ab 250 llama-3.1-8b --batch 1 16 --rounds 2 $D ;;
  l2_probe)   # can weights parked in L2 reach an SM's ring faster than from HBM, with the tiled copy (MK_W_TMA's)?
    cp bench/results/bulk_probe.csv "$out/bulk_probe_before.csv"
    timeout 60 python3 bench/bulk_probe.py --gb 1.0 --reps 5 --out "$out/bulk_probe_hbm.md" | tail -1
    for gb in 0.018 0.035 0.052; do
      timeout 40 python3 bench/bulk_probe.py --gb $gb --passes 40 --reps 5 --out "$out/bulk_probe_l2_$gb.md" | tail -1
    done
    diff "$out/bulk_probe_before.csv" bench/results/bulk_probe.csv | sed -n 's/^> //p' > "$out/bulk_probe_new_rows.csv"
    cp bench/results/bulk_probe_l2.csv "$out/"; rm -f "$out/bulk_probe_before.csv"
    grep -hE "^\| (per-row|tiled) \| (512|1024) \|" "$out"/bulk_probe_*.md | cut -c1-150 ;;
  part0|part1) copy_parts; ls /root/parts ;;
  tbt_8b) vllm_env
    timeout 590 python3 bench/tbt.py --models llama-3.1-8b --batches 1,8 --prompts 512 \
      --modes megakernel,megakernel+MK_LM_HEAD=megakernel --rounds 2 --runs 1 --outdir "$out" 2>&1 \
      | grep -v "^(EngineCore" | grep -v "^\[tbt\]   worker" | tail -30
    rm -rf "$out/logs" ;;
  tbt_auto_8b) vllm_env
    timeout 590 python3 bench/tbt.py --models llama-3.1-8b --batches 1,4,8,16 --prompts 512 --modes auto --rounds 2 \
      --runs 1 --outdir "$out" 2>&1 | grep -v "^(EngineCore" | grep -v "^\[tbt\]   worker" | tail -30
    tar czf "$out/logs_tbt_auto_8b.tgz" -C "$out" logs 2>/dev/null; rm -rf "$out/logs" ;;
  tbt_auto_8b_long) vllm_env
    timeout 590 python3 bench/tbt.py --models llama-3.1-8b --batches 8,16 --prompts 2048,8192 --modes auto --rounds 2 \
      --runs 1 --outdir "$out" 2>&1 | grep -v "^(EngineCore" | grep -v "^\[tbt\]   worker" | tail -30
    tar czf "$out/logs_tbt_auto_8b_long.tgz" -C "$out" logs 2>/dev/null; rm -rf "$out/logs" ;;
  correctness) vllm_env
    timeout 580 python3 bench/vllm_correctness.py --parts b,c --models llama-3.2-1b --mode megakernel \
      --mk-env MK_LM_HEAD=megakernel --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16
    # its 8-10 child logs in one archive: a run returns at most 8 files (session 37 lost part c's batch-4 truth log)
    rm -f "$out"/logs/*payload*; tar czf "$out/logs_correctness.tgz" -C "$out" logs && rm -rf "$out/logs" ;;
  serve_1b) vllm_env && serve_auto llama-3.2-1b --rounds 2 && tar czf "$out/logs_serve_1b.tgz" -C "$out" logs && rm -rf "$out/logs" ;;
  serve_8b) vllm_env && serve_auto llama-3.1-8b; rm -rf "$out/logs" ;;
  tbt_1layer) vllm_env && tbt_1layer_profiled tbt_1layer ;;
  soak_engines) vllm_env && soak megakernel --engines-only ;;
  soak) vllm_env && soak megakernel ;;
  *) echo "no call $n here (see the list at the top of bench/gpu_calls.sh)" ;;
esac
} 2>&1 | tee "$out/gpu_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
# A run returns at most 8 files (the device tool; session 35 lost the b1 trace's PNG and records to it): past 8 in
# $out, everything but the logs and earlier packs goes into one archive (tar xzf it here after the run).
pack=$(cd "$out" && find . -maxdepth 1 -type f ! -name '*.log' ! -name 'packed_*.tgz' -printf '%f\n' | sort)
if [ "$(find "$out" -maxdepth 1 -type f | wc -l)" -gt 8 ] && [ -n "$pack" ]; then
  (cd "$out" && printf '%s\n' "$pack" | tar czf "packed_${n}.tgz" -T - && printf '%s\n' "$pack" | xargs rm -f)
  echo "packed $(printf '%s\n' "$pack" | wc -l) files into $out/packed_${n}.tgz"
fi
