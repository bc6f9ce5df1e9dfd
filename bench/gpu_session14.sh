#!/usr/bin/env bash
# Session 12's GPU calls (bench/NOTES.md session 12; MK_MT_SPLIT and MK_RSTD_ROWS measured slower and
# removed after them: this script is their record and no longer builds). Run from the project root on the GPU host with .commit
# carried; output under $2 (default $OUT). Back to back, no edits and no helper sessions between calls.
# 1 (MK_MT_SPLIT and MK_RSTD_ROWS: gpu tests with both, A/B at 1B and 8B batch 1/8/16, phase trace),
# 2 (every test of tests/test_persistent_gpu.py on the default build), then gpu_session13.sh's vLLM calls
# (11, 12, 13, 15) as the time allows. A/B tables: python bench/ab_table.py LOG.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11, batch 16: the norm statistics' round trips (qkv/gate_up entry 2.6 us per task at 1B batch 16)
     # and down/o_proj's single M-tile (down chunk phase 19 us per task for 8 us of bytes); NOTES session 12
     timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "vs_vm or whole_step" --mk-define MK_MT_SPLIT=1 --mk-define MK_RSTD_ROWS=16 2>&1 | tail -1
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 3 \
       --build default --build MK_MT_SPLIT=1 --build MK_RSTD_ROWS=8 --build MK_RSTD_ROWS=16 \
       --build MK_MT_SPLIT=1,MK_RSTD_ROWS=16
     # (8B: 16 rows per round spill, 8 do not)
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 1 8 16 --rounds 2 \
       --build default --build MK_MT_SPLIT=1 --build MK_RSTD_ROWS=8 --build MK_MT_SPLIT=1,MK_RSTD_ROWS=8
     timeout 90 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
       --define MK_MT_SPLIT=1 --define MK_RSTD_ROWS=16 --records-dir "$out" --model bench/models/llama-3.2-1b \
       --batch 16 2>&1 | tail -12 ;;
  2) # every megakernel gpu test on the default build (session 12's all-tests call ran out of time in the
     # Triton op tests before reaching these)
     timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py 2>&1 | tail -3 ;;
  *) echo "no call $n here: see bench/gpu_session13.sh" ;;
esac
} 2>&1 | tee "$out/gpu_s14_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
