#!/usr/bin/env bash
# One short GPU call (no vLLM): megakernel + Triton GPU tests, one megakernel step timing with the
# fused LM head, A/B of the compiled-out kernel experiments (-D variants, bench/NOTES.md), and the
# 1B check table. Every step has its own timeout. Output tees into $1/final_gpu_<date>_<commit>.log.
# Usage (GPU host, project root; carry .commit): bash bench/final_gpu_run.sh $OUT
# Time: ~170 s of tests + ~60 s mk_step + ~35 s per variant + ~60 s variant tests + ~40 s check:
# ~9 min with the 6 default variants, close to a device call's 600 s: give run() timeout_s=600, or
# fewer variants with MK_AB_VARIANTS="MK_L2_PREFETCH=8 MK_SETMAXNREG=1,MK_X_PIPELINE=1";
# MK_VARIANT_TESTS=0 skips the variant gpu tests, MK_CHECK=0 the check table.
set -uo pipefail
out=${1:-bench/results}; mkdir -p "$out"
commit=$(python3 bench/common.py)  # see bench/common.git_commit
log="$out/final_gpu_$(date -u +%Y-%m-%d)_${commit}.log"
{
  echo "date $(date -u +%FT%TZ) gpu $(python3 -c 'import torch;print(torch.cuda.get_device_name())') commit ${commit}"
  echo "+ pytest -m gpu tests/test_persistent_gpu.py tests/test_decode_step.py"
  timeout ${MK_PYTEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py tests/test_decode_step.py 2>&1 | tail -8
  echo "+ python3 bench/mk_step.py --batch 1 8 --lm-head"
  timeout 70 python3 bench/mk_step.py --batch 1 8 --lm-head --reps 100 2>&1 | tail -6
  # Each variant: comma-joined -D settings (bench/NOTES.md "Next megakernel changes").
  for v in ${MK_AB_VARIANTS:-MK_L2_PREFETCH=4 MK_L2_PREFETCH=8 MK_L2_PREFETCH=16 MK_SETMAXNREG=1 \
             MK_SETMAXNREG=1,MK_X_PIPELINE=1 MK_SETMAXNREG=1,MK_X_PIPELINE=1,MK_L2_PREFETCH=8}; do
    defs=(); for d in ${v//,/ }; do defs+=(--define "$d"); done
    echo "+ python3 bench/mk_step.py --batch 1 8 --lm-head --no-triton ${defs[*]}"
    timeout 45 python3 bench/mk_step.py --batch 1 8 --lm-head --no-triton --reps 100 "${defs[@]}" 2>&1 | tail -3
  done
  # Correctness of the variants: the persistent gpu tests with one of them compiled in.
  tdefs="--mk-define MK_SETMAXNREG=1 --mk-define MK_X_PIPELINE=1 --mk-define MK_L2_PREFETCH=8"
  if [ "${MK_VARIANT_TESTS:-1}" = 1 ]; then
    echo "+ pytest -m gpu tests/test_persistent_gpu.py $tdefs"
    timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py $tdefs 2>&1 | tail -4
  fi
  if [ "${MK_CHECK:-1}" = 1 ]; then
    echo "+ python3 -m mk_plugin check --config bench/models/llama-3.2-1b --batch 1 --context 512"
    timeout 60 python3 -m mk_plugin check --config bench/models/llama-3.2-1b --batch 1 --context 512 2>&1 | tail -16
  fi
} 2>&1 | tee "$log"
