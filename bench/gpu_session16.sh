#!/usr/bin/env bash
# Session 13's second GPU call (bench/NOTES.md session 13): o_proj/down cut over K (tuning.ksplit). Run from
# the project root on the GPU host with .commit carried; output under $2 (default $OUT). ~6 min.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11, batch 8..16: a one-unit down task at batch 16 reads as many activation bytes as weight bytes
     # (256 KB each) and builds 16 fragment groups for 16 rows; cut over K in 4 parts a task holds 4 units x
     # 2048 columns: 64 KB of x for the same 256 KB of weights. Predicted at 1B batch 16: down's chunk phase
     # 19 -> ~8 us per task (+~1.5 us merge), -150 us per step; batch 8 -50; batch 1 +0..+20 (the merge's
     # round trip on the chain, nothing to gain: x staged whole). 8B batch 16 -150..-300 (NOTES session 13)
     timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py 2>&1 | tail -3
     timeout 120 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 2 \
       --build default --build ksplit.down=4 --build ksplit.down=2 --build ksplit.down=4,ksplit.o_proj=2
     timeout 150 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 1 8 16 --rounds 2 \
       --build default --build ksplit.down=2 --build ksplit.down=4 --build ksplit.down=2,ksplit.o_proj=2
     timeout 50 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
       --ksplit down=4 --records-dir "$out" --model bench/models/llama-3.2-1b --batch 16 2>&1 | tail -12 ;;
  *) echo "no call $n here: see bench/gpu_session13.sh" ;;
esac
} 2>&1 | tee "$out/gpu_s16_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
