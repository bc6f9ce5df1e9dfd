#!/usr/bin/env bash
# The next GPU session's calls (bench/NOTES.md session 13, "Next"). Run from the project root on the GPU host
# with .commit carried; output under $2 (default $OUT). Back to back, no edits between calls. 1 (both paths
# at the packaged table's K-split winners, rows to mk_step.csv; ~4 min), then the vLLM bundle (gpu_session13.sh
# 11, 12, 13) and gpu_session13.sh 18 (the soak with the fixed fp32 child), 15 (8B tbt) as time allows.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11: megakernel and Triton in one job with the tuned table (1B batch 5..16 and 8B 13..16 K-split)
     timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py 2>&1 | tail -3
     step --model bench/models/llama-3.2-1b --batch 1 4 8 12 16
     T=240 step --model bench/models/llama-3.1-8b --batch 1 8 12 16 ;;
  *) echo "no call $n here: see bench/gpu_session13.sh" ;;
esac
} 2>&1 | tee "$out/gpu_s17_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
