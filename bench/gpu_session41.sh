#!/usr/bin/env bash
# Session 34's GPU calls (bench/NOTES.md session 33, "Next"). `bash bench/gpu_session41.sh N $OUT` from the project
# root, .commit carried. On an H100, export MK_TUNING=$PWD/mk_plugin/persistent/tuned/megakernel_nvidia_h200.json
# first (the table file is per GPU name, its keys per model, batch and 132 SMs). Order: 1, 2, then gpu_session39.sh 6,
# gpu_session36.sh 2, the vLLM calls (gpu_session38.sh 11 / 12 for the bundle parts, gpu_session39.sh 7 with the
# third part and unpack.sh, 39's 8), then 39's 9 (ncu), 38's 5 (sanitizers), 38's 3 / 4 (serve) as the budget allows.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11: both paths on the session-33 kernel (the chunk-loop layout, 1B b16's wga_x 2; measured on an H100
     # only), every batch the issue names, ctx 512 then 4096; the op-by-op tests on the table's programs
     T=100 step --model bench/models/llama-3.2-1b --batch 1 4 8 16
     T=150 step --model bench/models/llama-3.1-8b --batch 1 8 16
     timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py tests/test_ring_mma_gpu.py \
       tests/test_wgmma_a_gpu.py -k "op_by_op or tuned_programs" 2>&1 | tail -8
     T=150 step --model bench/models/llama-3.1-8b --batch 1 8 16 --ctx 4096
     T=100 step --model bench/models/llama-3.2-1b --batch 1 8 16 --ctx 4096 ;;
  2) # issue 11: MK_WGA_X=2 at 8B b12 / b16 against the table's wga_x 1 entries on the H200 (session 33's H100: b16
     # -1.9% in both rounds, under the 2% bar), 2 alternated rounds; 1B b16 (the entry takes 2 since session 33)
     # against wga_x 1, the other way round
     W=MK_W_TMA=1,MK_WGMMA_A=4
     timeout 200 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group llama-3.1-8b \
       --batch 12 16 --rounds 2 --build default --build $W,MK_WGA_X=2
     timeout 150 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group llama-3.2-1b \
       --batch 16 --rounds 2 --build default --build $W,MK_WGA_X=1 ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s41_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
