#!/usr/bin/env bash
# Session 5's GPU calls (bench/NOTES.md "Session 5"), no vLLM needed. Run from the project root on the
# GPU host with .commit carried; output under $2.
#   call 2: the gpu tests on the new kernel, then mk_step at 1B batch 1/4/8/16 (Triton alongside)
#   call 3: mk_step at 8B batch 1/8 and 1B at ctx 4096, the DIAG decomposition again, a 1B batch-8 trace
set -uo pipefail
n=${1:?call number}; out=${2:?outdir}; mkdir -p "$out"
STEP_T=240; source bench/gpu_lib.sh   # header line, step() (240 s here), vllm_env()
case $n in
  2) timeout 420 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       tests/test_decode_step.py 2>&1 | tail -6
     step --batch 1 4 8 16 ;;
  3) # attention change (block table staged, 4 load steps in flight): the kernel tests again
     timeout 300 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "vs_vm or whole_step or graph" 2>&1 | tail -4
     # why batch 1 got slower at d3a556f: back-to-back polls vs sleeping ones, matvec out of line vs inlined
     for v in "" "--define MK_SPIN_POLLS=0" "--define MK_MATVEC_INLINE=1" "--define MK_SPIN_POLLS=0 --define MK_MATVEC_INLINE=1"; do
       echo "== variant: ${v:-default}"; step --batch 1 8 --no-triton $v; done
     step --batch 1 8 16
     T=300 step --model bench/models/llama-3.1-8b --batch 1 8
     step --batch 1 8 --ctx 4096 ;;
  4) # by-value matvec_task (no local-memory reloads in the chunk loop): tests, then the measured table
     timeout 300 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "vs_vm or whole_step or graph or watchdog" 2>&1 | tail -4
     for v in "" "--define MK_MATVEC_INLINE=1"; do
       echo "== variant: ${v:-default}"; step --batch 1 8 --no-triton $v; done
     step --batch 1 4 8 16
     T=300 step --model bench/models/llama-3.1-8b --batch 1 8
     for b in 1 8; do timeout 120 python3 bench/mk_step.py --batch $b --no-triton --trace --records-dir "$out" \
       --csv /dev/null 2>&1 | grep -E "^\| (qkv|attn|o_proj|gate|down|total)|traced step"; done ;;
  5) # the autotuner on the new kernel (1B, no LM head: the vLLM path), one batch per run (each merges
     # into the tables), then the sanitizers and the step with the tuned tables vs MK_TUNING=off
     for b in 1 8 16; do timeout 170 python3 bench/autotune.py --models 1b --batch $b --lm-head off --rounds 1 \
       --reps 100 --write-tuned --outdir "$out/b$b" 2>&1 | grep -E "best|winner|tuning table|Error" | tail -3; done
     cp mk_plugin/persistent/tuned/megakernel_*.json "$out/" 2>/dev/null
     MK_SAN_TIMEOUT=120 bash bench/sanitize.sh "$out" 16 2>&1 | grep -E "SUMMARY|exit code" | head -12
     step --batch 1 4 8 16
     MK_TUNING=off step --batch 1 4 8 16 --no-triton ;;
  6) # racecheck at batch 16 (cut at 120 s in call 5) and a batch-16 trace for the next session's analysis
     MK_SAN_BATCHES=16 MK_SAN_TIMEOUT=240 bash bench/sanitize.sh "$out" 16 2>&1 | grep -E "SUMMARY|exit code" | head -8
     timeout 120 python3 bench/mk_step.py --batch 16 --no-triton --trace --records-dir "$out" --csv /dev/null 2>&1 \
       | grep -E "^\| (qkv|attn|o_proj|gate|down|total)|traced step" ;;
esac
