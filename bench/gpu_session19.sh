#!/usr/bin/env bash
# Session 15's GPU calls (bench/NOTES.md session 15). Run from the project root on the GPU host with .commit
# carried; output under $2 (default $OUT).
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11: MK_ACT_LL (gate_up -> down by flagged words at batch 1): its gpu tests, the counter build's tests
     # with it, the A/B (predicted 1B batch 1 -40..-70 us, 8B batch 1 -60..-120; batch 8 the same programs:
     # +-noise), then its phase trace at 1B batch 1
     timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_act_ll_gpu.py 2>&1 | tail -3
     timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "vs_vm or whole_step or graph or watchdog" --mk-define MK_ACT_LL=1 2>&1 | tail -3
     timeout 120 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 8 --rounds 3 \
       --build default --build MK_ACT_LL=1
     timeout 150 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 1 --rounds 3 \
       --build default --build MK_ACT_LL=1
     timeout 60 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
       --define MK_ACT_LL=1 --records-dir "$out" --model bench/models/llama-3.2-1b --batch 1 2>&1 | tail -12 ;;
  2) # issue 11: MK_ACT_LL measured +55 us at 1B batch 1 (call 1): is it the ungated down prefetch slowing the
     # stragglers of gate_up (2: the release gate kept) or the polls' L2 traffic (3: gate kept, sleeping reloads)?
     # Predicted: 2 and 3 at -10..-20 us against default if the prefetch was the cost; then the LL tests at 2, and
     # the sanitizer on the current default (2 layers, batch 1 and 16)
     timeout 150 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 --rounds 3 \
       --build default --build MK_ACT_LL=1 --build MK_ACT_LL=2 --build MK_ACT_LL=3
     timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_act_ll_gpu.py 2>&1 | tail -3
     MK_SAN_BATCHES="1 16" MK_SAN_TIMEOUT=100 timeout 330 bash bench/sanitize.sh "$out" 2 2>&1 | grep -E "SUMMARY|exit code" ;;
  3) # issue 11: all MK_ACT_LL modes +50..+60 us (call 2), and attention/qkv/o_proj slower too in its phase trace:
     # the words' stores and the code (4: stored, unused) or the polls (1)? Predicted: 4 = default if the polls
     timeout 120 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 --rounds 3 \
       --build default --build MK_ACT_LL=4 --build MK_ACT_LL=1 ;;
  *) echo "no call $n here: see bench/gpu_session18.sh" ;;
esac
} 2>&1 | tee "$out/gpu_s19_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
