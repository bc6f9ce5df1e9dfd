#!/usr/bin/env bash
# The next GPU session's calls (bench/NOTES.md session 12, "Next"). Run from the project root on the GPU host
# with .commit carried; output under $2 (default $OUT). Back to back, no edits and no helper sessions between
# calls (the machine goes cold after ~30 s idle and loses the vLLM bundle). 1 (MK_GROUP_DEPTH: gpu tests of
# the default and the 3-deep build, A/B at 1B and 8B, phase trace; ~6 min), 2 (Nsight Compute's stall
# samples of the 1B batch-16 and batch-1 steps, summarised by bench/ncu_stalls.py, ~5 min), then
# gpu_session13.sh's vLLM calls 11, 12, 13 (bundle), 17 (serve 1B auto), 18 (soak) or 16 (one-layer model)
# as the time allows.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11, batch 8..16: activation column groups in flight (MK_GROUP_DEPTH; depth 3 needs 5 ring stages,
     # 5 needs 4; MK_NUM_STAGES=5 alone is the control). Predicted at 1B batch 16: down's chunk phase 19 -> ~10
     # us per task, -140 us per step; batch 8 -60 us; batch 1 (x staged whole) nothing (NOTES session 12)
     timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py 2>&1 | tail -1
     timeout 120 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "vs_vm or whole_step" --mk-define MK_NUM_STAGES=5 --mk-define MK_GROUP_DEPTH=3 2>&1 | tail -1
     for m in "llama-3.2-1b 1b 3" "llama-3.1-8b 8b 2"; do set -- $m
       timeout 200 python3 bench/mk_ab.py --model bench/models/$1 --group $2 --batch 1 8 16 --rounds $3 \
         --build default --build MK_NUM_STAGES=5 --build MK_NUM_STAGES=5,MK_GROUP_DEPTH=3 \
         --build MK_NUM_STAGES=4,MK_GROUP_DEPTH=5; done
     timeout 90 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
       --define MK_NUM_STAGES=5 --define MK_GROUP_DEPTH=3 --records-dir "$out" --model bench/models/llama-3.2-1b \
       --batch 16 2>&1 | tail -12 ;;
  2) # issue 11: where the consumers of a batch-16 down task spend ~0.9 us per column-group part (session 12)
     for b in 16 1; do
       timeout 240 ncu --clock-control none -k regex:mk_decode -s 4 -c 1 --section WarpStateStats \
         --section SourceCounters -o "$out/ncu_1b_b$b" -f python3 bench/mk_step.py --model bench/models/llama-3.2-1b \
         --batch $b --reps 3 --no-triton --csv /dev/null > "$out/ncu_1b_b${b}_run.log" 2>&1; echo "ncu b$b rc $?"
       timeout 120 ncu --import "$out/ncu_1b_b$b.ncu-rep" --page source --csv --print-source sass \
         > "$out/ncu_1b_b${b}_source.csv" 2>&1
       gzip -f "$out/ncu_1b_b${b}_source.csv"
       python3 bench/ncu_stalls.py "$out/ncu_1b_b${b}_source.csv.gz" --top 30 --context 3 \
         --out "$out/ncu_1b_b${b}_stalls.md" | head -45
       rm -f "$out/ncu_1b_b$b.ncu-rep"
     done ;;
  *) echo "no call $n here: see bench/gpu_session13.sh" ;;
esac
} 2>&1 | tee "$out/gpu_s15_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
