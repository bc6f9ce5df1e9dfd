#!/usr/bin/env bash
# The next GPU session's calls (bench/NOTES.md session 8, "Next"). Run from the project root on the GPU
# host with .commit carried; output under $2 (default $OUT). Order: 1, 2, then gpu_session9.sh's vLLM
# calls 2, 3, 4 (bundle parts; 4 = serve.py 8B megakernel), 5 (1B), 6 (soak), 7 (tbt rounds) as the
# device time allows (~30 min in all: cut 7, then 6).
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # the gate's shared word: 0 volatile (racecheck hazards), 1 atomics (the default), 2 ld/st.relaxed.cta
     # (racecheck?), alternated over two rounds in one job (8B batch 1 was ~50 us apart across jobs), then
     # racecheck at batch 1 with room to finish (150 s cut it in session 8) on the default
     for r in 1 2; do
       for v in 0 1 2; do
         echo "== round $r: MK_GATE_WORD=$v"; step --batch 1 8 --no-triton --define MK_GATE_WORD=$v
         T=240 step --model bench/models/llama-3.1-8b --batch 1 8 --no-triton --define MK_GATE_WORD=$v; done; done
     MK_SAN_BATCHES="1" MK_SAN_TIMEOUT=300 bash bench/sanitize.sh "$out" 16 2>&1 | grep -E "SUMMARY|exit code" | head -6 ;;
  2) # the autotuner on the gated kernel where the gap is largest (8B batch 16: 1.50x Triton; 1B batch 16:
     # 1.33x): task splits, attention chunks, ring depth
     timeout 560 python3 bench/autotune.py --models 8b 1b --batch 16 --lm-head off --rounds 1 --reps 50 \
       --outdir "$out" 2>&1 | grep -E "^\| llama|Winners" | head -12 ;;
  *) bash bench/gpu_session9.sh "$n" "$out" ;;
esac
} 2>&1 | tee "$out/gpu_s10_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
