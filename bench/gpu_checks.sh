#!/usr/bin/env bash
# Issue-2 acceptance on the GPU host: `pytest -m gpu` and `python -m mk_plugin check` at the 1B and
# 8B shapes. Writes logs and a markdown record (date, GPU, commit, command) to $1 (default
# bench/results). Usage from the project root:  bash bench/gpu_checks.sh [outdir]
set -uo pipefail
out=${1:-bench/results}
mkdir -p "$out"
commit=$(python3 bench/common.py)  # see bench/common.git_commit
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name())")
stamp=$(date -u +%Y-%m-%d)
rec="$out/gpu_checks_${stamp}.md"
{
  echo "# GPU checks ${stamp}"
  echo "GPU: ${gpu}; commit: ${commit}; torch $(python3 -c 'import torch; print(torch.__version__)'),"\
       "triton $(python3 -c 'import triton; print(triton.__version__)')"
  echo
} > "$rec"
run() {  # run and record one command
  echo "## \`$*\`" >> "$rec"; echo '```' >> "$rec"
  "$@" 2>&1 | tee -a "$rec.tmp"; rc=${PIPESTATUS[0]}
  tail -n 40 "$rec.tmp" >> "$rec"; rm -f "$rec.tmp"
  echo '```' >> "$rec"; echo "exit code: $rc" >> "$rec"; echo >> "$rec"
  return $rc
}
status=0
run python3 -m pytest -m gpu -q -p no:cacheprovider || status=1
run python3 -m mk_plugin check --config bench/models/llama-3.2-1b --batch 1 --context 512 || status=1
run python3 -m mk_plugin check --config bench/models/llama-3.2-1b --batch 8 --context 1000 || status=1
run python3 -m mk_plugin check --config bench/models/llama-3.1-8b --batch 1 --context 512 || status=1
echo "record: $rec"
exit $status
