#!/usr/bin/env bash
# Session 7's second machine (bench/NOTES.md session 7): the new default kernel (merge in the last
# partial, residuals loaded early) verified and measured at one commit, then the real client. Run from the
# project root on the GPU host with .commit carried; output under $2 (default $OUT). Calls 2 and 3 carry
# bundle parts 0 and 1; call 4 carries part 2 and .gpuhost/unpack.sh. Run in the order 1, 5, 2, 3, 4.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # gpu tests of the new defaults, the step tables (both paths, one job), traced 1B steps
     timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "merge or vs_vm or whole_step" 2>&1 | tail -3
     step --batch 1 4 8 16
     T=240 step --model bench/models/llama-3.1-8b --batch 1 8
     # the traced steps (per-op table, records for the PNG) of the phase-stamping build: where a ready
     # matvec task's time goes (staging / chunks / reduction+epilogue)
     timeout 150 python3 bench/mk_step.py --reps 20 --batch 1 8 --no-triton --trace --records-dir "$out/records" \
       --define MK_TRACE_PHASES=1 2>&1 | grep -v "^tuning" | tail -44 ;;
  5) # the release's cost per task (ph_release), then the same without weight copies (MK_DIAG=2: timing
     # only, wrong results): does the signal's fence wait on the SM's in-flight weight loads?
     for d in "" "--define MK_DIAG=2"; do
       echo "== phases ${d:-with weights}"
       timeout 150 python3 bench/mk_step.py --reps 20 --batch 1 8 --no-triton --trace --records-dir "$out/records" \
         --define MK_TRACE_PHASES=1 $d 2>&1 | grep -v "^tuning" | grep -A12 "median per task"; done ;;
  2|3) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  4) vllm_env   # issue 12: the real client, 8B (stock, triton = the default mode, megakernel)
     timeout 420 python3 bench/serve.py --models llama-3.1-8b --modes triton,megakernel --concurrency 1,8,16 \
       --prompts 32 --outdir "$out" 2>&1 | grep -v "^(APIServer" | tail -24 ;;
esac
} 2>&1 | tee "$out/gpu_s8_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
