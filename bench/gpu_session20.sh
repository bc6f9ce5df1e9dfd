#!/usr/bin/env bash
# Session 16's GPU calls (bench/NOTES.md session 15, "Next"). Run from the project root on the GPU host with
# .commit carried; output under $2 (default $OUT). Calls 1 and 2 first (kernel only, ~8 and ~8 min); the vLLM
# calls (4, 5) need the bundle: calls 11 and 12 carrying part.0 / part.1, then 4 with part.2 and unpack.sh.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11: two switches built in session 15 without device time. MK_ATT_MMA (attention's KV loop on tensor
     # cores; predicted 1B batch 16 -150 us, batch 8 -60..-90, batch 1 -5..-10; 8B batch 16 -300..-600, batch 8
     # -100..-200, batch 1 -10..-30) and MK_RSTD_PARTS (qkv/gate_up take rstd from the residual writers' unit sums
     # of squares, one round trip instead of rows_rstd's rounds where x is not staged whole; predicted 1B batch 16
     # -30..-60, batch 8 -15..-30, batch 1 0; 8B batch 16 -60..-120). Correctness first, both together (the
     # op-by-op GPU-vs-VM test names the first diverging op: attention or qkv/gate_up), then the 1B A/B.
     timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py \
       --mk-define MK_ATT_MMA=1 --mk-define MK_RSTD_PARTS=1 2>&1 | tail -4
     timeout 300 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 3 \
       --build default --build MK_ATT_MMA=1 --build MK_RSTD_PARTS=1 --build MK_ATT_MMA=1,MK_RSTD_PARTS=1 ;;
  2) # issue 11: the same four builds at 8B, then the phase trace of both at 1B batch 16
     timeout 420 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 1 8 16 --rounds 2 \
       --build default --build MK_ATT_MMA=1 --build MK_RSTD_PARTS=1 --build MK_ATT_MMA=1,MK_RSTD_PARTS=1
     timeout 60 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
       --define MK_ATT_MMA=1 --define MK_RSTD_PARTS=1 --records-dir "$out" --model bench/models/llama-3.2-1b \
       --batch 16 2>&1 | tail -12 ;;
  3) # issue 11: if MK_ATT_MMA won, fewer KV chunks at batch 1 (a tile per warp: 128 tokens per task at C = 4)
     timeout 150 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 --rounds 3 \
       --build MK_ATT_MMA=1 --build MK_ATT_MMA=1,chunks=8 --build MK_ATT_MMA=1,chunks=4 ;;
  11|12) mkdir -p /root/parts && cp .gpuhost/part.* /root/parts/ && ls /root/parts ;;
  4) vllm_env   # issue 11's vLLM target: 8B TBT with MK_MODE=megakernel <= 0.85x stock at batch 1 and 8; stock
     # alternated with the plugin over 2 rounds (a fresh engine each), profiled (GPU busy per step next to TBT)
     timeout 580 python3 bench/tbt.py --models llama-3.1-8b --batches 1,8 --prompts 512 --modes megakernel \
       --rounds 2 --profile --outdir "$out" 2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  5) vllm_env   # issue 13: part (c) for the Triton path at 8B (1B's and the megakernel's passed in session 6/7)
     timeout 580 python3 bench/vllm_correctness.py --parts c --models llama-3.1-8b --mode triton --outdir "$out" \
       2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  *) echo "no call $n here: see bench/gpu_session19.sh" ;;
esac
} 2>&1 | tee "$out/gpu_s20_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
