#!/usr/bin/env bash
# Session 32's GPU calls once a machine came (late, after failed starts): the kernel A/Bs of gpu_session39.sh 1 and
# 10 folded into fewer calls (one default build timed per model instead of one per call); the release gate stays
# gpu_session39.sh 12. `bash
# bench/gpu_session40.sh N $OUT` from the project root, .commit carried. On an H100, export
# MK_TUNING=$PWD/mk_plugin/persistent/tuned/megakernel_nvidia_h200.json first (the table is keyed by model, batch and
# 132 SMs; its file by GPU name), so that the builds run the H200 table's tunings there too.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11, kernel A/B, 2 alternated rounds on the table's tunings: MK_FALLTHROUGH (session 32) and MK_NW_L1
     # (session 31) at b1 / 8 / 16; then MK_WGA_X=2 (session 30) at b16 (its build keeps its own wga_x)
     W=MK_W_TMA=1,MK_WGMMA_A=4
     for m in llama-3.2-1b llama-3.1-8b; do
       timeout 220 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/$m --group "$m" \
         --batch 1 8 16 --rounds 2 --build default --build MK_FALLTHROUGH=1 --build MK_NW_L1=1
     done
     for m in llama-3.1-8b llama-3.2-1b; do
       timeout 150 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/$m --group "$m" \
         --batch 16 --rounds 2 --build default --build $W,MK_WGA_X=2
     done ;;
  2) # the GPU tests of the switches: MK_FALLTHROUGH bitwise the build without it (and the watchdog through its
     # out-of-line wait), MK_NW_L1 bitwise, MK_WGA_X's tests
     timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fallthrough_gpu.py 2>&1 | tail -4
     timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py -k watchdog \
       --mk-define MK_FALLTHROUGH=1 2>&1 | tail -2
     timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_wgmma_a_gpu.py -k "nw_l1 or wga_x" 2>&1 \
       | tail -4 ;;
  3) # a short device budget: MK_FALLTHROUGH alone (its rule's shapes: 1B b1 and no shape slower), 2 rounds, then its
     # bitwise test at 1B
     for m in llama-3.2-1b llama-3.1-8b; do
       timeout 160 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/$m --group "$m" \
         --batch 1 8 --rounds 2 --build default --build MK_FALLTHROUGH=1
     done
     timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fallthrough_gpu.py -k "1b" 2>&1 | tail -3 ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s40_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
