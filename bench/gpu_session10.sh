#!/usr/bin/env bash
# The next GPU session's calls (bench/NOTES.md session 8, "Next"). Run from the project root on the GPU
# host with .commit carried; output under $2 (default $OUT). Order: 1, 2, then the vLLM calls 11, 12,
# 13 (bundle parts; 13 = serve.py 8B megakernel), 14 (1B), 15 (soak), 16 (tbt rounds) -- gpu_session9.sh's
# calls 2..7 --, and 3 (autotune) last, as the device time allows (~30 min in all: cut 3, then 16, then 15).
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # (a) MK_POLL_ACQUIRE=1: counter polls are acquires, so the poll that sees a hand-off needs no second
     # L2 round trip (predicted -25..-50 us at 1B batch 1, -50..-100 at 8B batch 1: ~0.6 us off each of the
     # five hand-offs per layer); its gpu tests first. (b) the gate's shared word: 0 volatile (racecheck
     # hazards), 1 atomics (the default), 2 ld/st.relaxed.cta (8B batch 1 was ~50 us apart across jobs).
     # (c) MK_PTR_EARLY=1: no weight-pointer load (an L1 miss after the wait's acquire, ~0.5 us: the
     # "entry" phase) between a matvec task's wait and its staging; predicted -15..-35 us at 1B batch 1.
     # All alternated over two rounds in one job.
     timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "vs_vm or whole_step or watchdog" --mk-define MK_POLL_ACQUIRE=1 --mk-define MK_PTR_EARLY=1 2>&1 | tail -2
     for r in 1 2; do
       for v in "" "--define MK_POLL_ACQUIRE=1" "--define MK_PTR_EARLY=1" \
                "--define MK_POLL_ACQUIRE=1 --define MK_PTR_EARLY=1" "--define MK_GATE_WORD=0" "--define MK_GATE_WORD=2"; do
         echo "== round $r: ${v:-default}"; T=60 step --batch 1 8 --no-triton $v
         T=90 step --model bench/models/llama-3.1-8b --batch 1 8 --no-triton $v; done; done ;;
  2) # racecheck at batch 1 with room to finish (150 s cut it in session 8), then the batch-16 phase traces
     # (1B and 8B: where 1.33x / 1.50x of the Triton step goes)
     MK_SAN_BATCHES="1" MK_SAN_TIMEOUT=300 bash bench/sanitize.sh "$out" 16 2>&1 | grep -E "SUMMARY|exit code" | head -6
     for m in llama-3.2-1b llama-3.1-8b; do
       timeout 120 python3 bench/mk_step.py --model bench/models/$m --reps 20 --batch 16 --no-triton --trace \
         --records-dir "$out/records" --define MK_TRACE_PHASES=1 2>&1 | grep -v "^tuning" | grep -A12 "traced step"; done ;;
  3) # the autotuner on the gated kernel where the gap is largest (8B batch 16: 1.50x Triton; 1B batch 16:
     # 1.33x): task splits, attention chunks, ring depth
     timeout 560 python3 bench/autotune.py --models 8b 1b --batch 16 --lm-head off --rounds 1 --reps 50 \
       --outdir "$out" 2>&1 | grep -E "^\| llama|Winners" | head -12 ;;
  1[1-6]) bash bench/gpu_session9.sh $((n - 9)) "$out" ;;
  *) echo "no call $n" ;;
esac
} 2>&1 | tee "$out/gpu_s10_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
