#!/usr/bin/env bash
# The next GPU session's calls (bench/NOTES.md session 10, "Next"). Run from the project root on the GPU
# host with .commit carried; output under $2 (default $OUT). Order: 1 (kernel diagnosis, ~4 min), 2 (both
# paths at the default, ~4 min), then vLLM: 11 and 12 carry bundle parts 0 and 1, 13 carries part 2 and
# .gpuhost/unpack.sh and unpacks (start each call within the ~30 s warm window: a machine that goes cold
# loses the unpacked bundle), 15 (tbt 8B, ~9 min), 16 (one-layer profile, ~4 min), 17 (serve 1B, ~8 min),
# 18 (soak) as the time allows. A/B tables: python bench/ab_table.py LOG.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # Where batch 16's chunk loop loses (NOTES session 10): the copy engine's cost per bulk copy (the
     # probe: bytes per copy, ring depth, one copy per chunk, the consumer's MMA pattern), then today's
     # kernel with its weight copies (MK_DIAG=2), its MMAs (4), both (6) or its counter waits (1) taken out,
     # at batch 1, 8 and 16 (1B) and 8, 16 (8B), builds alternated in one process per model
     timeout 150 python3 bench/bulk_probe.py --out "$out/bulk_probe.md" 2>&1 | tail -30
     D="--build default --build MK_DIAG=2 --build MK_DIAG=4 --build MK_DIAG=6 --build MK_DIAG=1"
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 2 $D
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 8 16 --rounds 2 \
       --build default --build MK_DIAG=2 --build MK_DIAG=4 --build MK_DIAG=6 ;;
  2) # the default at 7af6278 (ATT_AU = 5, the packed ring gone): the gpu tests, then both paths at one
     # commit (README table, paths table for MK_MODE=auto), ctx 512 and 4096
     timeout 150 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py 2>&1 | tail -1
     T=150 step --model bench/models/llama-3.2-1b --batch 1 4 8 16
     T=200 step --model bench/models/llama-3.1-8b --batch 1 8 16
     T=120 step --model bench/models/llama-3.2-1b --batch 1 8 --ctx 4096
     T=150 step --model bench/models/llama-3.1-8b --batch 1 8 --ctx 4096 ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  13) vllm_env && echo "vLLM bundle unpacked" ;;
  15) vllm_env   # issues 11/12: 8B TBT of both plugin paths against stock; auto picks Triton at 8B batch 1 from
     # kernel timings 1% apart, while inside vLLM the megakernel measured 0.89x stock (session 9)
     timeout 580 python3 bench/tbt.py --models llama-3.1-8b --batches 1,8 --prompts 512 \
       --modes triton,megakernel --rounds 2 --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  16) vllm_env   # issue 12's host cost: a profiled one-layer run, stock and Triton (the plugin path auto ran
     # there, ~0.2 ms above stock in session 10's medians), GPU busy vs period per step (host_gap.py)
     timeout 400 python3 bench/tbt.py --models llama-3.2-1b-1layer --batches 1,8 --prompts 512 --modes triton \
       --rounds 1 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -12
     find "$out/profiles" -name "*.json*" | head -4 | while read -r f; do
       echo "== $f"; timeout 60 python3 bench/host_gap.py "$f" | tail -8; done ;;
  17) vllm_env   # issue 12: serve.py 1B, stock and auto (c 1, 8, 16)
     timeout 580 python3 bench/serve.py --models llama-3.2-1b --modes auto --concurrency 1,8,16 \
       --prompts 32 --outdir "$out" 2>&1 | grep -v "^(APIServer" | tail -16 ;;
  18) vllm_env   # issue 13: the fp32-judged soak with preemption
     timeout 560 python3 bench/soak.py --requests 2000 --mode megakernel --outdir "$out" 2>&1 \
       | grep -v "^(EngineCore" | tail -16 ;;
  *) echo "no call $n" ;;
esac
} 2>&1 | tee "$out/gpu_s12_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
