#!/usr/bin/env bash
# Session 10's GPU calls (bench/NOTES.md session 9, "Next"; as run: 1, 4, 11-13, 14, 5, 11-13 again on a
# fresh machine, 17). Kept as the record of what ran: calls 1 and 4 time MK_NT2_SLOTS and MK_ATT_AU, which
# their A/B removed (bench/results/mk_ab_2026-12-01_e1489b8.md), so they no longer build. Run from the project root on the GPU
# host with .commit carried; output under $2 (default $OUT). Order: 1, 4, then (winners made the default,
# one commit) 2, then the vLLM calls: 11 and 12 carry bundle parts 0 and 1 (nothing else runs in them), 13
# carries part 2 and .gpuhost/unpack.sh and unpacks; 14 (serve 8B, ~9 min), 15 (tbt 8B triton+megakernel,
# ~9 min), 17 (tbt 1B + one-layer, auto), 16 (soak), 3 (autotune b16) last, as the device time allows
# (~30 min in all: cut 3, then 16, then 17). A/B tables from the logs: python bench/ab_table.py LOG.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # MK_NT2_SLOTS (session 9, predictions in bench/NOTES.md): at batch 9..16 the ring as N half-size
     # slots and the freed ring memory as matvec scratch. 6 = today's ring bytes (96 KB) with a 128 KB
     # scratch (x staged whole and kept across passes at 1B, groups 3 ahead), 8 = 130 KB of ring with a
     # 95 KB scratch, 10 = 162 KB of ring with a 63 KB scratch (groups 2 ahead). Gpu tests of 8 and of 6
     # (batch 16 goes through the packed ring), then 1B batch 12/16 and 8B batch 16, builds alternated
     # over two rounds; batch 8 of 8 as the control (NT = 1: must not move).
     for v in 8 6; do
       timeout 110 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
         -k "vs_vm or whole_step or watchdog or merge_in_partial" --mk-define MK_NT2_SLOTS=$v 2>&1 | tail -1; done
     # one process per model (bench/mk_ab.py: weights once, builds compiled once, rounds alternated);
     # batch 8 is the control (NT = 1 there: must not move)
     NT2="--build default --build MK_NT2_SLOTS=6 --build MK_NT2_SLOTS=8 --build MK_NT2_SLOTS=10"
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 8 12 16 --rounds 3 $NT2
     timeout 240 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 16 --rounds 2 $NT2 ;;
  4) # MK_ATT_AU (session 9, predictions in bench/NOTES.md): attention's KV load steps in flight per warp,
     # 4 (default) vs 5 vs 6 (6 spills 20 bytes at 8B: 1B only); where attention weighs most: 1B batch 16
     # (ctx 512, one 512-token chunk per task) and ctx 4096 at batch 8 (8B 1.09x Triton there)
     for v in 5 6; do
       timeout 110 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
         -k "vs_vm or whole_step" --mk-define MK_ATT_AU=$v 2>&1 | tail -1; done
     AU="--build default --build MK_ATT_AU=5 --build MK_ATT_AU=6"
     timeout 150 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 16 --rounds 3 $AU
     timeout 120 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group "1b ctx4096" --ctx 4096 --batch 8 --rounds 3 $AU
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group "8b ctx4096" --ctx 4096 --batch 8 --rounds 3 \
       --build default --build MK_ATT_AU=5 ;;
  2) # the default after call 1, both paths at one commit (README table, paths table), the traced 1B batch-1
     # step (issue 11's trace PNG and per-op table), then racecheck at batch 16 (the packed ring's first
     # sanitizer run if it became the default)
     T=150 step --model bench/models/llama-3.2-1b --batch 1 4 8 16
     T=200 step --model bench/models/llama-3.1-8b --batch 1 8 16
     timeout 120 python3 -m mk_plugin.trace run --config bench/models/llama-3.2-1b --batch 1 --context 512 --outdir "$out/trace" \
       2>&1 | grep -E "^\| |span" | head -12
     for m in llama-3.2-1b llama-3.1-8b; do   # batch-16 phases (stage now holds the column-group waits)
       timeout 120 python3 bench/mk_step.py --model bench/models/$m --reps 20 --batch 16 --no-triton --trace \
         --records-dir "$out/records" --define MK_TRACE_PHASES=1 2>&1 | grep -v "^tuning" | grep -A12 "traced step"; done
     MK_SAN_BATCHES="16" MK_SAN_TIMEOUT=200 bash bench/sanitize.sh "$out" 16 2>&1 | grep -E "SUMMARY|exit code" | head -6 ;;
  5) # call 2 without its step table (session 11: calls 1 and 4 left the default program as f83d309's,
     # whose table is committed): the traced 1B batch-1 step, batch-16 phases, the three sanitizers at batch 16 (4 layers: every hand-off kind, ~1/4 of the time)
     timeout 120 python3 -m mk_plugin.trace run --config bench/models/llama-3.2-1b --batch 1 --context 512 --outdir "$out/trace" \
       2>&1 | grep -E "^\| |span" | head -12
     for m in llama-3.2-1b llama-3.1-8b; do
       timeout 120 python3 bench/mk_step.py --model bench/models/$m --reps 20 --batch 16 --no-triton --trace \
         --records-dir "$out/records" --define MK_TRACE_PHASES=1 2>&1 | grep -v "^tuning" | grep -A14 "traced step"; done
     MK_SAN_BATCHES="16" MK_SAN_TIMEOUT=110 bash bench/sanitize.sh "$out" 4 2>&1 | grep -E "SUMMARY|exit code" | head -6 ;;
  3) # the autotuner at batch 16 on the new default (task splits, attention chunks, ring depth)
     timeout 560 python3 bench/autotune.py --models 8b 1b --batch 16 --lm-head off --rounds 1 --reps 50 \
       --outdir "$out" 2>&1 | grep -E "^\| llama|Winners" | head -12 ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  13) vllm_env && echo "vLLM bundle unpacked" ;;
  14) vllm_env   # issue 12: the megakernel mode through the real client, 8B (stock first, same job; ~9 min)
     timeout 580 python3 bench/serve.py --models llama-3.1-8b --modes megakernel --concurrency 1,8,16 \
       --prompts 32 --outdir "$out" 2>&1 | grep -v "^(APIServer" | tail -16 ;;
  15) vllm_env   # issues 11/12: 8B TBT of both plugin paths against stock (auto's table is kernel-only: at
     # 8B batch 1 it picks Triton (kernel 0.99x), yet inside vLLM the megakernel was 0.89x stock and Triton
     # 0.96x in session 3); 6 fresh engines, ~9 min
     timeout 580 python3 bench/tbt.py --models llama-3.1-8b --batches 1,8 --prompts 512 \
       --modes triton,megakernel --rounds 2 --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  17) vllm_env   # issue 12: 1B TBT with its one-layer host floor, stock alternated with auto
     timeout 560 python3 bench/tbt.py --models llama-3.2-1b-1layer,llama-3.2-1b --batches 1,8 --prompts 512 \
       --modes auto --rounds 1 --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  16) vllm_env   # issue 13: the fp32-judged soak with preemption
     timeout 560 python3 bench/soak.py --requests 2000 --mode megakernel --outdir "$out" 2>&1 \
       | grep -v "^(EngineCore" | tail -16 ;;
  *) echo "no call $n" ;;
esac
} 2>&1 | tee "$out/gpu_s11_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
