#!/usr/bin/env bash
# Session 29's verification call (bench/NOTES.md session 29): the packaged table with MK_RSTD_EPI (1B batch 3..16,
# 8B batch 1..9) and MK_WGMMA_A = 4 (8B batch 10..16) as per-batch knobs. `bash bench/gpu_session36.sh N $OUT` from
# the project root, .commit carried.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11: both paths, the new table, every batch the issue names and 8B batch 9..12 (the entries' seams); the
     # op-by-op tests (each op from the GPU's own state, session 29) and the table's programs against the default;
     # ctx 4096 last (the device budget may end the call first)
     T=100 step --model bench/models/llama-3.2-1b --batch 1 4 8 16
     T=150 step --model bench/models/llama-3.1-8b --batch 1 8 9 10 11 12 16
     timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py tests/test_ring_mma_gpu.py \
       tests/test_wgmma_a_gpu.py -k "op_by_op or tuned_programs" 2>&1 | tail -8
     T=150 step --model bench/models/llama-3.1-8b --batch 1 8 16 --ctx 4096
     T=100 step --model bench/models/llama-3.2-1b --batch 1 8 16 --ctx 4096 ;;
  2) # the rest of the kernel GPU tests on the new table (session 23: the whole kernel suite took 478 s)
     timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py tests/test_rstd_epi_gpu.py \
       tests/test_wgmma_a_gpu.py tests/test_ring_mma_gpu.py tests/test_decode_step.py -k "not op_by_op" 2>&1 | tail -8 ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s36_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
