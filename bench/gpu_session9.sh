#!/usr/bin/env bash
# The next GPU session's calls (bench/NOTES.md session 7, "Next"). Run from the project root on the GPU
# host with .commit carried; output under $2 (default $OUT). Calls 2 and 3 carry bundle parts 0 and 1;
# call 4 carries part 2 and .gpuhost/unpack.sh; 4-7 use the unpacked bundle. Order: 1, 8, 9, 2, 3, 4, 5, 6, 7
# (~30 min in all: cut 7, then 6, if the calls run long).
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # MK_RELEASE_GATE and MK_LDSM_BATCH: the gpu tests of a build with both, the A/B alternated over two
     # rounds (gate mask 32 = after gate_up, 96 = after gate_up and down, 126 = after every op; two fragments per ldmatrix
     # batch), then the phase trace of the gated build (is gate_up's release ~0.8 us?)
     timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "vs_vm or whole_step or watchdog" --mk-define MK_RELEASE_GATE=96 --mk-define MK_LDSM_BATCH=2 2>&1 | tail -3
     for r in 1 2; do
       for v in "" "--define MK_RELEASE_GATE=32" "--define MK_RELEASE_GATE=96" \
                "--define MK_RELEASE_GATE=126" "--define MK_LDSM_BATCH=2"; do
         echo "== round $r: ${v:-default}"; step --batch 1 4 8 --no-triton $v; done; done
     timeout 150 python3 bench/mk_step.py --reps 20 --batch 1 8 --no-triton --trace --records-dir "$out/records" \
       --define MK_TRACE_PHASES=1 --define MK_RELEASE_GATE=96 2>&1 | grep -v "^tuning" | grep -A12 "median per task" ;;
  10) # MK_ATTN_PREFETCH=1 (session 8): attention's first K/V rows in flight during its dependency wait. The
      # gpu tests of the build, the A/B alternated over two rounds (1B batch 1/4/8/16, 8B batch 1/8), and
      # the phase trace of the prefetch build
     timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "vs_vm or whole_step or watchdog or merge_in_partial" --mk-define MK_ATTN_PREFETCH=1 2>&1 | tail -3
     for r in 1 2; do
       for v in "" "--define MK_ATTN_PREFETCH=1"; do
         echo "== round $r: ${v:-default}"; step --batch 1 4 8 16 --no-triton $v
         T=240 step --model bench/models/llama-3.1-8b --batch 1 8 --no-triton $v; done; done
     timeout 150 python3 bench/mk_step.py --reps 20 --batch 1 8 --no-triton --trace --records-dir "$out/records" \
       --define MK_TRACE_PHASES=1 --define MK_ATTN_PREFETCH=1 2>&1 | grep -v "^tuning" | grep -B2 -A10 "traced step" ;;
  13) # the release gate after qkv too (34: o_proj's weights wait for qkv's release; they have ~15 us of
      # slack during attention) and 50 (also after o_proj: 45 us faster at 8B batch 1 in call 1d) against
      # the default 32, two rounds; then compute-sanitizer on the new default (its released() hint word)
     for r in 1 2; do
       for v in "" "--define MK_RELEASE_GATE=34" "--define MK_RELEASE_GATE=50"; do
         echo "== round $r: ${v:-default}"; step --batch 1 4 8 --no-triton $v
         T=240 step --model bench/models/llama-3.1-8b --batch 1 8 --no-triton $v; done; done
     MK_SAN_BATCHES="1 8" MK_SAN_TIMEOUT=150 bash bench/sanitize.sh "$out" 16 2>&1 \
       | grep -E "SUMMARY|exit code|sanitize-run" | head -16 ;;
  14) # the default with the gate's word on shared-memory atomics (racecheck-clean?): the gpu tests, the
      # sanitizers at batch 1 and 8, then call 12's table (both paths at one commit)
     timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py 2>&1 | tail -2
     MK_SAN_BATCHES="1 8" MK_SAN_TIMEOUT=150 bash bench/sanitize.sh "$out" 16 2>&1 \
       | grep -E "SUMMARY|exit code|sanitize-run" | head -16
     bash bench/gpu_session9.sh 12 "$out" ;;
  12) # the default build at one commit, both paths: 1B batch 1/4/8/16, 8B batch 1/8/16 (ctx 512), 1B ctx 4096
     step --batch 1 4 8 16; T=300 step --model bench/models/llama-3.1-8b --batch 1 8 16
     step --batch 1 8 --ctx 4096 ;;
  8) # Nsight Compute's per-instruction stall samples of one default 1B batch-1 step (the chunk loop of
     # one-M-tile tasks: ~0.93 us per 32 KB chunk with or without weight copies), read on a CPU
     timeout 240 ncu --clock-control none -k regex:mk_decode -s 4 -c 1 --section WarpStateStats --section SourceCounters \
       -o "$out/ncu_b1" -f python3 bench/mk_step.py --batch 1 --reps 3 --no-triton --csv /dev/null > "$out/ncu_b1_run.log" 2>&1
     timeout 120 ncu --import "$out/ncu_b1.ncu-rep" --page source --csv --print-source sass > "$out/ncu_b1_source.csv" 2>&1
     ls -la "$out" | tail -4 ;;
  9) # compute-sanitizer on the default kernel of session 7 (merge-in-partial tickets, early residual loads)
     MK_SAN_BATCHES="1 8" MK_SAN_TIMEOUT=120 bash bench/sanitize.sh "$out" 16 2>&1 | grep -E "SUMMARY|exit code" | head -12 ;;
  2|3) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  4) vllm_env   # issue 12: the plugin's megakernel mode through the real client, 8B (stock alternated)
     timeout 540 python3 bench/serve.py --models llama-3.1-8b --modes megakernel --concurrency 1,8,16 \
       --prompts 32 --outdir "$out" 2>&1 | grep -v "^(APIServer" | tail -16 ;;
  5) vllm_env   # issue 12: 1B through the real client (stock, triton = default, auto)
     timeout 560 python3 bench/serve.py --models llama-3.2-1b --modes triton,auto --concurrency 1,8,16 \
       --prompts 32 --outdir "$out" 2>&1 | grep -v "^(APIServer" | tail -16 ;;
  6) vllm_env   # issue 13: the fp32-judged soak with preemption
     timeout 560 python3 bench/soak.py --requests 2000 --mode megakernel --outdir "$out" 2>&1 \
       | grep -v "^(EngineCore" | tail -16 ;;
  7) vllm_env   # issue 11/12: TBT inside vLLM, 8B, stock alternated with the plugin over fresh engines
     timeout 560 python3 bench/tbt.py --models llama-3.1-8b --batches 1,8 --prompts 512 --modes megakernel --rounds 3 \
       --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
esac
} 2>&1 | tee "$out/gpu_s9_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
