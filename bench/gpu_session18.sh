#!/usr/bin/env bash
# Session 14's GPU calls (bench/NOTES.md session 14). Run from the project root on the GPU host with .commit
# carried; output under $2 (default $OUT). Back to back: 1 (~3 min), 2 (~1 min), then the vLLM bundle's parts
# (gpu_session13.sh 11, 12) and 3 (the soak's engines, ~7 min, with part.2 and unpack.sh), 4 (its verdict).
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11: gpu tests (default, then both new switches together), both paths at the tuned K-split winners
     timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py 2>&1 | tail -3
     timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "vs_vm or whole_step or ksplit" --mk-define MK_B_LDSM=1 --mk-define MK_ATT_PRELOAD=1 2>&1 | tail -3
     step --model bench/models/llama-3.2-1b --batch 1 4 8 12 16
     T=200 step --model bench/models/llama-3.1-8b --batch 1 8 16 ;;
  2) # issue 11: MK_B_LDSM (activation fragments by ldmatrix; predicted 1B batch 16 -30..-50 us, batch 8 -10..-20,
     # batch 1 +-5) and MK_ATT_PRELOAD (attention's first KV rows copied before its wait; predicted batch 1 -10..-20
     # at 1B, -20..-40 at 8B; batch 16 0..-10), alone and together; then the phase trace of the preload at 1B b1
     timeout 170 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 8 16 --rounds 3 \
       --build default --build MK_B_LDSM=1 --build MK_ATT_PRELOAD=1 --build MK_B_LDSM=1,MK_ATT_PRELOAD=1
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 1 8 16 --rounds 2 \
       --build default --build MK_B_LDSM=1 --build MK_ATT_PRELOAD=1 --build MK_B_LDSM=1,MK_ATT_PRELOAD=1
     timeout 60 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
       --define MK_ATT_PRELOAD=1 --records-dir "$out" --model bench/models/llama-3.2-1b --batch 1 2>&1 | tail -12 ;;
  5) # the new default (ldmatrix fragments at NT = 2): its gpu tests, both paths at batch 16, phase traces at 1B
     timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py 2>&1 | tail -3
     step --model bench/models/llama-3.2-1b --batch 16
     T=120 step --model bench/models/llama-3.1-8b --batch 16
     for b in 1 16; do timeout 60 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
       --records-dir "$out" --model bench/models/llama-3.2-1b --batch $b 2>&1 | tail -9; done ;;
  3) vllm_env   # issue 13: the soak's three engines (1B megakernel, 2000 requests), kept in /root/soak_work
     timeout 580 python3 bench/soak.py --requests 2000 --mode megakernel --outdir "$out" --work /root/soak_work \
       --engines-only 2>&1 | grep -v "^(EngineCore" | tail -8 ;;
  4) vllm_env   # issue 13: the same soak again: its engines reused from /root/soak_work, then the fp32 verdict
     timeout 580 python3 bench/soak.py --requests 2000 --mode megakernel --outdir "$out" --work /root/soak_work \
       2>&1 | grep -v "^(EngineCore" | tail -16 ;;
  6) # issue 11: where attention's 4.4 us (batch 1) and 12.5 us (batch 16) per task go: the phase-traced build now
     # splits attn_partial into q/block-table loads, the KV loop, the merges and the ticket (trace_phases)
     for b in 1 16; do timeout 60 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
       --records-dir "$out" --model bench/models/llama-3.2-1b --batch $b 2>&1 | grep -E "attn|path|megakernel"; done ;;
  *) echo "no call $n here: see bench/gpu_session13.sh" ;;
esac
} 2>&1 | tee "$out/gpu_s18_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
