#!/usr/bin/env bash
# Where does a megakernel step's time go? (bench/NOTES.md, session 5.) One GPU call, no vLLM:
#   1. bench/mk_step.py at batch 1, 8, 16: the default kernel (and the Triton path, in the same job),
#      then timing-only variants compiled with -DMK_DIAG=<mask> (wrong results, never shipped):
#      1 = no counter waits, 2 = no weight copies, 4 = no MMAs, and combinations;
#   2. Nsight Compute on one default step at batch 1 and 8: speed of light, warp states, and the
#      per-instruction stall samples (source page, CSV) for reading on a CPU.
# Usage (project root on the GPU host): bash bench/mk_diag.sh OUTDIR [batches...]
set -uo pipefail
out=${1:?outdir}; shift; batches=${*:-1 8 16}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() { timeout 240 python3 bench/mk_step.py --batch $batches --reps 100 --csv "$out/mk_step.csv" "$@" 2>&1 | tail -14; }
echo "== default (and Triton)"; step
for m in 1 2 4 3 6; do echo "== MK_DIAG=$m"; step --no-triton --define MK_DIAG=$m; done
for b in 1 8; do
  echo "== ncu batch $b"
  timeout 300 ncu --clock-control none -k regex:mk_decode -s 4 -c 1 --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters -o "$out/ncu_b$b" -f \
    python3 bench/mk_step.py --batch $b --reps 3 --no-triton --csv /dev/null > "$out/ncu_b${b}_run.log" 2>&1
  timeout 120 ncu --import "$out/ncu_b$b.ncu-rep" --print-details all > "$out/ncu_b${b}_details.txt" 2>&1
  timeout 120 ncu --import "$out/ncu_b$b.ncu-rep" --page source --csv --print-source sass > "$out/ncu_b${b}_source.csv" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Stall|Warp Cycles|Issued Warp|No Eligible" "$out/ncu_b${b}_details.txt" | head -30
done
