#!/usr/bin/env bash
# The next GPU session's calls (bench/NOTES.md session 12, "Next"). Run from the project root on the GPU host
# with .commit carried; output under $2 (default $OUT). Back to back, no edits and no helper sessions between
# calls (the machine goes cold after ~30 s idle and loses the vLLM bundle). 1 (Nsight Compute's stall
# samples of the 1B batch-16 and batch-1 steps, summarised by bench/ncu_stalls.py, ~5 min), 2 (the megakernel
# gpu tests, ~1 min), then gpu_session13.sh's vLLM calls 11, 12, 13 (bundle), 17 (serve 1B auto), 18 (soak)
# or 16 (one-layer model) as the time allows.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11: where the consumers of a batch-16 down task spend ~0.9 us per column-group part (session 12)
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
  2) timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py 2>&1 | tail -3 ;;
  *) echo "no call $n here: see bench/gpu_session13.sh" ;;
esac
} 2>&1 | tee "$out/gpu_s15_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
