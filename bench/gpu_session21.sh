#!/usr/bin/env bash
# Session 16's second GPU call (bench/NOTES.md session 16). Run from the project root on the GPU host with
# .commit carried; output under $2 (default $OUT).
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step(), vllm_env()
{
case $n in
  1) # issue 11, in one call (each step bounded):
     # (a) the release probe: is a hand-off whose payload goes by a bulk store (wait_group, relaxed flag: no
     # MEMBAR) free of the SM's in-flight weight copies, where the kernel's red.release is not? Predicted: mode 0
     # (the kernel's) ~1-1.5 us idle and 2-4 us under streaming; modes 1 / 4 within ~0.3 us of idle if the bulk
     # group's completion is per thread.
     timeout 150 python3 bench/release_probe.py --iters 1000 --reps 5 \
       --out "$out/release_probe_$(date -u +%Y-%m-%d)_${commit}.md" 2>&1 | tail -14
     d=$(mktemp -d); timeout 60 nvcc -std=c++17 -arch=sm_90a -cubin -o "$d/rp.cubin" bench/release_probe.cu \
       && cuobjdump -sass "$d/rp.cubin" | grep -oE "(MEMBAR|ERRBAR|CGAERRBAR|UBLKCP|FENCE|REDG|DEPBAR|SYNCS)[A-Z0-9._]*" \
       | sort | uniq -c
     # (b) MK_BULK_RELEASE (gate_up / o_proj / down outputs by bulk copy, relaxed signal): correctness first
     # (GPU vs VM op by op, whole step), then the A/B. Predicted 1B batch 1: with the gate kept -5..-15 us
     # (o_proj / down / gate_up releases 0.8 / 0.9 / 0.5 -> ~0.4 us), gate off -20..-50 (down's weights stream
     # during gate_up's tail); batch 8 (gate_up's output too large for the stage: MEMBAR) gate off +-20;
     # 8B batch 1 -20..-60. Mode 2 (proxy fence) = mode 1 +-5.
     timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py -k "vs_vm or whole_step" \
       --mk-define MK_BULK_RELEASE=1 --mk-define MK_RELEASE_GATE=0 2>&1 | grep -E "passed|failed|FAILED|Error" | head -8
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.2-1b --group 1b --batch 1 8 --rounds 3 \
       --build default --build MK_BULK_RELEASE=1 --build MK_BULK_RELEASE=1,MK_RELEASE_GATE=0 \
       --build MK_BULK_RELEASE=2,MK_RELEASE_GATE=0
     timeout 200 python3 bench/mk_ab.py --model bench/models/llama-3.1-8b --group 8b --batch 1 8 --rounds 2 \
       --build default --build MK_BULK_RELEASE=1 --build MK_BULK_RELEASE=1,MK_RELEASE_GATE=0
     for b in "" "--define MK_BULK_RELEASE=1 --define MK_RELEASE_GATE=0"; do
       timeout 60 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 $b \
         --records-dir "$out" --model bench/models/llama-3.2-1b --batch 1 2>&1 | tail -9
     done
     # (c) both paths at the current default kernel: issue 11's ctx 4096 row, and ctx 512 at 1B
     T=100 step --model bench/models/llama-3.2-1b --batch 1 8 16 --ctx 4096
     T=200 step --model bench/models/llama-3.1-8b --batch 1 8 16 --ctx 4096
     T=100 step --model bench/models/llama-3.2-1b --batch 1 4 8 16 ;;
  2) # MK_BULK_RELEASE failed one op-by-op case in call 1 (1B, 2 layers, batch 1): which op, and is it repeatable?
     # The default build once, then modes 1 and 2 three times each (E lines: the first diverging op's buffer).
     t="tests/test_persistent_gpu.py::test_megakernel_vs_vm_op_by_op[llama-3.2-1b-2-seq_lens1]"
     for m in 0 1 1 1 2 2 2; do
       echo "== MK_BULK_RELEASE=$m"
       timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider "$t" --mk-define MK_BULK_RELEASE=$m 2>&1 \
         | grep -E "^E .*(assert not|: \{)|passed|failed" | cut -c1-400 | head -4
     done ;;
  *) echo "no call $n here: see bench/gpu_session20.sh" ;;
esac
} 2>&1 | tee "$out/gpu_s21_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
