#!/usr/bin/env bash
# The next GPU session's calls (bench/NOTES.md session 8, "Next"). Run from the project root on the GPU
# host with .commit carried; output under $2 (default $OUT). Order: 1, 2, 4, then the vLLM calls 11, 12,
# 13 (bundle parts; 13 = serve.py 8B megakernel), 14 (1B), 15 (soak), 16 (tbt rounds) -- gpu_session9.sh's
# calls 2..7 --, and 3 (autotune) last, as the device time allows (~30 min in all: cut 3, then 16, then 15).
# After 1 and 2: make the winners the default (one commit), then 4 runs on it.
# Ran in session 9: calls 1 and 2 at a444019 (their switches have since left the kernel: rerun them only at
# that commit), 5 at f83d309, 13 (cut by its limit after stock), and 4's traces by hand; gpu_session11.sh
# has the next session's calls.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1|2) # Session 8's A/B builds (each leaves the default SASS unchanged; predictions in bench/NOTES.md
     # session 8): MK_POLL_ACQUIRE (counter polls are acquires: no second L2 round trip after a hand-off is
     # seen), MK_PTR_EARLY (no weight-pointer load between a matvec task's wait and its staging), both,
     # MK_GROUP_NONORM (o_proj/down stream x by column groups at batch 1 too), MK_ROPE_EARLY (qkv's cos|sin
     # at the pass start), MK_ATTN_OVERLAP (attention's block-table and q loads in one round trip),
     # MK_MERGE_BATCH (the attention merge's loads 16 chunks at a time), all six; and the gate word
     # (MK_GATE_WORD 0 volatile / 2 relaxed vs 1 atomics = default; 8B batch 1 was ~50 us apart across
     # jobs). Call 1: the gpu tests of the build with all six, then 1B batch 1/8; call 2: 8B batch 1/8.
     # Builds alternated over two rounds.
     all5="--define MK_POLL_ACQUIRE=1 --define MK_PTR_EARLY=1 --define MK_GROUP_NONORM=1 --define MK_ROPE_EARLY=1"
     all6="$all5 --define MK_ATTN_OVERLAP=1 --define MK_MERGE_BATCH=1"
     if [ "$n" = 1 ]; then
       timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
         -k "vs_vm or whole_step or watchdog or merge_in_partial" ${all6//--define/--mk-define} 2>&1 | tail -2
       model=bench/models/llama-3.2-1b; T=60
     else
       model=bench/models/llama-3.1-8b; T=100
     fi
     for r in 1 2; do
       for v in "" "--define MK_POLL_ACQUIRE=1" "--define MK_PTR_EARLY=1" \
                "--define MK_POLL_ACQUIRE=1 --define MK_PTR_EARLY=1" "--define MK_GROUP_NONORM=1" \
                "--define MK_ROPE_EARLY=1" "--define MK_ATTN_OVERLAP=1" "--define MK_MERGE_BATCH=1" "$all6" \
                "--define MK_GATE_WORD=0" \
                "--define MK_GATE_WORD=2"; do
         echo "== round $r: ${v:-default}"; step --model $model --batch 1 8 --no-triton $v; done; done ;;
  4) # racecheck at batch 1 with room to finish (150 s cut it in session 8), then the batch-16 phase traces
     # (1B and 8B: where 1.33x / 1.50x of the Triton step goes)
     MK_SAN_BATCHES="1" MK_SAN_TIMEOUT=300 bash bench/sanitize.sh "$out" 16 2>&1 | grep -E "SUMMARY|exit code" | head -6
     for m in llama-3.2-1b llama-3.1-8b; do
       timeout 120 python3 bench/mk_step.py --model bench/models/$m --reps 20 --batch 16 --no-triton --trace \
         --records-dir "$out/records" --define MK_TRACE_PHASES=1 2>&1 | grep -v "^tuning" | grep -A12 "traced step"; done ;;
  5) # session 9: the A/B winners as the default (MK_POLL_ACQUIRE, MK_PTR_EARLY, MK_ROPE_EARLY,
     # MK_ATTN_OVERLAP, MK_MERGE_BATCH): gpu tests, both paths at one commit, then racecheck at batch 1
     timeout 110 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_persistent_gpu.py \
       -k "vs_vm or whole_step or watchdog or merge_in_partial" 2>&1 | tail -2
     T=130 step --model bench/models/llama-3.2-1b --batch 1 4 8 16
     T=200 step --model bench/models/llama-3.1-8b --batch 1 8 16
     MK_SAN_BATCHES="1" MK_SAN_TIMEOUT=230 bash bench/sanitize.sh "$out" 16 2>&1 | grep -E "SUMMARY|exit code" | head -6 ;;
  3) # the autotuner on the gated kernel where the gap is largest (8B batch 16: 1.50x Triton; 1B batch 16:
     # 1.33x): task splits, attention chunks, ring depth
     timeout 560 python3 bench/autotune.py --models 8b 1b --batch 16 --lm-head off --rounds 1 --reps 50 \
       --outdir "$out" 2>&1 | grep -E "^\| llama|Winners" | head -12 ;;
  1[1-6]) bash bench/gpu_session9.sh $((n - 9)) "$out" ;;
  *) echo "no call $n" ;;
esac
} 2>&1 | tee "$out/gpu_s10_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
