#!/usr/bin/env bash
# Session 31's GPU calls (bench/NOTES.md session 30, "Next"). `bash bench/gpu_session38.sh N $OUT` from the project
# root, .commit carried. Order: 1, 2, then `bash bench/gpu_session36.sh 1` (both paths on the new table), 5, then the vLLM
# calls 11, 12 (one bundle part each; tracked bench/results/**/*.gz moved aside: the 64 MiB limit), 3 (the third
# part and unpack.sh: serve 1B), 4 (serve 8B).
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env(), serve_1b_auto()
{
case $n in
  1) # issue 11: MK_WGA_X=2 (x staged per warpgroup, built in session 30; prediction and rule in bench/NOTES.md) against
     # the table (8B b16 and 1B b12..16: wga_x 1; 8B b12: wgmma_a without it) and MK_WGA_X=1 at 8B b12, 2 alternated rounds
     W=MK_W_TMA=1,MK_WGMMA_A=4
     timeout 300 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.1-8b --group 8b \
       --batch 12 16 --rounds 2 --build default --build $W,MK_WGA_X=1 --build $W,MK_WGA_X=2
     timeout 200 python3 bench/mk_ab.py --csv "$out/mk_ab.csv" --model bench/models/llama-3.2-1b --group 1b \
       --batch 12 16 --rounds 2 --build default --build $W,MK_WGA_X=2 ;;
  2) # MK_WGA_X's GPU tests (both values: reference, Triton, bitwise repeatable, op by op against the VM, which models
     # the wgmma path's rstd epilogue since session 30) and MK_NW_L1's bitwise test (session 31), then the phase traces
     # at 8B batch 16 of the x = 2 build and of the table's build with MK_NW_L1 (its groups' stage against session 30's)
     timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_wgmma_a_gpu.py -k "wga_x or nw_l1" 2>&1 | tail -8
     timeout 120 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 --define MK_W_TMA=1 \
       --define MK_WGMMA_A=4 --define MK_WGA_X=2 --records-dir "$out" --model bench/models/llama-3.1-8b --batch 16 \
       2>&1 | tail -2
     for d in "--define MK_NW_L1=1" ""; do   # the table's build with and without it, side by side
       timeout 120 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 $d \
         --records-dir "$out" --model bench/models/llama-3.1-8b --batch 16 2>&1 | tail -2
     done
     for f in "$out"/*.records.json.gz; do python3 -m mk_plugin.persistent.trace_phases "$f" 2>&1 | sed -n 1,14p; done ;;
  5) # issue 11: the sanitizers on the wgmma path's x staging (MK_WGA_X 2 and 1: per-warpgroup barriers, 4 x buffers at 5
     # slots), 2 layers, batch 16 and 12 (memcheck, racecheck, synccheck; sanitize.py checks the step against Triton)
     for d in "MK_W_TMA=1 MK_WGMMA_A=4 MK_WGA_X=2" "MK_W_TMA=1 MK_WGMMA_A=4 MK_WGA_X=1 MK_NUM_STAGES=5"; do
       sub="$out/san_$(echo "$d" | tr -cd 'A-Z0-9=' | tr '=' '_')"   # one record file per build
       MK_SAN_DEFINES="$d" MK_SAN_BATCHES="16 12" MK_SAN_TIMEOUT=90 timeout 280 bash bench/sanitize.sh "$sub" 2 \
         2>&1 | grep -E "SUMMARY|exit code|sanitize-run"
     done ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  3) vllm_env && serve_1b_auto --rounds 2 && tar czf "$out/logs_call3.tgz" -C "$out" logs && rm -rf "$out/logs" ;;
  4) vllm_env   # issue 12: serve.py 8B, stock against auto, concurrency 1 / 8 / 16
     timeout 580 python3 bench/serve.py --models llama-3.1-8b --modes auto --concurrency 1,8,16 --prompts 32 \
       --outdir "$out" 2>&1 | grep -v "^(APIServer" | tail -16
     rm -rf "$out/logs" ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s38_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
