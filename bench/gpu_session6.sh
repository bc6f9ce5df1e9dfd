#!/usr/bin/env bash
# Session 6's GPU calls (bench/NOTES.md "Session 6"). Run from the project root on the GPU host with
# .commit carried; output under $2 (default $OUT). No vLLM needed for calls 1 and 2.
#   call 1: the kernel gpu tests on HEAD, then the batch-9..16 A/B (5-stage full-width vs 6-stage half-width)
#           and the 1B step table with Triton alongside
#   call 2: Nsight Compute per op (issue 14; carry .whl after `bash bench/profile_wheels.sh`), 8B table,
#           a batch-16 trace, the Triton op gpu tests
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) timeout 330 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       tests/test_decode_step.py 2>&1 | tail -5
     echo "== A/B: 6-stage ring (half-width chunks at 9..16)"; step --batch 12 16 --no-triton --stages 6
     echo "== default"; step --batch 1 4 8 12 16
     echo "== A/B again: 6-stage"; step --batch 16 --no-triton --stages 6 ;;
  2) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
       .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
     timeout 200 python3 bench/profile_ops.py --batch 1 8 16 --outdir "$out" 2>&1 | tail -24
     T=240 step --model bench/models/llama-3.1-8b --batch 1 8 16
     timeout 100 python3 bench/mk_step.py --batch 16 --no-triton --trace --records-dir "$out" --csv /dev/null 2>&1 \
       | grep -E "^\| (qkv|attn|o_proj|gate|down|total)|traced step"
     timeout 150 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_rms_norm.py tests/test_linear.py \
       tests/test_lm_head.py tests/test_paged_attention.py tests/test_rope_kv_append.py 2>&1 | tail -3 ;;
  3) # Nsight Compute per op (issue 14): carry .whl (bench/profile_wheels.sh: nsight-python 0.9.6 for ncu 2025.3)
     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
       .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
     ncu --version | tail -1
     timeout 300 python3 bench/profile_ops.py --batch 1 8 16 --outdir "$out" 2>&1 | tail -34 ;;
  4) # bundle part 0 on the way (carry .gpuhost/part.0); the ctx-4096 rows on the current kernel
     mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/
     step --batch 1 8 --ctx 4096 ;;
  5) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  6|7) vllm_env
     if [ "$n" = 6 ]; then  # issue 12: the real client, 8B, stock vs each decode path
       timeout 450 python3 bench/serve.py --models llama-3.1-8b --modes triton,megakernel --concurrency 1,8,16 \
         --prompts 32 --outdir "$out" 2>&1 | grep -v "^(APIServer" | tail -24
     else                   # issue 13 part (c) at 1B: stock and the megakernel against the fp32 truth
       timeout 480 python3 bench/vllm_correctness.py --parts c --mode megakernel --outdir "$out" 2>&1 \
         | grep -v "^(EngineCore" | tail -20
     fi ;;
esac
} 2>&1 | tee "$out/gpu_s6_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
