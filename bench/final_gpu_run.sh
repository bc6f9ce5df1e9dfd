#!/usr/bin/env bash
# One short GPU call: megakernel + Triton GPU tests, the 1B check table and one megakernel step
# timing (with and without the fused LM head). Output tees into $1/final_gpu_<date>.log.
set -uo pipefail
out=${1:-bench/results}; mkdir -p "$out"
log="$out/final_gpu_$(date -u +%Y-%m-%d).log"
{
  echo "date $(date -u +%FT%TZ) gpu $(python3 -c 'import torch;print(torch.cuda.get_device_name())') commit $(cat .commit 2>/dev/null)"
  echo "+ pytest -m gpu tests/test_persistent_gpu.py tests/test_decode_step.py"
  timeout ${MK_PYTEST_TIMEOUT:-400} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_persistent_gpu.py tests/test_decode_step.py 2>&1 | tail -8
  echo "+ python3 bench/mk_step.py --batch 1 8 --lm-head"
  timeout 60 python3 bench/mk_step.py --batch 1 8 --lm-head --reps 100 2>&1 | tail -12
  echo "+ python3 -m mk_plugin check --config bench/models/llama-3.2-1b --batch 1 --context 512"
  timeout 60 python3 -m mk_plugin check --config bench/models/llama-3.2-1b --batch 1 --context 512 2>&1 | tail -16
} 2>&1 | tee "$log"
