#!/usr/bin/env bash
# The next GPU session's calls (bench/NOTES.md session 6, "Next"). Run from the project root on the GPU
# host with .commit carried; output under $2 (default $OUT). Calls 1-2 need no vLLM; 3-5 carry one bundle
# part each (.gpuhost/part.N; 5 also .gpuhost/unpack.sh); 6-8 need the unpacked bundle (/root/vsite).
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
commit=$(python3 bench/common.py)
echo "date $(date -u +%FT%TZ) call $n commit $commit"
step() { timeout "${T:-200}" python3 bench/mk_step.py --reps 100 --csv "$out/mk_step.csv" "$@" 2>&1 | grep -v "^tuning" | tail -12; }
vllm_env() {
  mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ 2>/dev/null
  [ -f /root/vsite/vllm/__init__.py ] || bash .gpuhost/unpack.sh /root/parts > /dev/null || exit 1
  export PYTHONPATH=/root/vsite VLLM_USE_FLASHINFER_SAMPLER=0
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
}
{
case $n in
  1) # the merge-in-partial kernel: its tests, then the A/B against the default program, alternated
     timeout 300 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "merge or vs_vm or whole_step or tuned" 2>&1 | tail -4
     for r in 1 2; do
       echo "== default ($r)"; step --batch 1 4 8 --no-triton
       echo "== merge_in_partial ($r)"; step --batch 1 4 8 --no-triton --merge-in-partial; done
     step --batch 1 4 8 16 ;;
  2) T=300 step --model bench/models/llama-3.1-8b --batch 1 8 16
     T=300 step --model bench/models/llama-3.1-8b --batch 1 8 --no-triton --merge-in-partial ;;
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
