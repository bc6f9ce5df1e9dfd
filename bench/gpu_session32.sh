#!/usr/bin/env bash
# Session 24's second GPU call (bench/NOTES.md session 24): the default build (the branch-free one-n-tile fragment
# build, formerly MK_XFRAG=1, is the code now) against the Triton path, both in one job, rows in mk_step.csv
# (issue 11's table); the new 1B batch-1 step's trace (with its phases: records for `python -m mk_plugin.trace convert`
# and bench/roofline.py on the CPU). `bash bench/gpu_session32.sh 1 $OUT` from the project root.
set -uo pipefail
n=${1:?call number}; out=${2:-$OUT}; mkdir -p "$out"
source bench/gpu_lib.sh   # header line, step()
{
case $n in
  1) T=100 step --model bench/models/llama-3.2-1b --batch 1 4 8 16
     T=170 step --model bench/models/llama-3.1-8b --batch 1 8 16
     timeout 60 python3 bench/mk_step.py --reps 50 --no-triton --trace --define MK_TRACE_PHASES=1 \
       --records-dir "$out" --model bench/models/llama-3.2-1b --batch 1 2>&1 | tail -2
     for f in "$out"/*.records.json.gz; do python3 -m mk_plugin.persistent.trace_phases "$f" 2>&1 | sed -n 1,12p; done ;;
  *) echo "no call $n here" ;;
esac
} 2>&1 | tee "$out/gpu_s32_call_${n}_$(date -u +%Y-%m-%d)_${commit}.log"
