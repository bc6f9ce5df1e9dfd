#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) on one megakernel step, Llama-3.2-1B shape,
# batch 1, 8 and 16 (MK_SAN_BATCHES; bench/sanitize.py checks the step's result afterwards), the default build
# or the kernel variant of MK_SAN_DEFINES ("NAME=VALUE ...", bench/sanitize.py --define). Only the megakernel is
# instrumented (--kernel-name kns=mk_decode). Usage: bash bench/sanitize.sh [outdir] [layers]
# Writes $outdir/sanitize_<date>.md with date, GPU, commit, each command and its summary lines.
set -uo pipefail
out=${1:-bench/results}; layers=${2:-0}; mkdir -p "$out"
rec="$out/sanitize_$(date -u +%Y-%m-%d).md"
commit=$(python3 bench/common.py)  # see bench/common.git_commit
echo "# compute-sanitizer $(date -u +%FT%TZ), $(python3 -c 'import torch;print(torch.cuda.get_device_name())'), commit ${commit}" > "$rec"
echo "$(compute-sanitizer --version | tail -1)" >> "$rec"
status=0
for tool in memcheck racecheck synccheck; do
  for b in ${MK_SAN_BATCHES:-1 8 16}; do
    extra=""; [ "$tool" = racecheck ] && extra="--racecheck-report all"
    cmd="compute-sanitizer --tool $tool $extra --kernel-name kns=mk_decode --error-exitcode 3 python3 bench/sanitize.py --batch $b --layers $layers"
    for d in ${MK_SAN_DEFINES:-}; do cmd="$cmd --define $d"; done
    echo "## \`$cmd\`" >> "$rec"; echo '```' >> "$rec"
    t0=$(date +%s)
    timeout ${MK_SAN_TIMEOUT:-150} $cmd > /tmp/san.log 2>&1; rc=$?
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize-run|Error|Traceback|hazard" /tmp/san.log | head -20 >> "$rec"
    echo '```' >> "$rec"; echo "exit code: $rc ($(( $(date +%s) - t0 )) s)" >> "$rec"; echo >> "$rec"
    [ $rc -ne 0 ] && status=1
    tail -3 /tmp/san.log
  done
done
cat "$rec"
exit $status
