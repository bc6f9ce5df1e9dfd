#!/usr/bin/env bash
# The next GPU session's calls (bench/NOTES.md, session 5 "Next"), one per device `run`, so the
# machine's ~30 s warm window between calls is not spent typing. Run from the project root on the
# GPU host; carry .commit (and the bundle part named below). Output under $2 (default bench/results).
#   call 1: carry .commit .gpuhost/part.0   bash bench/gpu_calls.sh 1 $OUT
#   call 2: carry .commit .gpuhost/part.1   bash bench/gpu_calls.sh 2 $OUT
#   call 3: carry .commit .gpuhost/part.2 .gpuhost/unpack.sh   bash bench/gpu_calls.sh 3 $OUT
#   call 4, 5, 6, 7: carry .commit          bash bench/gpu_calls.sh 4 $OUT
#   (call 7, the autotuner, needs no vLLM: it can run first, right after call 1)
#   call 8: carry .commit .whl (after `bash bench/profile_wheels.sh` here): Nsight Compute per op
# Each call copies its bundle part to /root/parts first (the bundle is needed from call 3 on) and
# tees its output into $out/gpu_call_<n>_<date>_<commit>.log (mk_step prints only: the log is its record).
set -uo pipefail
n=${1:?call number 1..7}; out=${2:-bench/results}; mkdir -p "$out" /root/parts
for p in .gpuhost/part.*; do [ -f "$p" ] && cp "$p" /root/parts/; done
vllm_env() {
  [ -f /root/vsite/vllm/__init__.py ] || bash .gpuhost/unpack.sh /root/parts > /dev/null || exit 1
  export PYTHONPATH=/root/vsite VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
  cp bench/results/tbt.csv "$out/" 2>/dev/null || true  # new rows append to the committed history
}
quiet() { grep -v "^(EngineCore" | tail -"${1:-12}"; }
commit=$(python3 bench/common.py)
{
echo "date $(date -u +%FT%TZ) call $n commit $commit"
case $n in
  1) # the kernel first (no vLLM): the gpu tests and the step table (gpu_session5.sh call 4 as run on
     # 5918573), with the bundle part copied on the way
     bash bench/gpu_session5.sh 4 "$out" ;;
  2) # racecheck at batch 16 and a batch-16 trace (gpu_session5.sh call 6)
     bash bench/gpu_session5.sh 6 "$out" ;;
  3) vllm_env
     timeout 260 python3 bench/vllm_correctness.py --mode megakernel --parts a --a-weights random --steps-a 1024 \
       --mk-env MK_ROUNDING=stock --timeout 120 --outdir "$out" 2>&1 | quiet 6
     timeout 300 python3 bench/tbt.py --models llama-3.2-1b-1layer --prompts 512 --batches 1,8 \
       --modes triton,megakernel --runs 2 --outdir "$out" 2>&1 | quiet 10 ;;
  4) vllm_env
     timeout 580 python3 bench/vllm_correctness.py --models llama-3.1-8b --mode megakernel --a-weights random \
       --outdir "$out" 2>&1 | quiet 14 ;;
  5) vllm_env
     timeout 240 python3 bench/vllm_correctness.py --mode triton --parts b --runner v1 --timeout 110 \
       --outdir "$out" 2>&1 | quiet 10
     timeout 330 python3 bench/tbt.py --models llama-3.2-1b --prompts 2048 --batches 1,4,8 \
       --modes triton,megakernel --runs 2 --outdir "$out" 2>&1 | quiet 10 ;;
  6) vllm_env   # issue 5's sweep at 1B (~6 min: 3 engines x 4 prompts x 5 batches); 8B needs one call per mode
     timeout 580 python3 bench/tbt.py --sweep --models llama-3.2-1b --modes triton,megakernel --outdir "$out" \
       2>&1 | quiet 12 ;;
  7) # issue 5's autotuner at 1B (~4 min): winners to $out/megakernel_nvidia_h200.json (commit it as
     # mk_plugin/persistent/tuned/), then the step A/B: the built-in split vs the tuned one
     timeout 400 python3 bench/autotune.py --models 1b --batch 1 8 --lm-head both --rounds 1 \
       --cache "$out/megakernel_nvidia_h200.json" --outdir "$out" 2>&1 | grep -v "^  " | tail -14
     for tun in off "$out/megakernel_nvidia_h200.json"; do
       MK_TUNING=$tun timeout 90 python3 bench/mk_step.py --batch 1 8 --lm-head --no-triton 2>&1 | tail -4; done ;;
  *) echo "call number 1..7" >&2 ;;
  8) # Nsight Compute per op (issue 14): run `bash bench/profile_wheels.sh` here first, carry .whl
     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
       .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
     timeout 500 python3 bench/profile_ops.py --batch 1 8 16 --outdir "$out" 2>&1 | tail -30 ;;
  9) vllm_env   # issue 12: the real client, 1B then 8B (one server per mode; ~8 min for both)
     timeout 560 python3 bench/serve.py --models llama-3.2-1b,llama-3.1-8b --modes triton,megakernel,auto \
       --concurrency 1,8,16 --prompts 48 --outdir "$out" 2>&1 | grep -v "^(APIServer" | tail -20 ;;
  10) vllm_env  # issue 13 part (c): both paths against the fp32 truth, 1B (8B: its own call)
     timeout 580 python3 bench/vllm_correctness.py --parts c --mode megakernel --outdir "$out" 2>&1 | quiet 14 ;;
esac
} 2>&1 | tee "$out/gpu_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
