#!/usr/bin/env bash
# Session 7's first machine, as it ran at b200d73 (calls 1, 2, 5 and 7; bench/NOTES.md session 7): its
# --merge-in-partial and MK_RES_PREFETCH flags are that commit's (both became the default after it).
# Planned in session 6 (NOTES, "Next"). Run from the project root on the GPU
# host with .commit carried; output under $2 (default $OUT). Calls 1-2 need no vLLM; 3, 4 and 5 carry
# bundle parts 0, 1, 2 (5 also .gpuhost/unpack.sh); 5-8 use the unpacked bundle (/root/vsite).
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # the two unmeasured changes: their gpu tests (merge_in_partial in the default build; the residual
     # prefetch as the MK_RES_PREFETCH=1 variant), then the 1B step table on the default build
     timeout 300 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "merge or vs_vm or whole_step or tuned" 2>&1 | tail -4
     timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "vs_vm or whole_step" --mk-define MK_RES_PREFETCH=1 2>&1 | tail -4
     step --batch 1 4 8 16 ;;
  2) # the A/B, alternated over two rounds (1B, no LM head), then 8B on the default build
     for r in 1 2; do
       for v in "" "--merge-in-partial" "--define MK_RES_PREFETCH=1" "--merge-in-partial --define MK_RES_PREFETCH=1"; do
         echo "== round $r: ${v:-default}"; step --batch 1 4 8 --no-triton $v; done; done
     T=300 step --model bench/models/llama-3.1-8b --batch 1 8 16 ;;
  3|4) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  5) vllm_env   # issue 12: the real client, 8B (stock, triton, megakernel)
     timeout 500 python3 bench/serve.py --models llama-3.1-8b --modes triton,megakernel --concurrency 1,8,16 \
       --prompts 32 --outdir "$out" 2>&1 | grep -v "^(APIServer" | tail -24 ;;
  6) vllm_env   # issue 11/12: TBT inside vLLM, 8B, stock alternated with the plugin over fresh engines
     timeout 560 python3 bench/tbt.py --models llama-3.1-8b --batches 1,8 --prompts 512 --modes megakernel --rounds 3 \
       --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  7) vllm_env   # issue 13 part (c) at 8B
     timeout 560 python3 bench/vllm_correctness.py --parts c --models llama-3.1-8b --mode megakernel --outdir "$out" \
       2>&1 | grep -v "^(EngineCore" | tail -12 ;;
  8) vllm_env   # issue 13: the fp32-judged soak with preemption
     timeout 560 python3 bench/soak.py --requests 2000 --mode megakernel --outdir "$out" 2>&1 \
       | grep -v "^(EngineCore" | tail -16 ;;
esac
} 2>&1 | tee "$out/gpu_s7_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
