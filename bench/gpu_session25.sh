#!/usr/bin/env bash
# Session 19's GPU calls (bench/NOTES.md session 18, "Next"). Run from the project root on the GPU host with
# .commit carried; output under $2 (default $OUT). Call 1 needs no vLLM. The vLLM calls: move bench/results/**/*.gz
# aside first (the tracked tree plus one bundle part is over the run tool's 64 MiB), then 11 and 12 carrying
# .gpuhost/part.0 / part.1, then 2 (or 3, 4) with part.2 and unpack.sh; vllm_env unpacks once per machine.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11: the packaged table's ring-fed attention (8B b8/b16, 1B b16 att_tma 128) against the Triton path,
     # the steps session 18's call 8 had no device time left for. Predicted from its A/B: 8B b8/b16 ctx 512
     # ~4510 / ~5620 us, ctx 4096 ~6160 / ~8900; 1B b16 ctx 512 ~1250, ctx 4096 ~2010
     # and the megakernel's GPU tests on the review-mended code (0c63862: _kv_table's one cache check, the shared helper)
     timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py tests/test_tensormap.py \
       2>&1 | tail -4
     for c in 512 4096; do
       T=90 step --ctx $c --model bench/models/llama-3.1-8b --batch 8 16
       T=60 step --ctx $c --model bench/models/llama-3.2-1b --batch 16
     done ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  2) vllm_env   # issues 11/12: 8B TBT, stock alternated with the megakernel, batch 8 / 16 at prompts 512 and 2048
     # (the table's ring-fed attention pays at long contexts; session 17: batch 8 0.95x stock at prompt 512)
     timeout 580 python3 bench/tbt.py --models llama-3.1-8b --batches 8,16 --prompts 512,2048 --modes megakernel \
       --rounds 2 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  3) vllm_env   # issue 13: the Triton mode's 2,000-request soak, engines first (kept in /root/soak_work) ...
     soak_triton --engines-only ;;
  4) vllm_env   # ... then the fp32 verdict over the same engines' outputs (stock control included)
     soak_triton ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s25_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
