#!/usr/bin/env bash
# Session 30's GPU calls (bench/NOTES.md session 30). `bash bench/gpu_session37.sh N $OUT` from the project root,
# .commit carried. Calls 11, 12 carry one vLLM bundle part each (tracked bench/results/**/*.gz moved aside first: the
# 64 MiB limit), 3 the third part and unpack.sh; later vLLM calls reuse the unpacked tree while the machine is warm.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env(), tbt_1layer_profiled()
{
case $n in
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  3) vllm_env   # issues 11 and 12: 8B, stock alternated with the default mode (auto), 2 rounds, batch 1 / 4 / 8 / 16,
     # prompt 512, on the session-29 table (auto's choice per batch is in the log: the megakernel at b1 / 4 / 8 is
     # issue 11's in-vLLM row; issue 12: auto <= stock at every batch)
     timeout 560 python3 bench/tbt.py --models llama-3.1-8b --batches 1,4,8,16 --prompts 512 \
       --modes auto --rounds 2 --runs 1 --outdir "$out" 2>&1 | grep -v "^(EngineCore" \
       | grep -v "^\[tbt\]   worker" | tail -30
     grep -h "decode path ready\|MK_MODE=auto" "$out"/logs/*.log 2>/dev/null | sort | uniq -c | head -12
     rm -rf "$out/logs" ;;
  4) vllm_env && tbt_1layer_profiled call4 ;;   # issue 12: the one-layer model and 1B, 3 alternated rounds, profiles
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s37_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
