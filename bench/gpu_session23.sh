#!/usr/bin/env bash
# Session 18's GPU calls (bench/NOTES.md session 17, "Next"). Run from the project root on the GPU host with
# .commit carried; output under $2 (default $OUT). The vLLM calls: move bench/results/**/*.gz aside first (the
# tracked tree plus one bundle part is over the run tool's 64 MiB), then 11, 12 of gpu_session22.sh (parts 0/1),
# then 5 here with part.2 and unpack.sh.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11: MK_ATT_TMA's unfinished racecheck at batch 8 (session 17: past 100 s). Its ctx-512 A/B with
     # chunks=8 already ran (session 17's last call: +3/+5/+86 us at b1/b2/b4): not repeated here
     MK_SAN_DEFINES="MK_ATT_TMA=1" MK_SAN_BATCHES="8" MK_SAN_TIMEOUT=300 timeout 320 bash bench/sanitize.sh "$out" 2 \
       2>&1 | grep -E "SUMMARY|exit code" ;;
  5) vllm_env   # issue 13: the Triton mode's 2,000-request soak, engines first (kept in /root/soak_work) ...
     soak_triton --engines-only ;;
  6) vllm_env   # ... then the fp32 verdict over the same engines' outputs (stock control included)
     soak_triton ;;
  *) echo "no call $n here: see bench/gpu_session22.sh" ;;
esac
} 2>&1 | tee "$out/gpu_s23_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
